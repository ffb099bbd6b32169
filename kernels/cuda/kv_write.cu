// Paged KV-cache write: k, v [T, Hk * D] -> caches [blocks, block_size, Hk, D] at slot_mapping
// (slots < 0 are padding and skipped): a copy into bf16 caches, or quantized (fp8, int8, int4
// with scales, kernels/kv_quant.h) a warp per token's head.
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/kv_quant.cuh"
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

constexpr int kQuantWarps = 8;  // heads (K then V) of one token per block, a warp each

// Block (t, y): jobs [y * kQuantWarps, (y + 1) * kQuantWarps) of token t, job j < Hk the K head
// j, else the V head j - Hk.
template <DType kT, int kEpl>
__global__ void __launch_bounds__(kQuantWarps * 32)
    KvWriteQuantKernel(const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                       uint8_t* __restrict__ k_codes, uint8_t* __restrict__ v_codes,
                       float* __restrict__ k_scales, float* __restrict__ v_scales,
                       const int32_t* __restrict__ slot_mapping, int num_kv_heads,
                       int64_t num_slots) {
  constexpr int kHeadDim = 32 * kEpl;
  const int t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;
  const int job = blockIdx.y * kQuantWarps + threadIdx.x / 32;
  if (job >= 2 * num_kv_heads) return;  // whole warps: the shuffles below see full warps
  const bool is_v = job >= num_kv_heads;
  const int h = is_v ? job - num_kv_heads : job;
  const int lane = threadIdx.x % 32;
  float f[kEpl];
  LoadBf16<kEpl>(
      (is_v ? v : k) + (static_cast<int64_t>(t) * num_kv_heads + h) * kHeadDim + lane * kEpl, f);
  const int64_t row = slot * num_kv_heads + h;
  QuantizeHeadWarp<kT, kEpl>(f, lane, (is_v ? v_codes : k_codes) + KvByteOffset(kT, row * kHeadDim),
                             (is_v ? v_scales : k_scales) + row * KvScaleGroups(kT, kHeadDim));
}

}  // namespace

void LaunchKvWrite(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                   const DeviceBatch& b, cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(k, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(v, DType::kBF16);
  CheckKvCaches("KvWrite", k_cache, v_cache);
  TP_CHECK(k.numel() == v.numel() && k.dim(0) == b.num_tokens && k_cache.dim(1) == b.block_size)
      << "KvWrite: k " << k.ShapeString() << ", v " << v.ShapeString() << ", k_cache "
      << k_cache.ShapeString() << ", tokens " << b.num_tokens << ", block_size " << b.block_size;
  if (b.num_tokens == 0) return;
  int64_t per_token = k.numel() / b.num_tokens;
  TP_CHECK(per_token == k_cache.dim(2) * k_cache.dim(3) && per_token % 8 == 0)
      << "KvWrite: k " << k.ShapeString() << " does not match cache " << k_cache.ShapeString();
  if (IsQuantizedKv(k_cache.dtype)) {
    TP_CHECK(IsAligned16(k.data) && IsAligned16(v.data))
        << "KvWrite: k and v must be 16-byte aligned";
    const int hk = static_cast<int>(k_cache.dim(2));
    const dim3 grid(b.num_tokens, CeilDiv(2 * hk, kQuantWarps));
    DispatchKvQuant(k_cache.dtype, static_cast<int>(k_cache.dim(3)), [&](auto t, auto epl) {
      KvWriteQuantKernel<decltype(t)::value, decltype(epl)::value>
          <<<grid, kQuantWarps * 32, 0, stream>>>(
              k.ptr<const __nv_bfloat16>(), v.ptr<const __nv_bfloat16>(), k_cache.ptr<uint8_t>(),
              v_cache.ptr<uint8_t>(), static_cast<float*>(k_cache.scales),
              static_cast<float*>(v_cache.scales), b.slot_mapping, hk,
              k_cache.dim(0) * k_cache.dim(1));
    });
    TP_CUDA_CHECK_LAUNCH();
    return;
  }
  int vecs = static_cast<int>(per_token / 8);
  int threads = vecs >= 256 ? 256 : ((vecs + 31) / 32) * 32;
  KvWriteKernel<<<b.num_tokens, threads, 0, stream>>>(
      k.ptr<const uint4>(), v.ptr<const uint4>(), k_cache.ptr<uint4>(), v_cache.ptr<uint4>(),
      b.slot_mapping, vecs, k_cache.dim(0) * k_cache.dim(1));
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
