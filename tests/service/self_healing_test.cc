// Self-healing of the worker group, with the real coordinator and worker binaries and gRPC
// clients: a spawned TP = 2 group is killed (kill -9 of each rank) and frozen (SIGSTOP, caught by
// the heartbeat timeout) under 16 concurrent streams, round after round; --max-restarts runs out;
// workers launched apart make the coordinator exit, or with --rejoin register again.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/testing/http_test_util.h"
#include "tests/testing/service_info.h"
#include "tests/testing/service_test_util.h"
#include "tpserve/v1/inference.grpc.pb.h"

namespace tpserve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using Serving = grpc::health::v1::HealthCheckResponse::ServingStatus;
using service_test::FreePort;
using service_test::Info;
using service_test::ServerProcess;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::vector<int32_t> PromptIds(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(3 + (i * 37 + salt * 101) % 250);
  return p;
}

v1::GenerateRequest Greedy(const std::vector<int32_t>& prompt, int max_new) {
  v1::GenerateRequest req;
  req.mutable_token_ids()->mutable_ids()->Assign(prompt.begin(), prompt.end());
  req.mutable_stopping()->set_max_new_tokens(max_new);
  req.mutable_stopping()->set_ignore_eos(true);
  req.mutable_sampling()->set_temperature(0);
  return req;
}

struct Answer {
  grpc::Status status;
  std::vector<int32_t> ids;
  Clock::time_point end;
};

Answer Unary(v1::Inference::Stub& stub, const v1::GenerateRequest& req, int timeout_s = 60) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(timeout_s));
  v1::GenerateResponse resp;
  Answer a;
  a.status = stub.Generate(&ctx, req, &resp);
  a.ids.assign(resp.token_ids().begin(), resp.token_ids().end());
  a.end = Clock::now();
  return a;
}

// A stream that counts itself in `started` at its first message.
Answer Stream(v1::Inference::Stub& stub, const v1::GenerateRequest& req, std::atomic<int>* started,
              int timeout_s = 90) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(timeout_s));
  auto reader = stub.GenerateStream(&ctx, req);
  v1::GenerateResponse msg;
  Answer a;
  bool first = true;
  while (reader->Read(&msg)) {
    if (first) started->fetch_add(1);
    first = false;
    a.ids.insert(a.ids.end(), msg.token_ids().begin(), msg.token_ids().end());
  }
  a.status = reader->Finish();
  a.end = Clock::now();
  return a;
}

Serving Health(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok()) {
    return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }
  return resp.status();
}

// Polls health every 20 ms until it is `want`; the seconds since `from`, or -1 after `timeout_s`.
double WaitHealth(const std::shared_ptr<grpc::Channel>& channel, Serving want, double timeout_s,
                  Clock::time_point from) {
  const auto end = Clock::now() + std::chrono::milliseconds(static_cast<int>(timeout_s * 1000));
  while (Clock::now() < end) {
    if (Health(channel) == want) return Since(from);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

int CountEntries(const std::string& dir) {
  int n = 0;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); ++it) ++n;
  return n;
}

std::string Cmdline(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline");
  std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (char& c : cmd) c = c == '\0' ? ' ' : c;
  return cmd;
}

// Every process on the machine (zombies have no command line) whose command line holds
// `needle`: a spawned group's mpirun and workers carry its control address, wherever their
// parent went.
std::vector<pid_t> ProcessesWith(const std::string& needle) {
  std::vector<pid_t> pids;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    if (Cmdline(std::stoi(name)).find(needle) != std::string::npos) pids.push_back(std::stoi(name));
  }
  return pids;
}

// The pid the coordinator's log last reported for `rank` ("worker rank R registered (..., pid N)").
pid_t RankPid(const std::string& log, int rank) {
  const std::regex re("worker rank " + std::to_string(rank) +
                      " registered \\([^)]*pid ([0-9]+)\\)");
  pid_t pid = -1;
  for (std::sregex_iterator it(log.begin(), log.end(), re), end; it != end; ++it) {
    pid = std::stoi((*it)[1].str());
  }
  return pid;
}

std::string HttpStatus(int port, const std::string& path) {
  return service_test::RunCommand(
             absl::StrCat("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:", port, path),
             10)
      .output;
}

// One failure under load: 16 streams decode (the batch is full at --max-num-seqs 16), 3 more
// requests wait in the queue (no output yet); then rank `rank` gets `sig`.
struct FailureTimes {
  double unavailable_max_s = 0;  // the slowest stream's UNAVAILABLE, after the signal
  double kept_max_s = 0;         // the slowest queued request's answer, after the signal
  double not_serving_s = 0;      // health NOT_SERVING, after the signal
  double serving_s = 0;          // health SERVING again, after the signal
};

FailureTimes InjectFailure(ServerProcess& server, int http_port, int rank, int sig,
                           const std::vector<v1::GenerateRequest>& kept_reqs,
                           const std::vector<std::vector<int32_t>>& kept_expected,
                           const std::string& what) {
  constexpr int kStreams = 16;
  FailureTimes t;
  auto channel = server.Channel();
  auto stub = v1::Inference::NewStub(channel);
  std::atomic<int> started{0};
  std::vector<Answer> streams(kStreams), kept(kept_reqs.size());
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      auto s = v1::Inference::NewStub(server.Channel());
      streams[i] = Stream(*s, Greedy(PromptIds(16, 200 + i), 1500), &started);
    });
  }
  auto until = Clock::now() + std::chrono::seconds(30);
  while (started.load() < kStreams && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(started.load(), kStreams) << what << ": the streams did not all start\n"
                                      << server.Log();
  for (size_t k = 0; k < kept_reqs.size(); ++k) {
    threads.emplace_back([&, k] {
      auto s = v1::Inference::NewStub(server.Channel());
      kept[k] = Unary(*s, kept_reqs[k]);
    });
  }
  // They wait: every sequence slot is taken by a stream.
  until = Clock::now() + std::chrono::seconds(10);
  while (Info(*stub).kv().waiting_requests() < static_cast<int>(kept_reqs.size()) &&
         Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(Info(*stub).kv().waiting_requests(), static_cast<int>(kept_reqs.size())) << what;
  const pid_t victim = RankPid(server.Log(), rank);
  EXPECT_GT(victim, 0) << what << "\n" << server.Log();
  const auto t0 = Clock::now();
  if (victim > 0) kill(victim, sig);
  t.not_serving_s = WaitHealth(channel, grpc::health::v1::HealthCheckResponse::NOT_SERVING, 10, t0);
  EXPECT_GE(t.not_serving_s, 0) << what << ": health never turned NOT_SERVING";
  if (t.not_serving_s >= 0 && http_port > 0) {
    EXPECT_EQ(HttpStatus(http_port, "/health"), "503") << what;
  }
  t.serving_s = WaitHealth(channel, grpc::health::v1::HealthCheckResponse::SERVING, 30, t0);
  EXPECT_GE(t.serving_s, 0) << what << ": not SERVING again within 30 s\n" << server.Log();
  for (auto& th : threads) th.join();
  for (int i = 0; i < kStreams; ++i) {
    const Answer& a = streams[i];
    const double s = std::chrono::duration<double>(a.end - t0).count();
    t.unavailable_max_s = std::max(t.unavailable_max_s, s);
    EXPECT_EQ(a.status.error_code(), grpc::StatusCode::UNAVAILABLE)
        << what << " stream " << i << ": " << a.status.error_message();
    EXPECT_THAT(a.status.error_message(), HasSubstr(absl::StrCat("worker rank ", rank)))
        << what << " stream " << i;
    EXPECT_LT(s, 5.0) << what << " stream " << i << " was answered " << s << " s after the failure";
  }
  for (size_t k = 0; k < kept.size(); ++k) {
    const Answer& a = kept[k];
    t.kept_max_s = std::max(t.kept_max_s, std::chrono::duration<double>(a.end - t0).count());
    EXPECT_TRUE(a.status.ok()) << what << " queued request " << k << ": "
                               << a.status.error_message();
    EXPECT_EQ(a.ids, kept_expected[k]) << what << " queued request " << k;
  }
  EXPECT_LT(t.kept_max_s, 30.0) << what;
  if (sig == SIGSTOP && victim > 0) {
    // The coordinator killed the frozen worker; nothing is left stopped.
    EXPECT_THAT(Cmdline(victim), ::testing::Not(HasSubstr("tpserve-worker"))) << what;
  }
  std::printf(
      "%s: streams UNAVAILABLE within %.2f s, NOT_SERVING after %.2f s, SERVING again "
      "after %.2f s, queued requests served within %.2f s\n",
      what.c_str(), t.unavailable_max_s, t.not_serving_s, t.serving_s, t.kept_max_s);
  return t;
}

// The spawned group's processes (mpirun + the workers), waiting up to 5 s for `want` of them.
size_t GroupProcesses(const std::string& control_addr, size_t want) {
  const auto until = Clock::now() + std::chrono::seconds(5);
  size_t n = ProcessesWith("--coordinator " + control_addr + " ").size();
  while (n != want && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    n = ProcessesWith("--coordinator " + control_addr + " ").size();
  }
  return n;
}

std::string ControlAddress(const ServerProcess& server) {
  const std::vector<pid_t> workers = server.WorkerPids();
  if (workers.empty()) return "";
  const std::string cmd = Cmdline(workers.front());
  const size_t at = cmd.find("--coordinator ");
  if (at == std::string::npos) return "";
  const size_t begin = at + 14;
  return cmd.substr(begin, cmd.find(' ', begin) - begin);
}

TEST(SelfHealingTest, KilledAndFrozenRanksUnderLoadAreReplacedRoundAfterRound) {
  constexpr int kRounds = 3;
  const std::string model = service_test::ServiceModelDir();
  const int http_port = FreePort();
  ASSERT_GT(http_port, 0);
  auto server = ServerProcess::Start(
      model, {"--workers", "2", "--heartbeat-timeout", "2", "--max-restarts", "20",
              "--max-num-seqs", "16", "--http-port", std::to_string(http_port)});
  ASSERT_NE(server, nullptr);
  auto stub = v1::Inference::NewStub(server->Channel());
  const std::string control = ControlAddress(*server);
  ASSERT_FALSE(control.empty()) << server->Log();
  ASSERT_EQ(GroupProcesses(control, 3), 3u) << "mpirun and 2 workers";
  // Greedy answers before any failure.
  const v1::GenerateRequest probe = Greedy(PromptIds(24, 1), 12);
  const Answer before = Unary(*stub, probe);
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();
  ASSERT_EQ(before.ids.size(), 12u);
  std::vector<v1::GenerateRequest> kept_reqs;
  std::vector<std::vector<int32_t>> kept_expected;
  for (int k = 0; k < 3; ++k) {
    kept_reqs.push_back(Greedy(PromptIds(20 + k, 100 + k), 8));
    const Answer a = Unary(*stub, kept_reqs.back());
    ASSERT_TRUE(a.status.ok()) << a.status.error_message();
    kept_expected.push_back(a.ids);
  }
  const pid_t coordinator = server->pid();
  int threads_first = 0, fds_first = 0, failures = 0;
  for (int round = 0; round < kRounds; ++round) {
    struct Failure {
      int rank, sig;
      const char* name;
    };
    const Failure plan[] = {
        {0, SIGKILL, "kill -9"}, {1, SIGKILL, "kill -9"}, {round % 2, SIGSTOP, "SIGSTOP"}};
    for (const Failure& f : plan) {
      const std::string what = absl::StrCat("round ", round, ": ", f.name, " rank ", f.rank);
      InjectFailure(*server, http_port, f.rank, f.sig, kept_reqs, kept_expected, what);
      ++failures;
      const Answer after = Unary(*stub, probe);
      EXPECT_TRUE(after.status.ok()) << what << ": " << after.status.error_message();
      EXPECT_EQ(after.ids, before.ids) << what << ": other greedy tokens after the restart";
      EXPECT_EQ(GroupProcesses(control, 3), 3u) << what << ": mpirun and 2 workers, no stray";
      // A fresh KV cache: the prefix cache starts empty and every block is free once idle (the
      // probe's blocks are released a step after its last token reached us).
      EXPECT_TRUE(service_test::WaitIdle(*stub, 5)) << what;
      const v1::ModelInfo info = Info(*stub);
      EXPECT_TRUE(info.worker_group().serving()) << what;
      EXPECT_EQ(info.worker_group().restarts(), failures) << what;
      EXPECT_EQ(info.worker_group().failures(), failures) << what;
      EXPECT_THAT(info.worker_group().failed_ranks(), ::testing::ElementsAre(f.rank)) << what;
      EXPECT_THAT(info.worker_group().last_failure(), HasSubstr("worker rank")) << what;
      EXPECT_EQ(info.kv().free_blocks(), info.kv().total_blocks()) << what;
    }
    const int threads = CountEntries(absl::StrCat("/proc/", coordinator, "/task"));
    const int fds = CountEntries(absl::StrCat("/proc/", coordinator, "/fd"));
    std::printf("after round %d: coordinator threads %d, fds %d\n", round, threads, fds);
    if (round == 0) {
      threads_first = threads;
      fds_first = fds;
    } else {
      // gRPC may keep a thread or a connection more; restarts must not add theirs each time.
      EXPECT_LE(threads, threads_first + 4) << "round " << round;
      EXPECT_LE(fds, fds_first + 4) << "round " << round;
    }
  }
  const std::string metrics =
      service_test::RunCommand(absl::StrCat("curl -s http://127.0.0.1:", http_port, "/metrics"), 10)
          .output;
  EXPECT_EQ(service_test::MetricValue(metrics, "tpserve:worker_group_restarts_total"), failures);
  EXPECT_EQ(service_test::MetricValue(metrics, "tpserve:worker_group_failures_total"), failures);
  const int status = server->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << server->Log();
  EXPECT_EQ(GroupProcesses(control, 0), 0u) << "workers left after the coordinator exited";
}

TEST(SelfHealingTest, SpentRestartsExitNonZero) {
  const std::string model = service_test::ServiceModelDir();
  auto server = ServerProcess::Start(model, {"--workers", "2", "--max-restarts", "1"});
  ASSERT_NE(server, nullptr);
  const std::string control = ControlAddress(*server);
  ASSERT_FALSE(control.empty());
  auto t0 = Clock::now();
  kill(RankPid(server->Log(), 1), SIGKILL);
  ASSERT_GE(
      WaitHealth(server->Channel(), grpc::health::v1::HealthCheckResponse::NOT_SERVING, 10, t0), 0);
  ASSERT_GE(WaitHealth(server->Channel(), grpc::health::v1::HealthCheckResponse::SERVING, 30, t0),
            0)
      << "the first failure is restarted\n"
      << server->Log();
  t0 = Clock::now();
  kill(RankPid(server->Log(), 0), SIGKILL);
  const int status = server->WaitExit(std::chrono::seconds(20));
  const double seconds = Since(t0);
  const std::string log = server->Log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "status " << status << "\n" << log;
  EXPECT_THAT(log, HasSubstr("its restarts are spent (--max-restarts 1 within 10 minutes); the "
                             "last failure: worker rank 0"));
  EXPECT_LT(seconds, 15) << log;
  EXPECT_EQ(GroupProcesses(control, 0), 0u) << "workers left after the coordinator exited";
}

// A process with its output in a file; killed when destroyed.
class Child {
 public:
  Child(std::vector<std::string> args, const std::string& log)
      : pid_(service_test::SpawnLogged(std::move(args), log, /*own_group=*/false)), log_(log) {}
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  // The wait status, or -1 when it still runs after `timeout`.
  int WaitExit(std::chrono::milliseconds timeout) {
    const auto end = Clock::now() + timeout;
    int status = -1;
    while (pid_ > 0 && waitpid(pid_, &status, WNOHANG) != pid_) {
      if (Clock::now() >= end) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_ = -1;
  std::string log_;
};

// A coordinator whose one worker is launched apart (as by Kubernetes or Slurm), and a way to
// start that worker.
class ExternalLauncherTest : public ::testing::Test {
 protected:
  void StartCoordinator(std::vector<std::string> extra) {
    const fs::path dir =
        fs::path(::testing::TempDir()) / absl::StrCat("tpserve_heal_", getpid(), "_", counter_++);
    fs::remove_all(dir);  // an earlier run's folder (same pid) would hold a stale ready file
    fs::create_directories(dir);
    dir_ = dir.string();
    secret_ = (dir / "secret").string();
    std::ofstream(secret_) << "self-healing-test-secret\n";
    fs::permissions(secret_, fs::perms::owner_read | fs::perms::owner_write);
    control_port_ = FreePort();
    ASSERT_GT(control_port_, 0);
    const std::string ready = (dir / "ready").string();
    std::vector<std::string> args = {TPSERVE_COORDINATOR_BIN,
                                     "--model",
                                     service_test::ServiceModelDir(),
                                     "--host",
                                     "127.0.0.1",
                                     "--port",
                                     "0",
                                     "--http-port",
                                     "0",
                                     "--ready-file",
                                     ready,
                                     "--workers",
                                     "1",
                                     "--control-port",
                                     std::to_string(control_port_),
                                     "--cluster-secret-file",
                                     secret_,
                                     "--register-timeout",
                                     "30"};
    args.insert(args.end(), extra.begin(), extra.end());
    coordinator_ = std::make_unique<Child>(args, (dir / "coordinator.log").string());
    StartWorker();
    const auto until = Clock::now() + std::chrono::seconds(60);
    while (!fs::exists(ready) && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_TRUE(fs::exists(ready)) << coordinator_->Log();
    std::string address;
    std::ifstream(ready) >> address;
    channel_ = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  }
  void StartWorker() {
    worker_ = std::make_unique<Child>(
        std::vector<std::string>{TPSERVE_WORKER_BIN, "--coordinator",
                                 absl::StrCat("127.0.0.1:", control_port_), "--cluster-secret-file",
                                 secret_, "--rank", "0", "--world-size", "1", "--device", "cpu"},
        absl::StrCat(dir_, "/worker", workers_++, ".log"));
  }

  static inline int counter_ = 0;
  std::string dir_, secret_;
  int control_port_ = 0;
  int workers_ = 0;
  std::unique_ptr<Child> coordinator_, worker_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(ExternalLauncherTest, WithoutRejoinALostWorkerEndsTheCoordinatorNonZero) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({}));
  auto stub = v1::Inference::NewStub(channel_);
  ASSERT_TRUE(Unary(*stub, Greedy(PromptIds(8, 3), 4)).status.ok());
  const auto t0 = Clock::now();
  kill(worker_->pid(), SIGKILL);
  const int status = coordinator_->WaitExit(std::chrono::seconds(20));
  const double seconds = Since(t0);
  const std::string log = coordinator_->Log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "status " << status << "\n" << log;
  EXPECT_THAT(log, HasSubstr("worker rank 0"));
  EXPECT_THAT(log, HasSubstr("the coordinator exits so that the launcher restarts the job"));
  EXPECT_LT(seconds, 15) << log;
  std::printf("external launcher, kill -9: the coordinator exited after %.2f s\n", seconds);
}

TEST_F(ExternalLauncherTest, WithRejoinARestartedWorkerRegistersAgainAndServes) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator({"--rejoin"}));
  auto stub = v1::Inference::NewStub(channel_);
  const v1::GenerateRequest probe = Greedy(PromptIds(24, 5), 10);
  const Answer before = Unary(*stub, probe);
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();
  const auto t0 = Clock::now();
  kill(worker_->pid(), SIGKILL);
  ASSERT_GE(WaitHealth(channel_, grpc::health::v1::HealthCheckResponse::NOT_SERVING, 10, t0), 0)
      << coordinator_->Log();
  const Answer during = Unary(*stub, probe, 10);
  EXPECT_EQ(during.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(during.status.error_message(), HasSubstr("worker rank 0"));
  worker_->WaitExit(std::chrono::seconds(5));
  StartWorker();  // the launcher restarts the lost rank
  const double serving =
      WaitHealth(channel_, grpc::health::v1::HealthCheckResponse::SERVING, 30, t0);
  ASSERT_GE(serving, 0) << coordinator_->Log();
  std::printf(
      "external launcher with --rejoin: SERVING again %.2f s after kill -9 (the worker "
      "restarted at once)\n",
      serving);
  const Answer after = Unary(*stub, probe);
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.ids, before.ids);
  const v1::ModelInfo info = Info(*stub);
  EXPECT_EQ(info.worker_group().restarts(), 1);
  EXPECT_THAT(info.worker_group().failed_ranks(), ::testing::ElementsAre(0));
  kill(coordinator_->pid(), SIGTERM);
  const int status = coordinator_->WaitExit(std::chrono::seconds(25));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << coordinator_->Log();
  const int worker_status = worker_->WaitExit(std::chrono::seconds(10));
  EXPECT_TRUE(WIFEXITED(worker_status) && WEXITSTATUS(worker_status) == 0)
      << "the rejoined worker is shut down by the coordinator";
}

}  // namespace
}  // namespace tpserve
