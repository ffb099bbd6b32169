// Prefill attention on Hopper's warpgroup MMA (TPSERVE_PREFILL_KERNEL=wgmma; sm_90a): the
// FlashAttention-2 algorithm of attention_prefill.cu with its two products on wgmma, as
// FlashAttention-3 does, so that the tensor cores read Q, K and V straight from shared memory
// instead of through ldmatrix into registers.
// - One block per (tile of PrefillTileM() query rows, head), heads first (PrefillGrid); one
//   consumer warpgroup per 64 rows (two for 128-row tiles). Every thread also copies: K and V
//   tiles of kBN = 128 keys are gathered from the paged cache with cp.async (two stages: the next
//   tile loads while this one is computed) into the 128-byte-swizzled layout wgmma reads
//   (wgmma_util.cuh); the block-table entries of a thread's rows are read a tile ahead of its
//   copies.
// - S = Q K^T: m64n128k16 with Q and K K-major in shared memory (head_dim / 16 steps).
// - The online softmax runs on the S accumulators in fp32 (log2 domain), as in the mma.sync
//   kernel; P is rounded to bf16 in registers, whose accumulator layout is wgmma's A-operand
//   layout, so O += P V is m64n(head_dim)k16 with A in registers and V MN-major (wgmma's
//   transpose of B) from the same [keys][head_dim] tile: kBN / 16 steps.
// - TPSERVE_PREFILL_KERNEL=wgmma-pipe (kPipe, bf16 caches): tile t's S and tile t - 1's P V are in
//   flight together and the softmax of tile t runs while the tensor cores do the P V
//   (FlashAttention-3's intra-warpgroup overlap); three K/V stages.
// - TPSERVE_PREFILL_KERNEL=wgmma-ws (PrefillWgmmaWsKernel, bf16 caches): the pipelined consumers
//   fed by a producer warp through an mbarrier ring of 64-key tiles (below); wgmma-tma: the same
//   with the producer loading whole pages by TMA (block sizes that are multiples of 8 dividing
//   64), so that one thread's few instructions a page feed the ring instead of a warp's cp.async.
// - TPSERVE_PREFILL_KERNEL=wgmma-fa3 (PrefillWgmmaFa3Kernel, bf16 caches): FlashAttention-3's
//   structure, a producer warpgroup (TMA pages, block sizes that are multiples of 8 dividing 128)
//   that gives its registers to two consumer warpgroups (setmaxnreg), which compute 128-key tiles
//   from a 3-stage ring; wgmma-fa3pp: the same with the consumers' MMAs in ping-pong turns;
//   wgmma-fa3p: wgmma-fa3 on a persistent grid (below).
// - A quantized cache with one scale per key and head (fp8, int8): the codes and scales are
//   staged with cp.async and decoded into the bf16 tiles (exact), the K scale multiplies each
//   score and the V scale each softmax weight before its rounding, as in the mma.sync kernel.
//   int4 caches (two scale groups a head at head_dim 128) run the mma.sync kernel.
// Same inputs, masking and roundings as the mma.sync kernel (scores in fp32, P rounded once to
// bf16), except that the sums run in another order and exp2's argument is one FFMA: results agree
// with it to fp32 rounding, not bit for bit.
#include <algorithm>

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

// Byte offset of 16-byte chunk `chunk` (8 elements of the head) of row `row` in a tile of kRows
// rows: 64-element column blocks of kRows x 128 bytes, each 128-byte swizzled.
template <int kRows>
__device__ __forceinline__ int TileOffset(int row, int chunk) {
  return (chunk / 8) * (kRows * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

// A 3-D TMA load of the box at (c0, c1, c2) into shared memory, completing on `bar`.
__device__ __forceinline__ void TmaLoad3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                          int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(SmemAddrOf(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddrOf(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// The bf16 K/V tile stages of PrefillWgmmaKernel: two (the next tile loads while this one is
// computed), three when pipelined (tile t - 1's V is still read while tile t is computed and
// t + 1 loads); one for a quantized cache, whose codes and scales are staged twice.
template <typename Kv, bool kPipe>
inline constexpr int kTileStages = Kv::kQuantized ? 1 : (kPipe ? 3 : 2);

// The warp-specialized kernel's tiles: 64 keys (S is 32 registers a thread, so two consumer
// warpgroups and the producer warp fit the 168 registers a thread of a 288-thread block: nine
// warps put three on a register-file quarter), in a ring of 4 stages.
constexpr int kWsKeys = 64;
constexpr int kWsStages = 4;

// The producer warp of the warp-specialized kernels (wgmma-ws, -tma, -fa3). Its view of one
// block: the sequence's block-table row, the context, the KV head, the K/V tile ring of kStages
// tiles of kKeys keys (TileOffset<kKeys> layout) and its full / empty mbarriers.
template <int kD, int kKeys, int kStages>
struct KvTileProducer {
  static constexpr int kChunks = kD / 8;
  static constexpr int kTileBytes = kKeys * kD * 2;
  const __nv_bfloat16* k_cache;
  const __nv_bfloat16* v_cache;
  const int32_t* table;  // the sequence's block-table row
  int ctx, block_size, block_shift, num_kv_heads, kv_head;
  uint8_t* k_s;
  uint8_t* v_s;
  uint64_t* full;
  uint64_t* empty;

  __device__ __forceinline__ KvTileProducer(const __nv_bfloat16* k_cache,
                                            const __nv_bfloat16* v_cache, const int32_t* table,
                                            int ctx, int block_size, int block_shift,
                                            int num_kv_heads, int kv_head, uint8_t* k_s,
                                            uint8_t* v_s, uint64_t* full, uint64_t* empty)
      : k_cache(k_cache),
        v_cache(v_cache),
        table(table),
        ctx(ctx),
        block_size(block_size),
        block_shift(block_shift),
        num_kv_heads(num_kv_heads),
        kv_head(kv_head),
        k_s(k_s),
        v_s(v_s),
        full(full),
        empty(empty) {}

  // Chunk c of row r of the tile at stage s whose first key is key0 by cp.async, zeros past ctx.
  __device__ __forceinline__ void CopyChunk(int s, int key0, int r, int c) const {
    const int key = key0 + r;
    const int64_t off =
        key >= ctx
            ? 0
            : KvPoolRow(table, key, block_size, block_shift, num_kv_heads, kv_head) * kD + c * 8;
    const int dst = s * kTileBytes + TileOffset<kKeys>(r, c);
    CpAsync16(SmemAddr(k_s + dst), k_cache + off, key < ctx);
    CpAsync16(SmemAddr(v_s + dst), v_cache + off, key < ctx);
  }
  // Waits until the consumers released stage t % kStages (from the second round of the ring).
  __device__ __forceinline__ void AwaitStage(int t) const {
    if (t >= kStages) MbarWait(&empty[t % kStages], ((t / kStages) & 1) ^ 1);
  }

  // The TMA feed (lane = the warp's lane). Pages of block_size keys (a multiple of 8 dividing
  // kKeys): a page wholly before ctx is one TMA box of block_size rows x 128 bytes per 64-column
  // block of K and of V, which the 128-byte swizzle writes as TileOffset lays rows out (a page
  // starts at a multiple of 8 rows of a 1024-byte-aligned tile); lane 0 posts the tile's bytes
  // on `full` and issues the boxes. The rows from the first page reaching past ctx on are copied
  // by the warp with cp.async, zeros past ctx (a box would bring a page's stale rows, and 0 x NaN
  // is NaN in P V), so every `full` phase takes 33 arrivals: the warp's 32 cp.async arrivals and
  // lane 0's. Lane j < kKeys / block_size reads the block-table entry of page j of the next tile
  // while this one is issued. g0: the tiles this ring carried before (a persistent block's
  // earlier work items), which place tile t at ring position g0 + t. The caller waits for the
  // warp's copies (cp.async.wait_all) before the warp exits.
  __device__ __forceinline__ void RunTma(const CUtensorMap* k_map, const CUtensorMap* v_map,
                                         int num_tiles, int lane, int g0 = 0) const {
    const int pages = kKeys / block_size;  // <= 16
    auto table_entry = [&](int tile) {
      const int key = tile * kKeys + lane * block_size;
      return lane < pages && key < ctx ? table[tile * pages + lane] : 0;
    };
    int next = num_tiles > 0 ? table_entry(0) : 0;
    for (int t = 0; t < num_tiles; ++t) {
      const int s = (g0 + t) % kStages;
      const int entry = next;
      if (t + 1 < num_tiles) next = table_entry(t + 1);
      AwaitStage(g0 + t);
      const int key0 = t * kKeys;
      const int whole = min(max((ctx - key0) / block_size, 0), pages);  // pages before ctx
      if (lane == 0) MbarExpectTx(&full[s], whole * 2 * block_size * kD * 2);
      for (int p = 0; p < whole; ++p) {
        const int row = __shfl_sync(0xffffffffu, entry, p) * block_size;
        if (lane == 0) {
#pragma unroll
          for (int cb = 0; cb < kD / 64; ++cb) {
            const int dst = s * kTileBytes + cb * (kKeys * 128) + p * block_size * 128;
            TmaLoad3d(k_s + dst, k_map, &full[s], cb * 64, kv_head, row);
            TmaLoad3d(v_s + dst, v_map, &full[s], cb * 64, kv_head, row);
          }
        }
      }
      for (int i = lane; i < (kKeys - whole * block_size) * kChunks; i += 32) {
        CopyChunk(s, key0, whole * block_size + i / kChunks, i % kChunks);
      }
      CpAsyncArriveNoinc(&full[s]);
    }
  }
};

// Shared memory: Q (kBM rows), the bf16 K and V tile stages, a quantized cache's staged codes and
// scales, and 1 KB to align the start to the swizzle's 1024 bytes.
template <typename Kv, int kD, int kWgs, bool kPipe, bool kWs>
constexpr int WgmmaPrefillSmemBytes() {
  constexpr int kQ = kWgs * 64 * kD * 2;
  if constexpr (kWs) return 1024 + kQ + 2 * kWsStages * kWsKeys * kD * 2;
  constexpr int kTile = kBN * kD * 2;
  constexpr int kBf16 = kQ + 2 * kTileStages<Kv, kPipe> * kTile;
  if constexpr (!Kv::kQuantized) return 1024 + kBf16;
  constexpr int kCodeTile = kBN * kD * Kv::kBits / 8;
  return 1024 + kBf16 + 4 * kCodeTile + 4 * kBN * 4;
}

// What a block's work item means for it: the sequence, its query tile and its key tiles.
struct PrefillItem {
  int seq, q0, row_begin, qlen, ctx, prefix, num_tiles;
};
template <int kBM, int kKeys>
__device__ __forceinline__ PrefillItem ReadItem(const int2* work, int item,
                                                const int32_t* query_start,
                                                const int32_t* context_lens) {
  PrefillItem it;
  const int2 w = work[item];
  it.seq = w.x;
  it.q0 = w.y;
  it.row_begin = query_start[it.seq];
  it.qlen = query_start[it.seq + 1] - it.row_begin;
  it.ctx = context_lens[it.seq];
  it.prefix = it.ctx - it.qlen;  // keys cached before this step's queries
  const int q_last = min(it.q0 + kBM, it.qlen) - 1;
  it.num_tiles = (it.prefix + q_last + kKeys) / kKeys;
  return it;
}

// One consumer warpgroup's 64 query rows over tiles of kKeys keys: the S and O accumulators, P,
// the running max and sum, and the tile loop. Tile t's bf16 K and V are at stage t % kStages of
// k_s / v_s; a quantized cache's scales at stage t % 2 of ksc_s / vsc_s.
template <typename Kv, int kD, int kBM, int kKeys, int kStages>
struct WgConsumer {
  static constexpr bool kQuantized = Kv::kQuantized;
  static constexpr int kTileBytes = kKeys * kD * 2;
  const uint8_t* q_wg;  // this warpgroup's rows in each column block of Q
  const uint8_t* k_s;
  const uint8_t* v_s;
  const float* ksc_s;
  const float* vsc_s;
  int lane, warp, wg_row0, qi0, qi1, prefix, ctx, wg_tiles;
  int stage0;  // the ring position of tile 0 (a persistent block's earlier items; 0 from Init)
  float scale_log2;
  float
      s[kKeys / 2];  // S: s[4 n + e] is row 16 warp + lane / 4 + 8 (e / 2), key 8 n + 2 (lane % 4)
                     // + e % 2
  float o[kD / 2];   // O, the same layout over the head's dims
  uint32_t pa[kKeys / 16][4];  // P as wgmma A fragments: step kk covers keys 16 kk .. 16 kk + 15
  float m_row[2], l_row[2], alpha[2];

  __device__ __forceinline__ void Init(const PrefillItem& it, int wg, const uint8_t* q_s) {
    const int tid = threadIdx.x % kWarpgroup;
    lane = tid % 32;
    warp = tid / 32;
    wg_row0 = it.q0 + wg * 64;
    qi0 = wg_row0 + warp * 16 + lane / 4;
    qi1 = qi0 + 8;
    prefix = it.prefix;
    ctx = it.ctx;
    // Key tiles past the warpgroup's last query (all tiles when its rows are past the query
    // length) are masked whole for it: it skips their math.
    const int wg_q_last = min(wg_row0 + 63, it.qlen - 1);
    wg_tiles = wg_q_last < wg_row0 ? 0 : min((prefix + wg_q_last) / kKeys + 1, it.num_tiles);
    q_wg = q_s + wg * 64 * 128;
    stage0 = 0;
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
    m_row[0] = m_row[1] = -INFINITY;
    l_row[0] = l_row[1] = 0.0f;
  }

  // S = Q K^T of tile t, issued and committed. The first step overwrites S (scale-d 0) instead
  // of adding to zeros, which saves the kKeys / 2 moves a thread that zeroed it.
  __device__ __forceinline__ void IssueS(int t) {
    const uint8_t* kt = k_s + ((stage0 + t) % kStages) * kTileBytes;
#pragma unroll
    for (int i = 0; i < kKeys / 2; ++i) FenceReg(s[i]);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const int cb = (kk / 4) * 128, k16 = (kk % 4) * 32;  // column block, 16-element step
      Wgmma<kKeys>::Run(s, SmemDesc(q_wg + cb * kBM + k16), SmemDesc(kt + cb * kKeys + k16),
                        kk == 0 ? 0 : 1);
    }
    WgmmaCommit();
  }
  // O += P V(t), issued and committed.
  __device__ __forceinline__ void IssuePv(int t) {
    const uint8_t* vt = v_s + ((stage0 + t) % kStages) * kTileBytes;
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) FenceReg(o[i]);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      WgmmaRegA<kD>::Run(o, pa[kk], SmemDescMn(vt + kk * 16 * 128, kKeys * 128));
    }
    WgmmaCommit();
  }
  // After the last group's wait: O is read again, and P's registers stay live until the MMAs
  // have read them.
  __device__ __forceinline__ void FenceO() {
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) FenceReg(o[i]);
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
#pragma unroll
      for (int e = 0; e < 4; ++e) FenceReg(pa[kk][e]);
    }
  }
  // Tile t's scores (S complete) -> the softmax weights in s, the running max and sum updated,
  // alpha the rescaling of O. A quantized K: the scores times each key's scale first. The row
  // maximum is taken over the unscaled scores (scale_log2 > 0 keeps the order) and each weight
  // is exp2(s * scale_log2 - m) with one FFMA.
  __device__ __forceinline__ void Softmax(int t) {
#pragma unroll
    for (int i = 0; i < kKeys / 2; ++i) FenceReg(s[i]);
    if constexpr (kQuantized) {  // q.k = scale * (q . codes)
      const float* ksc = ksc_s + (t & 1) * kKeys;
#pragma unroll
      for (int i = 0; i < kKeys / 2; ++i) s[i] *= ksc[8 * (i / 4) + 2 * (lane % 4) + (i & 1)];
    }
    const int key0 = t * kKeys;
    if (key0 + kKeys - 1 > prefix + wg_row0 + warp * 16) {  // some key of the tile is masked
#pragma unroll
      for (int i = 0; i < kKeys / 2; ++i) {
        const int key = key0 + 8 * (i / 4) + 2 * (lane % 4) + (i & 1);
        const int qi = (i & 2) ? qi1 : qi0;
        if (key > prefix + qi || key >= ctx) s[i] = -INFINITY;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
        mx = fmaxf(mx, fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_row[r], mx * scale_log2);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      alpha[r] = Exp2Ftz(m_row[r] - m_use);
      m_row[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
        const float p0 = Exp2Ftz(fmaf(s[4 * n + 2 * r], scale_log2, -m_use));
        const float p1 = Exp2Ftz(fmaf(s[4 * n + 2 * r + 1], scale_log2, -m_use));
        s[4 * n + 2 * r] = p0;
        s[4 * n + 2 * r + 1] = p1;
        sum += p0 + p1;
      }
      l_row[r] = l_row[r] * alpha[r] + sum;
    }
  }
  // O *= alpha (O complete), and P (bf16; a quantized V: times each key's scale) into pa.
  __device__ __forceinline__ void RescaleAndPack(int t) {
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[4 * j + e] *= alpha[e / 2];
    }
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      float w0 = 1.0f, w1 = 1.0f, w2 = 1.0f, w3 = 1.0f;  // keys 2t, 2t + 1, 2t + 8, 2t + 9
      if constexpr (kQuantized) {
        const float* vsc = vsc_s + (t & 1) * kKeys;
        const int key = kk * 16 + 2 * (lane % 4);
        w0 = vsc[key];
        w1 = vsc[key + 1];
        w2 = vsc[key + 8];
        w3 = vsc[key + 9];
      }
      const float* lo = s + 8 * kk;  // column block 2 kk
      const float* hi = lo + 4;      // column block 2 kk + 1
      pa[kk][0] = PackBf16(lo[0] * w0, lo[1] * w1);
      pa[kk][1] = PackBf16(lo[2] * w0, lo[3] * w1);
      pa[kk][2] = PackBf16(hi[0] * w2, hi[1] * w3);
      pa[kk][3] = PackBf16(hi[2] * w2, hi[3] * w3);
    }
  }

  // The tile loop. acquire(t) runs first for every tile (the block's loads and barriers; a wait
  // for the tile where it is computed), release(t) once this warpgroup is done with tile t's
  // stage (also for the tiles it skips). kPipe: tile t's S and tile t - 1's P V are in flight
  // together, and the softmax of tile t runs while the tensor cores do the P V; its MMAs are
  // issued in num_tiles + 1 turns (turn t: S(t) and P V(t - 1), the last one P V(num_tiles - 1);
  // a turn whose tiles the warpgroup skips issues nothing), each between begin_turn() and
  // end_turn(), which run for every turn of every warpgroup (the ping-pong schedule counts on it).
  template <bool kPipe, typename Acquire, typename Release>
  __device__ __forceinline__ void Run(int num_tiles, Acquire&& acquire, Release&& release) {
    Run<kPipe>(
        num_tiles, acquire, release, [] {}, [] {});
  }
  template <bool kPipe, typename Acquire, typename Release, typename BeginTurn, typename EndTurn>
  __device__ __forceinline__ void Run(int num_tiles, Acquire&& acquire, Release&& release,
                                      BeginTurn&& begin_turn, EndTurn&& end_turn) {
    if constexpr (!kPipe) {
      for (int t = 0; t < num_tiles; ++t) {
        acquire(t);
        if (t < wg_tiles) {  // uniform over the warpgroup, as wgmma requires
          IssueS(t);
          WgmmaWait<0>();
          Softmax(t);
          RescaleAndPack(t);
          IssuePv(t);
          WgmmaWait<0>();
          FenceO();
        }
        release(t);
      }
    } else if (num_tiles > 0) {
      acquire(0);
      begin_turn();
      if (wg_tiles > 0) {
        IssueS(0);
        end_turn();
        WgmmaWait<0>();
        Softmax(0);
        RescaleAndPack(0);
      } else {
        end_turn();
        release(0);
      }
      for (int t = 1; t < num_tiles; ++t) {
        acquire(t);
        begin_turn();
        if (t < wg_tiles) {
          IssueS(t);
          IssuePv(t - 1);
          end_turn();
          WgmmaWait<1>();  // S done, P V may still run
          Softmax(t);
          WgmmaWait<0>();
          FenceO();
          release(t - 1);
          RescaleAndPack(t);
        } else if (t == wg_tiles) {
          IssuePv(t - 1);
          end_turn();
          WgmmaWait<0>();
          FenceO();
          release(t - 1);
          release(t);
        } else {
          end_turn();
          release(t);
        }
      }
      begin_turn();
      if (wg_tiles == num_tiles) {
        IssuePv(num_tiles - 1);
        end_turn();
        WgmmaWait<0>();
        FenceO();
        release(num_tiles - 1);
      } else {
        end_turn();
      }
    }
  }

  // Normalize and store this thread's two rows (bf16 pairs); rows past the query length are not
  // stored.
  __device__ __forceinline__ void Store(const PrefillItem& it, int head, int num_heads,
                                        __nv_bfloat16* __restrict__ out) const {
    const int64_t q_stride = static_cast<int64_t>(num_heads) * kD;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_row[r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      const int qi = r == 0 ? qi0 : qi1;
      if (qi < it.qlen) {
        __nv_bfloat16* dst = out + (it.row_begin + qi) * q_stride + head * kD + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) {
          *reinterpret_cast<__nv_bfloat162*>(dst + j * 8) =
              __floats2bfloat162_rn(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        }
      }
    }
  }
};

// Q's rows of the block (zeros past the query length), copied by threads [0, kCopiers) with
// cp.async into the swizzled layout.
template <int kD, int kBM, int kCopiers>
__device__ __forceinline__ void CopyQ(const __nv_bfloat16* __restrict__ q, const PrefillItem& it,
                                      int head, int num_heads, uint8_t* q_s, int ctid) {
  constexpr int kChunks = kD / 8;
  const int64_t q_stride = static_cast<int64_t>(num_heads) * kD;
#pragma unroll 4
  for (int i = ctid; i < kBM * kChunks; i += kCopiers) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = it.q0 + r < it.qlen;
    const __nv_bfloat16* src =
        valid ? q + (it.row_begin + it.q0 + r) * q_stride + head * kD + c * 8 : q;
    CpAsync16(SmemAddr(q_s + TileOffset<kBM>(r, c)), src, valid);
  }
}

// Every thread of the block copies (cp.async into the swizzled tiles, one __syncthreads a tile)
// and each warpgroup computes its 64 rows. kPipe: bf16 caches only.
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

  const PrefillBlock blk = PrefillBlockOf();
  const PrefillItem it = ReadItem<kBM, kBN>(work, blk.item, query_start, context_lens);
  const int num_tiles = it.num_tiles, ctx = it.ctx;
  const int head = blk.head;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int32_t* table = block_tables + static_cast<int64_t>(it.seq) * max_blocks_per_seq;
  const int tid = threadIdx.x;

  // Each thread copies one 16-byte chunk column of every kRowsPerPass-th row: the page lookup is
  // done once per row for K and V together.
  constexpr int kRowsPerPass = kThreads / kChunks;
  const int my_chunk = tid % kChunks, my_row = tid / kChunks;
  CopyQ<kD, kBM, kThreads>(q, it, head, num_heads, q_s, tid);
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

  WgConsumer<Kv, kD, kBM, kBN, kStages> c;
  c.k_s = k_s;
  c.v_s = v_s;
  c.ksc_s = ksc_s;
  c.vsc_s = vsc_s;
  c.scale_log2 = scale_log2;
  c.Init(it, tid / kWarpgroup, q_s);
  c.template Run<kPipe>(num_tiles, begin_tile, [](int) {});
  CpAsyncWait<0>();  // no copy outlives the block
  c.Store(it, head, num_heads, out);
#else
  __trap();  // built for sm_90a only (WgmmaPrefillFits checks the device)
#endif
}

// Warp-specialized (TPSERVE_PREFILL_KERNEL=wgmma-ws, bf16 caches): one producer warp copies Q
// and a ring of kWsStages K/V tiles of kWsKeys keys with cp.async, each stage's completion
// counted on its `full` mbarrier (every copier's noinc arrival); the consumer warpgroups wait on
// it and release the stage through its `empty` mbarrier (every consumer thread arrives, also for
// the tiles a warpgroup skips), so the warpgroups are not held in lockstep by block barriers
// and one's softmax can run beside the other's MMAs. The consumers are pipelined (kPipe).
template <int kD, int kWgs, bool kPipe, bool kTma>
__global__ void __launch_bounds__(kWgs* kWarpgroup + 32, 1)
    PrefillWgmmaWsKernel(const __grid_constant__ CUtensorMap k_map,
                         const __grid_constant__ CUtensorMap v_map,
                         const __nv_bfloat16* __restrict__ q,
                         const __nv_bfloat16* __restrict__ k_cache,
                         const __nv_bfloat16* __restrict__ v_cache, const int2* __restrict__ work,
                         const int32_t* __restrict__ query_start,
                         const int32_t* __restrict__ context_lens,
                         const int32_t* __restrict__ block_tables, int max_blocks_per_seq,
                         int block_size, int block_shift, int num_heads, int num_kv_heads,
                         float scale_log2, __nv_bfloat16* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kConsumers = kWgs * kWarpgroup;
  constexpr int kBM = kWgs * 64;
  constexpr int kChunks = kD / 8;
  constexpr int kStages = kWsStages;
  constexpr int kTileBytes = kWsKeys * kD * 2;
  static_assert(kD == 64 || kD == 128, "head_dim 64 or 128");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023));
  uint8_t* q_s = smem;
  uint8_t* k_s = q_s + kBM * kD * 2;
  uint8_t* v_s = k_s + kStages * kTileBytes;
  __shared__ __align__(8) uint64_t full[kStages];
  __shared__ __align__(8) uint64_t empty[kStages];
  __shared__ __align__(8) uint64_t q_full;

  const PrefillBlock blk = PrefillBlockOf();
  const PrefillItem it = ReadItem<kBM, kWsKeys>(work, blk.item, query_start, context_lens);
  const int num_tiles = it.num_tiles, ctx = it.ctx;
  const int head = blk.head;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      // The producer's 32 cp.async arrivals; with TMA also lane 0's expect_tx arrival.
      MbarInit(&full[s], kTma ? 33 : 32);
      MbarInit(&empty[s], kConsumers);
    }
    MbarInit(&q_full, 32);
    FenceMbarrierInit();
  }
  __syncthreads();

  if (tid >= kConsumers) {
    // The producer warp: lane l copies chunk column l % kChunks of every (32 / kChunks)-th row.
    const int ptid = tid - kConsumers;
    CopyQ<kD, kBM, 32>(q, it, head, num_heads, q_s, ptid);
    CpAsyncArriveNoinc(&q_full);
    const KvTileProducer<kD, kWsKeys, kStages> producer(
        k_cache, v_cache, block_tables + static_cast<int64_t>(it.seq) * max_blocks_per_seq, ctx,
        block_size, block_shift, num_kv_heads, head / (num_heads / num_kv_heads), k_s, v_s, full,
        empty);
    if constexpr (kTma) {
      producer.RunTma(&k_map, &v_map, num_tiles, ptid);
      asm volatile("cp.async.wait_all;" ::: "memory");  // the consumers wait for the TMA loads
      return;
    }
    constexpr int kRowsPerPass = 32 / kChunks;
    const int my_chunk = ptid % kChunks, my_row = ptid / kChunks;
    for (int t = 0; t < num_tiles; ++t) {
      producer.AwaitStage(t);
#pragma unroll 8
      for (int j = 0; j < kWsKeys / kRowsPerPass; ++j) {
        producer.CopyChunk(t % kStages, t * kWsKeys, my_row + j * kRowsPerPass, my_chunk);
      }
      CpAsyncArriveNoinc(&full[t % kStages]);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");  // no copy outlives the block
    return;
  }

  WgConsumer<KvBf16, kD, kBM, kWsKeys, kStages> c;
  c.k_s = k_s;
  c.v_s = v_s;
  c.ksc_s = nullptr;
  c.vsc_s = nullptr;
  c.scale_log2 = scale_log2;
  c.Init(it, tid / kWarpgroup, q_s);
  MbarWait(&q_full, 0);
  FenceProxyAsync();
  c.template Run<kPipe>(
      num_tiles,
      // Every tile is waited for, also one the warpgroup skips: an empty barrier counts
      // arrivals, not tiles, so a warpgroup that released tile t + kStages before the other
      // released tile t would complete the phase of tile t early, and the producer would refill
      // a stage still being read.
      [&](int t) {
        MbarWait(&full[t % kStages], (t / kStages) & 1);
        FenceProxyAsync();  // cp.async wrote the tile through the generic proxy
      },
      [&](int t) { MbarArrive(&empty[t % kStages]); });
  c.Store(it, head, num_heads, out);
#else
  __trap();  // built for sm_90a only (WgmmaPrefillFits checks the device)
#endif
}

// FlashAttention-3's block structure (TPSERVE_PREFILL_KERNEL=wgmma-fa3 / wgmma-fa3pp, bf16
// caches, block sizes that are multiples of 8 dividing kBN: Fa3Pages). A block of kWgs consumer
// warpgroups (threads [0, 128 kWgs)) and one producer warpgroup (the last 128 threads):
// - with two consumer warpgroups (384 threads, __launch_bounds__(384, 1): ptxas allocates 168
//   registers a thread at launch) the producer warpgroup drops to kFa3ProducerRegs registers and
//   the consumers rise to kFa3ConsumerRegs (setmaxnreg), so that they hold 128-key tiles: S is 64
//   floats a thread, O 64 at d 128, P 32 registers (the pipelined consumer took 215 registers in
//   wgmma-pipe). 56 / 224 rather than FlashAttention-3's 24 / 240: the producer's Q copy and
//   cp.async tail rows spilled at 24 and 40 registers, the consumers fit 224. One consumer
//   warpgroup (256 threads) has up to 255 registers a thread from the launch bounds and skips
//   the reallocation;
// - the producer warpgroup's 128 threads copy Q (cp.async, q_full counts their 128 noinc
//   arrivals); then warps 1-3 exit and warp 0 feeds a ring of kFa3Stages stages of kBN-key K and
//   V tiles as wgmma-tma's producer warp does: lane 0 posts a tile's TMA bytes on its `full`
//   barrier and issues 2 x kD / 64 boxes a page wholly before ctx, the warp copies the rows of
//   the tile from the first page reaching past ctx with cp.async (zeros past ctx) and every lane
//   arrives on `full` when its copies land (33 arrivals a phase); lanes 0 .. pages - 1 (pages =
//   kBN / block_size <= 16) read the next tile's block-table entries while this one is issued;
// - the consumers are the pipelined WgConsumer (kPipe) over kBN-key tiles; every consumer thread
//   waits for every tile's `full` phase and arrives on its `empty` barrier (count 128 kWgs), also
//   for the tiles its warpgroup skips (see the wgmma-ws kernel for why).
// kPingPong (wgmma-fa3pp, two consumer warpgroups): FlashAttention-3's inter-warpgroup schedule.
// The warpgroups issue their MMAs in alternating turns (WgConsumer::Run's num_tiles + 1 turns
// each, skipped tiles included, so the counts match): warpgroup w syncs on named barrier 1 + w
// (256 threads) before a turn's MMAs and arrives on the other's barrier after issuing them, so one
// warpgroup's softmax runs while the other's MMAs have the tensor cores. Warpgroup 1 arrives on
// barrier 1 once at the start (warpgroup 0 goes first) and not after its last turn, so both
// barriers end with every phase complete.
// kPersistent (wgmma-fa3p, without ping-pong): one block an SM loops over (work item, head)
// pairs of PrefillGrid's heads-first order, one a round in snake order (index_of). At 2048 tokens
// about a quarter of wgmma-fa3's warp time is once-a-block work (ncu, H200, 2026-12-06: the
// consumers waiting for an empty ring, the producer's register release, the last P V and the
// store) that no other block's MMAs overlap. Here the registers are reallocated once, warp 0's
// ring runs on across items (tile t of an item with g earlier tiles is ring position g + t, for
// the stages and for the `full` / `empty` phases), so the next item's first tiles load while the
// consumers finish and store this one, and warps 1-3 stay to copy each item's Q once the
// consumers arrive on `q_empty` (after their last wgmma of the previous item); `q_full`'s phase
// is the item's parity.
constexpr int kFa3ProducerRegs = 56;
constexpr int kFa3ConsumerRegs = 224;
static_assert(kWarpgroup * kFa3ProducerRegs + 2 * kWarpgroup * kFa3ConsumerRegs <= 65536,
              "setmaxnreg: the three warpgroups' registers fit the register file");
static_assert(kFa3ProducerRegs <= 168 && kFa3ConsumerRegs >= 168 &&
                  kWarpgroup * (168 - kFa3ProducerRegs) >=
                      2 * kWarpgroup * (kFa3ConsumerRegs - 168),
              "setmaxnreg: what the producer frees at 168 registers a thread covers the increases");

// Shared memory of the FA3 kernel: Q, kStages K and V tiles of kBN keys, 1 KB for the alignment.
template <int kD, int kWgs, int kStages>
constexpr int Fa3SmemBytes() {
  return 1024 + kWgs * 64 * kD * 2 + 2 * kStages * kBN * kD * 2;
}
// Three stages where they fit with 1 KB to spare under the 227 KB of a block (d 128 with two
// consumer warpgroups: 225 KB, as wgmma-pipe), else two.
template <int kD, int kWgs>
inline constexpr int kFa3Stages = Fa3SmemBytes<kD, kWgs, 3>() <= 226 * 1024 ? 3 : 2;

template <int kD, int kWgs, bool kPingPong, bool kPersistent>
__global__ void __launch_bounds__((kWgs + 1) * kWarpgroup, 1)
    PrefillWgmmaFa3Kernel(const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map,
                          const __nv_bfloat16* __restrict__ q,
                          const __nv_bfloat16* __restrict__ k_cache,
                          const __nv_bfloat16* __restrict__ v_cache, const int2* __restrict__ work,
                          const int32_t* __restrict__ query_start,
                          const int32_t* __restrict__ context_lens,
                          const int32_t* __restrict__ block_tables, int max_blocks_per_seq,
                          int block_size, int block_shift, int num_heads, int num_kv_heads,
                          int num_items, float scale_log2, __nv_bfloat16* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kConsumers = kWgs * kWarpgroup;
  constexpr int kBM = kWgs * 64;
  constexpr int kStages = kFa3Stages<kD, kWgs>;
  constexpr int kTileBytes = kBN * kD * 2;
  constexpr bool kRealloc = kWgs == 2;
  // The persistent block's Q copiers: the producer warpgroup's warps 1-3 (warp 0 feeds the ring).
  constexpr int kQCopiers = kPersistent ? kWarpgroup - 32 : kWarpgroup;
  static_assert(kD == 64 || kD == 128, "head_dim 64 or 128");
  static_assert(kWgs == 1 || kWgs == 2, "one or two consumer warpgroups");
  static_assert(!(kPingPong && kPersistent), "the persistent grid runs without ping-pong");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023));
  uint8_t* q_s = smem;                        // [kD / 64][kBM][128 B]
  uint8_t* k_s = q_s + kBM * kD * 2;          // [kStages][kD / 64][kBN][128 B]
  uint8_t* v_s = k_s + kStages * kTileBytes;  // [kStages][kD / 64][kBN][128 B]
  __shared__ __align__(8) uint64_t full[kStages];
  __shared__ __align__(8) uint64_t empty[kStages];
  __shared__ __align__(8) uint64_t q_full;
  __shared__ __align__(8) uint64_t q_empty;  // kPersistent: the consumers are done with Q

  // The block's work: its grid position's item and head (PrefillGrid), or, persistent, one
  // (item, head) pair i of the heads-first order (item i / num_heads, head i % num_heads) in each
  // round r of gridDim.x pairs, in snake order (block b takes pair b of an even round, pair
  // gridDim.x - 1 - b of an odd one): over SetBatch's heaviest-first list that balances the
  // blocks as the hardware's dispatch of a grid would (a list-scheduling model of a 2048-token
  // prefill: 34 tile-times a block, ideal 33, where a plain stride gives 40). Index: the pair of
  // round r, -2 when this round has none for the block (the last), -1 past the end.
  auto index_of = [&](int r) {
    if constexpr (!kPersistent) {
      return r == 0 ? 0 : -1;
    } else {
      const int rows = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
      const int base = r * rows;
      if (base >= num_items) return -1;
      const int i = base + ((r & 1) ? rows - 1 - b : b);
      return i < num_items ? i : -2;
    }
  };
  // f(item, head) for each of the block's work items, in order.
  auto for_each_item = [&](auto&& f) {
    for (int r = 0;; ++r) {
      const int i = index_of(r);
      if (i == -1) break;
      if (i < 0) continue;
      if constexpr (kPersistent) {
        f(ReadItem<kBM, kBN>(work, i / num_heads, query_start, context_lens), i % num_heads);
      } else {
        const PrefillBlock blk = PrefillBlockOf();
        f(ReadItem<kBM, kBN>(work, blk.item, query_start, context_lens), blk.head);
      }
    }
  };
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&full[s], 33);  // the producer warp's 32 cp.async arrivals and lane 0's expect_tx
      MbarInit(&empty[s], kConsumers);
    }
    MbarInit(&q_full, kQCopiers);
    if constexpr (kPersistent) MbarInit(&q_empty, kConsumers);
    FenceMbarrierInit();
  }
  __syncthreads();  // the last block-wide barrier: the producer's warps exit below

  if (tid >= kConsumers) {
    if constexpr (kRealloc) WarpgroupRegDealloc<kFa3ProducerRegs>();
    const int ptid = tid - kConsumers;
    if (ptid == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&k_map)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&v_map)) : "memory");
    }
    if (!kPersistent || ptid >= 32) {
      // Q: the whole warpgroup once (then warps 1-3 exit), or, persistent, warps 1-3 for each
      // item once the consumers are done with the previous one's.
      int j = 0;
      for_each_item([&](const PrefillItem& it, int head) {
        if (j++ > 0) MbarWait(&q_empty, (j - 2) & 1);
        CopyQ<kD, kBM, kQCopiers>(q, it, head, num_heads, q_s, kPersistent ? ptid - 32 : ptid);
        CpAsyncArriveNoinc(&q_full);
      });
      if (ptid >= 32) {
        asm volatile("cp.async.wait_all;" ::: "memory");
        return;
      }
    }
    // Warp 0: the TMA feed over kBN-key tiles (page sizes that are multiples of 8 dividing kBN:
    // up to 16 pages a tile), every item's tiles through the one ring.
    int g = 0;  // tiles fed before this item
    for_each_item([&](const PrefillItem& it, int head) {
      const KvTileProducer<kD, kBN, kStages> producer(
          k_cache, v_cache, block_tables + static_cast<int64_t>(it.seq) * max_blocks_per_seq,
          it.ctx, block_size, block_shift, num_kv_heads, head / (num_heads / num_kv_heads), k_s,
          v_s, full, empty);
      producer.RunTma(&k_map, &v_map, it.num_tiles, ptid, g);
      g += it.num_tiles;
    });
    asm volatile("cp.async.wait_all;" ::: "memory");  // the consumers wait for the TMA loads
    return;
  }

  if constexpr (kRealloc) WarpgroupRegAlloc<kFa3ConsumerRegs>();
  const int wg = tid / kWarpgroup;
  WgConsumer<KvBf16, kD, kBM, kBN, kStages> c;
  c.k_s = k_s;
  c.v_s = v_s;
  c.ksc_s = nullptr;
  c.vsc_s = nullptr;
  c.scale_log2 = scale_log2;
  int g = 0, j = 0;  // tiles consumed before this item, items before it
  for_each_item([&](const PrefillItem& it, int head) {
    const int num_tiles = it.num_tiles;
    c.Init(it, wg, q_s);
    c.stage0 = g % kStages;
    // The consumers' waits end in a fault, not a trap, past their deadline (MbarWaitNoTrap says
    // why); a producer stuck on an `empty` barrier still traps.
    MbarWaitNoTrap(&q_full, j & 1);
    FenceProxyAsync();
    // Every tile is waited for, also one the warpgroup skips (the wgmma-ws kernel says why).
    auto acquire = [&](int t) {
      MbarWaitNoTrap(&full[(g + t) % kStages], ((g + t) / kStages) & 1);
      FenceProxyAsync();  // the tail rows came by cp.async, through the generic proxy
    };
    auto release = [&](int t) { MbarArrive(&empty[(g + t) % kStages]); };
    if constexpr (kPingPong && kWgs == 2) {
      // Named barriers 1 (warpgroup 0's turns) and 2 (warpgroup 1's). Both warpgroups take
      // num_tiles + 1 turns (Run issues none when num_tiles is 0, and neither arrives then).
      const int turns = num_tiles > 0 ? num_tiles + 1 : 0;
      int turn = 0;
      if (wg == 1 && turns > 0) NamedBarrierArrive(1, 2 * kWarpgroup);  // warpgroup 0 goes first
      c.template Run<true>(
          num_tiles, acquire, release, [&] { NamedBarrierSync(1 + wg, 2 * kWarpgroup); },
          [&] {
            ++turn;
            if (wg == 0 || turn < turns) NamedBarrierArrive(2 - wg, 2 * kWarpgroup);
          });
    } else {
      c.template Run<true>(num_tiles, acquire, release);
    }
    // Run waited for every wgmma of the item: Q may be overwritten while this one is stored.
    if constexpr (kPersistent) MbarArrive(&q_empty);
    c.Store(it, head, num_heads, out);
    g += num_tiles;
    ++j;
  });
#else
  __trap();  // built for sm_90a only (WgmmaPrefillFits checks the device)
#endif
}

// The TMA descriptor of a bf16 cache [blocks, block_size, num_kv_heads, d] read a page of one
// head at a time: boxes of 64 elements x 1 head x block_size rows, 128-byte swizzled.
CUtensorMap KvPageMap(const Tensor& cache, int block_size, int num_kv_heads, int d) {
  CUtensorMap map;
  const int64_t rows = cache.numel() / (int64_t{num_kv_heads} * d);
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(num_kv_heads),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(d) * 2,
                                 static_cast<cuuint64_t>(num_kv_heads) * d * 2};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(block_size)};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r =
      EncodeTiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, cache.data, dims, strides, box, elem,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TP_CHECK(r == CUDA_SUCCESS) << "cuTensorMapEncodeTiled failed (" << static_cast<int>(r)
                              << ") for a KV cache of " << rows << " rows x " << num_kv_heads
                              << " heads x " << d;
  return map;
}

// Whether the TMA producer reads pages of this size (a multiple of 8 rows dividing the tile).
bool TmaPages(int block_size) { return block_size % 8 == 0 && kWsKeys % block_size == 0; }

// Whether the FA3 kernel's producer reads pages of this size (a multiple of 8 rows dividing kBN).
bool Fa3Pages(int block_size) { return block_size % 8 == 0 && kBN % block_size == 0; }

template <int kD, int kWgs, bool kPingPong, bool kPersistent>
void LaunchFa3Typed(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                    int num_kv_heads, float scale, const DeviceBatch& b, Tensor out,
                    cudaStream_t stream) {
  constexpr int kSmem = Fa3SmemBytes<kD, kWgs, kFa3Stages<kD, kWgs>>();
  static_assert(kSmem <= 227 * 1024 - 64, "shared memory of an sm_90 block");
  auto kernel = PrefillWgmmaFa3Kernel<kD, kWgs, kPingPong, kPersistent>;
  static bool configured = [&] {
    TP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    if constexpr (kWgs == 2) {
      // setmaxnreg.inc waits for registers the decrease freed: the arithmetic above assumes 168
      // a thread at launch (what ptxas allocates under __launch_bounds__(384, 1)).
      cudaFuncAttributes attr{};
      TP_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
      TP_CHECK(attr.numRegs == 168) << "wgmma-fa3: " << attr.numRegs
                                    << " registers a thread at launch, setmaxnreg assumes 168";
    }
    return true;
  }();
  (void)configured;
  const CUtensorMap k_map = KvPageMap(k_cache, b.block_size, num_kv_heads, kD);
  const CUtensorMap v_map = KvPageMap(v_cache, b.block_size, num_kv_heads, kD);
  // Persistent: one block an SM (one fits: __launch_bounds__(..., 1) and the shared memory),
  // fewer when there are fewer work items x heads.
  const int num_items = b.num_prefill_work * num_heads;
  dim3 grid = PrefillGrid(b, num_heads);
  if constexpr (kPersistent) grid = dim3(std::min(num_items, CurrentDeviceSms()));
  kernel<<<grid, (kWgs + 1) * kWarpgroup, kSmem, stream>>>(
      k_map, v_map, q.ptr<const __nv_bfloat16>(), k_cache.ptr<const __nv_bfloat16>(),
      v_cache.ptr<const __nv_bfloat16>(), b.prefill_work, b.query_start, b.context_lens,
      b.block_tables, b.max_blocks_per_seq, b.block_size, KvBlockShift(b.block_size), num_heads,
      num_kv_heads, num_items, scale * kLog2e, out.ptr<__nv_bfloat16>());
  TP_CUDA_CHECK_LAUNCH();
}

// SetBatch cut the work list into tiles of PrefillTileM() rows: one consumer warpgroup per 64.
template <bool kPingPong, bool kPersistent>
void LaunchFa3For(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                  int num_kv_heads, int head_dim, float scale, const DeviceBatch& b, Tensor out,
                  cudaStream_t stream) {
  const bool tile64 = PrefillTileM() == 64;
  if (head_dim == 64) {
    if (tile64) {
      LaunchFa3Typed<64, 1, kPingPong, kPersistent>(q, k_cache, v_cache, num_heads, num_kv_heads,
                                                    scale, b, out, stream);
    } else {
      LaunchFa3Typed<64, 2, kPingPong, kPersistent>(q, k_cache, v_cache, num_heads, num_kv_heads,
                                                    scale, b, out, stream);
    }
  } else if (tile64) {
    LaunchFa3Typed<128, 1, kPingPong, kPersistent>(q, k_cache, v_cache, num_heads, num_kv_heads,
                                                   scale, b, out, stream);
  } else {
    LaunchFa3Typed<128, 2, kPingPong, kPersistent>(q, k_cache, v_cache, num_heads, num_kv_heads,
                                                   scale, b, out, stream);
  }
}

template <typename Kv, int kD, int kWgs, bool kPipe, bool kWs, bool kTma = false>
void LaunchTyped(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                 int num_kv_heads, float scale, const DeviceBatch& b, Tensor out,
                 cudaStream_t stream) {
  constexpr int kSmem = WgmmaPrefillSmemBytes<Kv, kD, kWgs, kPipe, kWs>();
  static_assert(kSmem <= 227 * 1024 - 64, "shared memory of an sm_90 block");
  const dim3 grid = PrefillGrid(b, num_heads);
  if constexpr (kWs) {
    static_assert(!Kv::kQuantized, "the warp-specialized kernel reads bf16 caches");
    auto kernel = PrefillWgmmaWsKernel<kD, kWgs, kPipe, kTma>;
    static bool configured = [&] {
      TP_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
      return true;
    }();
    (void)configured;
    CUtensorMap k_map{}, v_map{};  // unused by the cp.async producer
    if constexpr (kTma) {
      k_map = KvPageMap(k_cache, b.block_size, num_kv_heads, kD);
      v_map = KvPageMap(v_cache, b.block_size, num_kv_heads, kD);
    }
    kernel<<<grid, kWgs * kWarpgroup + 32, kSmem, stream>>>(
        k_map, v_map, q.ptr<const __nv_bfloat16>(), k_cache.ptr<const __nv_bfloat16>(),
        v_cache.ptr<const __nv_bfloat16>(), b.prefill_work, b.query_start, b.context_lens,
        b.block_tables, b.max_blocks_per_seq, b.block_size, KvBlockShift(b.block_size), num_heads,
        num_kv_heads, scale * kLog2e, out.ptr<__nv_bfloat16>());
  } else {
    auto kernel = PrefillWgmmaKernel<Kv, kD, kWgs, kPipe>;
    static bool configured = [&] {
      TP_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
      return true;
    }();
    (void)configured;
    kernel<<<grid, kWgs * kWarpgroup, kSmem, stream>>>(
        q.ptr<const __nv_bfloat16>(), static_cast<const uint8_t*>(k_cache.data),
        static_cast<const uint8_t*>(v_cache.data), static_cast<const float*>(k_cache.scales),
        static_cast<const float*>(v_cache.scales), b.prefill_work, b.query_start, b.context_lens,
        b.block_tables, b.max_blocks_per_seq, b.block_size, KvBlockShift(b.block_size), num_heads,
        num_kv_heads, scale * kLog2e, out.ptr<__nv_bfloat16>());
  }
  TP_CUDA_CHECK_LAUNCH();
}

// SetBatch cut the work list into tiles of PrefillTileM() rows: one warpgroup per 64.
template <typename Kv, bool kPipe, bool kWs, bool kTma = false>
void LaunchFor(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
               int num_kv_heads, int head_dim, float scale, const DeviceBatch& b, Tensor out,
               cudaStream_t stream) {
  const bool tile64 = PrefillTileM() == 64;
  if (head_dim == 64) {
    if (tile64) {
      LaunchTyped<Kv, 64, 1, kPipe, kWs, kTma>(q, k_cache, v_cache, num_heads, num_kv_heads, scale,
                                               b, out, stream);
    } else {
      LaunchTyped<Kv, 64, 2, kPipe, kWs, kTma>(q, k_cache, v_cache, num_heads, num_kv_heads, scale,
                                               b, out, stream);
    }
  } else if (tile64) {
    LaunchTyped<Kv, 128, 1, kPipe, kWs, kTma>(q, k_cache, v_cache, num_heads, num_kv_heads, scale,
                                              b, out, stream);
  } else {
    LaunchTyped<Kv, 128, 2, kPipe, kWs, kTma>(q, k_cache, v_cache, num_heads, num_kv_heads, scale,
                                              b, out, stream);
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
                                 const DeviceBatch& b, Tensor out, PrefillKernel kernel,
                                 cudaStream_t stream) {
  TP_CHECK(WgmmaPrefillFits(k_cache.dtype, head_dim) && kernel != PrefillKernel::kMma)
      << "wgmma prefill attention: KV dtype " << DTypeName(k_cache.dtype) << ", head_dim "
      << head_dim << " (needs bf16, fp8 or int8 at head_dim 64 or 128 on an sm_90 device)";
  switch (k_cache.dtype) {
    case DType::kBF16:
      if ((kernel == PrefillKernel::kWgmmaFa3 || kernel == PrefillKernel::kWgmmaFa3Pp ||
           kernel == PrefillKernel::kWgmmaFa3P) &&
          Fa3Pages(b.block_size)) {
        if (kernel == PrefillKernel::kWgmmaFa3Pp) {
          LaunchFa3For<true, false>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale,
                                    b, out, stream);
        } else if (kernel == PrefillKernel::kWgmmaFa3P) {
          LaunchFa3For<false, true>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale,
                                    b, out, stream);
        } else {
          LaunchFa3For<false, false>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale,
                                     b, out, stream);
        }
      } else if (kernel == PrefillKernel::kWgmmaTma && TmaPages(b.block_size)) {
        LaunchFor<KvBf16, true, true, true>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                                            scale, b, out, stream);
      } else if (kernel == PrefillKernel::kWgmmaWs || kernel == PrefillKernel::kWgmmaTma) {
        LaunchFor<KvBf16, true, true>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale,
                                      b, out, stream);
      } else if (kernel == PrefillKernel::kWgmmaPipe) {
        LaunchFor<KvBf16, true, false>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                                       scale, b, out, stream);
      } else {  // wgmma, and wgmma-fa3 / -fa3pp / -fa3p at block sizes Fa3Pages does not take
        LaunchFor<KvBf16, false, false>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                                        scale, b, out, stream);
      }
      break;
    case DType::kF8E4M3:  // 8-bit caches: the kernel without pipelining or producer warp
      LaunchFor<KvF8E4M3, false, false>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                                        scale, b, out, stream);
      break;
    default:
      LaunchFor<KvI8, false, false>(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale,
                                    b, out, stream);
      break;
  }
}

}  // namespace tpserve::cuda
