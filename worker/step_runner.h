// A worker's step runner: its shard of the model and its KV cache, driven by the coordinator's
// StepPlans (worker.proto). Builds the BatchMeta of a plan, runs the forward and, on the
// sampling rank (last stage, tp rank 0), applies repetition penalties and samples.
#pragma once

#include <map>
#include <memory>
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

struct StepRunnerOptions {
  int block_size = 16;
  // KV cache size: kv_cache_bytes when > 0, else (on a device) what gpu_memory_utilization
  // leaves after the weights and workspace, else (CPU) room for 4 full-length sequences.
  int64_t kv_cache_bytes = 0;
  double gpu_memory_utilization = 0.90;
  ModelOptions model;
  // Replay decode steps as CUDA graphs (CUDA, tp = pp = 1 only), sizing the batch buffers once
  // before the KV budget as Engine::Create does. The worker turns it off with
  // TPSERVE_WORKER_CUDA_GRAPHS=0 (tools/serve_check.sh compares served and engine tokens).
  bool cuda_graphs = true;
};

class StepRunner {
 public:
  // Loads rank `rank`'s shard of `plan` (files must outlive the runner) and allocates its cache.
  static absl::StatusOr<std::unique_ptr<StepRunner>> Create(const ModelFiles& files,
                                                            const ShardPlan& plan, int rank,
                                                            Ops* ops, ParallelContext comms,
                                                            const StepRunnerOptions& options);
  ~StepRunner();

  // Runs one step. On the sampling rank the result holds the sampled ids (one per sampled
  // sequence, in plan order) and the log-probabilities of the sequences that ask for them; on
  // the others it is empty. Only token_ids and logprobs are filled.
  absl::StatusOr<worker::StepResult> Run(const worker::StepPlan& plan);

  bool is_sampler() const { return sampler_; }
  int num_blocks() const { return cache_->num_blocks(); }
  const LlamaModel& model() const { return *model_; }

  // The BatchMeta a plan describes (exposed for tests).
  static absl::StatusOr<BatchMeta> MakeBatch(const worker::StepPlan& plan, int block_size,
                                             int num_blocks);

 private:
  StepRunner() = default;
  // Divides / multiplies the logits of `history`'s tokens in row `row`. When `raw` is not null
  // it receives the row's first `vocab` logits as they were before (f32).
  absl::Status ApplyRepetitionPenalty(const Tensor& logits, int row, float penalty,
                                      const std::vector<int32_t>& history, int64_t vocab,
                                      std::vector<float>* raw);

  Ops* ops_ = nullptr;
  StepRunnerOptions options_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<CudaGraphRunner> graphs_;  // CUDA, tp = pp = 1: decode steps as graphs
  bool sampler_ = false;
  // Sampling rank only: every token of each live sequence (for repetition penalties).
  std::map<uint64_t, std::vector<int32_t>> history_;
};

}  // namespace tpserve
