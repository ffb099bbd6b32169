// The CPU engine on a small random model: batching, chunked prefill and the KV cache layout do
// not change the results.
#include <cmath>

#include <gtest/gtest.h>

#include "tests/worker/test_models.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += double(got[i] - want[i]) * (got[i] - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / den);
}

class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing_util::WriteTestModel(testing_util::AwkwardConfig(), "awkward"));
  }
  static std::unique_ptr<Engine> MakeEngine(int max_batch_tokens = 2048) {
    EngineOptions options;
    options.device = "cpu";
    options.num_kv_blocks = 64;
    options.block_size = 16;
    options.model.max_batch_tokens = max_batch_tokens;
    options.model.max_batch_seqs = 64;
    auto engine = Engine::Create(*dir_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return std::move(*engine);
  }
  static GenerateRequest Greedy(std::vector<int32_t> prompt, int n) {
    GenerateRequest r;
    r.prompt = std::move(prompt);
    r.max_new_tokens = n;
    r.ignore_eos = true;
    r.record_logits = true;
    return r;
  }
  static std::vector<int32_t> Prompt(int len, int salt) {
    std::vector<int32_t> p;
    for (int i = 0; i < len; ++i) p.push_back((i * 37 + salt * 11 + 3) % 301);
    return p;
  }
  static std::string* dir_;
};
std::string* EngineTest::dir_ = nullptr;

TEST_F(EngineTest, BatchOfDifferentLengthsEqualsEachAlone) {
  auto engine = MakeEngine();
  std::vector<GenerateRequest> reqs = {Greedy(Prompt(5, 1), 12), Greedy(Prompt(17, 2), 9),
                                       Greedy(Prompt(33, 3), 14)};
  auto together = engine->Generate(reqs);
  ASSERT_TRUE(together.ok()) << together.status();
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto alone = MakeEngine()->Generate({reqs[i]});
    ASSERT_TRUE(alone.ok()) << alone.status();
    const GenerateResult& a = (*alone)[0];
    const GenerateResult& t = (*together)[i];
    EXPECT_EQ(t.output_ids, a.output_ids) << "sequence " << i;
    EXPECT_EQ(t.output_ids.size(), static_cast<size_t>(reqs[i].max_new_tokens));
    EXPECT_EQ(t.finish_reason, "length");
    ASSERT_EQ(t.step_logits.size(), a.step_logits.size());
    for (size_t s = 0; s < a.step_logits.size(); ++s) {
      EXPECT_LT(RelErr(t.step_logits[s], a.step_logits[s]), 1e-5) << "seq " << i << " step " << s;
    }
  }
}

TEST_F(EngineTest, ChunkedPrefillEqualsOnePass) {
  auto whole = MakeEngine(2048)->Generate({Greedy(Prompt(45, 4), 6)});
  auto chunked = MakeEngine(7)->Generate({Greedy(Prompt(45, 4), 6)});
  ASSERT_TRUE(whole.ok() && chunked.ok());
  EXPECT_EQ((*whole)[0].output_ids, (*chunked)[0].output_ids);
  // The step that sampled the first token held the prompt's last chunk (45 = 6 * 7 + 3), each
  // decode step one token.
  const std::vector<int> chunked_tokens = {3, 1, 1, 1, 1, 1};
  EXPECT_EQ((*chunked)[0].step_tokens, chunked_tokens);
  EXPECT_EQ((*whole)[0].step_tokens.front(), 45);
  for (size_t s = 0; s < (*whole)[0].step_logits.size(); ++s) {
    EXPECT_LT(RelErr((*chunked)[0].step_logits[s], (*whole)[0].step_logits[s]), 1e-5);
  }
}

TEST_F(EngineTest, PromptLogitsLastRowEqualsFirstSampledStep) {
  auto engine = MakeEngine();
  auto prompt = Prompt(20, 5);
  auto rows = engine->PromptLogits(prompt);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), prompt.size());
  auto gen = MakeEngine()->Generate({Greedy(prompt, 1)});
  ASSERT_TRUE(gen.ok());
  EXPECT_LT(RelErr(rows->back(), (*gen)[0].step_logits[0]), 1e-6);
}

TEST_F(EngineTest, SeededSamplingIsReproducibleAndBatchIndependent) {
  GenerateRequest r = Greedy(Prompt(9, 6), 10);
  r.sampling.temperature = 0.9f;
  r.sampling.top_p = 0.9f;
  r.sampling.seed = 1234;
  auto a = MakeEngine()->Generate({r});
  auto b = MakeEngine()->Generate({Greedy(Prompt(30, 7), 4), r});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)[0].output_ids, (*b)[1].output_ids);
  r.sampling.seed = 99;
  auto c = MakeEngine()->Generate({r});
  ASSERT_TRUE(c.ok());
  EXPECT_NE((*a)[0].output_ids, (*c)[0].output_ids);
}

TEST_F(EngineTest, BadRequestsAreRejectedWithClearErrors) {
  auto engine = MakeEngine();
  auto empty = engine->Generate({Greedy({}, 3)});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  auto bad_id = engine->Generate({Greedy({5, 301}, 3)});
  EXPECT_EQ(bad_id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_id.status().message().find("301"), absl::string_view::npos);
  auto too_long = engine->Generate({Greedy(Prompt(500, 1), 20)});
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("512"), absl::string_view::npos);
  // The engine still works afterwards.
  EXPECT_TRUE(engine->Generate({Greedy(Prompt(4, 1), 2)}).ok());
}

TEST_F(EngineTest, StopsAtEos) {
  // Find what greedy produces, then declare its 3rd token a stop token.
  auto first = MakeEngine()->Generate({Greedy(Prompt(8, 9), 6)});
  ASSERT_TRUE(first.ok());
  GenerateRequest r = Greedy(Prompt(8, 9), 6);
  r.stop_token_ids = {(*first)[0].output_ids[2]};
  auto stopped = MakeEngine()->Generate({r});
  ASSERT_TRUE(stopped.ok());
  const auto& ids = (*stopped)[0].output_ids;
  EXPECT_EQ((*stopped)[0].finish_reason, "stop");
  EXPECT_LE(ids.size(), 3u);
  EXPECT_EQ(ids.back(), (*first)[0].output_ids[2]);
}

}  // namespace
}  // namespace tpserve
