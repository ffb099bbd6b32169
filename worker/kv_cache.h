// The paged KV cache of one worker: for each local layer a K and a V pool of
// [num_blocks, block_size, local KV heads, head_dim], in one allocation made once at start.
// Stored in the compute dtype, or quantized (fp8, int8, int4: kernels/kv_quant.h) with each
// pool's scales beside it. Workers own the contents; block tables (which blocks a sequence
// uses) live in the scheduler.
#pragma once

#include <vector>

#include "common/dtype.h"
#include "kernels/ops.h"

namespace tpserve {

class KvCache {
 public:
  // `dtype`: the compute dtype or a quantized one (IsQuantizedKv).
  KvCache(Ops* ops, int num_layers, int num_blocks, int block_size, int num_kv_heads, int head_dim,
          DType dtype);

  // Bytes one block takes over all local layers (K and V, scales included).
  static size_t BlockBytes(int num_layers, int block_size, int num_kv_heads, int head_dim,
                           DType dtype);

  Tensor k(int local_layer) { return Layer(2 * local_layer); }
  Tensor v(int local_layer) { return Layer(2 * local_layer + 1); }
  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  DType dtype() const { return dtype_; }
  int64_t capacity_tokens() const { return static_cast<int64_t>(num_blocks_) * block_size_; }
  size_t bytes() const { return pool_.bytes(); }

 private:
  Tensor Layer(int index) const;

  Ops* ops_;
  int num_blocks_, block_size_, num_kv_heads_, head_dim_;
  DType dtype_;
  size_t data_bytes_;    // the elements of one K or V pool of one layer
  size_t scale_bytes_;   // its scales (0 unless quantized)
  size_t stride_bytes_;  // one pool and its scales, rounded up to 256 bytes
  DeviceBuffer pool_;    // [layer][K, V][blocks, block_size, heads, head_dim] (+ scales)
};

}  // namespace tpserve
