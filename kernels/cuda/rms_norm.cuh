// The arithmetic of RMSNorm shared by the norm kernels (rms_norm.cu) and the skinny GEMM's
// fused residual-add + norm epilogue (gemm_skinny.cu), so that both round alike: a block of
// kNormThreads threads, thread t taking the 8-element vectors t, t + kNormThreads, ... in that
// order, fp32 sums of squares combined by BlockSum.
#pragma once

#include "kernels/cuda/cuda_util.cuh"

namespace tpserve::cuda {

inline constexpr int kNormThreads = 256;
inline constexpr int kNormMaxVecs = 8;  // vectors per thread: hidden <= 256 * 8 * 8

__device__ __forceinline__ float SumSquares8(const float f[8], float ss) {
#pragma unroll
  for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
  return ss;
}

// 1 / sqrt(mean of squares + eps) from the block's total.
__device__ __forceinline__ float NormScale(float ss_total, int hidden, float eps) {
  return rsqrtf(ss_total / hidden + eps);
}

// f * rstd * w, rounded to bf16.
__device__ __forceinline__ Bf16x8 ScaleBf16x8(const float f[8], float rstd, const Bf16x8& w) {
  float wf[8], r[8];
  Bf16x8ToFloat(w, wf);
#pragma unroll
  for (int e = 0; e < 8; ++e) r[e] = __fmul_rn(__fmul_rn(f[e], rstd), wf[e]);
  return FloatToBf16x8(r);
}

// Normalizes one row of `vecs` vectors that the block reads from global memory through L2
// (written by other blocks of the same kernel): a pass for the sum of squares, a second to scale
// and store. blockDim.x must be kNormThreads.
__device__ __forceinline__ void NormalizeRowFromL2(const Bf16x8* row, const Bf16x8* weight,
                                                   float eps, int vecs, Bf16x8* out,
                                                   float* scratch /* [32] shared */) {
  float ss = 0.0f;
  for (int j = 0; j < kNormMaxVecs; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < vecs) {
      float f[8];
      const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(row + i));
      Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&raw), f);
      ss = SumSquares8(f, ss);
    }
  }
  const float rstd = NormScale(BlockSum(ss, scratch), vecs * 8, eps);
  for (int j = 0; j < kNormMaxVecs; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < vecs) {
      float f[8];
      const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(row + i));
      Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&raw), f);
      out[i] = ScaleBf16x8(f, rstd, weight[i]);
    }
  }
}

}  // namespace tpserve::cuda
