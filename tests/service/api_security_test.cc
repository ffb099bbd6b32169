// The public API's access control with real clients: API keys (--api-key-file) on gRPC (Python
// grpcio with metadata) and HTTP (curl), health exempt.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "coordinator/api_keys.h"
#include "tests/service/service_test_util.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return 0;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

struct CommandResult {
  int code = -1;
  std::string out;
};

CommandResult RunCommand(const std::string& cmd) {
  CommandResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string SourceDir() {
  const char* src = std::getenv("TPSERVE_SOURCE_DIR");
  return src ? src : ".";
}

TEST(ApiSecurityTest, ApiKeysGuardGrpcAndHttpButNotHealth) {
  const std::string keys =
      (fs::path(::testing::TempDir()) / absl::StrCat("api_keys_", getpid())).string();
  std::ofstream(keys) << "# keys of the test\nfirst-key\n\n  second-key  \n";
  const int http_port = FreePort();
  ASSERT_GT(http_port, 0);
  const std::string model = service_test::ServiceModelDir();
  auto server = service_test::ServerProcess::Start(
      model, {"--workers", "1", "--api-key-file", keys, "--http-port", std::to_string(http_port)});
  ASSERT_NE(server, nullptr);
  // Keys on loopback: no warning about an open API.
  EXPECT_THAT(server->Log(), ::testing::Not(HasSubstr("without an API key")));

  const CommandResult py =
      RunCommand(absl::StrCat("timeout -k 5 120 /usr/bin/python3 ", SourceDir(),
                              "/tests/service/api_key_client_test.py --server ", server->address(),
                              " --proto-dir ", SourceDir(), "/proto --key second-key"));
  EXPECT_EQ(py.code, 0) << py.out;
  EXPECT_THAT(py.out, HasSubstr("the right key: served 3 tokens")) << py.out;

  const std::string base = absl::StrCat("http://127.0.0.1:", http_port);
  auto http_code = [&](const std::string& extra, const std::string& path) {
    return RunCommand(absl::StrCat("curl -sS --max-time 20 -o /dev/null -w '%{http_code}' ", extra,
                                   " ", base, path))
        .out;
  };
  EXPECT_EQ(http_code("", "/v1/models"), "401");
  EXPECT_EQ(http_code("-H 'Authorization: Bearer nope'", "/v1/models"), "401");
  EXPECT_EQ(http_code("-H 'Authorization: Bearer first-key'", "/v1/models"), "200");
  EXPECT_EQ(http_code("", "/health"), "200");
  const CommandResult denied =
      RunCommand(absl::StrCat("curl -sS --max-time 20 -H 'Content-Type: application/json' -d "
                              "'{\"prompt\": \"hi\", \"max_tokens\": 2}' ",
                              base, "/v1/completions"));
  EXPECT_THAT(denied.out, HasSubstr("Bearer")) << denied.out;
  const CommandResult served = RunCommand(
      absl::StrCat("curl -sS --max-time 60 -H 'Authorization: Bearer first-key' -H "
                   "'Content-Type: application/json' -d '{\"model\": \"",
                   model, "\", \"prompt\": \"hi\", \"max_tokens\": 2}' ", base, "/v1/completions"));
  EXPECT_THAT(served.out, HasSubstr("\"completion_tokens\":2")) << served.out;
}

// Which hosts count as loopback for the warning about an API without keys (a server in a test
// may not listen beyond loopback, so the decision is checked here).
TEST(ApiSecurityTest, LoopbackHostsAreTheOnlyOnesWithoutAWarning) {
  for (const char* h : {"127.0.0.1", "127.0.0.2", "::1", "localhost"}) {
    EXPECT_TRUE(IsLoopbackHost(h)) << h;
  }
  for (const char* h : {"0.0.0.0", "::", "10.0.0.5", "128.0.0.1", "localhost.example.com"}) {
    EXPECT_FALSE(IsLoopbackHost(h)) << h;
  }
}

TEST(ApiSecurityTest, ApiKeyChecksAndFiles) {
  const ApiKeys keys({"k1", "k2"});
  EXPECT_TRUE(keys.Check("Bearer k1").ok());
  EXPECT_TRUE(keys.Check("Bearer k2").ok());
  EXPECT_TRUE(absl::IsUnauthenticated(keys.Check("Bearer k3")));
  EXPECT_TRUE(absl::IsUnauthenticated(keys.Check("k1")));
  EXPECT_TRUE(absl::IsUnauthenticated(keys.Check("")));
  EXPECT_TRUE(ApiKeys().Check("").ok());
  const std::string empty =
      (fs::path(::testing::TempDir()) / absl::StrCat("no_keys_", getpid())).string();
  std::ofstream(empty) << "# nothing\n\n";
  EXPECT_THAT(std::string(ApiKeys::Load(empty, "").status().message()), HasSubstr("holds no key"));
  EXPECT_THAT(std::string(ApiKeys::Load("/nonexistent/keys", "").status().message()),
              HasSubstr("cannot read the API key file"));
}

}  // namespace
}  // namespace tpserve
