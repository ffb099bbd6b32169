// CUDA graph capture and replay of decode steps (see cuda_graph_runner.h).
#include "worker/cuda_graph_runner.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/status.h"
#include "kernels/cuda/cuda_ops.h"

namespace tpserve {

struct CudaGraphRunner::Graph {
  cudaGraphExec_t exec = nullptr;
  Tensor logits;
  ~Graph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
};

CudaGraphRunner::CudaGraphRunner(CudaOps* ops, LlamaModel* model, KvCache* cache, int max_seqs)
    : ops_(ops), model_(model), cache_(cache), max_seqs_(max_seqs) {
  generation_ = ops_->layout_generation();
}

CudaGraphRunner::~CudaGraphRunner() { Clear(); }

void CudaGraphRunner::Clear() { graphs_.clear(); }

CudaReserve CudaGraphRunner::ReserveFor(const ModelConfig& config, const RankShard& shard,
                                        const ModelOptions& model, int block_size,
                                        int64_t max_table_blocks) {
  CudaReserve r;
  r.max_tokens = model.max_batch_tokens;
  r.max_seqs = Bucket(model.max_batch_seqs);
  r.max_blocks_per_seq = std::max(16, Bucket(static_cast<int>(max_table_blocks)));
  r.block_size = block_size;
  r.num_heads = shard.num_q_heads;
  r.head_dim = static_cast<int>(config.head_dim);
  return r;
}

int CudaGraphRunner::Bucket(int n) {
  int b = 1;
  while (b < n) b *= 2;
  return b;
}

BatchMeta CudaGraphRunner::Pad(const BatchMeta& meta, int seqs, int blocks) const {
  BatchMeta p = meta;
  const int extra = seqs - meta.num_seqs;
  p.num_seqs = seqs;
  p.num_tokens = seqs;
  for (int i = 0; i < extra; ++i) {
    // An empty sequence: no cache to read, nothing to write.
    p.token_ids.push_back(0);
    p.positions.push_back(0);
    p.slot_mapping.push_back(-1);
    p.context_lens.push_back(0);
    p.logits_rows.push_back(meta.num_seqs + i);
  }
  p.query_start.resize(seqs + 1);
  for (int s = 0; s <= seqs; ++s) p.query_start[s] = s;
  p.block_tables.assign(static_cast<size_t>(seqs) * blocks, -1);
  for (int s = 0; s < meta.num_seqs; ++s) {
    std::copy_n(meta.block_tables.begin() + static_cast<size_t>(s) * meta.max_blocks_per_seq,
                meta.max_blocks_per_seq, p.block_tables.begin() + static_cast<size_t>(s) * blocks);
  }
  p.max_blocks_per_seq = blocks;
  return p;
}

namespace {

// The first `n` rows of a forward's logits; a stage that is not the last has none (empty).
Tensor FirstRows(const Tensor& logits, int n) {
  return logits.data == nullptr ? Tensor() : logits.rows(0, n);
}

}  // namespace

absl::StatusOr<Tensor> CudaGraphRunner::RunDecode(const BatchMeta& meta) {
  if (!meta.all_decode() || static_cast<int>(meta.logits_rows.size()) != meta.num_seqs) {
    return absl::InvalidArgumentError("CUDA graphs replay decode-only batches");
  }
  const int seqs = std::min(Bucket(meta.num_seqs), std::max(max_seqs_, meta.num_seqs));
  const int blocks = std::max(16, Bucket(meta.max_blocks_per_seq));
  const BatchMeta padded = Pad(meta, seqs, blocks);
  if (ops_->layout_generation() != generation_) {
    Clear();  // a batch buffer moved: every graph holds stale addresses
    generation_ = ops_->layout_generation();
  }
  auto key = std::make_pair(seqs, blocks);
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    // One eager run first: it lets cuBLASLt pick its algorithms and grows any buffer outside
    // the capture, and it is this step's forward (the capture only records; the graph first
    // runs at the next step of the bucket). So every call runs exactly one forward, captured or
    // not, and the transfers stay matched with peers that capture at other times or not at all
    // (a stage that recaptures after a buffer moved sends one residual, as its next stage
    // receives one).
    ops_->SetBatch(padded);
    TP_ASSIGN_OR_RETURN(const Tensor eager, model_->Run(padded, *cache_));
    ops_->SetBatch(padded);
    if (ops_->layout_generation() != generation_) {
      Clear();
      generation_ = ops_->layout_generation();
    }
    auto graph = std::make_unique<Graph>();
    cudaStream_t stream = ops_->stream();
    cudaGraph_t g = nullptr;
    TP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    auto logits = model_->Run(padded, *cache_);
    TP_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    if (!logits.ok()) {
      cudaGraphDestroy(g);
      return logits.status();
    }
    TP_CUDA_CHECK(cudaGraphInstantiate(&graph->exec, g, 0));
    TP_CUDA_CHECK(cudaGraphDestroy(g));
    graph->logits = *logits;  // the activation buffers the eager run wrote too
    graphs_.emplace(key, std::move(graph));
    return FirstRows(eager, meta.num_seqs);
  }
  ops_->SetBatch(padded);
  if (ops_->layout_generation() != generation_) {
    Clear();
    generation_ = ops_->layout_generation();
    return RunDecode(meta);
  }
  TP_CUDA_CHECK(cudaGraphLaunch(it->second->exec, ops_->stream()));
  return FirstRows(it->second->logits, meta.num_seqs);
}

}  // namespace tpserve
