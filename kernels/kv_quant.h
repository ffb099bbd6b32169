// The quantized KV cache (--kv-cache-dtype fp8|int8|int4): one definition of the formats and of
// the rounding, compiled for the host (the CPU reference, tests) and the device (the CUDA
// kernels), so that a CUDA kernel and the CPU reference quantize the same values to the same
// bits. No dependencies beyond common/dtype.h, so CUDA sources include it too.
//
// A quantized pool (one layer's K or V) is a Tensor of dtype kF8E4M3, kI8 or kI4 and logical
// shape [blocks, block_size, Hk, D] (kI4 packs two elements a byte, element 2i in the low
// nibble), with `scales`: f32 [blocks, block_size, Hk, D / KvScaleGroup(dtype, D)], one scale
// per group of consecutive elements of one token's head:
//   fp8 (e4m3, finite, max 448) and int8: one scale per token and head (group = D);
//   int4: one scale per kKvInt4Group elements (see kernels/cuda/NOTES.md for why).
// Every element reads back as Decode(q) * scale, q = Encode(x * inv) with the group's scale and
// its inverse inv from the group's extreme m (KvExtreme: the element of largest magnitude):
//   fp8 and int8: symmetric, scale = |m| / qmax (448, 127), q in [-qmax, qmax];
//   int4: all 16 levels, q in [-8, 7]: m maps to -8, scale = -m / 8 (negative when m > 0), so
//     the grid is [-8, 7] * scale with the longer side towards m (int4 stores q + 8).
// Encode rounds to nearest even and clamps (int8, int4); fp8 rounds to the nearest e4m3 value and
// saturates at 448. An all-zero group has scale 0 and reads back as zeros.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/dtype.h"

#if defined(__CUDACC__)
#define TP_KVQ_HD __host__ __device__ __forceinline__
#else
#define TP_KVQ_HD inline
#endif

namespace tpserve {

inline constexpr int kKvInt4Group = 64;

TP_KVQ_HD constexpr bool IsQuantizedKv(DType t) {
  return t == DType::kF8E4M3 || t == DType::kI8 || t == DType::kI4;
}

// Elements per scale along the head dimension.
TP_KVQ_HD constexpr int KvScaleGroup(DType t, int head_dim) {
  return t == DType::kI4 ? (head_dim < kKvInt4Group ? head_dim : kKvInt4Group) : head_dim;
}

// Scales per token and head.
TP_KVQ_HD int KvScaleGroups(DType t, int head_dim) {
  return IsQuantizedKv(t) ? head_dim / KvScaleGroup(t, head_dim) : 0;
}

// The magnitude a group's extreme maps to (int4: to -8; the positive side ends at 7).
TP_KVQ_HD float KvQuantMax(DType t) {
  return t == DType::kF8E4M3 ? 448.0f : (t == DType::kI8 ? 127.0f : 8.0f);
}

// float -> e4m3 (the "fn" variant: no infinities, 0x7f/0xff are NaN), round to nearest even,
// saturating at +-448 (as CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)).
TP_KVQ_HD uint8_t FloatToE4M3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);  // NaN
  float a;
  std::memcpy(&a, &mag, 4);
  if (a < 0.015625f) {  // below 2^-6: subnormal e4m3, a multiple of 2^-9 (8 * 2^-9 is 2^-6)
    const float m = rintf(a * 512.0f);
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(m));
  }
  int e = static_cast<int>(mag >> 23) - 127;  // a >= 2^-6: e >= -6
  uint32_t keep = (mag >> 20) & 7u;
  const uint32_t rem = mag & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (keep & 1u))) ++keep;
  if (keep == 8) {
    keep = 0;
    ++e;
  }
  if (e > 8 || (e == 8 && keep == 7)) return static_cast<uint8_t>(sign | 0x7e);  // 448
  return static_cast<uint8_t>(sign | static_cast<uint8_t>(((e + 7) << 3) | keep));
}

// e4m3 -> float (exact).
TP_KVQ_HD float E4M3ToFloat(uint8_t c) {
  const int e = (c >> 3) & 15;
  const int m = c & 7;
  float v;
  if (e == 0) {
    v = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  } else if (e == 15 && m == 7) {
    v = NAN;
  } else {
    v = ldexpf(1.0f + static_cast<float>(m) * 0.125f, e - 7);
  }
  return (c & 0x80) ? -v : v;
}

// A group's extreme, reduced pairwise in any order: of two elements the one of larger magnitude,
// of equal magnitudes the smaller (the negative) one. It is the maximum of a total order on the
// values (NaNs are skipped), so a sequential loop (QuantizeKvHead) and a warp's shuffle tree
// (kv_quant.cuh) find the same element; the extreme of an empty or all-zero group is 0.
TP_KVQ_HD float KvExtreme(float a, float b) {
  const float fa = fabsf(a), fb = fabsf(b);
  return fa > fb ? a : (fb > fa ? b : fminf(a, b));
}

// The scale of a group whose extreme is `m`, and the factor that maps its elements to the
// quantized range (both 0 for an all-zero group). int4's scale is 0 - m / 8 (exact: a power of
// two), the 0 - keeping +0 for m = 0 or -0.
TP_KVQ_HD float KvScale(DType t, float m) {
  return t == DType::kI4 ? 0.0f - m * 0.125f : fabsf(m) / KvQuantMax(t);
}
TP_KVQ_HD float KvInvScale(DType t, float m) {
  if (t == DType::kI4) return m != 0.0f ? -8.0f / m : 0.0f;
  const float absmax = fabsf(m);
  return absmax > 0.0f ? KvQuantMax(t) / absmax : 0.0f;
}

// One element, already multiplied by the inverse scale, in its stored code: the e4m3 byte, the
// int8 byte (q in [-127, 127]), or the int4 nibble (q + 8, q in [-8, 7]).
TP_KVQ_HD uint8_t KvEncode(DType t, float v) {
  if (t == DType::kF8E4M3) return FloatToE4M3(v);
  const float qmax = t == DType::kI8 ? 127.0f : 7.0f;
  const float qmin = t == DType::kI8 ? -127.0f : -8.0f;
  float r = rintf(v);
  r = r > qmax ? qmax : (r < qmin ? qmin : r);
  const int q = static_cast<int>(r);
  return t == DType::kI8 ? static_cast<uint8_t>(static_cast<int8_t>(q))
                         : static_cast<uint8_t>(q + 8);
}

// A stored code back to its quantized value (before the scale).
TP_KVQ_HD float KvDecode(DType t, uint8_t code) {
  if (t == DType::kF8E4M3) return E4M3ToFloat(code);
  if (t == DType::kI8) return static_cast<float>(static_cast<int8_t>(code));
  return static_cast<float>(static_cast<int>(code & 15) - 8);
}

// Byte offset of element `e` within a pool whose rows are packed: element index * bits / 8.
TP_KVQ_HD int64_t KvByteOffset(DType t, int64_t e) { return t == DType::kI4 ? e / 2 : e; }

// Host reference of one token's head (n = head_dim elements of x, f32): writes the codes of
// elements [0, n) at `dst` (element 0 of the head; n / 2 bytes for int4) and the head's
// KvScaleGroups scales at `scales`. The CPU ops and the tests use it; CUDA kernels quantize
// with the same KvExtreme / KvScale / KvInvScale / KvEncode.
inline void QuantizeKvHead(DType t, const float* x, int n, uint8_t* dst, float* scales) {
  const int group = KvScaleGroup(t, n);
  for (int g0 = 0; g0 < n; g0 += group) {
    float m = 0.0f;
    for (int i = g0; i < g0 + group; ++i) m = KvExtreme(m, x[i]);
    const float inv = KvInvScale(t, m);
    scales[g0 / group] = KvScale(t, m);
    for (int i = g0; i < g0 + group; ++i) {
      const uint8_t code = KvEncode(t, x[i] * inv);
      if (t == DType::kI4) {
        uint8_t& b = dst[i / 2];
        b = (i & 1) ? static_cast<uint8_t>((b & 0x0f) | (code << 4))
                    : static_cast<uint8_t>((b & 0xf0) | code);
      } else {
        dst[i] = code;
      }
    }
  }
}

// The inverse: n elements of one token's head from its codes and scales.
inline void DequantizeKvHead(DType t, const uint8_t* src, const float* scales, int n, float* out) {
  const int group = KvScaleGroup(t, n);
  for (int i = 0; i < n; ++i) {
    const uint8_t code =
        t == DType::kI4 ? static_cast<uint8_t>((src[i / 2] >> ((i & 1) * 4)) & 15) : src[i];
    out[i] = KvDecode(t, code) * scales[i / group];
  }
}

}  // namespace tpserve
