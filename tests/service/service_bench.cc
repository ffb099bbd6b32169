// Measures the service on this machine (CPU): the gRPC path's overhead per decode step over the
// in-process engine (same model, same TP=1 layout, one sequence), and throughput with 1 and 16
// concurrent clients for TP=1 and TP=2. Prints a table; asserts only that everything succeeded.
//   TPSERVE_SOURCE_DIR=$PWD build/tests/service/service_bench   (ctest -L bench)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/service_info.h"
#include "tests/testing/service_test_util.h"
#include "tpserve/v1/inference.grpc.pb.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

using service_test::Info;
using service_test::ServerProcess;
using Clock = std::chrono::steady_clock;

constexpr int kNewTokens = 128;
constexpr int kRepeats = 5;

std::vector<int32_t> Prompt(int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < 16; ++i) p.push_back(5 + (i * 13 + salt * 7) % 200);
  return p;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

v1::GenerateResponse Generate(v1::Inference::Stub& stub, int salt, int max_new) {
  v1::GenerateRequest req;
  const auto p = Prompt(salt);
  req.mutable_token_ids()->mutable_ids()->Assign(p.begin(), p.end());
  req.mutable_stopping()->set_max_new_tokens(max_new);
  req.mutable_stopping()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  v1::GenerateResponse resp;
  grpc::Status s = stub.Generate(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.output_tokens(), max_new);
  return resp;
}

TEST(ServiceBench, DecodeOverheadAndThroughput) {
  const std::string model = service_test::ServiceModelDir();
  std::printf("model: %s, %d new tokens after a 16-token prompt, median of %d runs\n",
              model.c_str(), kNewTokens, kRepeats);

  // In-process engine: per decode step = (time for 1 + N tokens - time for 1 token) / N.
  EngineOptions options;
  options.device = "cpu";
  auto engine = Engine::Create(model, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto run = [&](int n) {
    GenerateRequest req;
    req.prompt = Prompt(0);
    req.max_new_tokens = n;
    req.ignore_eos = true;
    const auto t0 = Clock::now();
    auto r = (*engine)->Generate({req});
    EXPECT_TRUE(r.ok());
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  run(8);  // warm-up
  std::vector<double> engine_step;
  for (int i = 0; i < kRepeats; ++i) {
    engine_step.push_back((run(kNewTokens + 1) - run(1)) / kNewTokens);
  }
  const double engine_ms = Median(engine_step) * 1e3;
  std::printf("in-process engine (TP=1): %.3f ms per decode step\n", engine_ms);
  engine->reset();

  for (int workers : {1, 2}) {
    auto server =
        ServerProcess::Start(model, {"--workers", std::to_string(workers), "--max-num-seqs", "16"});
    ASSERT_NE(server, nullptr);
    auto stub = v1::Inference::NewStub(server->Channel());
    Generate(*stub, 0, 8);  // warm-up
    // Per decode step of one sequence, from the server's own counters: the scheduler's step,
    // the round trip to the workers, and the sampling worker's forward + sampling.
    std::vector<double> step, trip, fwd;
    for (int i = 0; i < kRepeats; ++i) {
      const v1::ModelInfo before = Info(*stub);
      Generate(*stub, 0, kNewTokens + 1);
      const v1::ModelInfo after = Info(*stub);
      const double n = after.steps().steps() - before.steps().steps();
      step.push_back((after.steps().step_seconds() - before.steps().step_seconds()) / n);
      trip.push_back((after.steps().round_trip_seconds() - before.steps().round_trip_seconds()) /
                     n);
      fwd.push_back((after.steps().forward_seconds() - before.steps().forward_seconds()) / n);
    }
    std::printf(
        "service TP=%d: per step %.3f ms = worker forward+sample %.3f ms + control-plane "
        "round trip %.3f ms + scheduler %.3f ms (vs %.3f ms in-process)\n",
        workers, Median(step) * 1e3, Median(fwd) * 1e3, (Median(trip) - Median(fwd)) * 1e3,
        (Median(step) - Median(trip)) * 1e3, engine_ms);
    for (int clients : {1, 16}) {
      std::vector<double> tput;
      for (int rep = 0; rep < 3; ++rep) {
        const auto t0 = Clock::now();
        std::vector<std::thread> threads;
        for (int c = 0; c < clients; ++c) {
          threads.emplace_back([&, c] {
            auto s = v1::Inference::NewStub(server->Channel());
            Generate(*s, c, kNewTokens);
          });
        }
        for (auto& t : threads) t.join();
        tput.push_back(clients * kNewTokens /
                       std::chrono::duration<double>(Clock::now() - t0).count());
      }
      std::printf("service TP=%d, %2d concurrent clients: %.0f output tokens/s (median of 3)\n",
                  workers, clients, Median(tput));
    }
    server->Stop();
  }
}

}  // namespace
}  // namespace tpserve
