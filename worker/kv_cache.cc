// Allocation of the paged KV pools.
#include "worker/kv_cache.h"

namespace tpserve {

KvCache::KvCache(Ops* ops, int num_layers, int num_blocks, int block_size, int num_kv_heads,
                 int head_dim)
    : ops_(ops),
      num_blocks_(num_blocks),
      block_size_(block_size),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim) {
  const size_t layer_bytes = static_cast<size_t>(num_blocks) * block_size * num_kv_heads *
                             head_dim * DTypeSize(ops->compute_dtype());
  for (int l = 0; l < num_layers; ++l) {
    k_.emplace_back(ops, layer_bytes);
    v_.emplace_back(ops, layer_bytes);
  }
}

size_t KvCache::BlockBytes(int num_layers, int block_size, int num_kv_heads, int head_dim,
                           DType dtype) {
  return 2ull * num_layers * block_size * num_kv_heads * head_dim * DTypeSize(dtype);
}

Tensor KvCache::Layer(const DeviceBuffer& buf) const {
  return Tensor(buf.get(), {num_blocks_, block_size_, num_kv_heads_, head_dim_},
                ops_->compute_dtype(), ops_->device());
}

}  // namespace tpserve
