// The serving metrics (see serving_metrics.h).
#include "coordinator/serving_metrics.h"

#include <string>

#include "coordinator/scheduler.h"

namespace tpserve {

namespace {
const std::vector<double>& LatencyBuckets() {  // 1 ms .. ~160 s
  static const std::vector<double> b = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                        0.1,   0.25,  0.5,  0.75, 1.0,  2.5,  5.0,
                                        7.5,   10.0,  20.0, 40.0, 80.0, 160.0};
  return b;
}
const std::vector<double>& TokenBuckets() {  // time per output token / step: 0.1 ms .. 10 s
  static const std::vector<double> b = {0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                        0.05,   0.075,  0.1,   0.15,   0.2,   0.3,  0.4,
                                        0.5,    0.75,   1.0,   2.5,    5.0,   10.0};
  return b;
}
}  // namespace

ServingMetrics::ServingMetrics(MetricsRegistry* r) : registry_(r) {
  running_ = r->GetGauge("tpserve:num_requests_running", "Requests running on the workers.");
  waiting_ = r->GetGauge("tpserve:num_requests_waiting", "Requests waiting to be scheduled.");
  kv_usage_ =
      r->GetGauge("tpserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).");
  preemptions_ = r->GetCounter("tpserve:num_preemptions_total",
                               "Sequences preempted (recomputed later) for lack of KV blocks.");
  prompt_tokens_ =
      r->GetCounter("tpserve:prompt_tokens_total", "Prompt tokens of finished requests.");
  generation_tokens_ =
      r->GetCounter("tpserve:generation_tokens_total", "Tokens generated (finished requests).");
  group_failures_ = r->GetCounter("tpserve:worker_group_failures_total",
                                  "Failures of the worker group (a rank died, went silent or "
                                  "reported an error).");
  group_restarts_ = r->GetCounter("tpserve:worker_group_restarts_total",
                                  "Worker groups started after a failure (spawned again, or "
                                  "rejoined with --rejoin).");
  const std::string finished = "tpserve:request_success_total";
  const std::string finished_help =
      "Finished requests by finish reason (abort: cancelled or failed).";
  finished_stop_ = r->GetCounter(finished, finished_help, {{"finished_reason", "stop"}});
  finished_length_ = r->GetCounter(finished, finished_help, {{"finished_reason", "length"}});
  finished_abort_ = r->GetCounter(finished, finished_help, {{"finished_reason", "abort"}});
  queue_time_ = r->GetHistogram("tpserve:request_queue_time_seconds",
                                "Time from arrival to first scheduling.", LatencyBuckets());
  ttft_ = r->GetHistogram("tpserve:time_to_first_token_seconds",
                          "Time from arrival to the first output token.", LatencyBuckets());
  tpot_ = r->GetHistogram("tpserve:time_per_output_token_seconds",
                          "Mean time between output tokens after the first, per request.",
                          TokenBuckets());
  e2e_ = r->GetHistogram("tpserve:e2e_request_latency_seconds",
                         "Time from arrival to the end of the request.", LatencyBuckets());
  step_time_ =
      r->GetHistogram("tpserve:step_duration_seconds",
                      "Scheduler step time: plan, worker round trip, apply.", TokenBuckets());
  r->AddCollector([this] { Collect(); });
}

void ServingMetrics::OnRequestFinished(const absl::Status& status, const FinalInfo& info) {
  prompt_tokens_->Add(info.prompt_tokens);
  generation_tokens_->Add(info.output_tokens);
  if (!status.ok() || info.reason == Finish::kNone) {
    finished_abort_->Add();
    return;
  }
  (info.reason == Finish::kStop ? finished_stop_ : finished_length_)->Add();
  queue_time_->Observe(info.queued_s);
  e2e_->Observe(info.total_s);
  if (info.output_tokens > 0) ttft_->Observe(info.ttft_s);
  if (info.output_tokens > 1) {
    tpot_->Observe((info.total_s - info.ttft_s) / (info.output_tokens - 1));
  }
}

void ServingMetrics::OnStep(double seconds) { step_time_->Observe(seconds); }

void ServingMetrics::SetWorkerMemory(int rank, int64_t used_bytes, int64_t total_bytes) {
  const MetricLabels labels = {{"rank", std::to_string(rank)}};
  registry_
      ->GetGauge("tpserve:worker_device_memory_used_bytes",
                 "Device memory a worker uses (host memory for CPU workers).", labels)
      ->Set(static_cast<double>(used_bytes));
  registry_
      ->GetGauge("tpserve:worker_device_memory_total_bytes",
                 "A worker's device memory in total (host memory for CPU workers).", labels)
      ->Set(static_cast<double>(total_bytes));
}

void ServingMetrics::SetKvCache(const std::string& dtype, int64_t capacity_tokens) {
  registry_
      ->GetGauge("tpserve:kv_cache_capacity_tokens",
                 "Tokens the KV cache holds, by the dtype it stores (--kv-cache-dtype).",
                 {{"dtype", dtype}})
      ->Set(static_cast<double>(capacity_tokens));
}

void ServingMetrics::Collect() {
  Scheduler* s = scheduler_.load();
  if (s == nullptr) return;
  const SchedulerStats st = s->stats();
  running_->Set(st.running);
  waiting_->Set(st.waiting);
  kv_usage_->Set(st.total_blocks > 0 ? 1.0 - static_cast<double>(st.free_blocks) / st.total_blocks
                                     : 0.0);
  preemptions_->Set(static_cast<double>(st.preemptions));
}

}  // namespace tpserve
