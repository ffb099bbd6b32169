// The workers' control plane against impostors: a process that races the real workers to every
// port the coordinator listens on never becomes a worker and never sees a step (so no prompt);
// a worker with a wrong or no secret is refused with a message saying why; each rank registers
// once; a coordinator launched apart from its workers without a secret does not start.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/cluster_secret.h"
#include "tests/testing/http_test_util.h"
#include "tests/testing/service_test_util.h"
#include "tpserve/v1/inference.grpc.pb.h"
#include "worker.grpc.pb.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

using service_test::FreePort;

// The TCP ports `pid` listens on: its socket inodes matched against /proc/net/tcp{,6} LISTEN rows.
std::set<int> ListeningPorts(pid_t pid) {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const std::string target = fs::read_symlink(e.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) {
      inodes.insert(target.substr(8, target.size() - 9));
    }
  }
  std::set<int> ports;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, state, queues, timer, retr, uid, timeout, inode;
      f >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (state != "0A" || inodes.count(inode) == 0) continue;  // 0A: LISTEN
      ports.insert(std::stoi(local.substr(local.rfind(':') + 1), nullptr, 16));
    }
  }
  return ports;
}

// One impostor attempt: a control stream to 127.0.0.1:`port` registering `rank` of `world`, with
// `secret` as metadata unless empty. Returns the status the stream ended with; `got_message` is
// set when the coordinator sent it anything but a heartbeat (an assignment, a step: a prompt).
grpc::Status TryRegister(int port, int rank, int world, const std::string& secret,
                         bool* got_message) {
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  auto stub = worker::WorkerControl::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  if (!secret.empty()) ctx.AddMetadata(kClusterSecretMetadata, secret);
  auto stream = stub->Control(&ctx);
  worker::WorkerMessage reg;
  reg.mutable_register_()->set_rank(rank);
  reg.mutable_register_()->set_world_size(world);
  reg.mutable_register_()->set_device("cpu");
  reg.mutable_register_()->set_hostname("impostor");
  stream->Write(reg);
  worker::CoordinatorMessage msg;
  while (stream->Read(&msg)) {
    if (!msg.has_heartbeat()) *got_message = true;
  }
  return stream->Finish();
}

std::string WriteFile(const std::string& name, const std::string& text, int mode = 0600) {
  const std::string path =
      (fs::path(::testing::TempDir()) / absl::StrCat(name, "_", getpid())).string();
  std::ofstream(path) << text;
  chmod(path.c_str(), mode);
  return path;
}

// The coordinator spawns its worker 3 s late (a wrapper script sleeps first); meanwhile an
// impostor connects to every port the coordinator listens on, again and again, registering every
// rank with no secret and with a guessed one. The real worker still becomes rank 0, requests are
// served, and the impostor got nothing but refusals.
TEST(ControlPlaneSecurityTest, ImpostorRacingTheWorkersNeverBecomesAWorker) {
  const std::string model = service_test::ServiceModelDir();
  const std::string wrapper =
      WriteFile("slow_worker.sh",
                absl::StrCat("#!/bin/sh\nsleep 3\nexec ", TPSERVE_WORKER_BIN, " \"$@\"\n"), 0700);
  const int http_port = FreePort();
  ASSERT_GT(http_port, 0);
  std::atomic<bool> stop{false};
  std::atomic<bool> hijacked{false};
  std::mutex mu;
  std::map<int, std::vector<grpc::Status>> results;  // port -> the impostor's refusals
  std::thread impostor;
  auto server = service_test::ServerProcess::Start(
      model,
      {"--workers", "1", "--worker-binary", wrapper, "--http-port", std::to_string(http_port)}, 90,
      [&](pid_t pid) {
        impostor = std::thread([&, pid] {
          const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
          while (!stop.load() && std::chrono::steady_clock::now() < end) {
            for (int port : ListeningPorts(pid)) {
              for (const std::string& secret : {std::string(), std::string("guess")}) {
                for (int rank = 0; rank < 2; ++rank) {
                  bool got = false;
                  const grpc::Status st = TryRegister(port, rank, rank + 1, secret, &got);
                  if (got) hijacked = true;
                  std::lock_guard<std::mutex> lock(mu);
                  results[port].push_back(st);
                }
              }
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
        });
      });
  stop = true;
  if (impostor.joinable()) impostor.join();
  ASSERT_NE(server, nullptr);
  EXPECT_FALSE(hijacked.load()) << "the impostor received a coordinator message";
  // The impostor found the public gRPC port, the HTTP port and the control port.
  const int public_port = std::stoi(server->address().substr(server->address().rfind(':') + 1));
  ASSERT_GE(results.size(), 3u) << server->Log();
  EXPECT_TRUE(results.count(public_port));
  EXPECT_TRUE(results.count(http_port));
  int control_refusals = 0;
  for (const auto& [port, statuses] : results) {
    for (const grpc::Status& st : statuses) {
      EXPECT_FALSE(st.ok()) << "port " << port;
      if (port == public_port) {
        // The control service is not on the public port at all.
        EXPECT_EQ(st.error_code(), grpc::StatusCode::UNIMPLEMENTED) << st.error_message();
      } else if (st.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
        EXPECT_THAT(st.error_message(), HasSubstr("cluster secret")) << st.error_message();
        ++control_refusals;
      }
    }
  }
  EXPECT_GT(control_refusals, 0) << "the impostor never reached the control plane";
  EXPECT_THAT(server->Log(), HasSubstr("refused a worker registration"));
  // The real worker is rank 0 and serves.
  EXPECT_THAT(server->Log(), ::testing::ContainsRegex("worker rank 0 registered \\(cpu"));
  EXPECT_THAT(server->Log(), Not(HasSubstr("impostor")));
  auto stub = v1::Inference::NewStub(server->Channel());
  v1::GenerateRequest req;
  for (int id : {5, 6, 7, 8}) req.mutable_token_ids()->add_ids(id);
  req.mutable_stopping()->set_max_new_tokens(3);
  req.mutable_stopping()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::GenerateResponse resp;
  const grpc::Status st = stub->Generate(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message() << "\n" << server->Log();
  EXPECT_EQ(resp.token_ids_size(), 3);
}

using service_test::CommandResult;
using service_test::RunCommand;

// A coordinator launched apart from its workers (as under Slurm): a worker with a wrong secret or
// none is refused with the reason, the right one serves, a second one for the same rank is
// refused, and the coordinator without a secret file does not start.
TEST(ControlPlaneSecurityTest, WorkersWithoutTheSecretAreRefusedWithAClearMessage) {
  const std::string model = service_test::ServiceModelDir();
  const std::string good = WriteFile("good_secret", NewClusterSecret() + "\n");
  const std::string bad = WriteFile("bad_secret", NewClusterSecret() + "\n");
  const int control_port = FreePort();
  ASSERT_GT(control_port, 0);
  const std::string ready = WriteFile("apart_ready", "");
  fs::remove(ready);
  const std::string log = WriteFile("apart_log", "");
  const std::string coordinator =
      absl::StrCat(TPSERVE_COORDINATOR_BIN, " --model ", model,
                   " --host 127.0.0.1 --port 0 --http-port 0 --workers 1 --control-port ",
                   control_port, " --register-timeout 60 --ready-file ", ready);

  // Without a secret file the coordinator refuses to start (its workers are not spawned).
  const CommandResult no_file = RunCommand("timeout 30 " + coordinator);
  EXPECT_NE(no_file.exit_code, 0) << no_file.output;
  EXPECT_THAT(no_file.output, HasSubstr("--cluster-secret-file is required")) << no_file.output;

  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd =
        absl::StrCat("exec ", coordinator, " --cluster-secret-file ", good, " >", log, " 2>&1");
    execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  const std::string worker = absl::StrCat("OPENBLAS_NUM_THREADS=1 timeout 60 ", TPSERVE_WORKER_BIN,
                                          " --coordinator 127.0.0.1:", control_port,
                                          " --device cpu --rank 0 --world-size 1");
  const CommandResult wrong = RunCommand(worker + " --cluster-secret-file " + bad);
  EXPECT_EQ(wrong.exit_code, 1) << wrong.output;
  EXPECT_THAT(wrong.output, HasSubstr("the coordinator refused this worker")) << wrong.output;
  EXPECT_THAT(wrong.output, HasSubstr("the cluster secret does not match")) << wrong.output;

  const CommandResult none = RunCommand("env -u TPSERVE_CLUSTER_SECRET " + worker);
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_THAT(none.output, HasSubstr("no cluster secret")) << none.output;

  // The right secret (here through the environment, as spawned workers get it).
  FILE* real = popen(
      absl::StrCat("TPSERVE_CLUSTER_SECRET=$(cat ", good, ") ", worker, " 2>&1").c_str(), "r");
  ASSERT_NE(real, nullptr);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(ready) && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(fs::exists(ready)) << "the coordinator did not become ready";
  // Rank 0 is taken: a second worker with the right secret is refused, saying so.
  const CommandResult second = RunCommand(worker + " --cluster-secret-file " + good);
  EXPECT_EQ(second.exit_code, 1) << second.output;
  EXPECT_THAT(second.output, HasSubstr("registration is closed")) << second.output;

  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  pclose(real);
  std::ifstream in(log);
  const std::string coordinator_log((std::istreambuf_iterator<char>(in)),
                                    std::istreambuf_iterator<char>());
  EXPECT_THAT(coordinator_log, HasSubstr("the cluster secret does not match")) << coordinator_log;
  // The secret itself is never logged.
  std::ifstream secret_in(good);
  std::string secret;
  secret_in >> secret;
  EXPECT_THAT(coordinator_log, Not(HasSubstr(secret)));
}

}  // namespace
}  // namespace tpserve
