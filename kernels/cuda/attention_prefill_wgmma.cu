// Prefill attention on Hopper's warpgroup MMA (TPSERVE_PREFILL_KERNEL=wgmma; sm_90a): the
// FlashAttention-2 algorithm of attention_prefill.cu with its two products on wgmma, as
// FlashAttention-3 does, so that the tensor cores read Q, K and V straight from shared memory
// instead of through ldmatrix into registers.
// - One block per (tile of PrefillTileM() query rows, head); one consumer warpgroup per 64 rows
//   (two for 128-row tiles). Every thread also copies: K and V tiles of kBN = 128 keys are
//   gathered from the paged cache with cp.async (two stages: the next tile loads while this one
//   is computed) into the 128-byte-swizzled layout wgmma reads (wgmma_util.cuh); the block-table
//   entries of a thread's rows are read a tile ahead of its copies.
// - S = Q K^T: m64n128k16 with Q and K K-major in shared memory (head_dim / 16 steps).
// - The online softmax runs on the S accumulators in fp32 (log2 domain), as in the mma.sync
//   kernel; P is rounded to bf16 in registers, whose accumulator layout is wgmma's A-operand
//   layout, so O += P V is m64n(head_dim)k16 with A in registers and V MN-major (wgmma's
//   transpose of B) from the same [keys][head_dim] tile: kBN / 16 steps.
// - TPSERVE_PREFILL_KERNEL=wgmma-pipe (kPipe, bf16 caches): tile t's S and tile t - 1's P V are in
//   flight together and the softmax of tile t runs while the tensor cores do the P V
//   (FlashAttention-3's intra-warpgroup overlap); three K/V stages.
// - A quantized cache with one scale per key and head (fp8, int8): the codes and scales are
//   staged with cp.async and decoded into the bf16 tiles (exact), the K scale multiplies each
//   score and the V scale each softmax weight before its rounding, as in the mma.sync kernel.
//   int4 caches (two scale groups a head at head_dim 128) run the mma.sync kernel.
// Same inputs, masking and roundings as the mma.sync kernel (scores in fp32, P rounded once to
// bf16), except that the sums run in another order and exp2's argument is one FFMA: results agree
// with it to fp32 rounding, not bit for bit.
#include "common/check.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/kv_read.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/mma_util.cuh"
#include "kernels/cuda/wgmma_util.cuh"

namespace tpserve::cuda {
namespace {

constexpr int kBN = 128;  // keys per tile
constexpr int kWarpgroup = 128;
constexpr float kLog2e = 1.4426950408889634f;

// Byte offset of 16-byte chunk `chunk` (8 elements of the head) of row `row` in a tile of kRows
// rows: 64-element column blocks of kRows x 128 bytes, each 128-byte swizzled.
template <int kRows>
__device__ __forceinline__ int TileOffset(int row, int chunk) {
  return (chunk / 8) * (kRows * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The bf16 K/V tile stages: two (the next tile loads while this one is computed), three when
// pipelined (tile t - 1's V is still read while tile t is computed and t + 1 loads); one for a
// quantized cache, whose codes and scales are staged twice instead.
template <typename Kv, bool kPipe>
inline constexpr int kTileStages = Kv::kQuantized ? 1 : (kPipe ? 3 : 2);

// Shared memory: Q (kBM rows), the bf16 K and V tile stages, a quantized cache's staged codes and
// scales, and 1 KB to align the start to the swizzle's 1024 bytes.
template <typename Kv, int kD, int kWgs, bool kPipe>
constexpr int WgmmaPrefillSmemBytes() {
  constexpr int kTile = kBN * kD * 2;
  constexpr int kQ = kWgs * 64 * kD * 2;
  constexpr int kBf16 = kQ + 2 * kTileStages<Kv, kPipe> * kTile;
  if constexpr (!Kv::kQuantized) return 1024 + kBf16;
  constexpr int kCodeTile = kBN * kD * Kv::kBits / 8;
  return 1024 + kBf16 + 4 * kCodeTile + 4 * kBN * 4;
}

template <typename Kv, int kD, int kWgs, bool kPipe>
__global__ void __launch_bounds__(kWgs* kWarpgroup, 1)
    PrefillWgmmaKernel(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k_cache,
                       const uint8_t* __restrict__ v_cache, const float* __restrict__ k_scales,
                       const float* __restrict__ v_scales, const int2* __restrict__ work,
                       const int32_t* __restrict__ query_start,
                       const int32_t* __restrict__ context_lens,
                       const int32_t* __restrict__ block_tables, int max_blocks_per_seq,
                       int block_size, int block_shift, int num_heads, int num_kv_heads,
                       float scale_log2, __nv_bfloat16* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kThreads = kWgs * kWarpgroup;
  constexpr int kBM = kWgs * 64;   // query rows per block
  constexpr int kChunks = kD / 8;  // 16-byte chunks of a bf16 row of the head
  constexpr bool kQuantized = Kv::kQuantized;
  constexpr int kStages = kTileStages<Kv, kPipe>;
  constexpr int kTileBytes = kBN * kD * 2;
  constexpr int kRowBytes = kD * Kv::kBits / 8;  // codes of one key's head
  constexpr int kCodeChunks = kRowBytes / 16;
  constexpr int kCodeTile = kBN * kRowBytes;
  static_assert(kD == 64 || kD == 128, "head_dim 64 or 128");
  static_assert(!kQuantized || kKvGroup<Kv, kD> == kD, "one scale a key and head");
  static_assert(!kQuantized || !kPipe, "the pipelined kernel reads bf16 caches");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023));
  uint8_t* q_s = smem;                         // [kD / 64][kBM][128 B]
  uint8_t* k_s = q_s + kBM * kD * 2;           // [kStages][kD / 64][kBN][128 B]
  uint8_t* v_s = k_s + kStages * kTileBytes;   // [kStages][kD / 64][kBN][128 B]
  uint8_t* kq_s = v_s + kStages * kTileBytes;  // quantized: codes [2][kBN][kRowBytes]
  uint8_t* vq_s = kq_s + 2 * kCodeTile;
  float* ksc_s = reinterpret_cast<float*>(vq_s + 2 * kCodeTile);  // scales [2][kBN]
  float* vsc_s = ksc_s + 2 * kBN;

  const int2 item = work[blockIdx.x];
  const int seq = item.x, q0 = item.y;
  const int head = blockIdx.y;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int row_begin = query_start[seq];
  const int qlen = query_start[seq + 1] - row_begin;
  const int ctx = context_lens[seq];
  const int prefix = ctx - qlen;  // keys cached before this step's queries
  const int q_last = min(q0 + kBM, qlen) - 1;
  const int num_tiles = (prefix + q_last + kBN) / kBN;
  const int32_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;
  const int tid = threadIdx.x, wg = tid / kWarpgroup, warp = (tid % kWarpgroup) / 32;
  const int lane = tid % 32;
  const int64_t q_stride = static_cast<int64_t>(num_heads) * kD;

  // Each thread copies one 16-byte chunk column of every kRowsPerPass-th row: the page lookup is
  // done once per row for K and V together.
  constexpr int kRowsPerPass = kThreads / kChunks;
  const int my_chunk = tid % kChunks, my_row = tid / kChunks;
#pragma unroll
  for (int j = 0; j < kBM / kRowsPerPass; ++j) {
    const int r = my_row + j * kRowsPerPass;
    const bool valid = q0 + r < qlen;  // rows past the query length are zero and never stored
    const __nv_bfloat16* src =
        valid ? q + (row_begin + q0 + r) * q_stride + head * kD + my_chunk * 8 : q;
    CpAsync16(SmemAddr(q_s + TileOffset<kBM>(r, my_chunk)), src, valid);
  }
  auto kv_row = [&](int key) -> int64_t {
    return key >= ctx ? 0 : KvPoolRow(table, key, block_size, block_shift, num_kv_heads, kv_head);
  };
  // bf16: the block-table entries of this thread's rows of the next tile to load, read one tile
  // ahead (fetch_pages(t + 2) right after tile t + 1's copies are issued), so that the copies do
  // not wait on a global load at the top of every tile.
  constexpr int kLoadRows = kBN / kRowsPerPass;
  int pages[kLoadRows];
  auto page_of = [&](int key) { return block_shift >= 0 ? key >> block_shift : key / block_size; };
  auto fetch_pages = [&](int tile) {
#pragma unroll
    for (int j = 0; j < kLoadRows; ++j) {
      const int key = tile * kBN + my_row + j * kRowsPerPass;
      pages[j] = key < ctx ? table[page_of(key)] : 0;
    }
  };
  // K and V of tile `tile` into its stage (bf16: the tiles, from `pages`; quantized: the codes
  // and scales).
  auto load_tile = [&](int tile) {
    const int key0 = tile * kBN;
    if constexpr (!kQuantized) {
      const auto* kc = reinterpret_cast<const __nv_bfloat16*>(k_cache);
      const auto* vc = reinterpret_cast<const __nv_bfloat16*>(v_cache);
      const int stage = tile % kStages;
#pragma unroll
      for (int j = 0; j < kLoadRows; ++j) {
        const int r = my_row + j * kRowsPerPass, key = key0 + r;
        const int in_page = key - page_of(key) * block_size;
        const int64_t row =
            (static_cast<int64_t>(pages[j]) * block_size + in_page) * num_kv_heads + kv_head;
        const int64_t off = key >= ctx ? 0 : row * kD + my_chunk * 8;
        const int dst = stage * kTileBytes + TileOffset<kBN>(r, my_chunk);
        CpAsync16(SmemAddr(k_s + dst), kc + off, key < ctx);
        CpAsync16(SmemAddr(v_s + dst), vc + off, key < ctx);
      }
    } else {
      const int stage = tile & 1;
      for (int i = tid; i < kBN * kCodeChunks; i += kThreads) {
        const int r = i / kCodeChunks, c = i % kCodeChunks, key = key0 + r;
        const int64_t off = kv_row(key) * kRowBytes + c * 16;
        const int dst = stage * kCodeTile + r * kRowBytes + c * 16;
        CpAsync16(SmemAddr(kq_s + dst), k_cache + off, key < ctx);
        CpAsync16(SmemAddr(vq_s + dst), v_cache + off, key < ctx);
      }
      for (int i = tid; i < kBN; i += kThreads) {
        const int key = key0 + i;
        const int64_t off = kv_row(key);
        CpAsync4(SmemAddr(ksc_s + stage * kBN + i), k_scales + off, key < ctx);
        CpAsync4(SmemAddr(vsc_s + stage * kBN + i), v_scales + off, key < ctx);
      }
    }
  };
  auto k_tile = [&](int t) { return k_s + (kQuantized ? 0 : (t % kStages) * kTileBytes); };
  auto v_tile = [&](int t) { return v_s + (kQuantized ? 0 : (t % kStages) * kTileBytes); };
  // The start of tile t: its loads (and Q's) have landed and are visible, every warpgroup is done
  // with the stage the next tile loads into, which starts loading; a quantized tile is decoded.
  auto begin_tile = [&](int t) {
    CpAsyncWait<0>();
    if constexpr (!kQuantized) FenceProxyAsync();  // cp.async wrote what wgmma reads
    __syncthreads();
    if (t + 1 < num_tiles) {
      load_tile(t + 1);
      CpAsyncCommit();
      if (!kQuantized && t + 2 < num_tiles) fetch_pages(t + 2);
    }
    if constexpr (kQuantized) {
      // Codes -> bf16 tiles, exact (every e4m3 and int8 value is a bf16 value).
      const uint8_t* kq = kq_s + (t & 1) * kCodeTile;
      const uint8_t* vq = vq_s + (t & 1) * kCodeTile;
      for (int i = tid; i < kBN * kChunks; i += kThreads) {
        const int r = i / kChunks, c = i % kChunks;
        const int src = r * kRowBytes + c * Kv::kBits;  // 8 elements: kBits bytes
        float f[8];
        Kv::Decode8(*reinterpret_cast<const typename Kv::Vec8*>(kq + src), f);
        *reinterpret_cast<Bf16x8*>(k_s + TileOffset<kBN>(r, c)) = FloatToBf16x8(f);
        Kv::Decode8(*reinterpret_cast<const typename Kv::Vec8*>(vq + src), f);
        *reinterpret_cast<Bf16x8*>(v_s + TileOffset<kBN>(r, c)) = FloatToBf16x8(f);
      }
      FenceProxyAsync();
      __syncthreads();
    }
  };
  if constexpr (!kQuantized) fetch_pages(0);
  load_tile(0);
  CpAsyncCommit();
  if (!kQuantized && num_tiles > 1) fetch_pages(1);

  float o[kD / 2];  // O, m64n(kD) accumulator layout
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
  float m_row[2] = {-INFINITY, -INFINITY};
  float l_row[2] = {0.0f, 0.0f};
  // This warpgroup's first row in the block, and this thread's two rows (query index within the
  // sequence): rows 16 warp + lane / 4 (+ 8) of the warpgroup's 64.
  const int wg_row0 = q0 + wg * 64;
  const int qi0 = wg_row0 + warp * 16 + lane / 4;
  const int qi1 = qi0 + 8;
  // Key tiles past the warpgroup's last query (all tiles when its rows are past the query
  // length) are masked whole for it: it still loads and synchronizes, but skips the math.
  const int wg_q_last = min(wg_row0 + 63, qlen - 1);
  const int wg_tiles = wg_q_last < wg_row0 ? 0 : min((prefix + wg_q_last) / kBN + 1, num_tiles);
  const uint8_t* q_wg = q_s + wg * 64 * 128;  // this warpgroup's rows in each column block

  // S = Q K^T for the warpgroup's 64 rows and tile t's 128 keys, issued and committed: s[4 n + e]
  // is row 16 warp + lane / 4 + 8 (e / 2), key 8 n + 2 (lane % 4) + e % 2.
  float s[kBN / 2];
  auto issue_s = [&](int t) {
    const uint8_t* kt = k_tile(t);
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) {
      s[i] = 0.0f;
      FenceReg(s[i]);
    }
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const int cb = (kk / 4) * 128, k16 = (kk % 4) * 32;  // column block, 16-element step
      Wgmma<kBN>::Run(s, SmemDesc(q_wg + cb * kBM + k16), SmemDesc(kt + cb * kBN + k16));
    }
    WgmmaCommit();
  };
  // P as wgmma A fragments: step kk covers keys 16 kk .. 16 kk + 15 (accumulator columns
  // n = 2 kk and 2 kk + 1). O += P V(t), issued and committed.
  uint32_t pa[kBN / 16][4];
  auto issue_pv = [&](int t) {
    const uint8_t* vt = v_tile(t);
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) FenceReg(o[i]);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      WgmmaRegA<kD>::Run(o, pa[kk], SmemDescMn(vt + kk * 16 * 128, kBN * 128));
    }
    WgmmaCommit();
  };
  // After the last group's wait: the accumulators are read again, and P's registers are live
  // until the MMAs have read them.
  auto fence_o = [&] {
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) FenceReg(o[i]);
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
#pragma unroll
      for (int e = 0; e < 4; ++e) FenceReg(pa[kk][e]);
    }
  };
  // Tile t's scores (S complete) -> the softmax weights in s, the running max and sum updated;
  // alpha: the rescaling of O. A quantized K: the scores times each key's scale first.
  // The row maximum is taken over the unscaled scores (scale_log2 > 0 keeps the order) and each
  // weight is exp2(s * scale_log2 - m) with one FFMA.
  float alpha[2];
  auto softmax = [&](int t) {
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) FenceReg(s[i]);
    if constexpr (kQuantized) {  // q.k = scale * (q . codes)
      const float* ksc = ksc_s + (t & 1) * kBN;
#pragma unroll
      for (int i = 0; i < kBN / 2; ++i) s[i] *= ksc[8 * (i / 4) + 2 * (lane % 4) + (i & 1)];
    }
    const int key0 = t * kBN;
    if (key0 + kBN - 1 > prefix + wg_row0 + warp * 16) {  // some key of the tile is masked
#pragma unroll
      for (int i = 0; i < kBN / 2; ++i) {
        const int key = key0 + 8 * (i / 4) + 2 * (lane % 4) + (i & 1);
        const int qi = (i & 2) ? qi1 : qi0;
        if (key > prefix + qi || key >= ctx) s[i] = -INFINITY;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n) {
        mx = fmaxf(mx, fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_row[r], mx * scale_log2);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      alpha[r] = exp2f(m_row[r] - m_use);
      m_row[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < kBN / 8; ++n) {
        const float p0 = exp2f(fmaf(s[4 * n + 2 * r], scale_log2, -m_use));
        const float p1 = exp2f(fmaf(s[4 * n + 2 * r + 1], scale_log2, -m_use));
        s[4 * n + 2 * r] = p0;
        s[4 * n + 2 * r + 1] = p1;
        sum += p0 + p1;
      }
      l_row[r] = l_row[r] * alpha[r] + sum;
    }
  };
  // O *= alpha (O complete), and P (bf16; a quantized V: times each key's scale) into pa.
  auto rescale_and_pack = [&](int t) {
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[4 * j + e] *= alpha[e / 2];
    }
    const float* vsc = vsc_s + (t & 1) * kBN;
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      float w0 = 1.0f, w1 = 1.0f, w2 = 1.0f, w3 = 1.0f;  // keys 2t, 2t + 1, 2t + 8, 2t + 9
      if constexpr (kQuantized) {
        const int key = kk * 16 + 2 * (lane % 4);
        w0 = vsc[key];
        w1 = vsc[key + 1];
        w2 = vsc[key + 8];
        w3 = vsc[key + 9];
      }
      const float* lo = s + 8 * kk;  // column block 2 kk
      const float* hi = lo + 4;      // column block 2 kk + 1
      pa[kk][0] = PackBf16x2(lo[0] * w0, lo[1] * w1);
      pa[kk][1] = PackBf16x2(lo[2] * w0, lo[3] * w1);
      pa[kk][2] = PackBf16x2(hi[0] * w2, hi[1] * w3);
      pa[kk][3] = PackBf16x2(hi[2] * w2, hi[3] * w3);
    }
  };

  if constexpr (!kPipe) {
    for (int t = 0; t < num_tiles; ++t) {
      begin_tile(t);
      if (t < wg_tiles) {  // uniform over the warpgroup, as wgmma requires
        issue_s(t);
        WgmmaWait<0>();
        softmax(t);
        rescale_and_pack(t);
        issue_pv(t);
        WgmmaWait<0>();
        fence_o();
      }
    }
  } else if (num_tiles > 0) {
    // Pipelined: tile t's S = Q K^T and tile t - 1's O += P V are in flight together, and the
    // softmax of tile t runs while the tensor cores do the P V.
    begin_tile(0);
    if (wg_tiles > 0) {
      issue_s(0);
      WgmmaWait<0>();
      softmax(0);
      rescale_and_pack(0);
    }
    for (int t = 1; t < num_tiles; ++t) {
      begin_tile(t);
      if (t < wg_tiles) {
        issue_s(t);
        issue_pv(t - 1);
        WgmmaWait<1>();  // S done, P V may still run
        softmax(t);
        WgmmaWait<0>();
        fence_o();
        rescale_and_pack(t);
      } else if (t == wg_tiles) {
        issue_pv(t - 1);
        WgmmaWait<0>();
        fence_o();
      }
    }
    if (wg_tiles == num_tiles) {
      issue_pv(num_tiles - 1);
      WgmmaWait<0>();
      fence_o();
    }
  }
  CpAsyncWait<0>();  // no copy outlives the block

  // Normalize and store (bf16 pairs).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_row[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int qi = r == 0 ? qi0 : qi1;
    if (qi < qlen) {
      __nv_bfloat16* dst = out + (row_begin + qi) * q_stride + head * kD + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        *reinterpret_cast<__nv_bfloat162*>(dst + j * 8) =
            __floats2bfloat162_rn(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
      }
    }
  }
#else
  __trap();  // built for sm_90a only (WgmmaPrefillFits checks the device)
#endif
}

template <typename Kv, int kD, int kWgs, bool kPipe>
void LaunchTyped(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                 int num_kv_heads, float scale, const DeviceBatch& b, Tensor out,
                 cudaStream_t stream) {
  constexpr int kSmem = WgmmaPrefillSmemBytes<Kv, kD, kWgs, kPipe>();
  static_assert(kSmem <= 227 * 1024, "shared memory of an sm_90 block");
  static bool configured = [] {
    TP_CUDA_CHECK(cudaFuncSetAttribute(PrefillWgmmaKernel<Kv, kD, kWgs, kPipe>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    return true;
  }();
  (void)configured;
  dim3 grid(b.num_prefill_work, num_heads);
  PrefillWgmmaKernel<Kv, kD, kWgs, kPipe><<<grid, kWgs * kWarpgroup, kSmem, stream>>>(
      q.ptr<const __nv_bfloat16>(), static_cast<const uint8_t*>(k_cache.data),
      static_cast<const uint8_t*>(v_cache.data), static_cast<const float*>(k_cache.scales),
      static_cast<const float*>(v_cache.scales), b.prefill_work, b.query_start, b.context_lens,
      b.block_tables, b.max_blocks_per_seq, b.block_size, KvBlockShift(b.block_size), num_heads,
      num_kv_heads, scale * kLog2e, out.ptr<__nv_bfloat16>());
  TP_CUDA_CHECK_LAUNCH();
}

// SetBatch cut the work list into tiles of PrefillTileM() rows: one warpgroup per 64.
template <typename Kv, int kD, bool kPipe>
void LaunchForTile(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                   int num_kv_heads, float scale, const DeviceBatch& b, Tensor out,
                   cudaStream_t stream) {
  if (PrefillTileM() == 64) {
    LaunchTyped<Kv, kD, 1, kPipe>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, out,
                                  stream);
  } else {
    LaunchTyped<Kv, kD, 2, kPipe>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, out,
                                  stream);
  }
}

template <typename Kv, bool kPipe>
void LaunchForHeadDim(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                      int num_kv_heads, int head_dim, float scale, const DeviceBatch& b, Tensor out,
                      cudaStream_t stream) {
  if (head_dim == 64) {
    LaunchForTile<Kv, 64, kPipe>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, out,
                                 stream);
  } else {
    LaunchForTile<Kv, 128, kPipe>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, out,
                                  stream);
  }
}

}  // namespace

bool WgmmaPrefillFits(DType kv, int head_dim) {
  if (head_dim != 64 && head_dim != 128) return false;
  if (kv != DType::kBF16 && kv != DType::kF8E4M3 && kv != DType::kI8) return false;
  return Sm90aSupported();
}

void LaunchAttentionPrefillWgmma(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                 int num_heads, int num_kv_heads, int head_dim, float scale,
                                 const DeviceBatch& b, Tensor out, bool pipelined,
                                 cudaStream_t stream) {
  TP_CHECK(WgmmaPrefillFits(k_cache.dtype, head_dim))
      << "wgmma prefill attention: KV dtype " << DTypeName(k_cache.dtype) << ", head_dim "
      << head_dim << " (needs bf16, fp8 or int8 at head_dim 64 or 128 on an sm_90 device)";
  switch (k_cache.dtype) {
    case DType::kBF16:
      if (pipelined) {
        LaunchForHeadDim<KvBf16, true>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                                       scale, b, out, stream);
      } else {
        LaunchForHeadDim<KvBf16, false>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                                        scale, b, out, stream);
      }
      break;
    case DType::kF8E4M3:  // quantized caches: the unpipelined kernel
      LaunchForHeadDim<KvF8E4M3, false>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                                        scale, b, out, stream);
      break;
    default:
      LaunchForHeadDim<KvI8, false>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale,
                                    b, out, stream);
      break;
  }
}

}  // namespace tpserve::cuda
