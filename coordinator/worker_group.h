// The worker group: the coordinator's side of the control plane (worker.proto). Each worker
// holds one bidirectional stream: it registers, gets its assignment (model, shard plan, rank,
// NCCL ids relayed when there is no MPI), reports its KV capacity, then takes the same StepPlan
// as every other worker; the sampling rank (last stage, tp rank 0) answers with the ids (and
// the logprobs requests ask for).
// Heartbeats go both ways; a closed stream or a silent worker fails the group naming the rank.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "coordinator/scheduler.h"
#include "parallel/shard_plan.h"
#include "worker.grpc.pb.h"

namespace tpserve {

struct WorkerGroupOptions {
  std::string model_dir;
  int world_size = 1;
  int tp = 0;  // 0: world_size (pp = 1)
  int pp = 1;
  std::string device_map;      // optional manual layer map
  int64_t kv_cache_bytes = 0;  // per worker; 0: from gpu_memory_utilization (CPU: default)
  double gpu_memory_utilization = 0.90;
  bool deterministic = false;           // Assignment.deterministic
  std::string all_reduce;               // Assignment.all_reduce (empty: the workers' own)
  std::string kv_cache_dtype = "auto";  // Assignment.kv_cache_dtype
  int block_size = 16;
  int max_num_batched_tokens = 512;
  int max_num_seqs = 64;
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds heartbeat_timeout{4000};
  std::chrono::seconds step_timeout{120};
  int comm_timeout_seconds = 60;
  // What a worker must send as kClusterSecretMetadata on its control stream (never empty in
  // the service; empty only in tests that build a group by hand: then anyone may register).
  std::string cluster_secret;
  // Control streams handled at once (beyond that they are refused at once); 0: 2 x world + 16.
  int max_control_streams = 0;
};

// OK when a sampling rank's result for a plan with `sampled` sampling sequences (`with_logprobs`
// of them asking for logprobs) is well formed: one id per sampled sequence, every id (and every
// logprob alternative) inside [0, vocab_size), one logprobs entry per asking sequence.
absl::Status ValidateStepResult(const worker::StepResult& result, int sampled, int with_logprobs,
                                int64_t vocab_size);

class WorkerGroup final : public worker::WorkerControl::Service, public StepExecutor {
 public:
  WorkerGroup(const WorkerGroupOptions& options, const ModelConfig& config);
  ~WorkerGroup() override;

  // Waits for every rank to register, sends the assignments and waits for the KV reports.
  absl::Status Start(std::chrono::seconds register_timeout, std::chrono::seconds load_timeout);
  absl::StatusOr<worker::StepResult> Execute(const worker::StepPlan& plan) override;
  int max_in_flight() const override;
  absl::Status Submit(const worker::StepPlan& plan) override;
  absl::StatusOr<worker::StepResult> Collect(uint64_t step_id) override;
  double last_forward_seconds() const override { return last_forward_seconds_; }
  double sender_cpu_seconds() const override { return sender_cpu_seconds_.load(); }
  // Tells every worker to exit and closes the streams.
  void Shutdown(const std::string& reason);
  // After a failure (or a start that did not complete: then its streams are closed now): waits
  // (up to `timeout`) until the group's control streams and its monitor ended, then forgets its
  // workers so that Start can take a new group (every rank registers again, fresh assignments
  // and KV reports). FAILED_PRECONDITION after Shutdown; DEADLINE_EXCEEDED when a stream
  // outlives the timeout.
  absl::Status Reset(std::chrono::milliseconds timeout);
  // Fails the group naming no rank (e.g. the spawned workers' launcher exited): like a rank's
  // failure, the callback runs and every stream closes.
  void Abort(const std::string& reason) { Fail(-1, reason); }
  // The rank whose failure failed the group (-1: none, or an Abort).
  int failed_rank();
  // The pids the registered workers reported (0 for ranks not registered), by rank.
  std::vector<int64_t> worker_pids();
  // Called once when the group fails (from the thread that notices).
  void SetFailureCallback(std::function<void(const absl::Status&)> callback);
  absl::Status failure();

  const ShardPlan& plan() const { return plan_; }
  int num_blocks() const { return num_blocks_; }
  int block_size() const { return options_.block_size; }
  std::vector<std::string> rank_devices();
  // Each rank's KV report (device memory after loading), by rank; valid after Start.
  std::vector<worker::KvReport> kv_reports();

  grpc::Status Control(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<worker::CoordinatorMessage, worker::WorkerMessage>* stream) override;

 private:
  struct Slot;
  void Fail(int rank, const std::string& reason);
  bool Send(int rank, const worker::CoordinatorMessage& msg);
  void Monitor();
  // Writes queued plans to every worker, in submission order.
  void SendLoop();

  const WorkerGroupOptions options_;
  const ModelConfig config_;
  ShardPlan plan_;
  int num_blocks_ = 0;
  int sampler_rank_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Slot>> slots_;  // by rank
  bool started_ = false;                      // assignments sent
  bool shutdown_ = false;
  int active_streams_ = 0;    // control handlers of registered workers running
  int control_handlers_ = 0;  // every control handler running (capped)
  absl::Status failure_;
  int failed_rank_ = -1;
  std::function<void(const absl::Status&)> on_failure_;
  std::map<uint64_t, worker::StepResult> results_;  // step id -> the sampler's result
  // step id -> (sampled sequences, of which asking for logprobs), to validate its result.
  std::map<uint64_t, std::pair<int, int>> expected_;
  std::map<uint64_t, double> forward_seconds_;  // step id -> the sampler's time
  double last_forward_seconds_ = 0;             // scheduler thread only
  std::thread monitor_;

  // Plans go to the workers from a thread of their own: serializing a plan and writing it to
  // every control stream (a synchronous gRPC write each) stays off the scheduler thread. Sent
  // messages are kept for reuse (their repeated fields keep their memory).
  std::mutex send_mu_;
  std::condition_variable send_cv_;
  std::deque<std::unique_ptr<worker::CoordinatorMessage>> send_queue_ ABSL_GUARDED_BY(send_mu_);
  std::vector<std::unique_ptr<worker::CoordinatorMessage>> send_free_ ABSL_GUARDED_BY(send_mu_);
  bool send_stop_ ABSL_GUARDED_BY(send_mu_) = false;
  bool sending_ ABSL_GUARDED_BY(send_mu_) = false;  // the sender is writing a plan
  std::condition_variable send_idle_cv_;            // sending_ became false
  std::atomic<double> sender_cpu_seconds_{0};
  std::thread sender_;
};

}  // namespace tpserve
