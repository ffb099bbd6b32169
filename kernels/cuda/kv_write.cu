// Paged KV-cache write: k, v [T, Hk * D] -> caches [blocks, block_size, Hk, D] at slot_mapping
// (slots < 0 are padding and skipped).
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {
namespace {

__global__ void KvWriteKernel(const uint4* __restrict__ k, const uint4* __restrict__ v,
                              uint4* __restrict__ k_cache, uint4* __restrict__ v_cache,
                              const int32_t* __restrict__ slot_mapping, int vecs_per_token,
                              int64_t num_slots) {
  int t = blockIdx.x;
  int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;
  const uint4* ks = k + static_cast<int64_t>(t) * vecs_per_token;
  const uint4* vs = v + static_cast<int64_t>(t) * vecs_per_token;
  uint4* kd = k_cache + slot * vecs_per_token;
  uint4* vd = v_cache + slot * vecs_per_token;
  for (int i = threadIdx.x; i < vecs_per_token; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

}  // namespace

void LaunchKvWrite(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                   const DeviceBatch& b, cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(k, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(v, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(k_cache, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(v_cache, DType::kBF16);
  TP_CHECK(k.numel() == v.numel() && k_cache.numel() == v_cache.numel() && k_cache.ndim == 4 &&
           k.dim(0) == b.num_tokens && k_cache.dim(1) == b.block_size)
      << "KvWrite: k " << k.ShapeString() << ", v " << v.ShapeString() << ", k_cache "
      << k_cache.ShapeString() << ", tokens " << b.num_tokens << ", block_size " << b.block_size;
  if (b.num_tokens == 0) return;
  int64_t per_token = k.numel() / b.num_tokens;
  TP_CHECK(per_token == k_cache.dim(2) * k_cache.dim(3) && per_token % 8 == 0)
      << "KvWrite: k " << k.ShapeString() << " does not match cache " << k_cache.ShapeString();
  int vecs = static_cast<int>(per_token / 8);
  int threads = vecs >= 256 ? 256 : ((vecs + 31) / 32) * 32;
  KvWriteKernel<<<b.num_tokens, threads, 0, stream>>>(
      k.ptr<const uint4>(), v.ptr<const uint4>(), k_cache.ptr<uint4>(), v_cache.ptr<uint4>(),
      b.slot_mapping, vecs, k_cache.dim(0) * k_cache.dim(1));
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
