// `tpserve bench --check-deterministic` against the CPU service on tiny-coder started with
// --deterministic (2 spawned workers, tp = 2; a small token budget per step, so prompts are
// chunked and share steps with other requests' decodes): 16 requests of 4 to 64 prompt tokens
// sent at once and then one at a time give identical answers, tokens and logprobs, sampled and
// greedy.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "tests/testing/service_test_util.h"
#include "tools/bench/bench_cmd.h"

namespace tpserve {
namespace {

using service_test::ServerProcess;

TEST(BenchCheckDeterministicServiceTest, DeterministicServerGivesIdenticalAnswers) {
  auto server =
      ServerProcess::Start(service_test::ServiceModelDir(),
                           {"--workers", "2", "--deterministic", "--max-num-batched-tokens", "40"});
  ASSERT_NE(server, nullptr);
  constexpr int kRequests = 16, kOut = 16;
  const std::string json =
      (std::filesystem::path(::testing::TempDir()) / "bench_check_deterministic.json").string();
  const absl::Status s = RunBenchCommand({"--check-deterministic",
                                          "--num-requests",
                                          std::to_string(kRequests),
                                          "--prompt-len-dist",
                                          "uniform:4:64",
                                          "--output-len",
                                          std::to_string(kOut),
                                          "--logprobs",
                                          "3",
                                          "--temperature",
                                          "0.9",
                                          "--sampling-seed",
                                          "5",
                                          "--seed",
                                          "2",
                                          "--server",
                                          server->address(),
                                          "--json",
                                          json,
                                          "--no-progress",
                                          "--timeout",
                                          "300"});
  EXPECT_TRUE(s.ok()) << s << "\nserver log:\n" << server->Log();
  std::ifstream in(json);
  ASSERT_TRUE(in) << json;
  const nlohmann::json j = nlohmann::json::parse(in);
  const nlohmann::json& c = j["deterministic_check"];
  EXPECT_EQ(c["passed"], true) << c["differences"].dump(2);
  EXPECT_EQ(c["server_deterministic"], true);
  EXPECT_GE(c["max_num_seqs"].get<int>(), kRequests);
  EXPECT_EQ(c["requests"], kRequests);
  EXPECT_EQ(c["identical"], kRequests);
  EXPECT_EQ(c["sampled"]["identical"], kRequests / 2);
  EXPECT_EQ(c["greedy"]["identical"], kRequests / 2);
  EXPECT_EQ(c["logprob_tokens"], kRequests * kOut);  // logprobs compared for every token
  EXPECT_EQ(c["concurrent"]["completed"], kRequests);
  EXPECT_EQ(c["sequential"]["completed"], kRequests);
  // The requests did share steps: one at a time, each needs at least its kOut decode steps.
  EXPECT_GE(c["sequential"]["server_steps"].get<int>(), kRequests * kOut);
  EXPECT_LT(c["concurrent"]["server_steps"].get<int>(), kRequests * kOut / 2);
  // The concurrent run's report, as any bench run's: every answer of full length.
  EXPECT_EQ(j["total_output_tokens"], kRequests * kOut);
  EXPECT_EQ(j["output_length_mismatches"], 0);
  EXPECT_EQ(j["config"]["concurrency"], kRequests);
  const int status = server->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << server->Log();
}

}  // namespace
}  // namespace tpserve
