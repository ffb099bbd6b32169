// The validation of sampling parameters (see sampling.h).
#include "common/sampling.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace tpserve {

absl::Status ValidateSampling(const SamplingParams& p, std::string_view prefix) {
  auto bad = [&](std::string_view field, const absl::AlphaNum& value, std::string_view range) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(prefix), std::string(field),
                                                   " must be ", std::string(range), " (got ",
                                                   value.Piece(), ")"));
  };
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return bad("temperature", p.temperature, "a number >= 0");
  }
  if (!std::isfinite(p.top_p) || p.top_p <= 0 || p.top_p > 1) {
    return bad("top_p", p.top_p, "in (0, 1]");
  }
  if (p.top_k < 0) return bad("top_k", p.top_k, ">= 0 (0 = off)");
  if (!std::isfinite(p.repetition_penalty) || p.repetition_penalty <= 0) {
    return bad("repetition_penalty", p.repetition_penalty, "> 0 (1 = off)");
  }
  if (p.logprobs < -1 || p.logprobs > kMaxLogprobs) {
    return bad("logprobs", p.logprobs, absl::StrCat("in [0, ", kMaxLogprobs, "] (or unset)"));
  }
  return absl::OkStatus();
}

}  // namespace tpserve
