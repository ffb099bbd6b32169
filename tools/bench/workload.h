// What the load generator sends: seeded random numbers, prompt / output length distributions,
// Poisson arrival times, the named presets of the DeepSeek-Coder bf16 guide, and the planned
// requests (prompt token ids, max_new_tokens, arrival time) drawn from one seed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tpserve::bench {

// splitmix64-seeded xoshiro256**: the same numbers on every platform and standard library
// (std::*_distribution are implementation-defined).
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t Next();
  double Uniform();                            // [0, 1)
  int64_t UniformInt(int64_t lo, int64_t hi);  // [lo, hi], inclusive
  double Normal(double mean, double stddev);   // Box-Muller
  double Exponential(double rate);             // mean 1 / rate

 private:
  uint64_t s_[4];
};

// A length: "512" (fixed), "uniform:LO:HI" (inclusive), "normal:MEAN:STD[:MIN:MAX]" (rounded,
// clipped to [MIN, MAX]; default MIN 1, MAX MEAN + 4 STD).
struct LengthDist {
  enum class Kind { kFixed, kUniform, kNormal };
  Kind kind = Kind::kFixed;
  double a = 0;  // fixed value, uniform LO or normal MEAN
  double b = 0;  // uniform HI or normal STD
  int64_t min = 1;
  int64_t max = 1;

  static absl::StatusOr<LengthDist> Parse(const std::string& flag, const std::string& text);
  static LengthDist Fixed(int64_t n);
  int64_t Draw(Rng& rng) const;
  int64_t Max() const { return max; }
  std::string ToString() const;
};

// Arrival times (seconds from the start) of `n` requests at `rate` requests/s: the first at 0,
// then exponential gaps (a Poisson process). rate <= 0 or infinite: all at 0.
std::vector<double> PoissonArrivals(int64_t n, double rate, uint64_t seed);

// A named scenario: the defaults it sets (explicit flags override them).
struct Preset {
  std::string name;
  std::string description;
  int64_t prompt_len = 512;
  int64_t output_len = 512;
  int64_t concurrency = 1;
  int64_t num_requests = 0;
  // Multi-turn chat: `conversations` run with `concurrency` in parallel, `turns` requests each;
  // turn t > 0 sends the history (previous prompt + previous output) + a new user turn of
  // `user_turn_len` tokens. 0 turns: not a chat.
  int64_t turns = 0;
  int64_t conversations = 0;
  int64_t user_turn_len = 0;
  // Tokens of one shared prefix (a system prompt) in front of every prompt (a chat's first
  // turn); prompt_len counts the unique part after it.
  int64_t shared_prefix_len = 0;
};
const std::vector<Preset>& Presets();
absl::StatusOr<Preset> FindPreset(const std::string& name);

struct WorkloadSpec {
  int64_t num_requests = 0;  // ignored for chat (conversations * turns)
  LengthDist prompt_len = LengthDist::Fixed(512);
  LengthDist output_len = LengthDist::Fixed(128);
  double request_rate = 0;  // <= 0 or inf: no pacing
  int64_t vocab_size = 0;   // prompt ids are drawn from [first_token_id, vocab_size)
  int64_t first_token_id = 0;
  int64_t context_length = 0;  // 0: not checked
  // Chat (turns > 0).
  int64_t turns = 0;
  int64_t conversations = 0;
  LengthDist user_turn_len = LengthDist::Fixed(128);
  int64_t shared_prefix_len = 0;  // drawn once, in front of every prompt (a chat's first turn)
  uint64_t seed = 0;
};

// One request of the plan. For a chat turn t > 0, `prompt` holds only the new user turn: the
// load generator prepends the conversation's history when it sends it.
struct PlannedRequest {
  int64_t index = 0;
  int64_t conversation = -1;  // chat only
  int64_t turn = 0;
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 0;
  double arrival_s = 0;
};

// Draws the whole plan from spec.seed (same seed, same plan). Errors name the flag whose values
// do not fit (e.g. prompt + output beyond the model's context length).
absl::StatusOr<std::vector<PlannedRequest>> PlanRequests(const WorkloadSpec& spec);

}  // namespace tpserve::bench
