// Decode steps replayed as CUDA graphs, one per (batch-size bucket, block-table-width bucket),
// so the ~300 kernel launches of a step cost one launch. At tp > 1 and pp > 1 the TP
// collectives and the stage boundary's Send / Recv are captured inside, so only stream-ordered
// communicators qualify (ShardRunner decides); host-staged ones cannot be captured. Built only
// with CUDA.
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

  // Runs a decode-only batch (meta.all_decode()): pads it to its bucket and replays the bucket's
  // graph; on the bucket's first use runs the forward eagerly and captures the graph for the
  // next time (one forward per call either way). Returns the logits of the real rows (the last
  // stage), or an empty tensor (other pipeline stages).
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
