// The comparison of `tpserve bench --check-deterministic` (tools/bench/determinism.h): which
// answers it calls identical, where it says two answers part and why, and the requests' sampling.
#include "tools/bench/determinism.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace tpserve::bench {
namespace {

// An answer of `n` tokens 100, 101, ... with logprobs -0.5 (i + 1) and two alternatives each.
RequestRecord Answer(int n, bool logprobs = true) {
  RequestRecord r;
  r.ok = true;
  for (int i = 0; i < n; ++i) {
    r.output_ids.push_back(100 + i);
    if (logprobs) {
      OutputLogprobs lp;
      lp.logprob = -0.5f * static_cast<float>(i + 1);
      lp.top_ids = {100 + i, 7};
      lp.top_logprobs = {lp.logprob, lp.logprob - 1};
      r.output_logprobs.push_back(lp);
    }
  }
  r.output_tokens = n;
  return r;
}

float NextUp(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }

TEST(DeterminismCompareTest, IdenticalAnswers) {
  for (bool logprobs : {false, true}) {
    const AnswerComparison c = CompareAnswer(Answer(12, logprobs), Answer(12, logprobs));
    EXPECT_EQ(c.divergence, Divergence::kNone);
    EXPECT_EQ(c.first_difference, -1);
    EXPECT_EQ(c.first_token_difference, -1);
    EXPECT_EQ(c.length_a, 12);
    EXPECT_EQ(c.length_b, 12);
  }
  // The same NaN bits are the same answer.
  RequestRecord a = Answer(3), b = Answer(3);
  a.output_logprobs[1].logprob = b.output_logprobs[1].logprob = std::nanf("");
  EXPECT_EQ(CompareAnswer(a, b).divergence, Divergence::kNone);
}

TEST(DeterminismCompareTest, TokenDifference) {
  RequestRecord a = Answer(12, false), b = Answer(12, false);
  b.output_ids[5] = 9;
  b.output_ids[8] = 9;
  const AnswerComparison c = CompareAnswer(a, b);
  EXPECT_EQ(c.divergence, Divergence::kTokens);
  EXPECT_EQ(c.first_difference, 5);
  EXPECT_EQ(c.first_token_difference, 5);
  EXPECT_STREQ(DivergenceName(c.divergence), "tokens");
}

TEST(DeterminismCompareTest, LogprobsPartBeforeTokens) {
  // One ulp at position 2, a token at 6: the answers part at 2, their ids at 6.
  RequestRecord a = Answer(10), b = Answer(10);
  b.output_logprobs[2].logprob = NextUp(b.output_logprobs[2].logprob);
  b.output_ids[6] = 3;
  AnswerComparison c = CompareAnswer(a, b);
  EXPECT_EQ(c.divergence, Divergence::kLogprobs);
  EXPECT_EQ(c.first_difference, 2);
  EXPECT_EQ(c.first_token_difference, 6);

  // Same ids throughout: only the logprobs differ.
  b = Answer(10);
  b.output_logprobs[4].top_logprobs[1] = NextUp(b.output_logprobs[4].top_logprobs[1]);
  c = CompareAnswer(a, b);
  EXPECT_EQ(c.divergence, Divergence::kLogprobs);
  EXPECT_EQ(c.first_difference, 4);
  EXPECT_EQ(c.first_token_difference, -1);

  // Another alternative id, and fewer alternatives, are differences too.
  b = Answer(10);
  b.output_logprobs[7].top_ids[1] = 8;
  EXPECT_EQ(CompareAnswer(a, b).first_difference, 7);
  b = Answer(10);
  b.output_logprobs[3].top_ids.pop_back();
  b.output_logprobs[3].top_logprobs.pop_back();
  EXPECT_EQ(CompareAnswer(a, b).first_difference, 3);

  // Bits, not values: -0.0 is not 0.0.
  a.output_logprobs[0].logprob = 0.0f;
  b = a;
  b.output_logprobs[0].logprob = -0.0f;
  EXPECT_EQ(CompareAnswer(a, b).divergence, Divergence::kLogprobs);

  // Logprobs in one answer only: they differ from the first token.
  c = CompareAnswer(Answer(5), Answer(5, false));
  EXPECT_EQ(c.divergence, Divergence::kLogprobs);
  EXPECT_EQ(c.first_difference, 0);
}

TEST(DeterminismCompareTest, TokenAndLogprobAtTheSamePositionIsATokenDifference) {
  RequestRecord a = Answer(6), b = Answer(6);
  b.output_ids[3] = 1;
  b.output_logprobs[3].logprob = -9;
  const AnswerComparison c = CompareAnswer(a, b);
  EXPECT_EQ(c.divergence, Divergence::kTokens);
  EXPECT_EQ(c.first_difference, 3);
}

TEST(DeterminismCompareTest, OneAnswerAPrefixOfTheOther) {
  const AnswerComparison c = CompareAnswer(Answer(7, false), Answer(9, false));
  EXPECT_EQ(c.divergence, Divergence::kLength);
  EXPECT_EQ(c.first_difference, 7);
  EXPECT_EQ(c.first_token_difference, 7);
  EXPECT_EQ(c.length_a, 7);
  EXPECT_EQ(c.length_b, 9);
}

TEST(DeterminismCompareTest, FailedRequestsAreNotCompared) {
  RequestRecord a = Answer(4), b = Answer(4);
  b.ok = false;
  b.error_code = "UNAVAILABLE";
  b.error_message = "rank 1 failed";
  const AnswerComparison c = CompareAnswer(a, b);
  EXPECT_EQ(c.divergence, Divergence::kFailed);
  EXPECT_EQ(c.first_difference, -1);
  EXPECT_EQ(c.error, "second run: UNAVAILABLE: rank 1 failed");
}

TEST(DeterminismCompareTest, CompareRunsCountsEachKind) {
  std::vector<RequestRecord> a, b;
  for (int i = 0; i < 6; ++i) {
    a.push_back(Answer(8));
    b.push_back(Answer(8));
    a.back().index = b.back().index = i;
  }
  b[1].output_ids[2] = 0;                                                     // tokens
  b[4].output_logprobs[5].logprob = NextUp(b[4].output_logprobs[5].logprob);  // logprobs
  a[5].ok = false;                                                            // failed
  a.push_back(Answer(8));  // a seventh request without an answer in the second run
  a.back().index = 6;
  const DeterminismReport r = CompareRuns(a, b);
  EXPECT_EQ(r.requests, 7);
  EXPECT_EQ(r.identical, 3);
  EXPECT_EQ(r.differing, 2);
  EXPECT_EQ(r.failed, 2);
  EXPECT_EQ(r.logprob_tokens, 5 * 8);  // the five answers that were compared
  ASSERT_EQ(r.answers.size(), 7u);
  EXPECT_EQ(r.answers[0].divergence, Divergence::kNone);
  EXPECT_EQ(r.answers[1].divergence, Divergence::kTokens);
  EXPECT_EQ(r.answers[1].first_difference, 2);
  EXPECT_EQ(r.answers[4].divergence, Divergence::kLogprobs);
  EXPECT_EQ(r.answers[4].first_difference, 5);
  EXPECT_EQ(r.answers[5].divergence, Divergence::kFailed);
  EXPECT_EQ(r.answers[6].divergence, Divergence::kFailed);
  EXPECT_EQ(r.answers[6].index, 6);
  EXPECT_EQ(r.answers[6].error, "no answer in the second run");
}

TEST(DeterminismCompareTest, CheckSamplingAlternatesSampledAndGreedy) {
  v1::SamplingOptions base;
  base.set_temperature(0.7f);
  base.set_top_p(0.9f);
  base.set_seed(40);
  base.set_logprobs(3);
  const std::vector<v1::SamplingOptions> s = DeterminismCheckSampling(base, 5);
  ASSERT_EQ(s.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(s[i].seed(), 40u + static_cast<uint64_t>(i)) << i;
    EXPECT_EQ(s[i].logprobs(), 3) << i;
    EXPECT_EQ(IsGreedy(s[i]), i % 2 == 1) << i;
    EXPECT_FLOAT_EQ(s[i].temperature(), i % 2 == 1 ? 0.0f : 0.7f) << i;
  }
}

}  // namespace
}  // namespace tpserve::bench
