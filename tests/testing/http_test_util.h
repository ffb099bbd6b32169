// Helpers of the HTTP service tests: a free loopback port, shell commands with a time limit
// (curl, node, prometheus, cmake), reading a series from the Prometheus text format.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <sstream>
#include <string>

namespace tpserve::service_test {

// A loopback port nothing listens on now, for a server the caller starts right away. Chosen at
// random below the kernel's ephemeral range (32768-60999 on Linux): a port the kernel picked for
// a bind to port 0 could be picked again for another process's bind to port 0 (ctest runs tests
// side by side) before the server binds it, which failed a CI run once
// (control_plane_security_test: "HTTP: could not listen on 127.0.0.1:38391"). Falls back to the
// kernel's choice if 200 random ports are all taken.
inline int FreePort() {
  auto try_bind = [](int port) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return 0;
    sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    int got = 0;
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
      socklen_t len = sizeof(a);
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
      got = ntohs(a.sin_port);
    }
    close(fd);
    return got;
  };
  std::mt19937 rng(
      static_cast<uint32_t>(getpid()) * 2654435761u ^
      static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::uniform_int_distribution<int> dist(20000, 32767);
  for (int i = 0; i < 200; ++i) {
    if (const int port = try_bind(dist(rng)); port > 0) return port;
  }
  return try_bind(0);
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
