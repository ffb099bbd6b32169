// Deterministic mode on the CPU (fp32, OpenBLAS): one request's tokens, logprobs and logits are
// the same bits alone and among 1, 7, 64 or 200 other requests of random lengths, at random
// positions, with chunked prefill of several sizes, a prefix-cache hit and a preemption.
#include <random>

#include <gtest/gtest.h>

#include "tests/testing/determinism_harness.h"
#include "tests/testing/test_models.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

using testing_util::DetHarness;
using testing_util::DetOutcome;
using testing_util::DetScenario;

class DeterminismTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing_util::WriteTestModel(testing_util::AwkwardConfig(), "det"));
  }
  static std::unique_ptr<Engine> MakeEngine(bool deterministic) {
    EngineOptions options;
    options.device = "cpu";
    options.num_kv_blocks = 1024;
    options.block_size = 16;
    options.model.max_batch_tokens = 2048;
    options.model.max_batch_seqs = 256;
    options.deterministic = deterministic;
    auto engine = Engine::Create(*dir_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  }
  static std::vector<int32_t> Prompt() {
    std::mt19937 rng(11);
    std::vector<int32_t> p;
    for (int i = 0; i < 45; ++i) p.push_back(3 + static_cast<int32_t>(rng() % 290));
    return p;
  }
  static std::string* dir_;
};
std::string* DeterminismTest::dir_ = nullptr;

constexpr int kNewTokens = 8;

TEST_F(DeterminismTest, SameBitsAloneAndInAnyBatch) {
  auto engine = MakeEngine(true);
  ASSERT_NE(engine, nullptr);
  DetHarness h(&engine->runner());
  h.set_vocab_hint(301);
  const std::vector<int32_t> prompt = Prompt();
  auto alone = h.Run(prompt, kNewTokens, DetScenario{.name = "alone, one pass"},
                     /*keep_prefix=*/true);
  ASSERT_TRUE(alone.ok()) << alone.status();
  ASSERT_EQ(alone->tokens.size(), static_cast<size_t>(kNewTokens));
  const std::vector<DetScenario> scenarios = {
      {.name = "alone, chunks of 4", .chunk = 4},
      {.name = "1 other, chunks of 7", .others = 1, .chunk = 7, .seed = 2},
      {.name = "7 others, chunks of 16", .others = 7, .chunk = 16, .seed = 3},
      {.name = "64 others, chunks of 5", .others = 64, .chunk = 5, .seed = 4},
      // Every other request in every step: 200 x 3 tokens.
      {.name = "200 others, chunks of 3", .others = 200, .chunk = 3, .seed = 5},
      {.name = "200 others, chunks of 11, 600 tokens a step",
       .others = 200,
       .chunk = 11,
       .max_step_tokens = 600,
       .seed = 9},
      {.name = "prefix hit, 7 others", .others = 7, .chunk = 9, .prefix_hit = true, .seed = 6},
      {.name = "preempted after 3 tokens, 20 others, chunks of 6",
       .others = 20,
       .chunk = 6,
       .preempt_after = 3,
       .seed = 7},
      {.name = "prefix hit, then preempted, 64 others",
       .others = 64,
       .chunk = 13,
       .prefix_hit = true,
       .preempt_after = 5,
       .seed = 8},
  };
  for (const DetScenario& sc : scenarios) {
    auto got = h.Run(prompt, kNewTokens, sc);
    ASSERT_TRUE(got.ok()) << sc.name << ": " << got.status();
    testing_util::ExpectSameBits(*got, *alone, sc.name);
  }
}

// The same check without the mode: OpenBLAS rounds a row differently beside other rows, so
// the comparison above is one that can fail.
TEST_F(DeterminismTest, WithoutTheModeABatchChangesTheBits) {
  auto engine = MakeEngine(false);
  ASSERT_NE(engine, nullptr);
  DetHarness h(&engine->runner());
  h.set_vocab_hint(301);
  const std::vector<int32_t> prompt = Prompt();
  auto alone = h.Run(prompt, kNewTokens, DetScenario{.name = "alone"});
  auto batched = h.Run(prompt, kNewTokens,
                       DetScenario{.name = "64 others", .others = 64, .chunk = 5, .seed = 4});
  ASSERT_TRUE(alone.ok() && batched.ok());
  size_t differ = 0;
  for (size_t i = 0; i < std::min(alone->logits.size(), batched->logits.size()); ++i) {
    for (size_t v = 0; v < alone->logits[i].size(); ++v) {
      differ += alone->logits[i][v] != batched->logits[i][v];
    }
  }
  EXPECT_GT(differ, 0u);
}

}  // namespace
}  // namespace tpserve
