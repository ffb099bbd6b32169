// Epilogue pieces shared by the decode GEMMs (gemm_skinny.cu, gemm_lt_chain.cu): the RoPE/KV
// store of a (i, i + D/2) row pair as RopeKvWrite computes it, and the row scale of a deferred
// RMSNorm's record (see kNormSumSlots in launchers.h).
#pragma once

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {

// The RoPE/KV epilogue's arguments (see RopeKvWrite in kernels/ops.h).
struct RopeKvArgs {
  const float* inv_freq = nullptr;
  const int32_t* positions = nullptr;
  const int32_t* slots = nullptr;
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t num_slots = 0;
  __nv_bfloat16* q_out = nullptr;
  __nv_bfloat16* k_cache = nullptr;
  __nv_bfloat16* v_cache = nullptr;
};

// Deterministic mode's RMSNorm (AddRmsNorm and the chain GEMMs' deferred norm give the same bits):
// a row's sum of squares is the integer total of each element's square in fixed point
// (NormSquareFixed; exact, so any order of addition gives it), its scale RowScaleOfSums of that
// total, and an output element bf16(bf16(h * gamma) * scale): the deferred norm's producer stores
// bf16(h * gamma) before the total is known, its consumer scales it.
__device__ __forceinline__ unsigned long long NormSquareFixed(float h) {
  return __float2ull_rn(__fmul_rn(__fmul_rn(h, h), kNormSumScale));
}
__device__ __forceinline__ float RowScaleOfTotal(unsigned long long total, int dim, float eps) {
  const float ss = static_cast<float>(static_cast<double>(total) * (1.0 / kNormSumScale));
  return rsqrtf(ss / dim + eps);
}

// The row scale rsqrt(sum / dim + eps) of a deferred norm, from the record's kNormSumSlots
// counters of one row, lane i of a full warp holding counter i; every lane gets the result.
__device__ __forceinline__ float RowScaleOfSums(unsigned long long v, int dim, float eps) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return RowScaleOfTotal(v, dim, eps);
}

// What StoreRopeKvPair reads besides the pair: token m's position and cache slot, and the
// frequency of element i. A kernel may load them early (after its programmatic-launch wait: the
// step's inputs) so that the store at its end waits on nothing.
struct RopePairOperands {
  int32_t position = 0;
  int64_t slot = -1;
  float inv_freq = 0.0f;
};
__device__ __forceinline__ RopePairOperands LoadRopePairOperands(const RopeKvArgs& p, int m,
                                                                 int head, int i) {
  RopePairOperands o;
  if (head < p.num_q_heads + p.num_kv_heads) {
    o.position = p.positions[m];
    o.inv_freq = p.inv_freq[i];
  }
  if (head >= p.num_q_heads) o.slot = p.slots[m];
  return o;
}

// Rotates the pair (a, b) = rows (i, i + D/2) of `head` for token m and stores it as
// RopeKvWrite does: q heads to q_out, k heads rotated and v heads as they are to the caches.
__device__ __forceinline__ void StoreRopeKvPair(const RopeKvArgs& p, int m, int head, int i,
                                                float a, float b, const RopePairOperands& o) {
  const int half = p.head_dim / 2;
  if (head < p.num_q_heads + p.num_kv_heads) {
    float sn, cs;
    sincosf(static_cast<float>(o.position) * o.inv_freq, &sn, &cs);
    float ra, rb;
    RopeRotate(a, b, cs, sn, ra, rb);
    a = ra;
    b = rb;
  }
  __nv_bfloat16* dst;
  if (head < p.num_q_heads) {
    dst = p.q_out + (static_cast<int64_t>(m) * p.num_q_heads + head) * p.head_dim;
  } else {
    const int64_t slot = o.slot;
    if (slot < 0 || slot >= p.num_slots) return;  // padding
    const int kv = head - p.num_q_heads;
    dst = kv < p.num_kv_heads
              ? p.k_cache + (slot * p.num_kv_heads + kv) * p.head_dim
              : p.v_cache + (slot * p.num_kv_heads + kv - p.num_kv_heads) * p.head_dim;
  }
  dst[i] = __float2bfloat16(a);
  dst[i + half] = __float2bfloat16(b);
}
__device__ __forceinline__ void StoreRopeKvPair(const RopeKvArgs& p, int m, int head, int i,
                                                float a, float b) {
  StoreRopeKvPair(p, m, head, i, a, b, LoadRopePairOperands(p, m, head, i));
}

}  // namespace tpserve::cuda
