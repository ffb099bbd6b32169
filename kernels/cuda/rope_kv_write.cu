// RoPE and the paged KV-cache write fused, on the output of the fused q/k/v projection:
// qkv [T, (Hq + 2 Hk) * D] -> q_out [T, Hq * D] (rotated), k (rotated) and v into the caches
// [blocks, block_size, Hk, D] at slot_mapping (slots < 0 are padding: q only). One kernel
// instead of three (Rope, KvWrite and the copies of separate q/k/v GEMMs); fp32 math, the same
// rounding as Rope then KvWrite. A quantized cache (kernels/kv_quant.h) gets the rotated k
// quantized from its fp32 values (never rounded to bf16) and v from its bf16 values.
#include <cuda_fp8.h>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/kv_quant.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {
namespace {

constexpr int kWarps = 8;      // a warp rotates or copies one head at a time
constexpr int kMaxHalf = 256;  // head_dim <= 512
// From this many tokens a block takes all heads of its token: a block per (token, 8 heads)
// made 24576 blocks of 2 KB for a 2048-token prefill of the 6.7B shape, which ran at half the
// copy bandwidth (48.5 us); below it, blocks of 8 heads keep small batches spread over the SMs.
constexpr int kAllHeadsMinTokens = 256;

// Block (t, y) handles heads [y * heads_per_block, (y + 1) * heads_per_block) of token t.
__global__ void __launch_bounds__(kWarps * 32)
    RopeKvWriteKernel(const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ inv_freq,
                      const int32_t* __restrict__ positions,
                      const int32_t* __restrict__ slot_mapping, int num_q_heads, int num_kv_heads,
                      int head_dim, int heads_per_block, int64_t num_slots,
                      __nv_bfloat16* __restrict__ q_out, __nv_bfloat16* __restrict__ k_cache,
                      __nv_bfloat16* __restrict__ v_cache) {
  __shared__ float cos_s[kMaxHalf], sin_s[kMaxHalf];
  PdlLaunchDependents();
  const int t = blockIdx.x;
  const int half = head_dim / 2;
  // Positions and slots come from SetBatch: safe to read before the wait.
  const float pos = static_cast<float>(positions[t]);
  const int64_t slot = slot_mapping[t];
  FillRopeTable(pos, inv_freq, half, cos_s, sin_s);
  PdlWait();  // qkv is the previous kernel's output

  const int heads = num_q_heads + 2 * num_kv_heads;
  const int lane = threadIdx.x % 32;
  const int head_end = min(heads, (blockIdx.y + 1) * heads_per_block);
  for (int head = blockIdx.y * heads_per_block + threadIdx.x / 32; head < head_end;
       head += kWarps) {
    const __nv_bfloat16* src = qkv + (static_cast<int64_t>(t) * heads + head) * head_dim;
    __nv_bfloat16* dst;
    if (head < num_q_heads) {
      dst = q_out + (static_cast<int64_t>(t) * num_q_heads + head) * head_dim;
    } else {
      if (slot < 0 || slot >= num_slots) return;  // padding: no cache row (k and v follow q)
      const int kv = head - num_q_heads;
      dst = kv < num_kv_heads ? k_cache + (slot * num_kv_heads + kv) * head_dim
                              : v_cache + (slot * num_kv_heads + kv - num_kv_heads) * head_dim;
    }
    const auto* s2 = reinterpret_cast<const __nv_bfloat162*>(src);
    auto* d2 = reinterpret_cast<__nv_bfloat162*>(dst);
    if (head >= num_q_heads + num_kv_heads) {  // v: a copy
      for (int i = lane; i < head_dim / 2; i += 32) d2[i] = s2[i];
      continue;
    }
    // Pairs (i, i + half), two adjacent i per lane (head_dim % 4 == 0).
    for (int j = lane; j < half / 2; j += 32) {
      float2 a = __bfloat1622float2(s2[j]);
      float2 b = __bfloat1622float2(s2[j + half / 2]);
      const int i = 2 * j;
      float ra0, rb0, ra1, rb1;
      RopeRotate(a.x, b.x, cos_s[i], sin_s[i], ra0, rb0);
      RopeRotate(a.y, b.y, cos_s[i + 1], sin_s[i + 1], ra1, rb1);
      d2[j] = __floats2bfloat162_rn(ra0, ra1);
      d2[j + half / 2] = __floats2bfloat162_rn(rb0, rb1);
    }
  }
}

// The prefill-sized path (kAllHeadsMinTokens tokens or more, head_dim % 16 == 0): a block per
// token; a thread takes the 16-byte chunks (c, c + D/16) of a head, the two halves RoPE pairs,
// and keeps up to kItems such items' loads in flight before it rotates and stores any.
constexpr int kItems = 4;

// A wide kernel's block: token blockIdx.x's RoPE table in cos_s / sin_s, its cache slot, and its
// items (item i: the chunk pair i % pairs of head i / pairs; a padding token has q heads only).
struct WideToken {
  int64_t slot;
  int pairs, items;
  const __nv_bfloat16* row;
};
__device__ __forceinline__ WideToken BeginWideToken(const __nv_bfloat16* __restrict__ qkv,
                                                    const float* __restrict__ inv_freq,
                                                    const int32_t* __restrict__ positions,
                                                    const int32_t* __restrict__ slot_mapping,
                                                    int num_q_heads, int num_kv_heads, int head_dim,
                                                    int64_t num_slots, float* cos_s, float* sin_s) {
  PdlLaunchDependents();
  const int t = blockIdx.x;
  WideToken w;
  // Positions and slots come from SetBatch: safe to read before the wait.
  w.slot = slot_mapping[t];
  FillRopeTable(static_cast<float>(positions[t]), inv_freq, head_dim / 2, cos_s, sin_s);
  PdlWait();  // qkv is the previous kernel's output
  w.pairs = head_dim / 16;
  const bool has_slot = w.slot >= 0 && w.slot < num_slots;
  w.items = (has_slot ? num_q_heads + 2 * num_kv_heads : num_q_heads) * w.pairs;
  w.row = qkv + static_cast<int64_t>(t) * (num_q_heads + 2 * num_kv_heads) * head_dim;
  return w;
}
// The chunk pairs of items first + u * blockDim.x (u < kItems) that exist, all loads issued.
__device__ __forceinline__ void LoadWideItems(const WideToken& w, int first, int head_dim,
                                              uint4 (&a)[kItems], uint4 (&b)[kItems]) {
#pragma unroll
  for (int u = 0; u < kItems; ++u) {
    const int i = first + u * blockDim.x;
    if (i < w.items) {
      const __nv_bfloat16* src = w.row + (i / w.pairs) * head_dim + (i % w.pairs) * 8;
      a[u] = *reinterpret_cast<const uint4*>(src);
      b[u] = *reinterpret_cast<const uint4*>(src + head_dim / 2);
    }
  }
}

__global__ void __launch_bounds__(kWarps * 32)
    RopeKvWriteWideKernel(const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ inv_freq,
                          const int32_t* __restrict__ positions,
                          const int32_t* __restrict__ slot_mapping, int num_q_heads,
                          int num_kv_heads, int head_dim, int64_t num_slots,
                          __nv_bfloat16* __restrict__ q_out, __nv_bfloat16* __restrict__ k_cache,
                          __nv_bfloat16* __restrict__ v_cache) {
  __shared__ float cos_s[kMaxHalf], sin_s[kMaxHalf];
  const WideToken w = BeginWideToken(qkv, inv_freq, positions, slot_mapping, num_q_heads,
                                     num_kv_heads, head_dim, num_slots, cos_s, sin_s);
  const int t = blockIdx.x, half = head_dim / 2, pairs = w.pairs;
  const int64_t slot = w.slot;
  for (int first = threadIdx.x; first < w.items; first += kItems * blockDim.x) {
    uint4 a[kItems], b[kItems];
    LoadWideItems(w, first, head_dim, a, b);
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int i = first + u * blockDim.x;
      if (i >= w.items) continue;
      const int head = i / pairs, c = i % pairs;
      __nv_bfloat16* dst;
      if (head < num_q_heads) {
        dst = q_out + (static_cast<int64_t>(t) * num_q_heads + head) * head_dim;
      } else {
        const int kv = head - num_q_heads;
        dst = kv < num_kv_heads ? k_cache + (slot * num_kv_heads + kv) * head_dim
                                : v_cache + (slot * num_kv_heads + kv - num_kv_heads) * head_dim;
      }
      dst += c * 8;
      if (head < num_q_heads + num_kv_heads) {  // q and k rotate; v is a copy
        float fa[8], fb[8], ra[8], rb[8];
        Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&a[u]), fa);
        Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&b[u]), fb);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          RopeRotate(fa[e], fb[e], cos_s[c * 8 + e], sin_s[c * 8 + e], ra[e], rb[e]);
        }
        *reinterpret_cast<Bf16x8*>(dst) = FloatToBf16x8(ra);
        *reinterpret_cast<Bf16x8*>(dst + half) = FloatToBf16x8(rb);
      } else {
        *reinterpret_cast<uint4*>(dst) = a[u];
        *reinterpret_cast<uint4*>(dst + half) = b[u];
      }
    }
  }
}

// Quantized caches: a warp per head (lane l holds elements [l * kEpl, (l + 1) * kEpl), rotated
// by RotateHalfWarp); block (t, y) handles heads [y * heads_per_block, (y + 1) * heads_per_block)
// of token t as RopeKvWriteKernel does. q heads are rotated and stored in bf16, k heads rotated and
// quantized in fp32, v heads quantized from bf16.
template <DType kT, int kEpl>
__global__ void __launch_bounds__(kWarps * 32)
    RopeKvWriteQuantKernel(const __nv_bfloat16* __restrict__ qkv,
                           const float* __restrict__ inv_freq,
                           const int32_t* __restrict__ positions,
                           const int32_t* __restrict__ slot_mapping, int num_q_heads,
                           int num_kv_heads, int heads_per_block, int64_t num_slots,
                           __nv_bfloat16* __restrict__ q_out, uint8_t* __restrict__ k_codes,
                           uint8_t* __restrict__ v_codes, float* __restrict__ k_scales,
                           float* __restrict__ v_scales) {
  constexpr int kHeadDim = 32 * kEpl, kHalf = kHeadDim / 2;
  __shared__ float cos_s[kHalf], sin_s[kHalf];
  PdlLaunchDependents();
  const int t = blockIdx.x;
  // Positions and slots come from SetBatch: safe to read before the wait.
  const float pos = static_cast<float>(positions[t]);
  const int64_t slot = slot_mapping[t];
  FillRopeTable(pos, inv_freq, kHalf, cos_s, sin_s);
  PdlWait();  // qkv is the previous kernel's output

  const bool has_slot = slot >= 0 && slot < num_slots;
  // Padding tokens: q heads only (k and v follow them).
  const int heads = has_slot ? num_q_heads + 2 * num_kv_heads : num_q_heads;
  const int lane = threadIdx.x % 32;
  const int head_end = min(heads, (blockIdx.y + 1) * heads_per_block);
  const __nv_bfloat16* row =
      qkv + static_cast<int64_t>(t) * (num_q_heads + 2 * num_kv_heads) * kHeadDim;
  // The loop bound is the same for the whole warp: every shuffle sees all 32 lanes.
  for (int head = blockIdx.y * heads_per_block + threadIdx.x / 32; head < head_end;
       head += kWarps) {
    float f[kEpl];
    LoadBf16<kEpl>(row + head * kHeadDim + lane * kEpl, f);
    if (head < num_q_heads + num_kv_heads) RotateHalfWarp<kEpl>(f, lane, cos_s, sin_s);  // q, k
    if (head < num_q_heads) {
      StoreBf16<kEpl>(
          q_out + (static_cast<int64_t>(t) * num_q_heads + head) * kHeadDim + lane * kEpl, f);
      continue;
    }
    const bool is_v = head >= num_q_heads + num_kv_heads;
    const int64_t cache_row = slot * num_kv_heads + head - num_q_heads - (is_v ? num_kv_heads : 0);
    QuantizeHeadWarp<kT, kEpl>(
        f, lane, (is_v ? v_codes : k_codes) + KvByteOffset(kT, cache_row * kHeadDim),
        (is_v ? v_scales : k_scales) + cache_row * KvScaleGroups(kT, kHeadDim));
  }
}

// An fp8 or int8 code of each of 8 elements (already times the inverse scale), packed as they
// lie in the cache. fp8: the hardware's satfinite conversion rounds to nearest even and saturates
// at 448 as FloatToE4M3 does; only a NaN loses its sign there, so NaNs take FloatToE4M3's code.
template <DType kT>
__device__ __forceinline__ uint2 EncodeCodes8(const float (&f)[8], float inv) {
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float x0 = f[4 * h + 2 * j] * inv, x1 = f[4 * h + 2 * j + 1] * inv;
      uint32_t pair;
      if constexpr (kT == DType::kF8E4M3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        pair = __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
        if (x0 != x0 || x1 != x1) pair = FloatToE4M3(x0) | (uint32_t{FloatToE4M3(x1)} << 8);
#else
        pair = FloatToE4M3(x0) | (uint32_t{FloatToE4M3(x1)} << 8);
#endif
      } else {
        pair = KvEncode(kT, x0) | (uint32_t{KvEncode(kT, x1)} << 8);
      }
      word |= pair << (16 * j);
    }
    w[h] = word;
  }
  return make_uint2(w[0], w[1]);
}

// The prefill-sized path for fp8 and int8 caches (one scale a token and head; kAllHeadsMinTokens
// tokens or more, head_dim % 16 == 0): RopeKvWriteWideKernel's items (a block per token; a
// thread takes the 16-byte chunks c and c + D/16 of a head, 8 RoPE pairs, with kItems items'
// loads in flight), so that a head is D/16 neighbouring lanes: they reduce its extreme with
// shuffles among themselves, and each encodes its 16 elements and stores 2 x 8 bytes of codes
// (lane c = 0 the scale). The same values, rotation (RopeRotate) and encoding as
// RopeKvWriteQuantKernel, so a token's codes do not depend on the path. That kernel (a warp a
// head, one 8-byte load a lane in flight) took 72.8-77.8 us for the 2048-token prefill of the
// 6.7B shape on an H100, the bf16 write 38.9.
template <DType kT>
__global__ void __launch_bounds__(kWarps * 32)
    RopeKvWriteQuantWideKernel(const __nv_bfloat16* __restrict__ qkv,
                               const float* __restrict__ inv_freq,
                               const int32_t* __restrict__ positions,
                               const int32_t* __restrict__ slot_mapping, int num_q_heads,
                               int num_kv_heads, int head_dim, int64_t num_slots,
                               __nv_bfloat16* __restrict__ q_out, uint8_t* __restrict__ k_codes,
                               uint8_t* __restrict__ v_codes, float* __restrict__ k_scales,
                               float* __restrict__ v_scales) {
  static_assert(kT == DType::kF8E4M3 || kT == DType::kI8, "one scale a token and head");
  __shared__ float cos_s[kMaxHalf], sin_s[kMaxHalf];
  const WideToken w = BeginWideToken(qkv, inv_freq, positions, slot_mapping, num_q_heads,
                                     num_kv_heads, head_dim, num_slots, cos_s, sin_s);
  const int t = blockIdx.x, half = head_dim / 2;
  const int pairs = w.pairs;  // lanes per head: a power of two <= 32
  const int64_t slot = w.slot;
  const int lane = threadIdx.x % 32;
  // A head's lanes: `pairs` neighbours from a multiple of `pairs` (blockDim.x is a multiple).
  const unsigned head_lanes =
      pairs == 32 ? 0xffffffffu : ((1u << pairs) - 1u) << (lane & ~(pairs - 1));
  for (int first = threadIdx.x; first < w.items; first += kItems * blockDim.x) {
    uint4 a[kItems], b[kItems];
    LoadWideItems(w, first, head_dim, a, b);
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int i = first + u * blockDim.x;
      if (i >= w.items) continue;  // a whole head's lanes alike
      const int head = i / pairs, c = i % pairs;
      float fa[8], fb[8];
      Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&a[u]), fa);
      Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&b[u]), fb);
      if (head < num_q_heads + num_kv_heads) {  // q and k rotate; v is quantized as it is
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float ra, rb;
          RopeRotate(fa[e], fb[e], cos_s[c * 8 + e], sin_s[c * 8 + e], ra, rb);
          fa[e] = ra;
          fb[e] = rb;
        }
      }
      if (head < num_q_heads) {
        __nv_bfloat16* dst = q_out + (static_cast<int64_t>(t) * num_q_heads + head) * head_dim;
        *reinterpret_cast<Bf16x8*>(dst + c * 8) = FloatToBf16x8(fa);
        *reinterpret_cast<Bf16x8*>(dst + c * 8 + half) = FloatToBf16x8(fb);
        continue;
      }
      float m = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) m = KvExtreme(KvExtreme(m, fa[e]), fb[e]);
      for (int o = pairs / 2; o > 0; o >>= 1) {
        m = KvExtreme(m, __shfl_xor_sync(head_lanes, m, o));
      }
      const bool is_v = head >= num_q_heads + num_kv_heads;
      const int64_t cache_row =
          slot * num_kv_heads + head - num_q_heads - (is_v ? num_kv_heads : 0);
      if (c == 0) (is_v ? v_scales : k_scales)[cache_row] = KvScale(kT, m);
      const float inv = KvInvScale(kT, m);
      uint8_t* dst = (is_v ? v_codes : k_codes) + cache_row * head_dim + c * 8;
      *reinterpret_cast<uint2*>(dst) = EncodeCodes8<kT>(fa, inv);
      *reinterpret_cast<uint2*>(dst + half) = EncodeCodes8<kT>(fb, inv);
    }
  }
}

}  // namespace

void LaunchRopeKvWrite(const Tensor& qkv, const Tensor& inv_freq, int num_q_heads, int num_kv_heads,
                       int head_dim, const DeviceBatch& b, Tensor q_out, Tensor k_cache,
                       Tensor v_cache, cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(qkv, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(inv_freq, DType::kF32);
  TP_CHECK_CUDA_TENSOR(q_out, DType::kBF16);
  CheckKvCaches("RopeKvWrite", k_cache, v_cache);
  const int64_t width = int64_t{num_q_heads + 2 * num_kv_heads} * head_dim;
  TP_CHECK(num_q_heads > 0 && num_kv_heads > 0 && head_dim > 0 && head_dim % 4 == 0 &&
           head_dim / 2 <= kMaxHalf && inv_freq.numel() == head_dim / 2 &&
           qkv.dim(0) == b.num_tokens && qkv.numel() == b.num_tokens * width &&
           q_out.numel() == int64_t{b.num_tokens} * num_q_heads * head_dim && k_cache.ndim == 4 &&
           k_cache.dim(1) == b.block_size && k_cache.dim(2) == num_kv_heads &&
           k_cache.dim(3) == head_dim && IsAligned16(qkv.data))
      << "RopeKvWrite: qkv " << qkv.ShapeString() << ", q_out " << q_out.ShapeString()
      << ", k_cache " << k_cache.ShapeString() << ", inv_freq " << inv_freq.ShapeString()
      << ", heads " << num_q_heads << "/" << num_kv_heads << ", head_dim " << head_dim
      << " (a multiple of 4), tokens " << b.num_tokens << ", block_size " << b.block_size;
  if (b.num_tokens == 0) return;
  const int heads = num_q_heads + 2 * num_kv_heads;
  const int heads_per_block = b.num_tokens >= kAllHeadsMinTokens ? heads : kWarps;
  const dim3 grid(b.num_tokens, CeilDiv(heads, heads_per_block));
  if (IsQuantizedKv(k_cache.dtype)) {
    TP_CHECK(IsAligned16(q_out.data)) << "RopeKvWrite: q_out must be 16-byte aligned";
    if ((k_cache.dtype == DType::kF8E4M3 || k_cache.dtype == DType::kI8) &&
        b.num_tokens >= kAllHeadsMinTokens && head_dim % 16 == 0 && IsAligned16(qkv.data)) {
      auto wide = k_cache.dtype == DType::kF8E4M3 ? RopeKvWriteQuantWideKernel<DType::kF8E4M3>
                                                  : RopeKvWriteQuantWideKernel<DType::kI8>;
      LaunchPdl(wide, dim3(b.num_tokens), dim3(kWarps * 32), 0, stream,
                qkv.ptr<const __nv_bfloat16>(), inv_freq.ptr<const float>(), b.positions,
                b.slot_mapping, num_q_heads, num_kv_heads, head_dim,
                k_cache.dim(0) * k_cache.dim(1), q_out.ptr<__nv_bfloat16>(), k_cache.ptr<uint8_t>(),
                v_cache.ptr<uint8_t>(), static_cast<float*>(k_cache.scales),
                static_cast<float*>(v_cache.scales));
      TP_CUDA_CHECK_LAUNCH();
      return;
    }
    DispatchKvQuant(k_cache.dtype, head_dim, [&](auto t, auto epl) {
      LaunchPdl(RopeKvWriteQuantKernel<decltype(t)::value, decltype(epl)::value>, grid,
                dim3(kWarps * 32), 0, stream, qkv.ptr<const __nv_bfloat16>(),
                inv_freq.ptr<const float>(), b.positions, b.slot_mapping, num_q_heads, num_kv_heads,
                heads_per_block, k_cache.dim(0) * k_cache.dim(1), q_out.ptr<__nv_bfloat16>(),
                k_cache.ptr<uint8_t>(), v_cache.ptr<uint8_t>(), static_cast<float*>(k_cache.scales),
                static_cast<float*>(v_cache.scales));
    });
    TP_CUDA_CHECK_LAUNCH();
    return;
  }
  if (b.num_tokens >= kAllHeadsMinTokens && head_dim % 16 == 0 && IsAligned16(q_out.data) &&
      IsAligned16(k_cache.data) && IsAligned16(v_cache.data)) {
    LaunchPdl(RopeKvWriteWideKernel, dim3(b.num_tokens), dim3(kWarps * 32), 0, stream,
              qkv.ptr<const __nv_bfloat16>(), inv_freq.ptr<const float>(), b.positions,
              b.slot_mapping, num_q_heads, num_kv_heads, head_dim, k_cache.dim(0) * k_cache.dim(1),
              q_out.ptr<__nv_bfloat16>(), k_cache.ptr<__nv_bfloat16>(),
              v_cache.ptr<__nv_bfloat16>());
    TP_CUDA_CHECK_LAUNCH();
    return;
  }
  LaunchPdl(RopeKvWriteKernel, grid, dim3(kWarps * 32), 0, stream, qkv.ptr<const __nv_bfloat16>(),
            inv_freq.ptr<const float>(), b.positions, b.slot_mapping, num_q_heads, num_kv_heads,
            head_dim, heads_per_block, k_cache.dim(0) * k_cache.dim(1), q_out.ptr<__nv_bfloat16>(),
            k_cache.ptr<__nv_bfloat16>(), v_cache.ptr<__nv_bfloat16>());
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
