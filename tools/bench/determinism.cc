// The determinism check of `tpserve bench` (see determinism.h): the requests' sampling, the two
// runs, and the comparison of their answers.
#include "tools/bench/determinism.h"

#include <algorithm>
#include <bit>
#include <random>

#include "absl/strings/str_cat.h"

namespace tpserve::bench {
namespace {

// Logprobs are compared as bits: the promise is bit for bit, and -0.0 == 0.0 or NaN != NaN
// would hide or invent a difference.
bool SameBits(float x, float y) { return std::bit_cast<uint32_t>(x) == std::bit_cast<uint32_t>(y); }

bool SameLogprobs(const OutputLogprobs& x, const OutputLogprobs& y) {
  if (!SameBits(x.logprob, y.logprob) || x.top_ids != y.top_ids ||
      x.top_logprobs.size() != y.top_logprobs.size()) {
    return false;
  }
  for (size_t i = 0; i < x.top_logprobs.size(); ++i) {
    if (!SameBits(x.top_logprobs[i], y.top_logprobs[i])) return false;
  }
  return true;
}

ServerSteps StepsBetween(const absl::StatusOr<v1::ModelInfo>& a,
                         const absl::StatusOr<v1::ModelInfo>& b) {
  ServerSteps s;
  if (!a.ok() || !b.ok()) return s;
  s.known = true;
  s.steps = b->steps().steps() - a->steps().steps();
  s.tokens = b->steps().tokens() - a->steps().tokens();
  return s;
}

}  // namespace

std::vector<v1::SamplingOptions> DeterminismCheckSampling(const v1::SamplingOptions& sampled,
                                                          int64_t n) {
  std::vector<v1::SamplingOptions> out;
  for (int64_t i = 0; i < n; ++i) {
    v1::SamplingOptions s = sampled;
    s.set_seed(sampled.seed() + static_cast<uint64_t>(i));
    if (i % 2 == 1) s.set_temperature(0);
    out.push_back(std::move(s));
  }
  return out;
}

bool IsGreedy(const v1::SamplingOptions& sampling) { return !(sampling.temperature() > 0); }

const char* DivergenceName(Divergence d) {
  switch (d) {
    case Divergence::kNone:
      return "none";
    case Divergence::kTokens:
      return "tokens";
    case Divergence::kLogprobs:
      return "logprobs";
    case Divergence::kLength:
      return "length";
    case Divergence::kFailed:
      return "failed";
  }
  return "unknown";
}

AnswerComparison CompareAnswer(const RequestRecord& a, const RequestRecord& b) {
  AnswerComparison c;
  c.index = a.index;
  c.length_a = static_cast<int64_t>(a.output_ids.size());
  c.length_b = static_cast<int64_t>(b.output_ids.size());
  if (!a.ok || !b.ok) {
    c.divergence = Divergence::kFailed;
    const RequestRecord& bad = a.ok ? b : a;
    c.error =
        absl::StrCat(a.ok ? "second" : "first", " run: ", bad.error_code, ": ", bad.error_message);
    return c;
  }
  const size_t n = std::min(a.output_ids.size(), b.output_ids.size());
  size_t token = 0;
  while (token < n && a.output_ids[token] == b.output_ids[token]) ++token;
  const bool ids_equal = token == n && a.output_ids.size() == b.output_ids.size();
  if (!ids_equal) c.first_token_difference = static_cast<int64_t>(token);

  const size_t m = std::min(a.output_logprobs.size(), b.output_logprobs.size());
  size_t lp = 0;
  while (lp < m && SameLogprobs(a.output_logprobs[lp], b.output_logprobs[lp])) ++lp;
  const bool logprobs_equal = lp == m && a.output_logprobs.size() == b.output_logprobs.size();

  if (ids_equal && logprobs_equal) return c;
  if (!logprobs_equal && (ids_equal || lp < token)) {
    c.divergence = Divergence::kLogprobs;
    c.first_difference = static_cast<int64_t>(lp);
  } else {
    c.divergence = token < n ? Divergence::kTokens : Divergence::kLength;
    c.first_difference = static_cast<int64_t>(token);
  }
  return c;
}

DeterminismReport CompareRuns(const std::vector<RequestRecord>& a,
                              const std::vector<RequestRecord>& b) {
  DeterminismReport r;
  const size_t n = std::max(a.size(), b.size());
  r.requests = static_cast<int64_t>(n);
  for (size_t i = 0; i < n; ++i) {
    AnswerComparison c;
    if (i < a.size() && i < b.size()) {
      c = CompareAnswer(a[i], b[i]);
      if (c.divergence != Divergence::kFailed) {
        r.logprob_tokens += static_cast<int64_t>(
            std::min(a[i].output_logprobs.size(), b[i].output_logprobs.size()));
      }
    } else {
      c.index = static_cast<int64_t>(i);
      c.divergence = Divergence::kFailed;
      c.error = absl::StrCat("no answer in the ", i < a.size() ? "second" : "first", " run");
    }
    switch (c.divergence) {
      case Divergence::kNone:
        ++r.identical;
        break;
      case Divergence::kFailed:
        ++r.failed;
        break;
      default:
        ++r.differing;
    }
    r.answers.push_back(std::move(c));
  }
  return r;
}

absl::StatusOr<DeterminismRun> RunDeterminismCheck(const LoadOptions& options,
                                                   const std::vector<PlannedRequest>& plan,
                                                   Progress* progress) {
  if (plan.empty()) return absl::InvalidArgumentError("--check-deterministic: no request planned");
  for (const PlannedRequest& p : plan) {
    if (p.conversation >= 0) {
      return absl::InvalidArgumentError(
          "--check-deterministic compares single requests, not chat turns (no --turns)");
    }
  }
  LoadOptions o = options;
  o.open_loop = false;
  o.keep_outputs = true;
  DeterminismRun run;
  run.sampling = DeterminismCheckSampling(options.sampling, static_cast<int64_t>(plan.size()));
  o.request_sampling = run.sampling;

  constexpr double kInfoTimeout = 10;
  absl::StatusOr<v1::ModelInfo> before = absl::UnknownError("not read");
  o.before_run = [&] {
    if (options.before_run) options.before_run();
    before = FetchModelInfo(o.server, kInfoTimeout);
  };
  o.concurrency = static_cast<int64_t>(plan.size());
  // Salts of this check alone: a later check on the same server finds nothing of it cached.
  std::random_device random;
  const std::string salt = absl::StrCat("tpserve-bench-check-", absl::Hex(random()),
                                        absl::Hex(random(), absl::kZeroPad8));
  o.cache_salt = salt + "-concurrent";
  absl::StatusOr<LoadResult> concurrent = RunLoad(o, plan, progress);
  if (!concurrent.ok()) return concurrent.status();
  run.concurrent = *std::move(concurrent);
  const absl::StatusOr<v1::ModelInfo> between = FetchModelInfo(o.server, kInfoTimeout);

  o.concurrency = 1;
  o.warmup = 0;
  o.before_run = nullptr;
  o.cache_salt = salt + "-sequential";
  absl::StatusOr<LoadResult> sequential = RunLoad(o, plan, progress);
  if (!sequential.ok()) return sequential.status();
  run.sequential = *std::move(sequential);
  const absl::StatusOr<v1::ModelInfo> after = FetchModelInfo(o.server, kInfoTimeout);

  run.concurrent_steps = StepsBetween(before, between);
  run.sequential_steps = StepsBetween(between, after);

  run.report = CompareRuns(run.concurrent.records, run.sequential.records);
  return run;
}

}  // namespace tpserve::bench
