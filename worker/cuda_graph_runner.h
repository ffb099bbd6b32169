// Decode steps replayed as CUDA graphs, one per (batch-size bucket, block-table-width bucket),
// so the ~300 kernel launches of a step cost one launch. Only for single-GPU layouts (tp = pp =
// 1); host-staged communicators cannot be captured. Built only with CUDA.
#pragma once

#include <map>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "worker/kv_cache.h"
#include "worker/model.h"

namespace tpserve {

class CudaOps;

class CudaGraphRunner {
 public:
  // `ops` must be the CudaOps the model runs on.
  CudaGraphRunner(CudaOps* ops, LlamaModel* model, KvCache* cache, int max_seqs);
  ~CudaGraphRunner();

  // Runs a decode-only batch (meta.all_decode()): pads it to its bucket, captures the graph of
  // that bucket on first use, replays it. Returns the logits of the real rows.
  absl::StatusOr<Tensor> RunDecode(const BatchMeta& meta);
  int num_graphs() const { return static_cast<int>(graphs_.size()); }

  static int Bucket(int n);  // next power of two (at least 1)
  // The batch-buffer sizes (CudaOps::Reserve) that cover every bucket this runner captures:
  // model.max_batch_tokens tokens, max_batch_seqs sequences and block tables of up to
  // `max_table_blocks` blocks, bucketed. Reserve them before warm-up so nothing moves later.
  static CudaReserve ReserveFor(const ModelConfig& config, const RankShard& shard,
                                const ModelOptions& model, int block_size,
                                int64_t max_table_blocks);

 private:
  struct Graph;
  BatchMeta Pad(const BatchMeta& meta, int seqs, int blocks) const;
  void Clear();

  CudaOps* ops_;
  LlamaModel* model_;
  KvCache* cache_;
  int max_seqs_;
  uint64_t generation_ = 0;
  std::map<std::pair<int, int>, std::unique_ptr<Graph>> graphs_;
};

}  // namespace tpserve
