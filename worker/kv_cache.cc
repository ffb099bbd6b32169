// Allocation of the paged KV pools.
#include "worker/kv_cache.h"

namespace tpserve {

KvCache::KvCache(Ops* ops, int num_layers, int num_blocks, int block_size, int num_kv_heads,
                 int head_dim)
    : ops_(ops),
      num_blocks_(num_blocks),
      block_size_(block_size),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      layer_bytes_(static_cast<size_t>(num_blocks) * block_size * num_kv_heads * head_dim *
                   DTypeSize(ops->compute_dtype())),
      pool_(ops, 2 * num_layers * layer_bytes_) {}

size_t KvCache::BlockBytes(int num_layers, int block_size, int num_kv_heads, int head_dim,
                           DType dtype) {
  return 2ull * num_layers * block_size * num_kv_heads * head_dim * DTypeSize(dtype);
}

Tensor KvCache::Layer(int index) const {
  return Tensor(static_cast<char*>(pool_.get()) + index * layer_bytes_,
                {num_blocks_, block_size_, num_kv_heads_, head_dim_}, ops_->compute_dtype(),
                ops_->device());
}

}  // namespace tpserve
