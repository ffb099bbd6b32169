// The CPU engine on a small random model: batching, chunked prefill and the KV cache layout do
// not change the results.
#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

#include "tests/testing/test_models.h"
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
  static std::unique_ptr<Engine> MakeEngine(int max_batch_tokens = 2048,
                                            const std::string& launch_ahead = "") {
    EngineOptions options;
    options.device = "cpu";
    options.launch_ahead = launch_ahead;
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

// Launching each step before the one in flight has finished (the CUDA path's logic, forced on
// the CPU) gives the serial loop's tokens, finish reasons and logprobs exactly: prompts of
// several chunks, greedy and seeded sampling, stops on a token of the step in flight (the one
// more token computed is dropped), length limits, a repetition penalty (its steps wait for the
// ids on the host) and logprobs; and steps did go ahead. Logprobs agree to 1e-5, not bit for
// bit: a step launched before a sequence's stop is known computes one more row for it, and
// OpenBLAS may round the other rows of a batch of another size differently (the batch-shape
// caveat of the README; the tokens are the same).
TEST_F(EngineTest, LaunchAheadEqualsTheSerialLoop) {
  std::vector<GenerateRequest> reqs = {Greedy(Prompt(5, 1), 12),  Greedy(Prompt(70, 2), 9),
                                       Greedy(Prompt(33, 3), 20), Greedy(Prompt(9, 4), 1),
                                       Greedy(Prompt(12, 5), 15), Greedy(Prompt(40, 6), 11)};
  for (auto& r : reqs) r.record_logits = false;
  reqs[2].sampling.temperature = 0.8f;
  reqs[2].sampling.seed = 7;
  reqs[4].sampling.logprobs = 3;
  reqs[5].sampling.temperature = 1.1f;
  reqs[5].sampling.top_k = 20;
  reqs[5].sampling.seed = 9;
  auto serial_engine = MakeEngine(48, "0");
  auto first = serial_engine->Generate(reqs);
  ASSERT_TRUE(first.ok()) << first.status();
  // Stops: request 0 at its 4th token, request 2 at its 7th.
  reqs[0].stop_token_ids = {(*first)[0].output_ids.at(3)};
  reqs[2].stop_token_ids = {(*first)[2].output_ids.at(6)};
  for (bool penalty : {false, true}) {
    SCOPED_TRACE(penalty ? "with a repetition penalty on request 1" : "no penalty");
    if (penalty) reqs[1].sampling.repetition_penalty = 1.4f;
    auto serial = serial_engine->Generate(reqs);
    ASSERT_TRUE(serial.ok()) << serial.status();
    auto ahead_engine = MakeEngine(48, "1");
    ASSERT_TRUE(ahead_engine->runner().launch_ahead());
    auto ahead = ahead_engine->Generate(reqs);
    ASSERT_TRUE(ahead.ok()) << ahead.status();
    EXPECT_GT(ahead_engine->runner().steps_launched_ahead(), 0);
    EXPECT_EQ(serial_engine->runner().steps_launched_ahead(), 0);
    ASSERT_EQ(ahead->size(), serial->size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_EQ((*ahead)[i].output_ids, (*serial)[i].output_ids);
      EXPECT_EQ((*ahead)[i].finish_reason, (*serial)[i].finish_reason);
      ASSERT_EQ((*ahead)[i].logprobs.size(), (*serial)[i].logprobs.size());
      for (size_t t = 0; t < (*ahead)[i].logprobs.size(); ++t) {
        EXPECT_NEAR((*ahead)[i].logprobs[t].logprob, (*serial)[i].logprobs[t].logprob, 1e-5) << t;
        ASSERT_EQ((*ahead)[i].logprobs[t].top.size(), (*serial)[i].logprobs[t].top.size());
        for (size_t k = 0; k < (*ahead)[i].logprobs[t].top.size(); ++k) {
          EXPECT_EQ((*ahead)[i].logprobs[t].top[k].id, (*serial)[i].logprobs[t].top[k].id);
        }
      }
    }
    EXPECT_EQ((*serial)[0].finish_reason, "stop");
    EXPECT_EQ((*serial)[0].output_ids.size(), 4u);
    EXPECT_EQ((*serial)[4].logprobs.size(), (*serial)[4].output_ids.size());
  }
}

// log_softmax of one row of logits, in double precision.
std::vector<double> LogSoftmax(const std::vector<float>& row) {
  double m = -INFINITY, sum = 0;
  for (float x : row) m = std::max(m, double(x));
  for (float x : row) sum += std::exp(double(x) - m);
  std::vector<double> out;
  for (float x : row) out.push_back(double(x) - m - std::log(sum));
  return out;
}

TEST_F(EngineTest, LogprobsAreTheLogSoftmaxOfTheForwardLogits) {
  GenerateRequest greedy = Greedy(Prompt(11, 2), 7);
  greedy.sampling.logprobs = 5;
  GenerateRequest sampled = Greedy(Prompt(6, 3), 8);
  sampled.sampling.temperature = 0.8f;
  sampled.sampling.top_k = 20;
  sampled.sampling.seed = 17;
  sampled.sampling.logprobs = 3;
  GenerateRequest none = Greedy(Prompt(9, 4), 5);
  auto together = MakeEngine()->Generate({greedy, sampled, none});
  ASSERT_TRUE(together.ok()) << together.status();
  const std::vector<GenerateRequest> reqs = {greedy, sampled};
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    const GenerateResult& r = (*together)[i];
    ASSERT_EQ(r.logprobs.size(), r.output_ids.size());
    ASSERT_EQ(r.step_logits.size(), r.output_ids.size());
    for (size_t s = 0; s < r.output_ids.size(); ++s) {
      const std::vector<double> want = LogSoftmax(r.step_logits[s]);
      const int32_t id = r.output_ids[s];
      EXPECT_NEAR(r.logprobs[s].logprob, want[id], 1e-5) << "step " << s;
      ASSERT_EQ(r.logprobs[s].top.size(), static_cast<size_t>(reqs[i].sampling.logprobs));
      for (size_t k = 0; k < r.logprobs[s].top.size(); ++k) {
        const TokenLogprob& alt = r.logprobs[s].top[k];
        EXPECT_NEAR(alt.logprob, want[alt.id], 1e-5) << "step " << s << " rank " << k;
        if (k > 0) {
          const TokenLogprob& prev = r.logprobs[s].top[k - 1];
          EXPECT_TRUE(prev.logprob > alt.logprob ||
                      (prev.logprob == alt.logprob && prev.id < alt.id));
        }
      }
      // Nothing outside the alternatives beats the last of them.
      const double last = r.logprobs[s].top.back().logprob;
      int better = 0;
      for (double x : want) better += x > last + 1e-6;
      EXPECT_LT(better, static_cast<int>(r.logprobs[s].top.size())) << "step " << s;
      if (i == 0) {
        EXPECT_EQ(r.logprobs[s].top[0].id, id) << "greedy picks the top-1, step " << s;
      }
    }
  }
  EXPECT_TRUE((*together)[2].logprobs.empty());
  // Asking for logprobs changes no token.
  GenerateRequest plain = sampled;
  plain.sampling.logprobs = -1;
  auto alone = MakeEngine()->Generate({plain});
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ((*alone)[0].output_ids, (*together)[1].output_ids);
  EXPECT_TRUE((*alone)[0].logprobs.empty());
  // Out of range is refused.
  GenerateRequest bad = greedy;
  bad.sampling.logprobs = kMaxLogprobs + 1;
  auto refused = MakeEngine()->Generate({bad});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("logprobs"), absl::string_view::npos);
}

}  // namespace
}  // namespace tpserve

namespace tpserve {
namespace {

// feed_last_sampled: the shard runner puts the id it sampled for a sequence in its previous step
// where the plan holds a placeholder, in the forward and in the repetition-penalty history, and
// refuses a feed whose previous step did not sample the sequence.
TEST_F(EngineTest, FeedLastSampledContinuesWithTheSampledToken) {
  auto engine = MakeEngine();
  ShardRunner& runner = engine->runner();
  const std::vector<int32_t> prompt = Prompt(21, 4);
  auto step = [](uint64_t seq, int start, std::vector<int32_t> tokens, bool feed) {
    worker::StepPlan plan;
    worker::SeqStep* s = plan.add_seqs();
    s->set_seq_id(seq);
    s->set_start_pos(start);
    s->mutable_token_ids()->Assign(tokens.begin(), tokens.end());
    for (int b = 0; b < 2; ++b) s->add_block_table(static_cast<int32_t>(seq * 2 + b));
    s->set_sample(true);
    s->mutable_sampling()->set_repetition_penalty(1.5f);
    s->set_feed_last_sampled(feed);
    return plan;
  };
  // Sequence 1 feeds, sequence 2 gets the same tokens spelled out: same ids three steps long.
  auto first = runner.Run(step(1, 0, prompt, false));
  ASSERT_TRUE(first.ok()) << first.status();
  auto first2 = runner.Run(step(2, 0, prompt, false));
  ASSERT_TRUE(first2.ok()) << first2.status();
  ASSERT_EQ(first->token_ids(0), first2->token_ids(0));
  int32_t last = first->token_ids(0);
  int pos = static_cast<int>(prompt.size());
  for (int i = 0; i < 3; ++i, ++pos) {
    auto fed = runner.Run(step(1, pos, {0}, true));
    ASSERT_TRUE(fed.ok()) << fed.status();
    auto spelled = runner.Run(step(2, pos, {last}, false));
    ASSERT_TRUE(spelled.ok()) << spelled.status();
    EXPECT_EQ(fed->token_ids(0), spelled->token_ids(0)) << "step " << i;
    last = spelled->token_ids(0);
  }
  // A step that does not sample sequence 1 leaves nothing to feed.
  worker::StepPlan no_sample = step(1, pos, {last}, false);
  no_sample.mutable_seqs(0)->set_sample(false);
  ASSERT_TRUE(runner.Run(no_sample).ok());
  auto refused = runner.Run(step(1, pos + 1, {0}, true));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("sequence 1"), std::string::npos) << refused.status();
  // A sequence that never sampled, and a feed with more than one token.
  EXPECT_FALSE(runner.Run(step(7, 0, {0}, true)).ok());
  EXPECT_FALSE(runner.Run(step(2, pos, {0, 0}, true)).ok());
}

}  // namespace
}  // namespace tpserve
