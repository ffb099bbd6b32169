// One shard's runtime, used alike by the in-process Engine and the worker process: its weights
// (LlamaModel), paged KV cache, CUDA graphs, the batch description of a step and sampling
// (repetition penalty and logprobs included). A step is described by a worker::StepPlan, the
// message the coordinator sends its workers; the engine builds the same message in-process.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_files.h"
#include "kernels/ops.h"
#include "parallel/shard_plan.h"
#include "worker.pb.h"
#include "worker/kv_cache.h"
#include "worker/model.h"

namespace tpserve {

class CudaGraphRunner;

struct ShardRunnerOptions {
  int block_size = 16;
  // KV cache size, in this order of precedence: kv_cache_bytes, num_kv_blocks, else (on a
  // device) what gpu_memory_utilization leaves after the weights and workspace
  // (worker/kv_budget.h), else (CPU) room for 4 sequences of the full context.
  int64_t kv_cache_bytes = 0;
  int64_t num_kv_blocks = 0;
  double gpu_memory_utilization = 0.90;  // fraction of the device's total memory, in (0, 1]
  // --kv-cache-dtype (ShardLoadOptions::kv_cache_dtype): nullopt is the compute dtype.
  std::optional<DType> kv_cache_dtype;
  ModelOptions model;
  // Replay decode-only steps as CUDA graphs. The rule (UsesGraphs): CUDA ops, this switch on,
  // at tp > 1 a TP communicator whose collectives are stream-ordered
  // (Communicator::stream_ordered_collectives: NCCL, the custom all-reduce), and at pp > 1 a PP
  // communicator whose Send / Recv of a decode batch's residual are
  // (Communicator::stream_ordered_p2p: NCCL, the custom p2p kernels); host-staged MPI transfers
  // cannot be captured.
  bool cuda_graphs = true;
  // Which ranks sample and report: the last stage's tp rank 0 (a worker: only its result is
  // read), or every tp rank of the last stage (the in-process engine, whose ranks all need the
  // ids to go on in lockstep; they sample the same all-gathered logits, so they agree). With
  // graphs at tp > 1 every rank samples anyway (so that no host-staged broadcast of the fed ids
  // stands between replays); only the reporting ranks return the result.
  bool sample_on_every_tp_rank = false;
  // Deterministic mode (--deterministic, Ops::SetDeterministic): a token's result does not
  // depend on the rest of the batch. Set on the ops before anything is sized.
  bool deterministic = false;
  // Launching a step before the one in flight has finished (ShardRunner::CanLaunchAhead):
  // "auto", "1" or "0" as TPSERVE_LAUNCH_AHEAD, which an empty value defers to.
  std::string launch_ahead;
};

class ShardRunner {
 public:
  // Loads rank `rank`'s shard of `plan` (files must outlive the runner) and allocates its KV
  // cache. On CUDA the batch buffers are sized once, before the KV budget is measured, so that
  // nothing moves after warm-up and decode steps can replay as graphs.
  static absl::StatusOr<std::unique_ptr<ShardRunner>> Create(const ModelFiles& files,
                                                             const ShardPlan& plan, int rank,
                                                             Ops* ops, ParallelContext comms,
                                                             const ShardRunnerOptions& options);
  ~ShardRunner();

  // The one builder of a step's BatchMeta: every sequence of `plan` in order, its tokens at
  // positions [start_pos, start_pos + n) written through its block table, and one logits row
  // for each sequence that samples. Checks every slot against a pool of `num_blocks`.
  static absl::StatusOr<BatchMeta> MakeBatch(const worker::StepPlan& plan, int block_size,
                                             int num_blocks);

  // Runs one step: the forward and, on the sampling rank (last stage, tp rank 0), repetition
  // penalties and sampling. Sequences with feed_last_sampled get the id sampled for them in
  // the previous step that held them (the sampling rank broadcasts the ids inside the TP group).
  // The result holds the sampled ids (one per sampling sequence, in plan order) and the logprobs of
  // the sequences that ask for them; empty on other ranks. When `logits` is not null the sampling
  // rank also copies each sampled row's logits (before any penalty) to it, as f32 over the
  // vocabulary (tests).
  absl::StatusOr<worker::StepResult> Run(const worker::StepPlan& plan,
                                         std::vector<std::vector<float>>* logits = nullptr);
  // Run in two halves, so that the next step can be enqueued while this one runs on the device.
  // Launch does everything up to the enqueued sampling (Ops::SampleAsync); Finish waits for the
  // oldest launched step and returns its result (as Run does). At most two steps are launched
  // and not finished. A step launched while another is in flight (CanLaunchAhead) takes the
  // feed_last_sampled ids of that one's sequences on the device (BatchMeta::fed_tokens), before
  // the host has seen them. Run = Launch + Finish with nothing in flight.
  absl::Status Launch(const worker::StepPlan& plan,
                      std::vector<std::vector<float>>* logits = nullptr);
  absl::StatusOr<worker::StepResult> Finish();
  // Steps launched and not finished.
  int in_flight() const { return static_cast<int>(in_flight_.size()); }
  // Whether Finish would return without waiting for the device.
  bool OldestReady();
  // Whether `plan` may be launched before the one step in flight finishes: launching ahead is on
  // (TPSERVE_LAUNCH_AHEAD: auto = asynchronous sampling, pp = 1, and at tp > 1 every rank
  // sampling), exactly one step is in flight, and no sequence of `plan` samples with a
  // repetition penalty (it needs the previous token on the host).
  bool CanLaunchAhead(const worker::StepPlan& plan) const;
  bool launch_ahead() const { return launch_ahead_; }
  // Steps launched while another was in flight (Launch), since the runner was created.
  int64_t steps_launched_ahead() const { return steps_ahead_; }

  // One forward over `meta`, whose block tables are already filled: a CUDA graph replay when
  // `graphs` and UsesGraphs(meta), else the eager forward (op profiles time the eager one).
  // Returns the last stage's logits on the device (an empty tensor elsewhere), valid until the
  // next forward.
  absl::StatusOr<Tensor> Forward(const BatchMeta& meta, bool graphs = true);
  // Host f32 copies [rows][vocab] of device logits.
  std::vector<std::vector<float>> LogitsToHost(const Tensor& logits) const;

  // Drops the sampling history (repetition penalties) and the last sampled ids of sequences
  // that ended.
  void Forget(const std::vector<uint64_t>& seq_ids);

  // Captures the CUDA graph of every decode batch bucket the runner may replay (the widest
  // block-table bucket of each batch bucket; narrower tables are padded up to it), so that no
  // request pays for a capture. Writes only KV block 0, before serving. No-op without graphs.
  absl::Status WarmUpGraphs();

  bool is_sampler() const { return sampler_; }
  bool UsesGraphs(const BatchMeta& meta) const;
  int GraphSeqLimit() const;
  int num_graphs() const;
  int num_blocks() const { return cache_->num_blocks(); }
  DType kv_dtype() const { return cache_->dtype(); }
  int block_size() const { return cache_->block_size(); }
  int64_t capacity_tokens() const { return cache_->capacity_tokens(); }
  const LlamaModel& model() const { return *model_; }
  Ops* ops() const { return ops_; }
  const ShardRunnerOptions& options() const { return options_; }

 private:
  ShardRunner() = default;
  // Divides / multiplies the logits of `history`'s tokens in row `row` (the Hugging Face rule).
  absl::Status ApplyRepetitionPenalty(const Tensor& logits, int row, float penalty,
                                      const std::vector<int32_t>& history);
  // A launched step: what Finish needs to make its result.
  struct InFlight {
    bool sampled = false;           // SampleAsync was called
    bool logprobs = false;          // some row asked for logprobs
    std::vector<uint64_t> seq_ids;  // the sampled sequences, in row order
    std::vector<int> logprobs_n;    // per row: the logprobs asked for, -1 for none
    std::vector<bool> record;       // per row: keep the id in last_sampled_ (not superseded)
    std::map<int, std::vector<float>> raw_rows;  // rows with a penalty and logprobs: raw logits
    // History entries the next step filled with a placeholder (the id fed on the device):
    // (sequence, index in its history, row of this step).
    std::vector<std::tuple<uint64_t, size_t, int>> history_fixups;
  };
  // Drops the id last sampled for `seq_id` (a later step holds the sequence, or it ended), also
  // the one a step in flight would record for it when it finishes.
  void ForgetLastSampled(uint64_t seq_id);
  // Penalties, then Ops::SampleAsync of the sampled rows of `logits` into `f`.
  absl::Status LaunchSampling(const worker::StepPlan& plan, const Tensor& logits,
                              std::vector<std::vector<float>>* host_logits, InFlight& f);
  // Replaces the placeholder of every feed_last_sampled sequence of `plan` in `meta` by the id
  // sampled for it in the previous step that held it (identical on every rank of the TP group):
  // from the host, or, when that step is `ahead_of` (in flight), as a fed token on the device.
  absl::Status ResolveFeeds(const worker::StepPlan& plan, BatchMeta& meta, InFlight* ahead_of);
  // The TP and PP communicators' Health() (stream-ordered work that failed after its call).
  absl::Status CommsHealth();

  Ops* ops_ = nullptr;
  ShardRunnerOptions options_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<CudaGraphRunner> graphs_;
  bool sampler_ = false;                // reports the step's result (is_sampler)
  bool samples_ = false;                // samples (the reporting rank, or every tp rank)
  bool every_tp_rank_samples_ = false;  // so each feeds its own ids, no broadcast
  int tp_ = 1, pp_ = 1;
  int graph_max_seqs_ = 0, graph_max_blocks_ = 0;  // the largest graph buckets (CUDA)
  ParallelContext comms_;
  // Sampling rank only: every token of each live sequence (for repetition penalties).
  std::map<uint64_t, std::vector<int32_t>> history_;
  // Sampling rank only: the id sampled for each sequence by the last step that held it (absent
  // when that step did not sample it), for feed_last_sampled.
  std::map<uint64_t, int32_t> last_sampled_;
  std::unique_ptr<DeviceBuffer> feed_ids_;  // the fed ids, broadcast inside the TP group
  bool launch_ahead_ = false;               // CanLaunchAhead's switch
  int64_t steps_ahead_ = 0;
  std::deque<InFlight> in_flight_;  // launched, not finished; oldest first
};

}  // namespace tpserve
