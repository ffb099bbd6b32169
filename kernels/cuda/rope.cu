// Rotary position embedding in place on q and k (rotate-half layout, HF Llama), fp32 math.
// cos/sin of position * inv_freq are computed once per token in shared memory.
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {
namespace {

constexpr int kMaxHalf = 256;  // head_dim <= 512

__global__ void RopeKernel(__nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ k,
                           const float* __restrict__ inv_freq,
                           const int32_t* __restrict__ positions, int num_q_heads, int num_k_heads,
                           int head_dim) {
  __shared__ float cos_s[kMaxHalf], sin_s[kMaxHalf];
  int t = blockIdx.x;
  int half = head_dim / 2;
  float pos = static_cast<float>(positions[t]);
  FillRopeTable(pos, inv_freq, half, cos_s, sin_s);
  int total = (num_q_heads + num_k_heads) * half;
  for (int p = threadIdx.x; p < total; p += blockDim.x) {
    int head = p / half, i = p % half;
    __nv_bfloat16* base =
        head < num_q_heads
            ? q + (static_cast<int64_t>(t) * num_q_heads + head) * head_dim
            : k + (static_cast<int64_t>(t) * num_k_heads + (head - num_q_heads)) * head_dim;
    float x1 = __bfloat162float(base[i]), x2 = __bfloat162float(base[i + half]);
    float c = cos_s[i], s = sin_s[i];
    base[i] = __float2bfloat16(x1 * c - x2 * s);
    base[i + half] = __float2bfloat16(x2 * c + x1 * s);
  }
}

}  // namespace

void LaunchRope(Tensor q, Tensor k, const Tensor& inv_freq, int head_dim, const DeviceBatch& b,
                cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(q, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(k, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(inv_freq, DType::kF32);
  TP_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim / 2 <= kMaxHalf &&
           inv_freq.numel() == head_dim / 2 && q.dim(0) == b.num_tokens &&
           k.dim(0) == b.num_tokens && q.numel() % (b.num_tokens * int64_t{head_dim}) == 0 &&
           k.numel() % (b.num_tokens * int64_t{head_dim}) == 0)
      << "Rope: q " << q.ShapeString() << ", k " << k.ShapeString() << ", inv_freq "
      << inv_freq.ShapeString() << ", head_dim " << head_dim << ", tokens " << b.num_tokens;
  if (b.num_tokens == 0) return;
  int hq = static_cast<int>(q.numel() / b.num_tokens / head_dim);
  int hk = static_cast<int>(k.numel() / b.num_tokens / head_dim);
  int pairs = (hq + hk) * head_dim / 2;
  int threads = pairs >= 512 ? 512 : ((pairs + 31) / 32) * 32;
  RopeKernel<<<b.num_tokens, threads, 0, stream>>>(q.ptr<__nv_bfloat16>(), k.ptr<__nv_bfloat16>(),
                                                   inv_freq.ptr<float>(), b.positions, hq, hk,
                                                   head_dim);
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
