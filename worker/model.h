// The LLaMA-family forward pass of one shard (a pipeline stage's layers, a tensor-parallel
// rank's heads and columns), written once against the ops interface. Column-parallel q/k/v and
// gate/up, row-parallel o and down followed by an all-reduce, vocab-parallel embedding and
// lm_head; the stage receives the residual stream before its first layer and sends it after
// its last, with no other branching.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/shard_plan.h"
#include "worker/kv_cache.h"

namespace tpserve {

class ModelFiles;

struct ModelOptions {
  int max_batch_tokens = 2048;  // most tokens one forward takes (sizes the activations)
  int max_batch_seqs = 256;     // most sequences (rows of logits) one forward returns
};

// Communicators of one rank. tp: its tensor-parallel group (size tp, index tp_rank); pp: the
// ranks with the same tp_rank, indexed by stage. A single-rank communicator when unused.
struct ParallelContext {
  Communicator* tp = nullptr;
  Communicator* pp = nullptr;
};

// Device bytes of one rank's shard, known before anything is allocated.
struct ShardMemory {
  int64_t weight_bytes = 0;      // the weights (one allocation, tensors 256-byte aligned)
  int64_t activation_bytes = 0;  // activation buffers for ModelOptions' batch limits
};

class LlamaModel {
 public:
  // What Load would allocate for rank `rank` on `ops` (reads only the checkpoint's header).
  static absl::StatusOr<ShardMemory> EstimateMemory(const ModelFiles& files, const ShardPlan& plan,
                                                    int rank, Ops* ops,
                                                    const ModelOptions& options);
  // Loads this rank's shard of the weights (converted to ops->compute_dtype()). On a device,
  // tensors stored in the compute dtype stream from the mapped file through the ops' uploader
  // (pinned staging on CUDA); others are converted on the host first.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const ModelFiles& files,
                                                          const ShardPlan& plan, int rank, Ops* ops,
                                                          ParallelContext comms,
                                                          const ModelOptions& options);
  ~LlamaModel();

  const ModelConfig& config() const { return config_; }
  const RankShard& shard() const { return shard_; }
  int num_local_layers() const { return shard_.layer_end - shard_.layer_begin; }
  int64_t vocab_padded() const { return plan_.vocab_padded; }
  // Bytes of this rank's weights on the device.
  size_t weight_bytes() const { return weight_bytes_; }
  // Bytes of its activation buffers.
  size_t activation_bytes() const { return activation_bytes_; }

  // Makes a KV cache for this shard's layers and KV heads.
  // `kv_dtype`: the compute dtype or a quantized one the ops support.
  std::unique_ptr<KvCache> MakeKvCache(int num_blocks, int block_size, DType kv_dtype) const;

  // One step. The first stage embeds meta.token_ids; other stages receive the residual stream
  // from the previous stage. Non-last stages send it on and return an empty tensor. The last
  // stage returns the logits [meta.logits_rows.size(), vocab_padded] in the compute dtype, on
  // the device (every TP rank of the last stage gets the full vocabulary). The returned view
  // is valid until the next Forward.
  absl::StatusOr<Tensor> Forward(const BatchMeta& meta, KvCache& cache);
  // Forward without the Ops::SetBatch that starts it: the caller made `meta` current already.
  // Used to capture a step as a CUDA graph (the batch upload stays outside the graph).
  absl::StatusOr<Tensor> Run(const BatchMeta& meta, KvCache& cache);

 private:
  struct Layer;
  struct PlannedWeight;
  LlamaModel(const ModelConfig& config, const ShardPlan& plan, int rank, Ops* ops,
             ParallelContext comms, const ModelOptions& options);
  static absl::Status CheckSupported(const ModelConfig& config, const ShardPlan& plan, int rank,
                                     Ops* ops);
  // Every weight tensor of this shard and where its parts come from; `layers_` is sized and
  // the plan points into it and into `fused` (per layer: qkv, qkv bias).
  absl::StatusOr<std::vector<PlannedWeight>> PlanWeights(const ModelFiles& files,
                                                         std::vector<Tensor>& fused);
  absl::Status LoadWeights(const ModelFiles& files);
  std::vector<int64_t> ActivationElems() const;
  void AllocateActivations();
  Tensor Act(int index, int64_t rows, int64_t cols);

  ModelConfig config_;
  ShardPlan plan_;
  RankShard shard_;
  Ops* ops_;
  ParallelContext comms_;
  ModelOptions options_;
  size_t weight_bytes_ = 0;
  size_t activation_bytes_ = 0;

  std::vector<DeviceBuffer> weight_buffers_;
  Tensor embed_, final_norm_, lm_head_, inv_freq_;
  std::vector<Layer> layers_;
  // The ops' other layouts of the GEMM weights (Ops::PrepareGemmWeight), released before the
  // weights.
  std::vector<std::unique_ptr<Ops::PreparedWeight>> prepared_;
  std::vector<DeviceBuffer> acts_;
};

}  // namespace tpserve
