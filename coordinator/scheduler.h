// The scheduler: ONE thread doing continuous batching with chunked prefill. It admits queued
// requests under --max-num-seqs, packs decode tokens then prefill chunks under
// --max-num-batched-tokens, owns every block table (BlockManager), preempts the newest sequence
// when blocks run out (it is recomputed later), sends each step to the executor (the worker
// group), and turns sampled ids into stop decisions and answers, which a delivery thread
// detokenizes and writes to the requests' streams (coordinator/delivery.h). With prefix caching, a
// sequence starts from the longest cached run of full blocks of its tokens (prefill skips them)
// and registers its own full blocks as they are computed. With overlap (pp = 1) step n + 1 is
// planned and sent while step n runs: a decoding sequence of step n continues in step n + 1 with
// feed_last_sampled, so the coordinator learns each token one step late and drops the one extra
// token of a sequence that stopped.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/block_manager.h"
#include "coordinator/delivery.h"
#include "coordinator/request.h"
#include "proto/block_tables.h"
#include "worker.pb.h"

namespace tpserve {

class Tokenizer;

// Runs steps on the workers. Execute runs one step and returns the sampling rank's result: the
// sampled ids (one per sampled sequence, in order) and the logprobs of the sampled sequences
// that ask for them (in order). An executor that can overlap steps (a pipeline of pp stages)
// says so in max_in_flight() and implements Submit/Collect: the scheduler submits up to that
// many plans over disjoint sequences and collects their results in submission order.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual absl::StatusOr<worker::StepResult> Execute(const worker::StepPlan& plan) = 0;
  virtual int max_in_flight() const { return 1; }
  // Defaults: Submit keeps the plan, Collect executes it.
  virtual absl::Status Submit(const worker::StepPlan& plan);
  virtual absl::StatusOr<worker::StepResult> Collect(uint64_t step_id);
  // Seconds the sampling worker spent in the last collected step (forward + sampling).
  virtual double last_forward_seconds() const { return 0; }
  // CPU time of a thread of the executor's own that sends the plans (0: Submit sends them).
  virtual double sender_cpu_seconds() const { return 0; }

 private:
  std::map<uint64_t, worker::StepPlan> submitted_;
};

struct SchedulerOptions {
  int max_num_seqs = 64;
  int max_num_batched_tokens = 512;
  int max_queued_requests = 256;  // waiting (not yet running) requests; more: RESOURCE_EXHAUSTED
  int num_blocks = 0;
  int block_size = 16;
  int64_t context_length = 2048;
  std::vector<int32_t> eos_token_ids;
  bool enable_prefix_caching = true;
  // Metrics hooks, called on the scheduler thread (must be cheap): a request ended (any way),
  // a step was applied (its whole time).
  std::function<void(const absl::Status&, const FinalInfo&)> on_request_finished;
  std::function<void(double step_seconds)> on_step;
  // Keep two steps in flight at pp = 1 (an executor with max_in_flight() == 1), decoding
  // sequences continuing with feed_last_sampled. Pipelines (max_in_flight() > 1) keep their
  // disjoint steps either way.
  bool overlap = true;
  // With overlap, step n + 1 is planned this long before step n is expected to end (its start
  // + the shortest recent step of at most as many tokens, as StepExecutor::last_forward_seconds
  // timed it), not as soon as step n is sent, so that requests arriving while step n runs join
  // step n + 1 instead of n + 2 (a step less of time to first token). An arrival ends the wait
  // at once. 0, or no step time known yet: plan it at once.
  double overlap_lead_seconds = 0.0015;
};

struct SchedulerStats {
  int total_blocks = 0;
  int free_blocks = 0;
  int running = 0;
  int waiting = 0;
  int64_t preemptions = 0;
  int64_t steps = 0;
  // Totals over all steps: the scheduler's whole step (plan, round trip to the workers, apply),
  // the round trip alone (Execute), and the sampling worker's forward + sampling time.
  double step_seconds = 0;
  double execute_seconds = 0;
  double forward_seconds = 0;
  int64_t step_tokens = 0;
  // Prefix cache: tokens looked up at admission (queries) and found cached (hits), blocks
  // evicted, blocks registered now (in use or evictable) and of those the evictable ones.
  bool prefix_caching = false;
  int64_t prefix_cache_queries = 0;
  int64_t prefix_cache_hits = 0;
  int64_t prefix_cache_evictions = 0;
  int cached_blocks = 0;
  int evictable_blocks = 0;
  // Requests that waited at admission for blocks a running sequence was computing (a shared
  // prefix arriving together) instead of computing them again.
  int64_t prefix_cache_waits = 0;
  // Prompt tokens the workers computed (prefill; a preempted request's again), cache or not:
  // with a shared prefix computed once, the prompt tokens less the hits.
  int64_t prompt_tokens_computed = 0;
  // CPU time of the scheduler thread (CLOCK_THREAD_CPUTIME_ID) spent planning and sending
  // steps and handling their results (stop checks, handing tokens to delivery), over all steps.
  double cpu_seconds = 0;
  // cpu_seconds by phase: planning (reap, admit, build plans), sending plans (the executor's
  // Submit: copy, serialization, writes), applying results (stop checks, the detokenization of
  // requests with stop strings, handing tokens to delivery).
  double plan_cpu_seconds = 0;
  double send_cpu_seconds = 0;
  double apply_cpu_seconds = 0;
  // CPU time of the delivery thread (detokenization, stream writes), apart from cpu_seconds.
  double delivery_cpu_seconds = 0;
  // CPU time of the executor's sender thread (serializing and writing plans to the workers).
  double sender_cpu_seconds = 0;
  // Sampled tokens dropped because their sequence had already finished (overlap).
  int64_t dropped_tokens = 0;
  bool overlap = false;  // two steps in flight over the same sequences (pp = 1)
};

class Scheduler {
 public:
  // `tokenizer` may be null (ids only: no text, no stop strings).
  Scheduler(const SchedulerOptions& options, const Tokenizer* tokenizer, StepExecutor* executor);
  ~Scheduler();  // Stops the thread; unfinished requests end UNAVAILABLE.

  void Start();
  // Queues a validated request; RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE when
  // draining or failed.
  absl::Status Submit(std::shared_ptr<RequestState> request);
  // Wakes the loop (a request was cancelled).
  void Wake();
  // Stop accepting; existing requests continue.
  void StopAccepting(absl::Status reason);
  // True when nothing is running or waiting.
  bool Idle();
  // Waits until Idle() or `deadline`; true when idle (the drain after SIGTERM).
  bool WaitIdle(std::chrono::steady_clock::time_point deadline);
  // Ends every request with `status` and refuses new ones (the worker group failed).
  void Fail(absl::Status status);
  // The worker group failed and is being replaced (its KV cache is lost): requests that already
  // produced output end with `status`, the others are kept (queued again, recomputed from their
  // prompt), new requests are refused with `status`, and no step runs until Resume. Must not
  // block (called from the thread that notices the failure).
  void Suspend(absl::Status status);
  // A new group with `num_blocks` KV blocks (fresh caches) serves: the block accounting and the
  // prefix cache start empty, the kept requests run again.
  void Resume(int num_blocks);
  SchedulerStats stats();
  const SchedulerOptions& options() const { return options_; }
  // Forgets the cached blocks of requests with `cache_salt` (every salt when `all`) and stops
  // the requests already submitted with it from caching more; `done` gets the number of blocks
  // forgotten, from the scheduler thread (or UNAVAILABLE when the scheduler stops first). Must
  // not block.
  void DropPrefixCache(std::string cache_salt, bool all,
                       std::function<void(absl::StatusOr<int>)> done);
  // The block table of a running sequence as the coordinator holds it (empty when it is not
  // running). Only on the scheduler thread: tests call it from the executor's Submit.
  std::vector<int32_t> BlockTableForTest(uint64_t seq_id) const;

 private:
  struct Seq;
  struct Pending;
  void Loop();
  // Something the loop must handle besides running and waiting requests: a stop, a wake, an
  // arrival, a failure, a drop, a suspension or a resumption.
  bool HasEvent() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the arrivals to waiting_; says whether there were any.
  bool TakeIncoming() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until `until` for a request to arrive (or a stop, failure, drop, suspension or wake);
  // moves the arrivals to waiting_ and says whether there were any.
  bool WaitForArrivals(Clock::time_point until);
  // When the late-overlap wait for the step after pending_.front() ends: its start plus the
  // shortest recent step of at most as many tokens, minus the lead (none known: min()).
  Clock::time_point LateBuildTime() const;
  void Reap(std::vector<uint64_t>& finished_ids);
  void Admit();
  void Preempt(Seq* seq);
  bool BuildStep(worker::StepPlan& plan, std::vector<Seq*>& sampled,
                 std::vector<std::pair<Seq*, int>>& chunks);
  // Appends a sampled token, decides whether it ends the sequence and queues its delivery.
  void ApplyToken(Seq& seq, int32_t id, std::optional<TokenLogprobs> logprobs);
  void Finish(Seq& seq, absl::Status status, Finish reason);
  // Releases the blocks of a finished sequence once no step in flight holds it.
  void ReleaseIfIdle(Seq& seq);
  // Applies a collected step's result (it was checked against the plan).
  void ApplyResult(const Pending& p, const worker::StepResult& result);
  void FailAll(const absl::Status& status);
  // Suspend's work on the scheduler thread: ends or re-queues every sequence, forgets the steps
  // in flight and every block (the workers that held them are gone).
  void Requeue(const absl::Status& status);
  // True when a Suspend is in effect or not yet handled (a failed step is then not fatal).
  bool Suspending();
  void PublishStats();
  void ExtendHashes(Seq& seq, size_t full_blocks);
  void RegisterComputed(Seq& seq);
  // Blocks running sequences are about to compute (chain hash -> producer), for Admit.
  absl::flat_hash_map<uint64_t, const Seq*> ProducingBlocks();
  void AddProducing(Seq& p, absl::flat_hash_map<uint64_t, const Seq*>& producing);
  // True when `s`'s full block `block` is being computed by a running sequence.
  bool AwaitsProducer(const Seq& s, size_t block,
                      const absl::flat_hash_map<uint64_t, const Seq*>& producing) const;
  void RunDrops();

  struct DropRequest {
    std::string salt;
    bool all = false;
    std::function<void(absl::StatusOr<int>)> done;
  };

  // A submitted step whose result is not yet collected.
  struct Pending {
    uint64_t step_id = 0;
    std::vector<Seq*> sampled;
    std::vector<std::pair<Seq*, int>> chunks;
    Clock::time_point submitted;
    int Tokens() const {  // tokens the step computes (all chunks)
      int n = 0;
      for (const auto& chunk : chunks) n += chunk.second;
      return n;
    }
  };

  const SchedulerOptions options_;
  const Tokenizer* tokenizer_;
  StepExecutor* executor_;
  BlockManager blocks_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;  // PublishStats notifies it (WaitIdle)
  std::deque<std::unique_ptr<Seq>> incoming_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status refuse_ ABSL_GUARDED_BY(mu_);  // not OK: refuse new requests
  absl::Status fail_ ABSL_GUARDED_BY(mu_);    // not OK: fail everything
  SchedulerStats stats_ ABSL_GUARDED_BY(mu_);
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<DropRequest> drops_ ABSL_GUARDED_BY(mu_);
  // Suspend / Resume: not OK while the group is replaced; each Suspend bumps the generation,
  // which the thread compares with the last one it handled; Resume leaves the block count.
  absl::Status suspend_ ABSL_GUARDED_BY(mu_);
  uint64_t suspend_generation_ ABSL_GUARDED_BY(mu_) = 0;
  int resume_blocks_ ABSL_GUARDED_BY(mu_) = 0;

  // Owned by the scheduler thread.
  std::deque<std::unique_ptr<Seq>> waiting_;
  std::vector<std::unique_ptr<Seq>> running_;  // in admission order
  std::vector<uint64_t> finished_ids_;         // to tell the workers in the next step
  std::deque<Pending> pending_;                // submitted steps, oldest first
  worker::StepPlan plan_;                      // the plan being built (reused)
  std::vector<Seq*> order_;                    // BuildStep's candidates (reused)
  uint64_t next_seq_id_ = 1;
  uint64_t handled_generation_ = 0;  // the last Suspend requeued
  bool suspended_ = false;           // between a handled Suspend and Resume
  uint64_t next_step_id_ = 1;
  uint64_t admit_counter_ = 0;
  int64_t preemptions_ = 0;
  int64_t steps_ = 0;
  double step_seconds_ = 0, execute_seconds_ = 0, forward_seconds_ = 0, cpu_seconds_ = 0;
  double plan_cpu_seconds_ = 0, send_cpu_seconds_ = 0, apply_cpu_seconds_ = 0;
  int64_t step_tokens_ = 0, dropped_tokens_ = 0;
  int64_t prefix_queries_ = 0, prefix_hits_ = 0, prefix_waits_ = 0, prompt_tokens_computed_ = 0;
  bool overlap_ = false;  // options_.overlap at pp = 1
  // Late overlap (options_.overlap_lead_seconds): the workers' recent step times with the
  // tokens of each step (a ring), and when the last result came back (the worker then started
  // the next step in its queue).
  struct StepTime {
    int tokens = 0;
    double seconds = 0;
  };
  std::array<StepTime, 16> recent_steps_{};
  size_t recent_steps_count_ = 0;  // filled entries
  size_t recent_steps_next_ = 0;   // the entry the next step time replaces
  Clock::time_point last_collect_{};
  std::atomic<int> queued_{0};  // submitted, never admitted
  // Output of the step being applied (scheduler thread), handed to delivery_ in one batch.
  std::vector<Delivery> deliveries_;
  DeliveryQueue delivery_;
  std::thread thread_;
};

}  // namespace tpserve
