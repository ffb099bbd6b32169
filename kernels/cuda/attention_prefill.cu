// Prefill attention, FlashAttention-2 style: one block of kWarps warps per (16 kWarps-query
// tile, head); each warp owns 16 query rows. K/V tiles of 64 keys are gathered from the paged
// cache with cp.async into swizzled shared memory, S = QK^T and O += PV run on the tensor cores
// (mma.sync m16n8k16 bf16, fp32 accumulators) and the softmax is online in fp32; K and V of the
// next tile load (two stages) while the current one is computed. 8 warps (128 query rows) by
// default, 4 warps with TPSERVE_PREFILL_TILE=64: on the H200 the 2048-token prefill of the 6.7B
// shape (32 heads, d 128) ran at 161 against 155 TFLOP/s (tpserve-cuda-bench --attention).
// Handles any batch of query lengths with a cached prefix (chunked prefill, mixed batches):
// query i of a sequence sees cache positions [0, context_len - query_len + i].
// A quantized cache (fp8 / int8 / int4, kv_read.cuh): the tiles' codes and scales are gathered
// with cp.async into staging buffers (two stages), decoded once per tile into the bf16 tiles
// (exact: every code value is a bf16 value), and the MMAs run on the codes; the K scale
// multiplies each score (one partial sum per scale group), the V scale each softmax weight
// before it is rounded to bf16 (one partial P per group of output columns).
#include <atomic>
#include <cstring>
#include <string>

#include "common/env.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/kv_quant.cuh"  // CheckKvCaches
#include "kernels/cuda/kv_read.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/mma_util.cuh"
#include "kernels/head_dims.h"

namespace tpserve::cuda {

int PrefillTileM() {
  static const int tile = EnvString(env::kPrefillTile) == "64" ? 64 : 128;
  return tile;
}

namespace {
std::atomic<int>& PrefillKernelOverride() {
  static std::atomic<int> kernel{[] {
    const std::string k = EnvString(env::kPrefillKernel);
    for (const auto& [kernel, name] : kPrefillKernels) {
      if (k == name) return static_cast<int>(kernel);
    }
    return static_cast<int>(PrefillKernel::kMma);
  }()};
  return kernel;
}

std::atomic<int>& PrefillDequantOverride() {
  static std::atomic<int> mode{[] {
    const std::string m = EnvString(env::kPrefillDequant);
    return static_cast<int>(m == "0"     ? PrefillDequant::kOff
                            : m == "all" ? PrefillDequant::kAll
                                         : PrefillDequant::kAuto);
  }()};
  return mode;
}

std::atomic<int>& MixedDecodeOverride() {
  static std::atomic<int> mode{[] {
    const std::string m = EnvString(env::kMixedDecode);
    return static_cast<int>(m == "0"   ? MixedDecode::kOff
                            : m == "1" ? MixedDecode::kOn
                                       : MixedDecode::kAuto);
  }()};
  return mode;
}

// Scratch page blockIdx.x, elements [blockIdx.y, blockIdx.y + 1) * kDequantElems of it: a
// thread decodes 8 codes (one 8-byte load) kDequantItems times, all loads first.
constexpr int kDequantThreads = 256;
constexpr int kDequantItems = 4;
constexpr int kDequantElems = kDequantThreads * 8 * kDequantItems;

template <typename Kv>
__global__ void __launch_bounds__(kDequantThreads)
    DequantizeKvPagesKernel(const uint8_t* __restrict__ k_codes,
                            const uint8_t* __restrict__ v_codes, const float* __restrict__ k_scales,
                            const float* __restrict__ v_scales, const int2* __restrict__ pages,
                            int page_elems, int row_elems, int head_dim,
                            __nv_bfloat16* __restrict__ k_out, __nv_bfloat16* __restrict__ v_out) {
  static_assert(Kv::kBits == 8, "8-bit caches: one scale a token and head");
  const int2 page = pages[blockIdx.x];  // (cache page, rows of the context in it)
  const int64_t src = int64_t{page.x} * page_elems;
  const int64_t dst = int64_t{blockIdx.x} * page_elems;
  const int valid = page.y * row_elems;
  const int first = blockIdx.y * kDequantElems + threadIdx.x * 8;
  typename Kv::Vec8 kc[kDequantItems], vc[kDequantItems];
  float ks[kDequantItems], vs[kDequantItems];
#pragma unroll
  for (int u = 0; u < kDequantItems; ++u) {
    const int e = first + u * kDequantThreads * 8;
    if (e < valid) {
      kc[u] = Kv::Load8(k_codes + src + e);
      vc[u] = Kv::Load8(v_codes + src + e);
      ks[u] = k_scales[(src + e) / head_dim];
      vs[u] = v_scales[(src + e) / head_dim];
    }
  }
#pragma unroll
  for (int u = 0; u < kDequantItems; ++u) {
    const int e = first + u * kDequantThreads * 8;
    if (e >= page_elems) break;
    float kf[8], vf[8];
    if (e < valid) {
      Kv::Decode8(kc[u], kf);
      Kv::Decode8(vc[u], vf);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        kf[i] *= ks[u];
        vf[i] *= vs[u];
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) kf[i] = vf[i] = 0.0f;
    }
    *reinterpret_cast<Bf16x8*>(k_out + dst + e) = FloatToBf16x8(kf);
    *reinterpret_cast<Bf16x8*>(v_out + dst + e) = FloatToBf16x8(vf);
  }
}

}  // namespace

void SetMixedDecode(MixedDecode mode) { MixedDecodeOverride() = static_cast<int>(mode); }
MixedDecode MixedDecodeChoice() { return static_cast<MixedDecode>(MixedDecodeOverride().load()); }
bool MixedDecodeSplits(MixedDecode mode, DType kv) {
  return mode == MixedDecode::kOn || (mode == MixedDecode::kAuto && IsQuantizedKv(kv));
}

void SetPrefillDequant(PrefillDequant mode) { PrefillDequantOverride() = static_cast<int>(mode); }
PrefillDequant PrefillDequantChoice() {
  return static_cast<PrefillDequant>(PrefillDequantOverride().load());
}

bool PrefillDequantTakes(PrefillDequant mode, int query_len, int context_len) {
  if (mode == PrefillDequant::kOff || query_len <= 0 || context_len <= 0) return false;
  if (mode == PrefillDequant::kAll) return true;
  // Causal pairs: every query sees the prefix and the queries up to itself.
  const int64_t prefix = context_len - query_len;
  const int64_t pairs = int64_t{query_len} * prefix + int64_t{query_len} * (query_len + 1) / 2;
  return pairs >= int64_t{kPrefillDequantPairsPerKey} * context_len;
}

void LaunchDequantizeKvPages(const Tensor& k_cache, const Tensor& v_cache, const DeviceBatch& b,
                             Tensor k_scratch, Tensor v_scratch, cudaStream_t stream) {
  CheckKvCaches("DequantizeKvPages", k_cache, v_cache);
  TP_CHECK_CUDA_TENSOR(k_scratch, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(v_scratch, DType::kBF16);
  TP_CHECK((k_cache.dtype == DType::kF8E4M3 || k_cache.dtype == DType::kI8) && k_cache.ndim == 4 &&
           k_scratch.ndim == 4 && k_cache.dim(1) == b.block_size &&
           k_scratch.dim(1) == b.block_size && k_scratch.dim(2) == k_cache.dim(2) &&
           k_scratch.dim(3) == k_cache.dim(3) && k_cache.dim(3) % 8 == 0 &&
           v_scratch.numel() == k_scratch.numel() && b.num_scratch_pages <= k_scratch.dim(0))
      << "DequantizeKvPages: cache " << k_cache.ShapeString() << " (" << DTypeName(k_cache.dtype)
      << "), scratch " << k_scratch.ShapeString() << ", " << b.num_scratch_pages << " pages of "
      << b.block_size << " rows (needs an fp8 or int8 "
      << "cache, head_dim a multiple of 8)";
  if (b.num_scratch_pages == 0) return;
  const int row_elems = static_cast<int>(k_cache.dim(2) * k_cache.dim(3));
  const int page_elems = b.block_size * row_elems;
  const dim3 grid(b.num_scratch_pages, CeilDiv(page_elems, kDequantElems));
  TP_CHECK(grid.y <= 65535) << "DequantizeKvPages: a page of " << page_elems << " elements";
  auto launch = [&](auto kv) {
    using Kv = decltype(kv);
    DequantizeKvPagesKernel<Kv><<<grid, kDequantThreads, 0, stream>>>(
        k_cache.ptr<uint8_t>(), v_cache.ptr<uint8_t>(), static_cast<const float*>(k_cache.scales),
        static_cast<const float*>(v_cache.scales), b.scratch_pages, page_elems, row_elems,
        static_cast<int>(k_cache.dim(3)), k_scratch.ptr<__nv_bfloat16>(),
        v_scratch.ptr<__nv_bfloat16>());
  };
  if (k_cache.dtype == DType::kF8E4M3) {
    launch(KvF8E4M3{});
  } else {
    launch(KvI8{});
  }
  TP_CUDA_CHECK_LAUNCH();
}

void SetPrefillKernel(PrefillKernel kernel) { PrefillKernelOverride() = static_cast<int>(kernel); }
PrefillKernel PrefillKernelChoice() {
  return static_cast<PrefillKernel>(PrefillKernelOverride().load());
}

dim3 PrefillGrid(const DeviceBatch& b, int num_heads) {
  TP_CHECK(b.num_prefill_work <= 65535 && num_heads <= 65535)
      << "prefill attention: " << b.num_prefill_work << " query tiles x " << num_heads
      << " heads exceed the grid (65,535 a dimension)";
  return dim3(num_heads, b.num_prefill_work);
}

namespace {

constexpr int kBN = 64;  // keys per tile

// Element offset of (row, 8-element chunk) in a [rows][kD] tile; chunks XOR-swizzled by row so
// that ldmatrix over 8 consecutive rows hits 8 different bank groups (kD >= 64; a 32-wide row
// has 4 chunks, and the XOR stays inside the row).
template <int kD>
__device__ __forceinline__ int Swizzle(int row, int chunk) {
  constexpr int kMask = (kD / 8 < 8 ? kD / 8 : 8) - 1;
  return row * kD + ((chunk ^ (row & kMask)) << 3);
}

// Shared memory of the kernel: q, the bf16 K and V tiles (two stages; one for a quantized cache,
// whose two stages are its codes and scales).
template <typename Kv, int kD, int kWarps>
constexpr int PrefillSmemBytes() {
  constexpr int kTileBytes = kBN * kD * 2;
  if constexpr (!Kv::kQuantized) return kWarps * 16 * kD * 2 + 4 * kTileBytes;
  constexpr int kCodeBytes = kBN * kD * Kv::kBits / 8;
  constexpr int kScaleBytes = kBN * (kD / kKvGroup<Kv, kD>)*4;
  return kWarps * 16 * kD * 2 + 2 * kTileBytes + 4 * kCodeBytes + 4 * kScaleBytes;
}

template <typename Kv, int kD, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    PrefillAttentionKernel(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k_cache,
                           const uint8_t* __restrict__ v_cache, const float* __restrict__ k_scales,
                           const float* __restrict__ v_scales, const int2* __restrict__ work,
                           const int32_t* __restrict__ query_start,
                           const int32_t* __restrict__ context_lens,
                           const int32_t* __restrict__ block_tables, int max_blocks_per_seq,
                           int block_size, int block_shift, int num_heads, int num_kv_heads,
                           float scale_log2, __nv_bfloat16* __restrict__ out) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kBM = kWarps * 16;  // query rows per block
  constexpr int kChunks = kD / 8;
  constexpr int kTile = kBN * kD;  // elements of one K or V tile
  constexpr bool kQuantized = Kv::kQuantized;
  constexpr int kStages = kQuantized ? 1 : 2;    // of the bf16 tiles
  constexpr int kRowBytes = kD * Kv::kBits / 8;  // codes of one key's head
  constexpr int kCodeChunks = kRowBytes / 16;    // 16-byte copies per key
  constexpr int kCodeTile = kBN * kRowBytes;     // code bytes of one K or V tile
  constexpr int kGroup = kKvGroup<Kv, kD>;       // elements per scale
  constexpr int kGroups = kD / kGroup;           // scales per key
  static_assert(kGroups <= 2, "one or two scale groups per head");
  extern __shared__ __align__(128) __nv_bfloat16 smem[];
  __nv_bfloat16* q_s = smem;                   // [kBM][kD]
  __nv_bfloat16* k_s = smem + kBM * kD;        // [kStages][kBN][kD]
  __nv_bfloat16* v_s = k_s + kStages * kTile;  // [kStages][kBN][kD]
  // Quantized only: codes [2][kBN][kRowBytes] and scales [2][kBN][kGroups] of K and V.
  uint8_t* kq_s = reinterpret_cast<uint8_t*>(v_s + kStages * kTile);
  uint8_t* vq_s = kq_s + 2 * kCodeTile;
  float* ksc_s = reinterpret_cast<float*>(vq_s + 2 * kCodeTile);
  float* vsc_s = ksc_s + 2 * kBN * kGroups;

  const PrefillBlock blk = PrefillBlockOf();
  const int2 item = work[blk.item];
  const int seq = item.x, q0 = item.y;
  const int head = blk.head;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int row_begin = query_start[seq];
  const int qlen = query_start[seq + 1] - row_begin;
  const int ctx = context_lens[seq];
  const int prefix = ctx - qlen;  // keys cached before this step's queries
  const int q_last = min(q0 + kBM, qlen) - 1;
  const int num_keys = prefix + q_last + 1;
  const int num_tiles = (num_keys + kBN - 1) / kBN;
  const int32_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t q_stride = static_cast<int64_t>(num_heads) * kD;

  // Each thread copies one 16-byte chunk column of every kRowsPerPass-th row, so the page
  // lookup (a shift for power-of-two block sizes) is done once per row for K and V together.
  constexpr int kRowsPerPass = kThreads / kChunks;
  const int my_chunk = tid % kChunks, my_row = tid / kChunks;
#pragma unroll
  for (int j = 0; j < kBM / kRowsPerPass; ++j) {
    int r = my_row + j * kRowsPerPass;
    bool valid = q0 + r < qlen;  // rows past the query length are zero and never stored
    const __nv_bfloat16* src =
        valid ? q + (row_begin + q0 + r) * q_stride + head * kD + my_chunk * 8 : q;
    CpAsync16(SmemAddr(q_s + Swizzle<kD>(r, my_chunk)), src, valid);
  }
  // The element offset in the cache of this thread's chunk of `key` (0 past the context).
  // The cache row (slot * Hk + kv head) of `key` (0 past the context).
  auto kv_row = [&](int key) -> int64_t {
    return key >= ctx ? 0 : KvPoolRow(table, key, block_size, block_shift, num_kv_heads, kv_head);
  };
  auto kv_offset = [&](int key) -> int64_t {
    return key >= ctx ? 0 : kv_row(key) * kD + my_chunk * 8;
  };
  // K and V of a tile into `stage` (bf16: the tiles; quantized: the codes and scales).
  auto load_tile = [&](int tile, int stage) {
    const int key0 = tile * kBN;
    if constexpr (!kQuantized) {
      const auto* kc = reinterpret_cast<const __nv_bfloat16*>(k_cache);
      const auto* vc = reinterpret_cast<const __nv_bfloat16*>(v_cache);
#pragma unroll
      for (int j = 0; j < kBN / kRowsPerPass; ++j) {
        int r = my_row + j * kRowsPerPass;
        int key = key0 + r;
        int64_t off = kv_offset(key);
        int swz = Swizzle<kD>(r, my_chunk);
        CpAsync16(SmemAddr(k_s + stage * kTile + swz), kc + off, key < ctx);
        CpAsync16(SmemAddr(v_s + stage * kTile + swz), vc + off, key < ctx);
      }
    } else {
      for (int i = tid; i < kBN * kCodeChunks; i += kThreads) {
        int r = i / kCodeChunks, c = i % kCodeChunks, key = key0 + r;
        int64_t off = kv_row(key) * kRowBytes + c * 16;
        int dst = stage * kCodeTile + r * kRowBytes + c * 16;
        CpAsync16(SmemAddr(kq_s + dst), k_cache + off, key < ctx);
        CpAsync16(SmemAddr(vq_s + dst), v_cache + off, key < ctx);
      }
      for (int i = tid; i < kBN * kGroups; i += kThreads) {
        int r = i / kGroups, g = i % kGroups, key = key0 + r;
        int64_t off = kv_row(key) * kGroups + g;
        CpAsync4(SmemAddr(ksc_s + stage * kBN * kGroups + i), k_scales + off, key < ctx);
        CpAsync4(SmemAddr(vsc_s + stage * kBN * kGroups + i), v_scales + off, key < ctx);
      }
    }
  };
  load_tile(0, 0);
  CpAsyncCommit();

  uint32_t qa[kD / 16][4];
  float o[kD / 8][4];
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m_row[2] = {-INFINITY, -INFINITY};
  float l_row[2] = {0.0f, 0.0f};
  // Query index (within the sequence) of this thread's two accumulator rows.
  const int qi0 = q0 + warp * 16 + lane / 4;
  const int qi1 = qi0 + 8;
  // Key tiles past this warp's last query (and all tiles when its rows are past the query
  // length) are masked whole for it: the warp still loads and synchronizes, but skips the math.
  const int warp_q_last = min(q0 + warp * 16 + 15, qlen - 1);
  const int warp_tiles = warp_q_last < q0 + warp * 16 ? 0 : (prefix + warp_q_last) / kBN + 1;
  const int q_row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;  // this lane's ldmatrix row

  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t & 1;
    if (t + 1 < num_tiles) {
      load_tile(t + 1, stage ^ 1);
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        LdMatrixX4(qa[kk], SmemAddr(q_s + Swizzle<kD>(q_row, kk * 2 + lane / 16)));
      }
    }
    const bool compute = t < warp_tiles;
    const __nv_bfloat16* kt = k_s + (kQuantized ? 0 : stage * kTile);
    const __nv_bfloat16* vt = v_s + (kQuantized ? 0 : stage * kTile);
    const float* ksc = ksc_s + stage * kBN * kGroups;
    const float* vsc = vsc_s + stage * kBN * kGroups;
    if constexpr (kQuantized) {
      // Codes -> bf16 tiles, exact (every e4m3, int8 and int4 value is a bf16 value).
      const uint8_t* kq = kq_s + stage * kCodeTile;
      const uint8_t* vq = vq_s + stage * kCodeTile;
      for (int i = tid; i < kBN * kChunks; i += kThreads) {
        int r = i / kChunks, c = i % kChunks;
        int src = r * kRowBytes + c * Kv::kBits;  // 8 elements: kBits bytes
        float f[8];
        Kv::Decode8(*reinterpret_cast<const typename Kv::Vec8*>(kq + src), f);
        *reinterpret_cast<Bf16x8*>(k_s + Swizzle<kD>(r, c)) = FloatToBf16x8(f);
        Kv::Decode8(*reinterpret_cast<const typename Kv::Vec8*>(vq + src), f);
        *reinterpret_cast<Bf16x8*>(v_s + Swizzle<kD>(r, c)) = FloatToBf16x8(f);
      }
      __syncthreads();
    }

    // S = Q K^T for this warp's 16 rows and the tile's 64 keys. A quantized K: s and s2 hold
    // the sums over the first and second scale group of the head (codes, unscaled).
    float s[kBN / 8][4];
    float s2[kBN / 8][4];  // registers only where kGroups > 1
    if (compute) {
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        if constexpr (kGroups > 1) s2[n][0] = s2[n][1] = s2[n][2] = s2[n][3] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const bool first_group = kGroups == 1 || kk * 16 < kGroup;  // known when unrolled
#pragma unroll
        for (int n2 = 0; n2 < kBN / 16; ++n2) {
          uint32_t b[4];
          int r = n2 * 16 + (lane % 8) + (lane / 16) * 8;
          int c = kk * 2 + (lane / 8) % 2;
          LdMatrixX4(b, SmemAddr(kt + Swizzle<kD>(r, c)));
          if (first_group) {
            Mma16816(s[2 * n2], qa[kk], b[0], b[1]);
            Mma16816(s[2 * n2 + 1], qa[kk], b[2], b[3]);
          } else {
            Mma16816(s2[2 * n2], qa[kk], b[0], b[1]);
            Mma16816(s2[2 * n2 + 1], qa[kk], b[2], b[3]);
          }
        }
      }
      if constexpr (kQuantized) {  // q.k = sum over groups of scale * (q . codes)
#pragma unroll
        for (int n = 0; n < kBN / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = n * 8 + 2 * (lane % 4) + (e & 1);
            float v = s[n][e] * ksc[key * kGroups];
            if constexpr (kGroups > 1) v = fmaf(s2[n][e], ksc[key * kGroups + 1], v);
            s[n][e] = v;
          }
        }
      }

      // Scale, mask, online softmax (log2 domain).
      const int key0 = t * kBN;
      const bool need_mask = key0 + kBN - 1 > prefix + q0 + warp * 16;
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[n][e] * scale_log2;
          if (need_mask) {
            int key = key0 + n * 8 + 2 * (lane % 4) + (e & 1);
            int qi = e < 2 ? qi0 : qi1;
            if (key > prefix + qi || key >= ctx) v = -INFINITY;
          }
          s[n][e] = v;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < kBN / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_new = fmaxf(m_row[r], mx);
        float m_use = m_new == -INFINITY ? 0.0f : m_new;
        float alpha = exp2f(m_row[r] - m_use);
        m_row[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kBN / 8; ++n) {
          float p0 = exp2f(s[n][2 * r] - m_use), p1 = exp2f(s[n][2 * r + 1] - m_use);
          s[n][2 * r] = p0;
          s[n][2 * r + 1] = p1;
          sum += p0 + p1;
        }
        l_row[r] = l_row[r] * alpha + sum;
#pragma unroll
        for (int d = 0; d < kD / 8; ++d) {
          o[d][2 * r] *= alpha;
          o[d][2 * r + 1] *= alpha;
        }
      }
    }
    // O += P V: P (bf16) from the S accumulators, V via transposed ldmatrix. A quantized V:
    // P times the V scale of each key, separately for each scale group of output columns.
    if (compute) {
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) {
          float w0 = 1.0f, w1 = 1.0f, w2 = 1.0f, w3 = 1.0f;  // keys 2t, 2t + 1, 2t + 8, 2t + 9
          if constexpr (kQuantized) {
            const int key = kk * 16 + 2 * (lane % 4);
            w0 = vsc[key * kGroups + grp];
            w1 = vsc[(key + 1) * kGroups + grp];
            w2 = vsc[(key + 8) * kGroups + grp];
            w3 = vsc[(key + 9) * kGroups + grp];
          }
          uint32_t pa[4];
          pa[0] = PackBf16(s[2 * kk][0] * w0, s[2 * kk][1] * w1);
          pa[1] = PackBf16(s[2 * kk][2] * w0, s[2 * kk][3] * w1);
          pa[2] = PackBf16(s[2 * kk + 1][0] * w2, s[2 * kk + 1][1] * w3);
          pa[3] = PackBf16(s[2 * kk + 1][2] * w2, s[2 * kk + 1][3] * w3);
#pragma unroll
          for (int d2 = grp * kGroup / 16; d2 < (grp + 1) * kGroup / 16; ++d2) {
            uint32_t b[4];
            int r = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
            int c = d2 * 2 + lane / 16;
            LdMatrixX4Trans(b, SmemAddr(vt + Swizzle<kD>(r, c)));
            Mma16816(o[2 * d2], pa, b[0], b[1]);
            Mma16816(o[2 * d2 + 1], pa, b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // the stage (and a quantized cache's bf16 tiles) is refilled next
  }
  CpAsyncWait<0>();  // no copy outlives the block (a padding row's tile count is 0)

  // Normalize and store (bf16 pairs).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_row[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    int qi = r == 0 ? qi0 : qi1;
    if (qi < qlen) {
      __nv_bfloat16* dst = out + (row_begin + qi) * q_stride + head * kD + 2 * (lane % 4);
#pragma unroll
      for (int d = 0; d < kD / 8; ++d) {
        *reinterpret_cast<__nv_bfloat162*>(dst + d * 8) =
            __floats2bfloat162_rn(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
      }
    }
  }
}

template <typename Kv, int kD, int kWarps>
void LaunchTyped(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                 int num_kv_heads, float scale, const DeviceBatch& b, Tensor out,
                 cudaStream_t stream) {
  constexpr int kSmem = PrefillSmemBytes<Kv, kD, kWarps>();
  static bool configured = [] {
    TP_CUDA_CHECK(cudaFuncSetAttribute(PrefillAttentionKernel<Kv, kD, kWarps>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    return true;
  }();
  (void)configured;
  const int block_shift = KvBlockShift(b.block_size);
  PrefillAttentionKernel<Kv, kD, kWarps><<<PrefillGrid(b, num_heads), kWarps * 32, kSmem, stream>>>(
      q.ptr<const __nv_bfloat16>(), static_cast<const uint8_t*>(k_cache.data),
      static_cast<const uint8_t*>(v_cache.data), static_cast<const float*>(k_cache.scales),
      static_cast<const float*>(v_cache.scales), b.prefill_work, b.query_start, b.context_lens,
      b.block_tables, b.max_blocks_per_seq, b.block_size, block_shift, num_heads, num_kv_heads,
      scale * kLog2e, out.ptr<__nv_bfloat16>());
  TP_CUDA_CHECK_LAUNCH();
}

template <typename Kv, int kWarps>
void LaunchForWarps(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                    int num_kv_heads, int head_dim, float scale, const DeviceBatch& b, Tensor out,
                    cudaStream_t stream) {
  if (head_dim == 32) {
    LaunchTyped<Kv, 32, kWarps>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, out,
                                stream);
  } else if (head_dim == 64) {
    LaunchTyped<Kv, 64, kWarps>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, out,
                                stream);
  } else {
    LaunchTyped<Kv, 128, kWarps>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, out,
                                 stream);
  }
}

}  // namespace

void LaunchAttentionPrefill(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                            int num_heads, int num_kv_heads, int head_dim, float scale,
                            const DeviceBatch& b, Tensor out, cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(q, DType::kBF16);
  CheckKvCaches("AttentionPrefill", k_cache, v_cache);
  TP_CHECK_CUDA_TENSOR(out, DType::kBF16);
  TP_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && CudaSupportsHeadDim(head_dim) &&
           k_cache.ndim == 4 && k_cache.dim(1) == b.block_size && k_cache.dim(2) == num_kv_heads &&
           k_cache.dim(3) == head_dim && v_cache.numel() == k_cache.numel() &&
           q.numel() == int64_t{b.num_tokens} * num_heads * head_dim && out.numel() == q.numel())
      << "AttentionPrefill: q " << q.ShapeString() << ", k_cache " << k_cache.ShapeString()
      << ", out " << out.ShapeString() << ", heads " << num_heads << "/" << num_kv_heads
      << ", head_dim " << head_dim << " (" << kCudaHeadDims << "), block_size " << b.block_size;
  if (b.num_prefill_work == 0) return;
  const PrefillKernel kernel = PrefillKernelChoice();
  if (kernel != PrefillKernel::kMma && WgmmaPrefillFits(k_cache.dtype, head_dim)) {
    LaunchAttentionPrefillWgmma(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale, b,
                                out, kernel, stream);
    return;
  }
  // SetBatch cut the work list into tiles of PrefillTileM() rows.
  DispatchKvType(k_cache.dtype, [&](auto kv_type) {
    using Kv = decltype(kv_type);
    if (PrefillTileM() == 64) {
      LaunchForWarps<Kv, 4>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale, b, out,
                            stream);
    } else {
      LaunchForWarps<Kv, 8>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale, b, out,
                            stream);
    }
  });
}

}  // namespace tpserve::cuda
