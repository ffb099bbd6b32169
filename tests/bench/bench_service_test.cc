// `tpserve bench` against the CPU service (a coordinator with 2 spawned CPU workers, TP=2) on
// models/tiny-coder: exact counts (requests, output tokens = requests x max_new_tokens with
// ignore_eos, zero errors), a chat run and an open-loop run.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "tests/testing/service_test_util.h"
#include "tools/bench/bench_cmd.h"

namespace tpserve {
namespace {

using service_test::ServerProcess;

class BenchServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = ServerProcess::Start(service_test::ServiceModelDir(), {"--workers", "2"}).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  nlohmann::json Bench(std::vector<std::string> args) {
    const std::string json =
        (std::filesystem::path(::testing::TempDir()) /
         absl::StrCat("bench_service_",
                      ::testing::UnitTest::GetInstance()->current_test_info()->name(), ".json"))
            .string();
    args.insert(args.end(), {"--server", server_->address(), "--json", json, "--no-progress",
                             "--timeout", "300"});
    absl::Status s = RunBenchCommand(args);
    EXPECT_TRUE(s.ok()) << s << "\nserver log:\n" << server_->Log();
    std::ifstream in(json);
    if (!in) return nlohmann::json();
    return nlohmann::json::parse(in);
  }

  static ServerProcess* server_;
};
ServerProcess* BenchServiceTest::server_ = nullptr;

TEST_F(BenchServiceTest, ClosedLoopCountsAreExact) {
  ASSERT_NE(server_, nullptr);
  constexpr int kRequests = 8, kOut = 12, kPrompt = 24;
  const nlohmann::json j = Bench({"--concurrency", "4", "--num-requests", std::to_string(kRequests),
                                  "--prompt-len", std::to_string(kPrompt), "--output-len",
                                  std::to_string(kOut), "--warmup", "1", "--seed", "1"});
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(j["tp"], 2);
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["num_requests"], kRequests);
  EXPECT_EQ(j["completed"], kRequests);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_TRUE(j["errors"].empty()) << j["errors"];
  EXPECT_EQ(j["output_length_mismatches"], 0);
  EXPECT_EQ(j["total_output_tokens"], kRequests * kOut);
  EXPECT_EQ(j["total_input_tokens"], kRequests * kPrompt);  // token ids: no BOS added
  EXPECT_EQ(j["ttft_ms"]["count"], kRequests);
  EXPECT_EQ(j["tpot_ms"]["count"], kRequests);
  // The service may coalesce tokens produced while a write is in flight: at most one gap per
  // token after the first.
  EXPECT_GE(j["itl_ms"]["count"].get<int>(), 1);
  EXPECT_LE(j["itl_ms"]["count"].get<int>(), kRequests * (kOut - 1));
  for (const char* key : {"ttft_ms", "tpot_ms", "e2e_ms"}) {
    EXPECT_GT(j[key]["median"].get<double>(), 0) << key;
    EXPECT_LE(j[key]["median"].get<double>(), j[key]["p90"].get<double>()) << key;
    EXPECT_LE(j[key]["p90"].get<double>(), j[key]["p99"].get<double>()) << key;
  }
  // TTFT on the client includes the server's own TTFT.
  EXPECT_GE(j["ttft_ms"]["median"].get<double>(), j["server_ttft_ms"]["min"].get<double>());
  EXPECT_GT(j["output_throughput"].get<double>(), 0);
}

// --compare-engine: the in-process engine on the same lengths, one ratio in the JSON; and the
// server's step counters over the run (overlap on by default at pp = 1).
TEST_F(BenchServiceTest, CompareEngineReportsTheServedOverEngineRatio) {
  ASSERT_NE(server_, nullptr);
  const std::string model = service_test::ServiceModelDir();
  const nlohmann::json j =
      Bench({"--concurrency", "3", "--num-requests", "6", "--prompt-len", "12", "--output-len",
             "10", "--warmup", "0", "--compare-engine", model, "--engine-device", "cpu"});
  ASSERT_FALSE(j.is_null());
  ASSERT_TRUE(j.contains("engine")) << j.dump(2);
  EXPECT_EQ(j["engine"]["batch"], 3);
  EXPECT_GT(j["engine"]["ms_per_token"].get<double>(), 0);
  EXPECT_DOUBLE_EQ(
      j["engine"]["served_over_engine"].get<double>(),
      j["tpot_ms"]["median"].get<double>() / j["engine"]["ms_per_token"].get<double>());
  ASSERT_TRUE(j.contains("server_steps")) << j.dump(2);
  EXPECT_GE(j["server_steps"]["steps"].get<int>(), 10);
  EXPECT_TRUE(j["server_steps"]["overlap_scheduling"].get<bool>());
  EXPECT_GT(j["server_steps"]["scheduler_cpu_ms"].get<double>(), 0);
  EXPECT_EQ(j["server_steps"]["dropped_tokens"], 0) << "lengths only: nothing stops early";
}

TEST_F(BenchServiceTest, ChatAndOpenLoop) {
  ASSERT_NE(server_, nullptr);
  // 2 conversations x 3 turns, 16-token first prompt, 4-token user turns, 6 new tokens:
  // prompts 16, 16 + 6 + 4 = 26, 26 + 6 + 4 = 36 per conversation.
  nlohmann::json j =
      Bench({"--turns", "3", "--num-conversations", "2", "--concurrency", "2", "--prompt-len", "16",
             "--user-turn-len", "4", "--output-len", "6", "--warmup", "0"});
  EXPECT_EQ(j["completed"], 6);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["total_input_tokens"], 2 * (16 + 26 + 36));
  EXPECT_EQ(j["total_output_tokens"], 6 * 6);
  // Prefix caching (blocks of 16 tokens): turns 2 and 3 find the first block of their history
  // cached (turn 2's second block is not full when it ends: 26 + 5 computed tokens).
  EXPECT_EQ(j["prefix_cache"]["enabled"], true);
  EXPECT_EQ(j["prefix_cache"]["queries"], 2 * (16 + 26 + 36));
  EXPECT_EQ(j["prefix_cache"]["hits"], 2 * (16 + 16));

  // The shared-prefix preset, shortened: 48 shared tokens (3 blocks) + 8, two clients, no
  // warm-up. The shared blocks are computed once: the first two requests arrive together (the
  // second waits for the first's blocks, or finds them cached), the others find them cached.
  j = Bench({"--preset", "shared-prefix", "--num-requests", "4", "--concurrency", "2",
             "--shared-prefix-len", "48", "--prompt-len", "8", "--output-len", "4", "--warmup",
             "0"});
  EXPECT_EQ(j["completed"], 4);
  EXPECT_EQ(j["total_input_tokens"], 4 * 56);
  EXPECT_EQ(j["prefix_cache"]["queries"], 4 * 56);
  EXPECT_EQ(j["prefix_cache"]["hits"], 3 * 48);
  EXPECT_EQ(j["prefix_cache"]["computed_prompt_tokens"], 48 + 4 * 8);

  j = Bench({"--request-rate", "20", "--num-requests", "6", "--prompt-len-dist", "uniform:4:32",
             "--output-len", "5", "--warmup", "0", "--seed", "2"});
  EXPECT_EQ(j["completed"], 6);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["total_output_tokens"], 30);
  EXPECT_EQ(j["config"]["mode"], "open");
}

}  // namespace
}  // namespace tpserve
