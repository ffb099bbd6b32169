// ValidateSampling: the one check of sampling parameters the CLI, the API, the engine and the
// workers share; IsGreedy: the threshold below which a temperature means argmax.
#include "common/sampling.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

namespace tpserve {
namespace {

TEST(SamplingTest, DefaultsAndValidValuesPass) {
  SamplingParams p;
  EXPECT_TRUE(ValidateSampling(p).ok());
  p.temperature = 0.7f;
  p.top_p = 0.9f;
  p.top_k = 40;
  p.repetition_penalty = 1.3f;
  p.logprobs = kMaxLogprobs;
  EXPECT_TRUE(ValidateSampling(p).ok());
  p.logprobs = 0;
  EXPECT_TRUE(ValidateSampling(p).ok());
}

TEST(SamplingTest, EachBadFieldIsNamedWithItsRange) {
  struct Case {
    void (*set)(SamplingParams&);
    const char* field;
  };
  const Case cases[] = {
      {[](SamplingParams& p) { p.temperature = -0.1f; }, "sampling.temperature must be"},
      {[](SamplingParams& p) { p.temperature = std::numeric_limits<float>::infinity(); },
       "sampling.temperature must be"},
      {[](SamplingParams& p) { p.top_p = 0.0f; }, "sampling.top_p must be in (0, 1]"},
      {[](SamplingParams& p) { p.top_p = 1.5f; }, "sampling.top_p must be in (0, 1]"},
      {[](SamplingParams& p) { p.top_p = std::numeric_limits<float>::quiet_NaN(); },
       "sampling.top_p"},
      {[](SamplingParams& p) { p.top_k = -1; }, "sampling.top_k must be >= 0"},
      {[](SamplingParams& p) { p.repetition_penalty = 0.0f; },
       "sampling.repetition_penalty must be > 0"},
      {[](SamplingParams& p) { p.repetition_penalty = -2.0f; },
       "sampling.repetition_penalty must be > 0"},
      {[](SamplingParams& p) { p.logprobs = kMaxLogprobs + 1; }, "sampling.logprobs must be in"},
      {[](SamplingParams& p) { p.logprobs = -2; }, "sampling.logprobs must be in"},
  };
  for (const Case& c : cases) {
    SamplingParams p;
    c.set(p);
    const absl::Status st = ValidateSampling(p, "sampling.");
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(st.message().find(c.field), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("(got "), std::string::npos) << st.message();
  }
}

TEST(SamplingTest, TinyTemperaturesAreGreedy) {
  EXPECT_TRUE(IsGreedy(0.0f));
  EXPECT_TRUE(IsGreedy(1e-38f));
  EXPECT_TRUE(IsGreedy(kGreedyTemperature));
  EXPECT_TRUE(IsGreedy(std::numeric_limits<float>::denorm_min()));
  EXPECT_FALSE(IsGreedy(2e-5f));
  EXPECT_FALSE(IsGreedy(1.0f));
}

}  // namespace
}  // namespace tpserve
