// `tpserve bench --check-deterministic`: the same requests sent all at once, then one at a time;
// every answer of the first run compared with its twin of the second, token for token and (with
// logprobs) bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/bench/load_gen.h"
#include "tools/bench/workload.h"
#include "tpserve/v1/inference.pb.h"

namespace tpserve::bench {

// The check's requests: even plan indices sample with `sampled` (its temperature, top-p, top-k,
// logprobs) and seed `sampled.seed() + index`; odd ones decode greedily (temperature 0, the
// same logprobs and seed). `n` requests.
std::vector<v1::SamplingOptions> DeterminismCheckSampling(const v1::SamplingOptions& sampled,
                                                          int64_t n);
bool IsGreedy(const v1::SamplingOptions& sampling);

// How two answers of one request differ, judged at the first position where they do.
enum class Divergence {
  kNone,      // identical: same ids, same length, logprobs equal bit for bit
  kTokens,    // a different token id
  kLogprobs,  // same ids so far, a logprob (or a top-logprob id or value) with other bits
  kLength,    // one answer is a prefix of the other
  kFailed,    // a request failed in either run: nothing to compare
};
const char* DivergenceName(Divergence d);

struct AnswerComparison {
  int64_t index = 0;
  Divergence divergence = Divergence::kNone;
  // The first token position where the answers differ in any way (ids, logprobs, length); -1
  // when identical or failed.
  int64_t first_difference = -1;
  // The first position whose token ids differ, or where one answer ends (-1: same ids); never
  // before first_difference.
  int64_t first_token_difference = -1;
  int64_t length_a = 0, length_b = 0;
  std::string error;  // kFailed: which run failed and why
};

// Pure. `a` and `b` are two answers of one request (kept with LoadOptions::keep_outputs); a
// request whose first answer has logprobs and whose second has none differs at position 0.
AnswerComparison CompareAnswer(const RequestRecord& a, const RequestRecord& b);

struct DeterminismReport {
  int64_t requests = 0;
  int64_t identical = 0;
  int64_t differing = 0;  // answered in both runs, not identical
  int64_t failed = 0;     // failed in either run
  // Tokens whose logprobs both runs returned (compared bit for bit), over all answers.
  int64_t logprob_tokens = 0;
  std::vector<AnswerComparison> answers;  // in plan order, one per request
};

// Pure: compares the two runs' records request by request (by position; a record missing from
// the shorter run counts as failed).
DeterminismReport CompareRuns(const std::vector<RequestRecord>& a,
                              const std::vector<RequestRecord>& b);

// The server's step counters over one run (GetModelInfo before and after it): how many requests
// shared a step.
struct ServerSteps {
  bool known = false;  // both readings succeeded
  int64_t steps = 0;
  int64_t tokens = 0;  // prompt and generated tokens the steps computed
};

struct DeterminismRun {
  std::vector<v1::SamplingOptions> sampling;  // of each request, by plan index
  LoadResult concurrent;                      // every request in flight at once
  LoadResult sequential;                      // one at a time, no warm-up
  ServerSteps concurrent_steps, sequential_steps;
  DeterminismReport report;
};

// Runs `plan` twice on `options.server` with the sampling of DeterminismCheckSampling (from
// options.sampling): all requests at once (options.warmup first), then one at a time. Each run
// (and the warm-up) has a cache_salt of its own, drawn afresh by every check, so no answer reads
// prompt blocks another run cached.
// `progress` (optional) counts both runs.
absl::StatusOr<DeterminismRun> RunDeterminismCheck(const LoadOptions& options,
                                                   const std::vector<PlannedRequest>& plan,
                                                   Progress* progress);

}  // namespace tpserve::bench
