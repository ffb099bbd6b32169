// The load generator: sends a planned workload to a tpserve.v1.Inference server (closed loop
// with N clients, or open loop at the plan's arrival times), measures every request on the
// client side, and reduces the measurements to a report.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/bench/stats.h"
#include "tools/bench/workload.h"
#include "tools/server_endpoint.h"
#include "tpserve/v1/inference.pb.h"

namespace tpserve::bench {

struct LoadOptions {
  ServerEndpoint server;
  // Closed loop: this many clients, each sending its next request when the previous one ends.
  // Open loop: at most this many requests in flight (0 = no limit).
  int64_t concurrency = 1;
  // Open loop when set: requests start at their planned arrival times.
  bool open_loop = false;
  bool stream = true;
  bool ignore_eos = true;
  // Send the prompts as text (the random ids detokenized by the server before the run).
  bool text_prompts = false;
  v1::SamplingOptions sampling;  // per request; a set seed becomes seed + request index
  // When not empty: the sampling of each planned request (by plan index), sent as it is
  // (instead of `sampling`).
  std::vector<v1::SamplingOptions> request_sampling;
  std::string cache_salt;     // of every request (the warm-up's: this + "-warmup")
  bool keep_outputs = false;  // keep each answer's token ids and logprobs in its record
  double timeout_s = 600;     // per request
  int64_t warmup = 0;         // requests sent (one at a time) before the measured run
  // Called after the warm-up, right before the measured run (e.g. to read server counters).
  std::function<void()> before_run;
};

// The log-probabilities of one generated token, as the server sent them (sampling.logprobs).
struct OutputLogprobs {
  float logprob = 0;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};

// Client-side measurements of one request (seconds from the start of the run).
struct RequestRecord {
  int64_t index = 0;
  int64_t conversation = -1;
  int64_t turn = 0;
  bool ok = false;
  std::string error_code;  // gRPC code name when !ok
  std::string error_message;
  double start_s = 0;
  double ttft_s = -1;  // first token-carrying message (stream only)
  double e2e_s = 0;
  std::vector<double> itl_s;  // gaps between token-carrying messages (stream only)
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  int64_t max_new_tokens = 0;
  double server_ttft_s = -1;  // the server's own timings (final message)
  double server_queued_s = -1;
  // With LoadOptions::keep_outputs: the answer (ids as received, even of a failed request).
  std::vector<int32_t> output_ids;
  std::vector<OutputLogprobs> output_logprobs;
};

struct Progress {
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> failed{0};
  std::atomic<int64_t> output_tokens{0};
};

struct LoadResult {
  std::vector<RequestRecord> records;  // in plan order
  double duration_s = 0;               // first send to last answer
};

absl::StatusOr<v1::ModelInfo> FetchModelInfo(const ServerEndpoint& server, double timeout_s);

// Runs the plan. `progress` (optional) is updated as requests end. Errors of single requests
// are recorded, not returned; the status is an error only when the run cannot start.
absl::StatusOr<LoadResult> RunLoad(const LoadOptions& options,
                                   const std::vector<PlannedRequest>& plan, Progress* progress);

struct Report {
  int64_t num_requests = 0;
  int64_t completed = 0;
  int64_t failed = 0;
  std::map<std::string, int64_t> errors;  // by gRPC code name
  // Completed requests whose output length is not max_new_tokens (expected 0 with ignore_eos).
  int64_t output_length_mismatches = 0;
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  double duration_s = 0;
  double request_throughput = 0;  // completed requests / s
  double output_throughput = 0;   // output tokens / s
  double total_token_throughput = 0;
  // Milliseconds. TPOT = (e2e - ttft) / (output tokens - 1), per request with >= 2 tokens.
  Summary ttft_ms, tpot_ms, itl_ms, e2e_ms, server_ttft_ms;
};

// Pure: the report of completed / failed records over `duration_s`.
Report ComputeReport(const std::vector<RequestRecord>& records, double duration_s);

}  // namespace tpserve::bench
