// Seeded random numbers, length distributions, arrivals, presets and request plans (see
// workload.h).
#include "tools/bench/workload.h"

#include <cmath>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tpserve::bench {
namespace {

uint64_t SplitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// Independent streams of one seed for the independent draws (prompts, lengths, arrivals), so
// that changing e.g. the rate does not change the prompts.
uint64_t StreamSeed(uint64_t seed, uint64_t stream) {
  uint64_t x = seed ^ (stream * 0xD1B54A32D192ED03ull);
  return SplitMix64(x);
}

}  // namespace

Rng::Rng(uint64_t seed) {
  uint64_t x = seed;
  for (uint64_t& s : s_) s = SplitMix64(x);
}

uint64_t Rng::Next() {
  const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return result;
}

double Rng::Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

int64_t Rng::UniformInt(int64_t lo, int64_t hi) {
  if (hi <= lo) return lo;
  const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
  // Rejection sampling: no modulo bias.
  const uint64_t limit =
      std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % span;
  uint64_t x;
  do {
    x = Next();
  } while (x >= limit);
  return lo + static_cast<int64_t>(x % span);
}

double Rng::Normal(double mean, double stddev) {
  const double u1 = 1.0 - Uniform();  // (0, 1]
  const double u2 = Uniform();
  return mean + stddev * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

double Rng::Exponential(double rate) { return -std::log(1.0 - Uniform()) / rate; }

LengthDist LengthDist::Fixed(int64_t n) {
  LengthDist d;
  d.kind = Kind::kFixed;
  d.a = static_cast<double>(n);
  d.min = d.max = n;
  return d;
}

absl::StatusOr<LengthDist> LengthDist::Parse(const std::string& flag, const std::string& text) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " '", text, "': ", why,
                     " (expected N, uniform:LO:HI or normal:MEAN:STD[:MIN:MAX], lengths >= 1)"));
  };
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  std::vector<double> nums;
  for (size_t i = (parts.size() > 1 ? 1 : 0); i < parts.size(); ++i) {
    double v;
    if (!absl::SimpleAtod(parts[i], &v) || !std::isfinite(v)) {
      return bad(absl::StrCat("'", parts[i], "' is not a number"));
    }
    nums.push_back(v);
  }
  LengthDist d;
  if (parts.size() == 1) {
    if (nums[0] < 1 || nums[0] != std::floor(nums[0])) return bad("not an integer >= 1");
    return Fixed(static_cast<int64_t>(nums[0]));
  }
  if (parts[0] == "fixed" && nums.size() == 1) {
    if (nums[0] < 1 || nums[0] != std::floor(nums[0])) return bad("not an integer >= 1");
    return Fixed(static_cast<int64_t>(nums[0]));
  }
  if (parts[0] == "uniform") {
    if (nums.size() != 2) return bad("uniform takes LO:HI");
    if (nums[0] < 1 || nums[1] < nums[0] || nums[0] != std::floor(nums[0]) ||
        nums[1] != std::floor(nums[1])) {
      return bad("need integers 1 <= LO <= HI");
    }
    d.kind = Kind::kUniform;
    d.a = nums[0];
    d.b = nums[1];
    d.min = static_cast<int64_t>(nums[0]);
    d.max = static_cast<int64_t>(nums[1]);
    return d;
  }
  if (parts[0] == "normal") {
    if (nums.size() != 2 && nums.size() != 4) return bad("normal takes MEAN:STD[:MIN:MAX]");
    if (nums[1] < 0) return bad("STD must be >= 0");
    d.kind = Kind::kNormal;
    d.a = nums[0];
    d.b = nums[1];
    d.min = nums.size() == 4 ? static_cast<int64_t>(nums[2]) : 1;
    d.max = nums.size() == 4 ? static_cast<int64_t>(nums[3])
                             : static_cast<int64_t>(std::ceil(nums[0] + 4 * nums[1]));
    if (d.min < 1 || d.max < d.min) return bad("need 1 <= MIN <= MAX");
    return d;
  }
  return bad(absl::StrCat("unknown distribution '", parts[0], "'"));
}

int64_t LengthDist::Draw(Rng& rng) const {
  switch (kind) {
    case Kind::kFixed:
      return min;
    case Kind::kUniform:
      return rng.UniformInt(min, max);
    case Kind::kNormal: {
      const double v = std::llround(rng.Normal(a, b));
      return std::clamp(static_cast<int64_t>(v), min, max);
    }
  }
  return min;
}

std::string LengthDist::ToString() const {
  switch (kind) {
    case Kind::kFixed:
      return absl::StrCat(min);
    case Kind::kUniform:
      return absl::StrCat("uniform:", min, ":", max);
    case Kind::kNormal:
      return absl::StrCat("normal:", a, ":", b, ":", min, ":", max);
  }
  return "";
}

std::vector<double> PoissonArrivals(int64_t n, double rate, uint64_t seed) {
  std::vector<double> t(static_cast<size_t>(std::max<int64_t>(n, 0)), 0.0);
  if (rate <= 0 || !std::isfinite(rate)) return t;
  Rng rng(StreamSeed(seed, 3));
  for (size_t i = 1; i < t.size(); ++i) t[i] = t[i - 1] + rng.Exponential(rate);
  return t;
}

const std::vector<Preset>& Presets() {
  static const std::vector<Preset>* presets = new std::vector<Preset>{
      {"latency", "batch 1: one client, 512-token prompt, 512 new tokens", 512, 512, 1, 10},
      {"batch32", "dynamic batching under load: 32 concurrent clients, 512 / 512", 512, 512, 32,
       64},
      {"batch64", "dynamic batching under load: 64 concurrent clients, 512 / 512", 512, 512, 64,
       128},
      {"batch128", "dynamic batching under load: 128 concurrent clients, 512 / 512", 512, 512, 128,
       256},
      {"chat",
       "multi-turn chat: 16 conversations (8 at a time) of 4 turns; each turn resends the history "
       "(previous prompt + previous output) + a 128-token user turn; 256-token first prompt, 128 "
       "new tokens per turn",
       256, 128, 8, 0, /*turns=*/4, /*conversations=*/16, /*user_turn_len=*/128},
      {"shared-prefix",
       "one long system prompt in front of every request: 64 concurrent clients, 1024 shared "
       "tokens + 128 unique tokens, 128 new tokens",
       128, 128, 64, 256, 0, 0, 0, /*shared_prefix_len=*/1024},
  };
  return *presets;
}

absl::StatusOr<Preset> FindPreset(const std::string& name) {
  std::string names;
  for (const Preset& p : Presets()) {
    if (p.name == name) return p;
    absl::StrAppend(&names, names.empty() ? "" : ", ", p.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--preset '", name, "' is not a preset (one of: ", names, ")"));
}

absl::StatusOr<std::vector<PlannedRequest>> PlanRequests(const WorkloadSpec& spec) {
  if (spec.vocab_size <= spec.first_token_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab size ", spec.vocab_size, " leaves no token ids to draw prompts from"));
  }
  Rng prompt_rng(StreamSeed(spec.seed, 1));
  Rng length_rng(StreamSeed(spec.seed, 2));
  auto draw_ids = [&](int64_t n) {
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (int32_t& id : ids) {
      id = static_cast<int32_t>(prompt_rng.UniformInt(spec.first_token_id, spec.vocab_size - 1));
    }
    return ids;
  };
  // The shared prefix has its own stream: the unique parts are the same with or without it.
  Rng shared_rng(StreamSeed(spec.seed, 4));
  std::vector<int32_t> shared(static_cast<size_t>(std::max<int64_t>(spec.shared_prefix_len, 0)));
  for (int32_t& id : shared) {
    id = static_cast<int32_t>(shared_rng.UniformInt(spec.first_token_id, spec.vocab_size - 1));
  }
  auto with_shared = [&shared](std::vector<int32_t> ids) {
    ids.insert(ids.begin(), shared.begin(), shared.end());
    return ids;
  };
  const int64_t shared_len = static_cast<int64_t>(shared.size());
  std::vector<PlannedRequest> plan;
  const bool chat = spec.turns > 0;
  if (chat) {
    if (spec.conversations < 1) {
      return absl::InvalidArgumentError("--num-conversations must be >= 1 for a chat workload");
    }
    const std::vector<double> arrivals =
        PoissonArrivals(spec.conversations, spec.request_rate, spec.seed);
    for (int64_t c = 0; c < spec.conversations; ++c) {
      int64_t history = 0;
      for (int64_t t = 0; t < spec.turns; ++t) {
        PlannedRequest r;
        r.index = static_cast<int64_t>(plan.size());
        r.conversation = c;
        r.turn = t;
        const int64_t len =
            t == 0 ? spec.prompt_len.Draw(length_rng) : spec.user_turn_len.Draw(length_rng);
        r.max_new_tokens = spec.output_len.Draw(length_rng);
        r.prompt = t == 0 ? with_shared(draw_ids(len)) : draw_ids(len);
        r.arrival_s = t == 0 ? arrivals[static_cast<size_t>(c)] : 0;
        history += len + (t == 0 ? shared_len : 0);
        if (spec.context_length > 0 && history + r.max_new_tokens > spec.context_length) {
          return absl::InvalidArgumentError(
              absl::StrCat("chat conversation ", c, " turn ", t, ": history of ", history,
                           " tokens + ", r.max_new_tokens,
                           " new tokens exceeds the model's context length ", spec.context_length,
                           "; lower --turns, --prompt-len, --user-turn-len or --output-len"));
        }
        history += r.max_new_tokens;
        plan.push_back(std::move(r));
      }
    }
    return plan;
  }
  if (spec.num_requests < 1) return absl::InvalidArgumentError("--num-requests must be >= 1");
  const std::vector<double> arrivals =
      PoissonArrivals(spec.num_requests, spec.request_rate, spec.seed);
  for (int64_t i = 0; i < spec.num_requests; ++i) {
    PlannedRequest r;
    r.index = i;
    const int64_t len = spec.prompt_len.Draw(length_rng);
    r.max_new_tokens = spec.output_len.Draw(length_rng);
    if (spec.context_length > 0 && shared_len + len + r.max_new_tokens > spec.context_length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", i, ": prompt of ", shared_len + len, " tokens + ", r.max_new_tokens,
          " new tokens exceeds the model's context length ", spec.context_length,
          "; lower --shared-prefix-len / --prompt-len / --output-len"));
    }
    r.prompt = with_shared(draw_ids(len));
    r.arrival_s = arrivals[static_cast<size_t>(i)];
    plan.push_back(std::move(r));
  }
  return plan;
}

}  // namespace tpserve::bench
