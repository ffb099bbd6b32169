// The serving metrics of /metrics, named like vLLM's with the `tpserve:` prefix: request-level
// (recorded when a request finishes, gRPC and HTTP alike), scheduler-level (read from
// Scheduler::stats at each scrape) and per-worker device memory.
#pragma once

#include <atomic>
#include <functional>

#include "absl/status/status.h"
#include "coordinator/metrics.h"
#include "coordinator/request.h"

namespace tpserve {

class Scheduler;

class ServingMetrics {
 public:
  explicit ServingMetrics(MetricsRegistry* registry);

  // Scheduler hooks (scheduler thread; cheap).
  void OnRequestFinished(const absl::Status& status, const FinalInfo& info);
  void OnStep(double seconds);
  // Reads running / waiting / KV usage / preemptions from `scheduler` at each scrape; null
  // until the scheduler exists (then they read 0).
  void SetScheduler(Scheduler* scheduler) { scheduler_.store(scheduler); }
  // One worker's device memory (bytes); CPU workers report host memory.
  void SetWorkerMemory(int rank, int64_t used_bytes, int64_t total_bytes);
  // The KV cache's capacity in tokens, labelled with what it stores (--kv-cache-dtype).
  void SetKvCache(const std::string& dtype, int64_t capacity_tokens);
  // The worker group failed / a new group was started after a failure.
  void OnWorkerGroupFailure() { group_failures_->Add(); }
  void OnWorkerGroupRestart() { group_restarts_->Add(); }

  MetricsRegistry* registry() { return registry_; }

 private:
  void Collect();

  MetricsRegistry* registry_;
  std::atomic<Scheduler*> scheduler_{nullptr};
  Gauge *running_, *waiting_, *kv_usage_;
  Counter *preemptions_, *prompt_tokens_, *generation_tokens_;
  Counter *finished_stop_, *finished_length_, *finished_abort_;
  Counter *group_failures_, *group_restarts_;
  Histogram *queue_time_, *ttft_, *tpot_, *e2e_, *step_time_;
};

}  // namespace tpserve
