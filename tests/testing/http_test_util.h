// Helpers of the HTTP service tests: a free loopback port, shell commands with a time limit
// (curl, node, prometheus, cmake), reading a series from the Prometheus text format.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>

namespace tpserve::service_test {

// A port nothing listens on now (the kernel's choice; the caller binds it right away).
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return 0;
  }
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

struct CommandResult {
  int exit_code = -1;  // -1: killed or did not run
  std::string output;  // stdout and stderr
};

// Runs `command` under `timeout` (killed after `seconds`, SIGKILL 5 s later).
inline CommandResult RunCommand(const std::string& command, int seconds = 120) {
  const std::string cmd = "timeout -k 5 " + std::to_string(seconds) + " bash -c '" + [&] {
    std::string q;
    for (char c : command) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q;
  }() + "' 2>&1";
  CommandResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// The value of one series (`name` or `name{labels}`, exactly as rendered) in a /metrics text.
inline std::optional<double> MetricValue(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nullopt;
}

}  // namespace tpserve::service_test
