// Runs a shell command for the multi-process failure tests: its merged output, exit code
// (128 + signal when killed) and wall time.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tpserve::testing_util {

struct RunResult {
  std::string output;
  int exit_code = -1;
  absl::Duration wall;
};

inline RunResult RunCommand(const std::string& cmd) {
  RunResult r;
  const absl::Time start = absl::Now();
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    r.output = "popen failed";
    return r;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.wall = absl::Now() - start;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

}  // namespace tpserve::testing_util
