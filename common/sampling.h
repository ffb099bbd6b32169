// Sampling parameters of one sequence and the one validation of them, used by the command line,
// the public API, the in-process engine and the workers alike.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "common/logprobs.h"

namespace tpserve {

// Temperatures at or below this are greedy: dividing logits by a smaller one overflows f32
// (1e-38 turned every logit into +-inf and sampled the least likely token).
inline constexpr float kGreedyTemperature = 1e-5f;
inline constexpr bool IsGreedy(float temperature) { return !(temperature > kGreedyTemperature); }

// temperature <= kGreedyTemperature means greedy (argmax, lowest id on ties); top_k 0 and
// top_p 1 are off; the draw of a sampled token is keyed by (seed, position) only.
struct SamplingParams {
  float temperature = 0.0f;
  int32_t top_k = 0;   // 0 = off
  float top_p = 1.0f;  // 1 = off
  uint64_t seed = 0;
  int64_t position = 0;  // position of the token being sampled (the RNG counter)
  // -1: no log-probabilities. N in [0, kMaxLogprobs]: Sample also returns the chosen token's
  // log-probability and the top min(N, vocab) alternatives (common/logprobs.h).
  int32_t logprobs = -1;
  // Hugging Face's rule over the sequence's earlier tokens (prompt and output): a positive
  // logit is divided by it, a negative one multiplied; 1 = off. Applied by the shard runner
  // before Ops::Sample; logprobs stay those of the raw distribution.
  float repetition_penalty = 1.0f;
};

// OK, or INVALID_ARGUMENT naming the first bad field as `prefix` + its name ("temperature",
// "top_p", "top_k", "repetition_penalty", "logprobs"), the value and the valid range.
absl::Status ValidateSampling(const SamplingParams& params, std::string_view prefix = "");

}  // namespace tpserve
