// Device side of the quantized KV-cache writes (KvWrite, RopeKvWrite): a warp holds one token's
// head (32 lanes x kEpl consecutive elements, head_dim = 32 * kEpl), reduces each scale group's
// extreme (KvExtreme) with shuffles and stores codes and scales with kernels/kv_quant.h's
// functions, so that the bits equal QuantizeKvHead's on the host.
#pragma once

#include <type_traits>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/kv_quant.h"

namespace tpserve::cuda {

// The head sizes the quantized writes take: a warp per head, head_dim / 32 elements a lane.
inline bool KvQuantHeadDimSupported(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// Checks the K and V caches of a write or an attention launcher: one dtype, the same shape [blocks,
// block_size, Hk, D], and scales on both exactly when that dtype is quantized (then D one of
// KvQuantHeadDimSupported and 16-byte aligned pools).
inline void CheckKvCaches(const char* op, const Tensor& k_cache, const Tensor& v_cache) {
  TP_CHECK(k_cache.dtype == v_cache.dtype &&
           (k_cache.scales == nullptr) == (v_cache.scales == nullptr))
      << op << ": the K and V caches must have the same dtype and both carry scales or neither: "
      << "k_cache " << k_cache.ShapeString() << (k_cache.scales ? " with" : " without")
      << " scales, v_cache " << v_cache.ShapeString() << (v_cache.scales ? " with" : " without")
      << " scales";
  bool same_shape = k_cache.ndim == 4 && v_cache.ndim == 4;
  for (int i = 0; same_shape && i < 4; ++i) same_shape = k_cache.dim(i) == v_cache.dim(i);
  TP_CHECK(same_shape) << op << ": k_cache " << k_cache.ShapeString() << " and v_cache "
                       << v_cache.ShapeString() << " must both be [blocks, block_size, Hk, D]";
  if (!IsQuantizedKv(k_cache.dtype)) {
    TP_CHECK_CUDA_TENSOR(k_cache, DType::kBF16);
    TP_CHECK_CUDA_TENSOR(v_cache, DType::kBF16);
    TP_CHECK(k_cache.scales == nullptr)
        << op << ": a " << DTypeName(k_cache.dtype) << " KV cache carries no scales";
    return;
  }
  TP_CHECK_CUDA_TENSOR(k_cache, k_cache.dtype);
  TP_CHECK_CUDA_TENSOR(v_cache, k_cache.dtype);
  TP_CHECK(k_cache.scales != nullptr && v_cache.scales != nullptr)
      << op << ": a quantized KV cache (" << DTypeName(k_cache.dtype)
      << ") needs its scales (Tensor::scales)";
  TP_CHECK(KvQuantHeadDimSupported(k_cache.dim(3)) && IsAligned16(k_cache.data) &&
           IsAligned16(v_cache.data) && IsAligned16(k_cache.scales) && IsAligned16(v_cache.scales))
      << op << ": a " << DTypeName(k_cache.dtype) << " KV cache needs head_dim 32, 64, 128 or 256 "
      << "and 16-byte aligned codes and scales, got " << k_cache.ShapeString();
}

// Calls fn(std::integral_constant<DType, t>, std::integral_constant<int, head_dim / 32>) for a
// quantized dtype and a KvQuantHeadDimSupported head_dim (checked before).
template <typename Fn>
void DispatchKvQuant(DType t, int head_dim, Fn&& fn) {
  auto by_epl = [&](auto dtype) {
    switch (head_dim) {
      case 32:
        return fn(dtype, std::integral_constant<int, 1>{});
      case 64:
        return fn(dtype, std::integral_constant<int, 2>{});
      case 128:
        return fn(dtype, std::integral_constant<int, 4>{});
      default:
        return fn(dtype, std::integral_constant<int, 8>{});
    }
  };
  switch (t) {
    case DType::kF8E4M3:
      return by_epl(std::integral_constant<DType, DType::kF8E4M3>{});
    case DType::kI8:
      return by_epl(std::integral_constant<DType, DType::kI8>{});
    default:
      return by_epl(std::integral_constant<DType, DType::kI4>{});
  }
}

// kEpl consecutive bf16 at p (aligned to 2 * kEpl bytes) as floats, and back.
template <int kEpl>
__device__ __forceinline__ void LoadBf16(const __nv_bfloat16* p, float (&f)[kEpl]) {
  if constexpr (kEpl == 1) {
    f[0] = __bfloat162float(*p);
  } else if constexpr (kEpl == 8) {
    float g[8];
    Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(p), g);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = g[e];
  } else {
    struct alignas(2 * kEpl) Vec {
      __nv_bfloat162 h[kEpl / 2];
    };
    const Vec v = *reinterpret_cast<const Vec*>(p);
#pragma unroll
    for (int i = 0; i < kEpl / 2; ++i) {
      const float2 t = __bfloat1622float2(v.h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
}

template <int kEpl>
__device__ __forceinline__ void StoreBf16(__nv_bfloat16* p, const float (&f)[kEpl]) {
  if constexpr (kEpl == 1) {
    *p = __float2bfloat16(f[0]);
  } else {
    struct alignas(2 * kEpl) Vec {
      __nv_bfloat162 h[kEpl / 2];
    };
    Vec v;
#pragma unroll
    for (int i = 0; i < kEpl / 2; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<Vec*>(p) = v;
  }
}

// RoPE (rotate-half, fp32) of the head a full warp holds as QuantizeHeadWarp takes it: lanes
// 0-15 hold the first half, and the partner of a lane's element i (i + D/2, or i - D/2) sits in
// lane l ^ 16 at the same place, one shuffle away. cos_s / sin_s: the token's table (D/2).
template <int kEpl>
__device__ __forceinline__ void RotateHalfWarp(float (&f)[kEpl], int lane,
                                               const float* __restrict__ cos_s,
                                               const float* __restrict__ sin_s) {
  float partner[kEpl];
#pragma unroll
  for (int e = 0; e < kEpl; ++e) partner[e] = __shfl_xor_sync(0xffffffffu, f[e], 16);
  const int i0 = (lane % 16) * kEpl;  // this lane's first index within the half
#pragma unroll
  for (int e = 0; e < kEpl; ++e) {
    const float c = cos_s[i0 + e], s = sin_s[i0 + e];
    // (a, b) = elements (i, i + D/2): lanes 0-15 hold a and store a * c - b * s, lanes 16-31
    // hold b and store b * c + a * s, rounded as RopeRotate (no contraction into FMAs), so that
    // every RoPE kernel (and the host's fp32 rotation) gives the same bits.
    float ra, rb;
    if (lane < 16) {
      RopeRotate(f[e], partner[e], c, s, ra, rb);
      f[e] = ra;
    } else {
      RopeRotate(partner[e], f[e], c, s, ra, rb);
      f[e] = rb;
    }
  }
}

// `bytes` (1, 2, 4 or 8) bytes of `w`, little-endian, at p (aligned to `bytes`).
template <int kBytes>
__device__ __forceinline__ void StoreBytes(uint8_t* p, uint64_t w) {
  if constexpr (kBytes == 1) {
    *p = static_cast<uint8_t>(w);
  } else if constexpr (kBytes == 2) {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(w);
  } else if constexpr (kBytes == 4) {
    *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(w);
  } else {
    static_assert(kBytes == 8);
    *reinterpret_cast<uint2*>(p) =
        make_uint2(static_cast<uint32_t>(w), static_cast<uint32_t>(w >> 32));
  }
}

// Quantizes one token's head held by a full warp (lane l holds elements [l * kEpl, (l + 1) *
// kEpl) in f, fp32) into `codes` (element 0 of the head in the pool) and `scales` (the head's
// KvScaleGroups scales), as QuantizeKvHead: per group the extreme m (KvExtreme, whose result does
// not depend on the order of the reduction), KvScale(m), KvEncode(x * KvInvScale(m)). Every lane
// of the warp must call it (shuffles).
template <DType kT, int kEpl>
__device__ __forceinline__ void QuantizeHeadWarp(const float (&f)[kEpl], int lane,
                                                 uint8_t* __restrict__ codes,
                                                 float* __restrict__ scales) {
  constexpr int kHeadDim = 32 * kEpl;
  // A group is a power of two >= kEpl elements here: lanes_per_group lanes, aligned.
  const int lanes_per_group = KvScaleGroup(kT, kHeadDim) / kEpl;
  float m = 0.0f;
#pragma unroll
  for (int e = 0; e < kEpl; ++e) m = KvExtreme(m, f[e]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (o < lanes_per_group) m = KvExtreme(m, __shfl_xor_sync(0xffffffffu, m, o));
  }
  if (lane % lanes_per_group == 0) scales[lane / lanes_per_group] = KvScale(kT, m);
  const float inv = KvInvScale(kT, m);
  uint32_t c[kEpl];
#pragma unroll
  for (int e = 0; e < kEpl; ++e) c[e] = KvEncode(kT, f[e] * inv);
  if constexpr (kT == DType::kI4) {
    if constexpr (kEpl == 1) {
      // One nibble a lane: the even lane stores its byte with the odd neighbour's high nibble.
      const uint32_t hi = __shfl_down_sync(0xffffffffu, c[0], 1);
      if ((lane & 1) == 0) codes[lane / 2] = static_cast<uint8_t>(c[0] | (hi << 4));
    } else {
      uint64_t w = 0;
#pragma unroll
      for (int j = 0; j < kEpl / 2; ++j) w |= uint64_t{c[2 * j] | (c[2 * j + 1] << 4)} << (8 * j);
      StoreBytes<kEpl / 2>(codes + lane * (kEpl / 2), w);
    }
  } else {
    uint64_t w = 0;
#pragma unroll
    for (int e = 0; e < kEpl; ++e) w |= uint64_t{c[e]} << (8 * e);
    StoreBytes<kEpl>(codes + lane * kEpl, w);
  }
}

}  // namespace tpserve::cuda
