// How the attention kernels read the KV cache: one type per cache dtype (bf16, or a quantized
// code of kernels/kv_quant.h) that loads 8 consecutive elements of a row and decodes them to fp32
// in registers, bit-exact with KvDecode. The scales are applied by the kernels, once per group.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/kv_quant.h"

namespace tpserve::cuda {

// Streaming loads of 8 and 4 bytes (KV codes are read once, like LoadStreaming).
__device__ __forceinline__ uint2 LoadStreaming8(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(r.x), "=r"(r.y)
               : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t LoadStreaming4(const void* p) {
  uint32_t r;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

// Two e4m3 codes (element 2i in the low byte) -> two floats through the hardware conversion to
// f16 (exact: every e4m3 value is an f16 value).
__device__ __forceinline__ float2 E4M3x2ToFloat2(uint32_t two_codes) {
  __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_codes), __NV_E4M3);
  return __half22float2(__half2(h));
}

// Byte b of w (0..255) as a float without an integer conversion: 2^23 + b is a float whose low
// mantissa bits are b, so (bits 0x4B0000bb as float) - 2^23 = b exactly.
template <int kByte>
__device__ __forceinline__ float ByteToFloat(uint32_t w, float bias) {
  return __int_as_float(static_cast<int>(__byte_perm(w, 0x4B000000u, 0x7540 | kByte))) -
         (8388608.0f + bias);
}

// The cache element types. Vec8 holds 8 consecutive elements of a row (16, 8 or 4 bytes);
// Decode8 gives their values before the scale: KvDecode(code) for a quantized type.
struct KvBf16 {
  static constexpr DType kDType = DType::kBF16;
  static constexpr bool kQuantized = false;
  static constexpr int kBits = 16;
  using Vec8 = uint4;
  __device__ static __forceinline__ Vec8 Load8(const uint8_t* p) { return LoadStreaming(p); }
  __device__ static __forceinline__ void Decode8(const Vec8& v, float f[8]) {
    Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&v), f);
  }
};

struct KvF8E4M3 {
  static constexpr DType kDType = DType::kF8E4M3;
  static constexpr bool kQuantized = true;
  static constexpr int kBits = 8;
  using Vec8 = uint2;
  __device__ static __forceinline__ Vec8 Load8(const uint8_t* p) { return LoadStreaming8(p); }
  __device__ static __forceinline__ void Decode8(const Vec8& v, float f[8]) {
    const uint32_t w[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float2 a = E4M3x2ToFloat2(w[i]), b = E4M3x2ToFloat2(w[i] >> 16);
      f[4 * i] = a.x;
      f[4 * i + 1] = a.y;
      f[4 * i + 2] = b.x;
      f[4 * i + 3] = b.y;
    }
  }
};

struct KvI8 {
  static constexpr DType kDType = DType::kI8;
  static constexpr bool kQuantized = true;
  static constexpr int kBits = 8;
  using Vec8 = uint2;
  __device__ static __forceinline__ Vec8 Load8(const uint8_t* p) { return LoadStreaming8(p); }
  // Flipping the sign bit maps int8 q to the byte q + 128.
  __device__ static __forceinline__ void Decode8(const Vec8& v, float f[8]) {
    const uint32_t w[2] = {v.x ^ 0x80808080u, v.y ^ 0x80808080u};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      f[4 * i] = ByteToFloat<0>(w[i], 128.0f);
      f[4 * i + 1] = ByteToFloat<1>(w[i], 128.0f);
      f[4 * i + 2] = ByteToFloat<2>(w[i], 128.0f);
      f[4 * i + 3] = ByteToFloat<3>(w[i], 128.0f);
    }
  }
};

struct KvI4 {
  static constexpr DType kDType = DType::kI4;
  static constexpr bool kQuantized = true;
  static constexpr int kBits = 4;
  using Vec8 = uint32_t;
  __device__ static __forceinline__ Vec8 Load8(const uint8_t* p) { return LoadStreaming4(p); }
  // Nibble i is element i, stored as q + 8.
  __device__ static __forceinline__ void Decode8(const Vec8& v, float f[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      f[i] = __int_as_float(static_cast<int>(((v >> (4 * i)) & 15u) | 0x4B000000u)) -
             (8388608.0f + 8.0f);
    }
  }
};

// Two 8-bit codes of w (bytes 0-1, or 2-3 with kHigh) as an f16x2 (the lower byte in the low
// half), exact: every e4m3 and int8 value is an f16 value. The tensor-core decode kernel's
// operands. fp8: the hardware e4m3x2 -> f16x2 conversion; int8: the f16 bits 0x64bb are
// 1024 + b, so with b = q + 128 (the sign bit flipped) 0x64bb - 1152 = q.
template <typename Kv, bool kHigh>
__device__ __forceinline__ uint32_t CodePairToHalf2(uint32_t w) {
  static_assert(Kv::kQuantized && Kv::kBits == 8, "8-bit codes");
  if constexpr (Kv::kDType == DType::kF8E4M3) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(kHigh ? w >> 16 : w & 0xffffu), __NV_E4M3);
    return (static_cast<uint32_t>(h.y) << 16) | h.x;
  } else {
    const uint32_t bits = __byte_perm(w ^ 0x80808080u, 0x64646464u, kHigh ? 0x4342 : 0x4140);
    __half2 v = *reinterpret_cast<const __half2*>(&bits);
    v = __hsub2(v, __half2(__half(1152.0f), __half(1152.0f)));
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// kE consecutive elements of a row (8 or 16) as one load of kE * bits / 8 bytes (16, 8 or 4):
// a quantized cache read 16 elements a lane moves 16 bytes of codes per load instruction and
// needs half the lanes per row, so the per-row work of a lane (page lookup, address, scale)
// is spread over twice the bytes.
template <typename Kv, int kE>
struct KvLane {
  static_assert(kE == 8 || kE == 16, "8 or 16 elements a lane");
  static constexpr int kBytes = kE * Kv::kBits / 8;
  typename Kv::Vec8 v[kE / 8];
  __device__ __forceinline__ void Load(const uint8_t* p) {
    if constexpr (kE == 8) {
      v[0] = Kv::Load8(p);
    } else if constexpr (kBytes == 32) {  // bf16: two 16-byte loads
      v[0] = Kv::Load8(p);
      v[1] = Kv::Load8(p + 16);
    } else if constexpr (kBytes == 16) {  // 8-bit codes
      const uint4 w = LoadStreaming(p);
      v[0] = make_uint2(w.x, w.y);
      v[1] = make_uint2(w.z, w.w);
    } else {  // int4 codes
      const uint2 w = LoadStreaming8(p);
      v[0] = w.x;
      v[1] = w.y;
    }
  }
  __device__ __forceinline__ void Clear() {
#pragma unroll
    for (int i = 0; i < kE / 8; ++i) v[i] = typename Kv::Vec8{};
  }
  __device__ __forceinline__ void Decode(float f[kE]) const {
#pragma unroll
    for (int i = 0; i < kE / 8; ++i) Kv::Decode8(v[i], f + 8 * i);
  }
};

// Elements per scale (kernels/kv_quant.h) for head dimension kD; a group is a whole number of
// 8-element chunks.
template <typename Kv, int kD>
inline constexpr int kKvGroup = KvScaleGroup(Kv::kDType, kD);

// The pool row (slot * num_kv_heads + kv_head) of position `pos` of a sequence whose block-table
// row is `table`: the page by a shift when block_shift >= 0 (KvBlockShift), else by a division.
__device__ __forceinline__ int64_t KvPoolRow(const int32_t* __restrict__ table, int pos,
                                             int block_size, int block_shift, int num_kv_heads,
                                             int kv_head) {
  int page, in_page;
  if (block_shift >= 0) {
    page = pos >> block_shift;
    in_page = pos & (block_size - 1);
  } else {
    page = pos / block_size;
    in_page = pos - page * block_size;
  }
  return (static_cast<int64_t>(table[page]) * block_size + in_page) * num_kv_heads + kv_head;
}

// A prefill-attention block's work item (SetBatch's list) and head in PrefillGrid's (heads, work
// items) grid, read from the block index registers (which the compiler reads again where needed
// instead of holding them: a 1-D grid's quotient and remainder made three mma kernels spill).
struct PrefillBlock {
  int item, head;
};
__device__ __forceinline__ PrefillBlock PrefillBlockOf() {
  return {static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.x)};
}

// Byte offset of element `e` (a multiple of 8) in a pool of Kv.
template <typename Kv>
__device__ __forceinline__ int64_t KvBytes(int64_t e) {
  return e * Kv::kBits / 8;
}

// The scale of the element at offset `e` (>= 0) in a pool of groups of kGroup (a power of two).
template <int kGroup>
__device__ __forceinline__ int64_t KvScaleIndex(int64_t e) {
  static_assert((kGroup & (kGroup - 1)) == 0, "a shift");
  return static_cast<int64_t>(static_cast<uint64_t>(e) / kGroup);
}

// Calls f(Kv{}) with the element type of `dtype` (a KV-cache dtype the kernels read).
template <typename F>
void DispatchKvType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF8E4M3:
      f(KvF8E4M3{});
      return;
    case DType::kI8:
      f(KvI8{});
      return;
    case DType::kI4:
      f(KvI4{});
      return;
    default:
      f(KvBf16{});
      return;
  }
}

}  // namespace tpserve::cuda
