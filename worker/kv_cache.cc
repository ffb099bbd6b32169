// Allocation of the paged KV pools.
#include "worker/kv_cache.h"

#include "common/logging.h"
#include "kernels/kv_quant.h"

namespace tpserve {
namespace {

size_t RoundUp256(size_t n) { return (n + 255) / 256 * 256; }

// Bytes of one pool's elements and of its scales.
size_t DataBytes(int64_t slots, int num_kv_heads, int head_dim, DType dtype) {
  return static_cast<size_t>(slots) * num_kv_heads * head_dim * DTypeBits(dtype) / 8;
}
size_t ScaleBytes(int64_t slots, int num_kv_heads, int head_dim, DType dtype) {
  return static_cast<size_t>(slots) * num_kv_heads * KvScaleGroups(dtype, head_dim) * sizeof(float);
}

}  // namespace

KvCache::KvCache(Ops* ops, int num_layers, int num_blocks, int block_size, int num_kv_heads,
                 int head_dim, DType dtype)
    : ops_(ops),
      num_blocks_(num_blocks),
      block_size_(block_size),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      dtype_(dtype),
      data_bytes_(
          DataBytes(static_cast<int64_t>(num_blocks) * block_size, num_kv_heads, head_dim, dtype)),
      scale_bytes_(
          ScaleBytes(static_cast<int64_t>(num_blocks) * block_size, num_kv_heads, head_dim, dtype)),
      stride_bytes_(RoundUp256(data_bytes_) + RoundUp256(scale_bytes_)),
      pool_(ops, 2 * num_layers * stride_bytes_) {
  TP_CHECK(dtype == ops->compute_dtype() || IsQuantizedKv(dtype))
      << "KV cache dtype " << DTypeName(dtype) << " with compute dtype "
      << DTypeName(ops->compute_dtype());
  TP_CHECK(!IsQuantizedKv(dtype) || head_dim % KvScaleGroup(dtype, head_dim) == 0)
      << "head_dim " << head_dim << " is not a multiple of the scale group";
}

size_t KvCache::BlockBytes(int num_layers, int block_size, int num_kv_heads, int head_dim,
                           DType dtype) {
  return 2ull * num_layers *
         (DataBytes(block_size, num_kv_heads, head_dim, dtype) +
          ScaleBytes(block_size, num_kv_heads, head_dim, dtype));
}

Tensor KvCache::Layer(int index) const {
  char* base = static_cast<char*>(pool_.get()) + index * stride_bytes_;
  Tensor t(base, {num_blocks_, block_size_, num_kv_heads_, head_dim_}, dtype_, ops_->device());
  if (IsQuantizedKv(dtype_)) t.scales = base + RoundUp256(data_bytes_);
  return t;
}

}  // namespace tpserve
