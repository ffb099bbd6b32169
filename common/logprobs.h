// Log-probabilities of a generated token, as the sampler computes them and the API returns
// them: under the model's raw next-token distribution (log_softmax of the logits over the real
// vocabulary, before repetition penalty, temperature, top-k and top-p).
#pragma once

#include <cstdint>
#include <vector>

namespace tpserve {

// Most alternatives a request may ask for (the API's sampling.logprobs, like OpenAI's).
inline constexpr int kMaxLogprobs = 20;

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
};

struct TokenLogprobs {
  float logprob = 0.0f;           // of the token actually chosen
  std::vector<TokenLogprob> top;  // the N most likely tokens: logprob descending, then id ascending
};

}  // namespace tpserve
