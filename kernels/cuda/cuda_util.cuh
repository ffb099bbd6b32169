// Device helpers shared by the CUDA kernels: bf16 vectors of 8 (16-byte loads), reductions,
// and the host-side shape checks every launcher uses.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.h"
#include "common/dtype.h"
#include "common/logging.h"

namespace tpserve::cuda {

// Eight bf16 values, one 16-byte access.
struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];
};

__device__ __forceinline__ void Bf16x8ToFloat(const Bf16x8& v, float f[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(v.h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ Bf16x8 FloatToBf16x8(const float f[8]) {
  Bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// Streaming 16-byte load that skips L1 (weights and KV read exactly once).
__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). All threads get the result.
__device__ __forceinline__ float BlockSum(float v, float* scratch /* [32] shared */) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.0f;
  return WarpSum(v);
}

inline bool IsAligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace tpserve::cuda

// Shape/dtype checks in launchers.
#define TP_CHECK_CUDA_TENSOR(t, dt)                                                                \
  TP_CHECK((t).device == ::tpserve::Device::kCuda && (t).dtype == (dt) && (t).data != nullptr)     \
      << #t " must be a " << ::tpserve::DTypeName(dt) << " CUDA tensor, got " << (t).ShapeString() \
      << ((t).device == ::tpserve::Device::kCuda ? " (cuda)" : " (cpu)")
