// Decode attention over the paged KV cache (one query per sequence), flash-decoding style:
// the context is cut into partitions (DecodePartition keys), one block per (partition, group
// of G query heads sharing a KV head, sequence). Each block writes its partial result (output,
// softmax max and sum) to the workspace; the last block of a (sequence, head group) to finish,
// found with an arrival counter, merges the partials into the output, so a step is one kernel.
// K and V are each read once (bf16: 16-byte loads; a quantized cache, kv_read.cuh: 8-byte fp8 /
// int8 or 4-byte int4 loads of codes, decoded in registers, the scale folded into each lane's
// partial dot product and into the softmax weight of V); fp32 math. The grid depends only on
// (num_seqs, max_blocks_per_seq), so a decode step can be captured in a CUDA graph and
// replayed for any context lengths up to that capacity.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/env.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/kv_quant.cuh"  // CheckKvCaches
#include "kernels/cuda/kv_read.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/mma_util.cuh"
#include "kernels/head_dims.h"

namespace tpserve::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kSub = 64;  // keys whose K and V are in flight at once (sub-tile kernel)
constexpr int kMaxTwoPhasePartition = 512;
constexpr int kMaxMmaPartition = 1024;
constexpr int kTokenGroup = kDecodeTokenGroup;  // tokens a group (deterministic prefill)
// The mma kernel's largest split for kG heads a block (its scores and the int4 V scales of a
// split are in static shared memory: 48 KB).
constexpr int MmaMaxPartition(int g) { return g <= 4 ? kMaxMmaPartition : kMaxTwoPhasePartition; }

// A block's (split, head group, sequence) in the launch's grid order (DecodeGrid):
// kDecodeSplitMajor (splits, groups, seqs), kDecodeSeqMajor (seqs, groups, splits) or
// kDecodeHeadMajor (groups, seqs, splits).
enum DecodeOrder { kDecodeSplitMajor = 0, kDecodeSeqMajor = 1, kDecodeHeadMajor = 2 };
struct DecodeBlock {
  int split, group, seq, num_splits;
};
__device__ __forceinline__ DecodeBlock DecodeBlockIndex(int order) {
  if (order == kDecodeSeqMajor) {
    return {static_cast<int>(blockIdx.z), static_cast<int>(blockIdx.y),
            static_cast<int>(blockIdx.x), static_cast<int>(gridDim.z)};
  }
  if (order == kDecodeHeadMajor) {
    return {static_cast<int>(blockIdx.z), static_cast<int>(blockIdx.x),
            static_cast<int>(blockIdx.y), static_cast<int>(gridDim.z)};
  }
  return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z),
          static_cast<int>(gridDim.x)};
}

// Writes zeros for the kG heads of a padding sequence (context 0).
template <int kD, int kG>
__device__ void WriteZeroRows(int64_t q_row, int num_heads, int head0,
                              __nv_bfloat16* __restrict__ out) {
  for (int i = threadIdx.x; i < kG * kD; i += kThreads) {
    out[(q_row * num_heads + head0) * kD + i] = __float2bfloat16(0.0f);
  }
}

// Sums acc (this thread's kE columns of o for each head, over its token lane's keys) over the
// block's token lanes into o_s in a fixed order: lanes of a warp by shuffles, then the four
// warps pairwise through o_s and `spare`, a dead kG x kD buffer. Float atomics here added in
// arrival order, so one step could give different bits from run to run, and greedy decoding
// of a model with near-ties different tokens.
template <int kD, int kG, int kE = 8>
__device__ __forceinline__ void SumTokenLanes(float (&acc)[kG][kE], float (*o_s)[kD],
                                              float (*spare)[kD]) {
  static_assert(kThreads == 128, "four warps");
  constexpr int kLanesPerToken = kD / kE;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, chunk = tid % kLanesPerToken;
#pragma unroll
  for (int o = kLanesPerToken; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
    }
  }
  const bool holder = lane < kLanesPerToken;  // one lane per column chunk holds the warp's sum
  auto store = [&](float(*buf)[kD]) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
#pragma unroll
      for (int e = 0; e < kE; ++e) buf[g][chunk * kE + e] = acc[g][e];
    }
  };
  auto add = [&](float(*buf)[kD]) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[g][e] += buf[g][chunk * kE + e];
    }
  };
  __syncthreads();
  if (holder && warp == 2) store(spare);
  if (holder && warp == 3) store(o_s);
  __syncthreads();
  if (holder && warp == 0) add(spare);
  if (holder && warp == 1) add(o_s);
  __syncthreads();
  if (holder && warp == 1) store(spare);
  __syncthreads();
  if (holder && warp == 0) {
    add(spare);
    store(o_s);
  }
  __syncthreads();
}

// The query tokens of a block. A decode launch has one (kQ = 1): the block's sequence. A
// token-group launch (deterministic mode's prefill, DeviceBatch::token_groups) has up to kQ
// consecutive query tokens of one sequence, each with its own context: the block's columns are
// (token i, head g) = column i kG + g, and every column's arithmetic is the one a decode block
// of that single token does. For token i: its row in q and out, its record slot in the
// workspace, its context and its splits (`used`; 0 for a missing token).
template <int kQ>
struct SplitTokens {
  int64_t q_row[kQ];
  int slot[kQ];
  int ctx[kQ];
  int used[kQ];
  int used_max;       // splits of the longest context: the blocks that arrive at `counter`
  unsigned* counter;  // the (tokens, head group) arrival counter
};

// One split's partial (its max ms, sum ls, numerator o: this lane's kD / 32 elements) folded
// into a running merge (online softmax rescaling; every operation rounded explicitly so that no
// call site contracts differently). The first fold of a run starts from m = -inf, den = num = 0.
template <int kD>
__device__ __forceinline__ void FoldSplit(float& m_run, float& den, float (&num)[kD / 32], float ms,
                                          float ls, const float (&o)[kD / 32]) {
  constexpr int kVec = kD / 32;
  const float m_new = fmaxf(m_run, ms);
  const float a = exp2f(__fsub_rn(m_run, m_new)), b = exp2f(__fsub_rn(ms, m_new));
  den = __fadd_rn(__fmul_rn(den, a), __fmul_rn(ls, b));
#pragma unroll
  for (int e = 0; e < kVec; ++e) num[e] = __fadd_rn(__fmul_rn(num[e], a), __fmul_rn(o[e], b));
  m_run = m_new;
}

// The four folds of a column combined in fold order and written (lane l: elements
// [l kD / 32, (l + 1) kD / 32)). A fold without splits has m = -inf.
template <int kD>
__device__ __forceinline__ void CombineFolds(const float (&fm)[4], const float (&fden)[4],
                                             const float (&fnum)[4][kD / 32], int lane,
                                             __nv_bfloat16* __restrict__ out) {
  constexpr int kVec = kD / 32, kFolds = 4;
  float m = -INFINITY;
#pragma unroll
  for (int v = 0; v < kFolds; ++v) m = fmaxf(m, fm[v]);
  float total_den = 0.0f, total_num[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) total_num[e] = 0.0f;
#pragma unroll
  for (int v = 0; v < kFolds; ++v) {
    if (fm[v] == -INFINITY) continue;  // a fold without splits
    const float f = exp2f(__fsub_rn(fm[v], m));
    total_den = __fadd_rn(total_den, __fmul_rn(fden[v], f));
#pragma unroll
    for (int e = 0; e < kVec; ++e) total_num[e] = __fadd_rn(total_num[e], __fmul_rn(fnum[v][e], f));
  }
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    out[lane * kVec + e] =
        __float2bfloat16(total_den > 0.0f ? __fdiv_rn(total_num[e], total_den) : 0.0f);
  }
}

// One column's merge by one warp (FinishSplit's kColumnMerge): lane l holds elements
// [l kVec, (l + 1) kVec); four folds v = 0..3 take splits v, v + 4, ... in order (FoldSplit),
// then are combined in fold order (CombineFolds). The bf16 mma kernel's split loop
// (kLoopSplits) folds each split as it finishes, with the same helpers: the same bits.
template <int kD>
__device__ __forceinline__ void MergeColumn(const float* __restrict__ rec, int used, int lane,
                                            __nv_bfloat16* __restrict__ out) {
  constexpr int kVec = kD / 32, kFolds = 4;
  float fm[kFolds], fden[kFolds], fnum[kFolds][kVec];
#pragma unroll
  for (int v = 0; v < kFolds; ++v) {
    float m_run = -INFINITY, den = 0.0f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) fnum[v][e] = 0.0f;
#pragma unroll 4
    for (int s = v; s < used; s += kFolds) {
      const float* r = rec + s * (kD + 2);
      const float ms = __ldcg(r + kD), ls = __ldcg(r + kD + 1);
      float o[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) o[e] = __ldcg(r + lane * kVec + e);
      FoldSplit<kD>(m_run, den, fnum[v], ms, ls, o);
    }
    fm[v] = m_run;
    fden[v] = den;
  }
  CombineFolds<kD>(fm, fden, fnum, lane, out);
}

// A token whose context fits one split: an element of its output, normalized directly (no merge).
__device__ __forceinline__ __nv_bfloat16 SingleSplitOut(float o, float l) {
  return __float2bfloat16(l > 0.0f ? o / l : 0.0f);
}

// The end of every split: o_s holds sum_t p_t v_t (p relative to m_s), l_s the sum of p, per
// column. A token whose context fits one partition is normalized and written directly.
// Otherwise the partial goes to the workspace record [slot][head][split]; the block that arrives
// last at the counter merges each token's `used` partials and resets the counter for the next
// launch (threadfence reduction: each block's records are visible before its arrival is
// counted). kColumnMerge (the bf16 mma kernel, whose blocks have up to 16 columns): a warp
// merges whole columns (w, w + 4, ...), folding the splits in the same order and with the same
// arithmetic (MergeColumn) whether a block has one column or sixteen.
template <int kD, int kG, int kQ, bool kColumnMerge = false>
__device__ void FinishSplit(const float (&o_s)[kG * kQ][kD], const float* m_s, const float* l_s,
                            const SplitTokens<kQ>& tk, int split, int num_splits, int head0,
                            int num_heads, float* __restrict__ records,
                            __nv_bfloat16* __restrict__ out) {
  constexpr int kC = kG * kQ;
  __shared__ bool last_s;
  const int tid = threadIdx.x;
  for (int i = tid; i < kC * kD; i += kThreads) {
    const int c = i / kD, d = i % kD, t = kQ == 1 ? 0 : c / kG, g = c % kG;
    if (tk.used[t] != 1 || split != 0) continue;
    const float l = l_s[c];
    out[(tk.q_row[t] * num_heads + head0 + g) * kD + d] = SingleSplitOut(o_s[c][d], l);
  }
  if (tk.used_max <= 1) return;
  for (int i = tid; i < kC * (kD + 2); i += kThreads) {
    const int c = i / (kD + 2), j = i % (kD + 2), t = kQ == 1 ? 0 : c / kG, g = c % kG;
    if (tk.used[t] <= 1 || split >= tk.used[t]) continue;
    const int64_t rec =
        (static_cast<int64_t>(tk.slot[t]) * num_heads + head0 + g) * num_splits + split;
    const float v = j < kD ? o_s[c][j] : (j == kD ? m_s[c] : l_s[c]);
    records[rec * (kD + 2) + j] = v;
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    unsigned arrived = atomicAdd(tk.counter, 1u) + 1;
    last_s = arrived == static_cast<unsigned>(tk.used_max);
    if (last_s) atomicExch(tk.counter, 0u);
  }
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  if constexpr (kColumnMerge) {
    const int warp = tid / 32, lane = tid % 32;
    for (int c = warp; c < kC; c += kThreads / 32) {
      const int t = kQ == 1 ? 0 : c / kG, g = c % kG, used = tk.used[t];
      if (used <= 1) continue;  // warp-uniform
      const float* rec = records + (static_cast<int64_t>(tk.slot[t]) * num_heads + head0 + g) *
                                       num_splits * (kD + 2);
      MergeColumn<kD>(rec, used, lane, out + (tk.q_row[t] * num_heads + head0 + g) * kD);
    }
    return;
  }
  // Merge, one column at a time: warp w folds splits w, w + 4, ... (online softmax rescaling,
  // the loads of several splits in flight), lane l holds elements [l * kVec, (l + 1) * kVec);
  // then the four warps' results are combined through shared memory.
  constexpr int kWarpsPerBlock = kThreads / 32;
  constexpr int kVec = kD / 32;
  __shared__ float warp_m[kWarpsPerBlock], warp_den[kWarpsPerBlock];
  __shared__ float warp_num[kWarpsPerBlock][kD];
  const int warp = tid / 32, lane = tid % 32;
  for (int c = 0; c < kC; ++c) {
    const int t = kQ == 1 ? 0 : c / kG, g = c % kG, used = tk.used[t];
    if (used <= 1) continue;  // block-uniform
    const float* rec = records + (static_cast<int64_t>(tk.slot[t]) * num_heads + head0 + g) *
                                     num_splits * (kD + 2);
    float m_run = -INFINITY, den = 0.0f, num[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) num[e] = 0.0f;
#pragma unroll 4
    for (int s = warp; s < used; s += kWarpsPerBlock) {
      const float* r = rec + s * (kD + 2);
      float ms = __ldcg(r + kD), ls = __ldcg(r + kD + 1), o[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) o[e] = __ldcg(r + lane * kVec + e);
      float m_new = fmaxf(m_run, ms);
      float a = exp2f(m_run - m_new), b = exp2f(ms - m_new);  // a = 0 on the first split
      den = den * a + ls * b;
#pragma unroll
      for (int e = 0; e < kVec; ++e) num[e] = num[e] * a + o[e] * b;
      m_run = m_new;
    }
    if (lane == 0) {
      warp_m[warp] = m_run;
      warp_den[warp] = den;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) warp_num[warp][lane * kVec + e] = num[e];
    __syncthreads();
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarpsPerBlock; ++w) m = fmaxf(m, warp_m[w]);
    for (int d = tid; d < kD; d += kThreads) {
      float total_num = 0.0f, total_den = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarpsPerBlock; ++w) {
        if (warp_m[w] == -INFINITY) continue;  // a warp without splits
        float f = exp2f(warp_m[w] - m);
        total_num += warp_num[w][d] * f;
        total_den += warp_den[w] * f;
      }
      out[(tk.q_row[t] * num_heads + head0 + g) * kD + d] =
          __float2bfloat16(total_den > 0.0f ? total_num / total_den : 0.0f);
    }
    __syncthreads();  // warp_* are rewritten for the next column
  }
}

// A token-group block's tokens (grid (splits, head groups x kTokenGroup / kQ, groups of the
// launch)): tokens first .. first + kQ - 1 of group z, first = (y % (kTokenGroup / kQ)) kQ. The
// token arrays and the groups' first tokens are local to the launch's chunk of token queries,
// so a token's index is its record slot; the counter is its first token's. kGlobal (a launch of
// every chunk's groups, without records): the token arrays are the whole step's, and a group's
// first token is its chunk's first plus its own (the chunk is in the count's upper half). False:
// the block has no token (a short group).
template <int kQ, bool kGlobal = false>
__device__ __forceinline__ bool GroupTokens(const int2* __restrict__ groups, int y, int z,
                                            const int32_t* __restrict__ query_start,
                                            const int32_t* __restrict__ context_lens, int partition,
                                            int num_groups, unsigned* __restrict__ counters,
                                            SplitTokens<kQ>& tk, int& group, int& seq) {
  constexpr int kSubs = kTokenGroup / kQ;
  static_assert(kTokenGroup % kQ == 0, "a group is whole blocks");
  group = y / kSubs;
  const int2 grp = groups[z];
  const int first = (y % kSubs) * kQ;  // of the group's tokens
  const int count = grp.y & 0xffff;
  seq = grp.x + first + (kGlobal ? (grp.y >> 16) * kDecodeQueryChunk : 0);
  tk.used_max = 0;
#pragma unroll
  for (int i = 0; i < kQ; ++i) {
    const bool has = first + i < count;
    const int t = seq + i;
    tk.q_row[i] = has ? query_start[t] : 0;
    tk.slot[i] = t;
    tk.ctx[i] = has ? context_lens[t] : -1;
    tk.used[i] = has ? (tk.ctx[i] + partition - 1) / partition : 0;
    tk.used_max = max(tk.used_max, tk.used[i]);
  }
  tk.counter = counters + static_cast<int64_t>(seq) * num_groups + group;
  return first < count;
}

// A decode block's one token: sequence `seq` of the launch, its (sequence, head group) counter.
__device__ __forceinline__ SplitTokens<1> OneToken(int64_t q_row, int seq, int ctx, int partition,
                                                   int group, int num_groups,
                                                   unsigned* __restrict__ counters) {
  SplitTokens<1> tk;
  tk.q_row[0] = q_row;
  tk.slot[0] = seq;
  tk.ctx[0] = ctx;
  tk.used[0] = tk.used_max = (ctx + partition - 1) / partition;
  tk.counter = counters + static_cast<int64_t>(seq) * num_groups + group;
  return tk;
}

// The longest context of the block's tokens.
template <int kQ>
__device__ __forceinline__ int MaxContext(const SplitTokens<kQ>& tk) {
  int ctx_max = 0;
#pragma unroll
  for (int i = 0; i < kQ; ++i) ctx_max = max(ctx_max, tk.ctx[i]);
  return ctx_max;
}

// The keys of split `split` of a context of ctx_max: the first (start) and how many (n). False:
// the split starts past the context.
__device__ __forceinline__ bool SplitRange(int split, int partition, int ctx_max, int& start,
                                           int& n) {
  start = split * partition;
  if (start >= ctx_max) return false;
  n = min(partition, ctx_max - start);
  return true;
}

// The keys of split `split` (from `start`): n, of the tokens' longest context, and each token's
// (n_tok; <= 0 for a token whose context ends before the split). False: the split starts past
// every context.
template <int kQ>
__device__ __forceinline__ bool SplitKeys(const SplitTokens<kQ>& tk, int split, int partition,
                                          int& start, int& n, int (&n_tok)[kQ]) {
  if (!SplitRange(split, partition, MaxContext(tk), start, n)) return false;
#pragma unroll
  for (int i = 0; i < kQ; ++i) n_tok[i] = min(partition, tk.ctx[i] - start);
  return true;
}

// The opening of a split block of the two-phase and the bf16 mma kernels: the block's split
// and its first key, its tokens (decode: its sequence's one; a token-group launch: kQ tokens of
// a group, GroupTokens), head group and sequence, zero output rows for tokens of context 0 (split
// 0), the keys of the split (n: of the longest context) and each token's keys in it (n_tok).
// False: the block has nothing to compute (no token, or the split starts past every context).
template <int kD, int kG, int kQ, bool kGlobal = false>
__device__ __forceinline__ bool BeginSplitBlock(
    int order, const int2* __restrict__ groups, const int32_t* __restrict__ query_start,
    const int32_t* __restrict__ context_lens, int partition, int num_heads,
    unsigned* __restrict__ counters, __nv_bfloat16* __restrict__ out, SplitTokens<kQ>& tk,
    int& split, int& num_splits, int& start, int& group, int& seq, int& head0, int& n,
    int (&n_tok)[kQ]) {
  DecodeBlock blk = DecodeBlockIndex(order);
  // kGlobal: a launch of a step's groups, the heaviest (latest tokens) first.
  if constexpr (kGlobal) blk.seq = static_cast<int>(gridDim.z - 1 - blockIdx.z);
  split = blk.split;
  num_splits = blk.num_splits;
  if constexpr (kQ == 1) {
    group = blk.group;
    seq = blk.seq;
    tk = OneToken(query_start[seq], seq, context_lens[seq], partition, group, num_heads / kG,
                  counters);
  } else {
    if (!GroupTokens<kQ, kGlobal>(groups, blk.group, blk.seq, query_start, context_lens, partition,
                                  num_heads / kG, counters, tk, group, seq)) {
      return false;
    }
  }
  head0 = group * kG;
  if (split == 0) {
#pragma unroll
    for (int i = 0; i < kQ; ++i) {
      if (tk.ctx[i] == 0) {
        PdlWait();
        WriteZeroRows<kD, kG>(tk.q_row[i], num_heads, head0, out);
      }
    }
  }
  return SplitKeys<kQ>(tk, split, partition, start, n, n_tok);
}

// Elements of a row per lane in the two-phase kernel: 16 for a quantized cache when the
// block's heads leave room in registers (q and the accumulator are kG x kE floats a lane), else
// 8. Measured on the H200 (B=64, ctx 1024, d 128, G=1): with 8 elements a lane every cache dtype
// took the same time per row (bf16 0.275, fp8 0.285, int4 0.331 ms): the per-row work of a
// lane, not the bytes, bounded the 8-bit and 4-bit caches.
template <typename Kv, int kD, int kG>
inline constexpr int kTwoPhaseLaneElems = (Kv::kQuantized && kG <= 2 && kKvGroup<Kv, kD> % 16 == 0)
                                              ? 16
                                              : 8;

// Tokens a block of a token-group launch takes (deterministic mode's prefill): kQ tokens x kG
// heads = kC columns, each a query that shares the block's K/V loads, at most 8 (4 with 16
// elements a lane) so that q and the accumulators (kC x kE floats a lane) stay in registers.
// Every group has at most kTokenGroup tokens, so a group is kTokenGroup / kQ blocks a head group.
// Head size 32 (tiny models) keeps one token a block: fewer kernels in the binary.
template <typename Kv, int kD, int kG>
inline constexpr int kTwoPhaseGroupTokens =
    kD < 64 ? 1 : std::max(1, (kTwoPhaseLaneElems<Kv, kD, kG> == 16 ? 4 : 8) / kG);

// Large batches: one block per split of up to kMaxTwoPhasePartition keys, three phases (all
// scores, softmax, PV) with few registers, so that many blocks stay resident and their loads
// overlap. `block_shift`: KvBlockShift(block_size).
// kQ > 1: a token-group launch (`groups`: [first token, count] of each group, grid (splits,
// head groups x kTokenGroup / kQ, groups), split-major): the block's kQ tokens of one sequence
// (token_* arrays: query_start, context_lens and table_rows indexed by token) share its K/V
// loads; a column's scores, softmax, products and merge are the kQ = 1 block's for that token
// alone (other columns only add work beside it), so a token's bits do not depend on the group.
template <typename Kv, int kD, int kG, int kQ>
__global__ void __launch_bounds__(kThreads)
    DecodeTwoPhaseKernel(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k_cache,
                         const uint8_t* __restrict__ v_cache, const float* __restrict__ k_scales,
                         const float* __restrict__ v_scales,
                         const int32_t* __restrict__ query_start,
                         const int32_t* __restrict__ context_lens,
                         const int32_t* __restrict__ block_tables,
                         const int32_t* __restrict__ table_rows, const int2* __restrict__ groups,
                         int max_blocks_per_seq, int block_size, int num_heads, int num_kv_heads,
                         int partition, float scale_log2, unsigned* __restrict__ counters,
                         float* __restrict__ records, __nv_bfloat16* __restrict__ out,
                         int block_shift, int order, int prefetch) {
  constexpr int kC = kG * kQ;
  constexpr int kE = kTwoPhaseLaneElems<Kv, kD, kG>;
  using Lane = KvLane<Kv, kE>;
  constexpr int kLanesPerToken = kD / kE;                    // kE-element chunks per row
  constexpr int kTokensPerStep = kThreads / kLanesPerToken;  // tokens read per block step
  // Loads in flight per thread: 4 of 16 bytes for bf16, 8 of 8 or 16 bytes for codes.
  constexpr int kUnroll = Kv::kQuantized ? 8 : 4;
  constexpr int kGroup = kKvGroup<Kv, kD>;
  static_assert(kGroup % kE == 0, "a lane's elements lie in one scale group");
  static_assert(kQ == 1 || kTokenGroup % kQ == 0, "a group is whole blocks");
  __shared__ float q_s[kC][kD];
  __shared__ float p_s[kC][kMaxTwoPhasePartition];
  __shared__ float o_s[kC][kD];
  __shared__ float m_s[kC], l_s[kC];

  PdlLaunchDependents();
  SplitTokens<kQ> tk;
  int split, num_splits, start, group, seq, head0, n, n_tok[kQ];
  if (!BeginSplitBlock<kD, kG, kQ>(order, groups, query_start, context_lens, partition, num_heads,
                                   counters, out, tk, split, num_splits, start, group, seq, head0,
                                   n, n_tok)) {
    return;
  }
  const int kv_head = head0 / (num_heads / num_kv_heads);
  const int tid = threadIdx.x;
  const int32_t* table =
      block_tables +
      static_cast<int64_t>(table_rows != nullptr ? table_rows[seq] : seq) * max_blocks_per_seq;

  PdlWait();  // q and this step's K/V rows come from the previous kernels
  for (int i = tid; i < kC * kD; i += kThreads) {
    const int c = i / kD, d = i % kD, t = kQ == 1 ? 0 : c / kG, g = c % kG;
    q_s[c][d] =
        n_tok[t] > 0
            ? __bfloat162float(LoadProduced(q + (tk.q_row[t] * num_heads + head0 + g) * kD + d)) *
                  scale_log2
            : 0.0f;
    o_s[c][d] = 0.0f;
  }
  __syncthreads();

  const int chunk = tid % kLanesPerToken, tok_lane = tid / kLanesPerToken;
  // Element offset of this lane's chunk of key `tok` of the partition.
  auto elem_off = [&](int tok) -> int64_t {
    return KvPoolRow(table, start + tok, block_size, block_shift, num_kv_heads, kv_head) * kD +
           chunk * kE;
  };

  // Phase 1: scores (log2 domain) of the partition's keys.
  float qf[kC][kE];
#pragma unroll
  for (int c = 0; c < kC; ++c) {
#pragma unroll
    for (int e = 0; e < kE; ++e) qf[c][e] = q_s[c][chunk * kE + e];
  }
  for (int base = 0; base < n; base += kTokensPerStep * kUnroll) {
    Lane kv[kUnroll];
    float ks[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = base + u * kTokensPerStep + tok_lane;
      kv[u].Clear();
      ks[u] = 0.0f;
      if (tok < n) {
        const int64_t off = elem_off(tok);
        kv[u].Load(k_cache + KvBytes<Kv>(off));
        if constexpr (Kv::kQuantized) ks[u] = __ldg(k_scales + KvScaleIndex<kGroup>(off));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = base + u * kTokensPerStep + tok_lane;
      float kf[kE];
      kv[u].Decode(kf);
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < kE; ++e) s = fmaf(qf[c][e], kf[e], s);
        if constexpr (Kv::kQuantized) s *= ks[u];  // the chunk lies in one scale group
#pragma unroll
        for (int o = kLanesPerToken / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (chunk == 0 && tok < n) p_s[c][tok] = s;
      }
    }
  }
  __syncthreads();

  // Phase 2: softmax numerators of the partition, per column (one warp per column), over the
  // keys of its token's context.
  const int warp = tid / 32, lane = tid % 32;
  for (int c = warp; c < kC; c += kThreads / 32) {
    const int nc = n_tok[kQ == 1 ? 0 : c / kG];
    float m = -INFINITY;
    for (int i = lane; i < nc; i += 32) m = fmaxf(m, p_s[c][i]);
    m = WarpMax(m);
    float l = 0.0f;
    for (int i = lane; i < nc; i += 32) {
      float p = exp2f(p_s[c][i] - m);
      p_s[c][i] = p;
      l += p;
    }
    l = WarpSum(l);
    if (lane == 0) {
      m_s[c] = m;
      l_s[c] = l;
    }
  }
  __syncthreads();

  // Phase 3: o = sum_t p_t v_t; token groups accumulate in registers, then in shared memory.
  float acc[kC][kE];
#pragma unroll
  for (int c = 0; c < kC; ++c) {
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[c][e] = 0.0f;
  }
  for (int base = 0; base < n; base += kTokensPerStep * kUnroll) {
    Lane vv[kUnroll];
    float vs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = base + u * kTokensPerStep + tok_lane;
      vv[u].Clear();
      vs[u] = 0.0f;
      if (tok < n) {
        const int64_t off = elem_off(tok);
        vv[u].Load(v_cache + KvBytes<Kv>(off));
        if constexpr (Kv::kQuantized) vs[u] = __ldg(v_scales + KvScaleIndex<kGroup>(off));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = base + u * kTokensPerStep + tok_lane;
      if (tok < n) {
        float vf[kE];
        vv[u].Decode(vf);
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          if (kQ > 1 && tok >= n_tok[c / kG]) continue;  // past this column's context
          float p = p_s[c][tok];
          if constexpr (Kv::kQuantized) p *= vs[u];  // p v = (p scale) code
#pragma unroll
          for (int e = 0; e < kE; ++e) acc[c][e] = fmaf(p, vf[e], acc[c][e]);
        }
      }
    }
  }
  SumTokenLanes<kD, kC, kE>(acc, o_s, q_s);  // q_s is dead: q is in registers
  FinishSplit<kD, kG, kQ>(o_s, m_s, l_s, tk, split, num_splits, head0, num_heads, records, out);
}

// The tensor-core decode kernel (fp8, int8 and int4 caches at head_dim 64 and 128): the
// two-phase kernel's phases with both products on mma.m16n8k16 (f16 operands: every code is an
// f16 value; f32 accumulation), for the few instructions per byte that 8- and 4-bit elements
// leave (the two-phase kernel spent ~2.5 per element of K and of V on conversions and FMAs and
// reached 65-72% of copy bandwidth at B=64 for 8 bits, 32% for 4).
// A warp takes 16-key tiles. Lane (r, c) = (lane / 4, lane % 4):
// - scores, S^T[16 keys, heads] = K[16 keys, kD] q^T: K is the A operand, straight from the
//   cache rows in registers: the lane loads keys r and r + 8 at dims 64 ch + 16 c + [0, 16)
//   (ch < kD / 64: 16 bytes of 8-bit codes, 8 of int4), and k step 4 ch + i takes 4 of those
//   dims as the fragment's columns (2c, 2c + 1, 2c + 8, 2c + 9): a sum does not depend on which
//   column holds which term as long as q (the B operand, head g = r) puts the same dims in the
//   same columns (8 bits: dims 4i + [0, 4) in order; int4: the pairs (j, j + 4) of an 8-dim word
//   that the nibble-to-f16 trick yields). Each score is scaled by its key's K scale (int4: a
//   sum per 64-dim scale group, ch, each scaled by its group's scale).
// - output, O^T[kD, heads] = V^T[kD, 16 keys] P'^T: V is the A operand, its rows the dims:
//   block j's fragment rows r and r + 8 are two adjacent dims, its columns (2c, 2c + 1, 2c + 8,
//   2c + 9) the keys 4c .. 4c + 3 (byte permutes pair two keys' codes of one dim). 8 bits: the
//   lane loads kD / 8 bytes of each of its 4 keys at dims (kD / 8) r + [0, kD / 8), block j
//   takes dims (kD / 8) r + 2j and + 1. int4: the 16 rows of a block lie in one 64-dim scale
//   group (its V scale goes into P'): the lane loads 4 bytes per key and group at dims
//   64 g + 8 r + [0, 8), block j takes dims 64 (j / 4) + 8 r + 2 (j % 4) and + 1.
//   P' = p * vscale / max |vscale| of the split (in [-1, 1], so its rounding to f16 keeps ~11
//   bits; the split's output is multiplied back by the max), the B operand with head g = r.
// The q and P' operands use columns r < kG; the others are zero (the MMA's waste at G = 1 is
// 7 columns of 8, still ~16 FLOP per cache byte at 8 bits, 32 at 4: far under the tensor
// cores' rate). The first V tiles are loaded before the softmax phase, so their latency
// overlaps it.
// H200, 32 heads, d 128, ctx 1024, 512-key splits (tpserve-cuda-bench --decode): fp8 B=64
// 0.167 ms (78% of copy) against the two-phase kernel's 0.199 (65%), B=128 80% against 67%.
// Resident blocks an SM the mma kernel is compiled for (<= 80 registers): fp8 B=64 ctx 1024
// took 0.1747 ms at 88 registers (5 blocks) and 0.1667 at 80 (6).
constexpr int kMmaBlocksPerSm = 6;
template <typename Kv, int kD>
inline constexpr bool kMmaDecodeSupported = Kv::kQuantized && (kD == 64 || kD == 128) &&
                                            (Kv::kBits == 8 ||
                                             (Kv::kBits == 4 && kKvGroup<Kv, kD> == 64));

// Four f16x2 of an int4 word (nibble j = dim j, stored as q + 8): (dims j, j + 4) for j = 0..3,
// exact. 0x6400 | n is the f16 1024 + n, and 0x6400 | (n << 4) is 1024 + 16 n.
__device__ __forceinline__ void I4WordToHalf2(uint32_t w, uint32_t (&h)[4]) {
  const __half2 k1032 = __half2(__half(1032.0f), __half(1032.0f));
  const __half2 k1_16 = __half2(__half(0.0625f), __half(0.0625f));
  const __half2 km72 = __half2(__half(-72.0f), __half(-72.0f));
  const uint32_t w8 = w >> 8;
  uint32_t b[4] = {(w & 0x000F000Fu) | 0x64006400u, (w & 0x00F000F0u) | 0x64006400u,
                   (w8 & 0x000F000Fu) | 0x64006400u, (w8 & 0x00F000F0u) | 0x64006400u};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    __half2 v = *reinterpret_cast<const __half2*>(&b[j]);
    v = (j % 2 == 0) ? __hsub2(v, k1032) : __hfma2(v, k1_16, km72);
    h[j] = *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Byte jj of a (low 8 bits) and of b (bits 16..23), the other bytes copies: the input of the
// nibble-to-f16 trick for two keys' codes of the dims 2 jj and 2 jj + 1.
template <int kJJ>
__device__ __forceinline__ uint32_t PairBytes(uint32_t a, uint32_t b) {
  return __byte_perm(a, b, kJJ | (kJJ << 4) | ((4 + kJJ) << 8) | ((4 + kJJ) << 12));
}
// (low nibbles, high nibbles) of PairBytes as f16x2 values q = n - 8.
__device__ __forceinline__ void I4PairToHalf2(uint32_t t, uint32_t& lo, uint32_t& hi) {
  const uint32_t a = (t & 0x000F000Fu) | 0x64006400u, b = (t & 0x00F000F0u) | 0x64006400u;
  const __half2 x =
      __hsub2(*reinterpret_cast<const __half2*>(&a), __half2(__half(1032.0f), __half(1032.0f)));
  const __half2 y =
      __hfma2(*reinterpret_cast<const __half2*>(&b), __half2(__half(0.0625f), __half(0.0625f)),
              __half2(__half(-72.0f), __half(-72.0f)));
  lo = *reinterpret_cast<const uint32_t*>(&x);
  hi = *reinterpret_cast<const uint32_t*>(&y);
}

// One output MMA of an int4 V block: dims 2 kJJ and 2 kJJ + 1 of the word of keys 4c .. 4c + 3
// (v[0..3]) as the A operand, P' (b0, b1) as B.
template <int kJJ>
__device__ __forceinline__ void I4PvMma(float (&acc)[4], const uint32_t (&v)[4], uint32_t b0,
                                        uint32_t b1) {
  uint32_t lo01, hi01, lo23, hi23;
  I4PairToHalf2(PairBytes<kJJ>(v[0], v[1]), lo01, hi01);
  I4PairToHalf2(PairBytes<kJJ>(v[2], v[3]), lo23, hi23);
  Mma16816F16(acc, lo01, hi01, lo23, hi23, b0, b1);
}

// A hint: the 128-byte line holding p into L2 (no register holds the data, nothing waits on it).
__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ uint32_t Float2ToHalf2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <typename Kv, int kD, int kG, bool kPrefetch>
__global__ void __launch_bounds__(kThreads, kMmaBlocksPerSm)
    DecodeMmaKernel(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k_cache,
                    const uint8_t* __restrict__ v_cache, const float* __restrict__ k_scales,
                    const float* __restrict__ v_scales, const int32_t* __restrict__ query_start,
                    const int32_t* __restrict__ context_lens,
                    const int32_t* __restrict__ block_tables,
                    const int32_t* __restrict__ table_rows, const int2* __restrict__ /*groups*/,
                    int max_blocks_per_seq, int block_size, int num_heads, int num_kv_heads,
                    int partition, float scale_log2, unsigned* __restrict__ counters,
                    float* __restrict__ records, __nv_bfloat16* __restrict__ out, int block_shift,
                    int order, int prefetch) {
  if constexpr (kMmaDecodeSupported<Kv, kD> && kG <= 8) {
    constexpr bool kI4 = Kv::kBits == 4;
    constexpr int kSteps = kD / 16;   // k steps of a score tile = dim blocks of an output tile
    constexpr int kChunks = kD / 64;  // K loads per key row and lane (dims 64 ch + 16 c + [0, 16))
    constexpr int kGroups = kI4 ? kD / 64 : 1;  // scale groups per row
    constexpr int kRowBytes = kD * Kv::kBits / 8;
    constexpr int kVBytes = kD / 8;  // 8 bits: bytes of a V row per lane
    constexpr int kWarps = kThreads / 32;
    // Tiles in flight per warp. H200, fp8, B=64 ctx 1024, 512-key splits: 2 tiles 78% of copy
    // (80 registers: 6 blocks an SM), 4 tiles 71% (~128 registers: 4 blocks).
    constexpr int kUnroll = 2;
    constexpr int kMaxP = MmaMaxPartition(kG);
    using KLoad = std::conditional_t<kI4, uint2, uint4>;
    // A lane's V codes of one key: 8 bits, kD / 8 bytes; int4, one word per scale group.
    struct VLoad {
      uint32_t w[kI4 ? kGroups : kVBytes / 4];
    };
    static_assert(kWarps * kG * kD <= kG * kMaxP, "warp outputs fit in p_s");
    __shared__ __align__(16) float p_s[kG][kMaxP];
    __shared__ float vs_s[kMaxP][kGroups];
    __shared__ int32_t row_s[kMaxP];
    __shared__ float o_s[kG][kD];
    __shared__ float m_s[kG], l_s[kG];
    __shared__ float vmax_s;

    PdlLaunchDependents();
    const DecodeBlock blk = DecodeBlockIndex(order);
    const int split = blk.split, group = blk.group, seq = blk.seq, num_splits = blk.num_splits;
    const int ctx = context_lens[seq];
    const int start = split * partition;
    const int head0 = group * kG;
    const int64_t q_row = query_start[seq];
    if (start >= ctx) {
      if (ctx == 0 && split == 0) {
        PdlWait();
        WriteZeroRows<kD, kG>(q_row, num_heads, head0, out);
      }
      return;
    }
    const int n = min(partition, ctx - start);
    const int num_tiles = (n + 15) / 16;
    const int kv_head = head0 / (num_heads / num_kv_heads);
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, r = lane / 4, c = lane % 4;
    const int32_t* table =
        block_tables +
        static_cast<int64_t>(table_rows != nullptr ? table_rows[seq] : seq) * max_blocks_per_seq;

    PdlWait();  // q and this step's K/V rows come from the previous kernels
    // q of head r as the score MMAs' B operand, step 4 ch + i, dims as the K fragment's (above).
    uint32_t qb[kSteps][2];
    {
      const __nv_bfloat16* qrow = q + (q_row * num_heads + head0 + min(r, kG - 1)) * kD;
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch) {
        float f[16];
        const uint4 lo = LoadProduced(reinterpret_cast<const uint4*>(qrow + 64 * ch + 16 * c));
        const uint4 hi = LoadProduced(reinterpret_cast<const uint4*>(qrow + 64 * ch + 16 * c + 8));
        Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&lo), f);
        Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&hi), f + 8);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // 8 bits: dims 4i + (0, 1) and 4i + (2, 3); int4: in the word of dims 8 (i / 2) +
          // [0, 8), pairs (j, j + 4) and (j + 1, j + 5) for j = 2 (i % 2).
          const int a0 = kI4 ? 8 * (i / 2) + 2 * (i % 2) : 4 * i;
          const int a1 = kI4 ? a0 + 4 : a0 + 1;
          const int b0 = kI4 ? a0 + 1 : a0 + 2;
          const int b1 = kI4 ? a0 + 5 : a0 + 3;
          qb[4 * ch + i][0] = r < kG ? Float2ToHalf2(f[a0], f[a1]) : 0u;
          qb[4 * ch + i][1] = r < kG ? Float2ToHalf2(f[b0], f[b1]) : 0u;
        }
      }
    }

    // kPrefetch (TPSERVE_DECODE_PREFETCH > 0, its own instantiation so that the default kernel
    // keeps its registers): L2 prefetches ahead of a warp's loads, bytes in flight that cost no
    // registers: the rows of loop iterations 1 .. `prefetch` before a phase's loop, then in
    // iteration i those of iteration i + prefetch + 1 (lane l: key l % 16 of the iteration's
    // tile l / 16). K rows need the page lookup; V rows come from row_s (phase 1 fills it).
    constexpr int kStride = kWarps * kUnroll;  // tiles a loop iteration of all warps
    auto prefetch_k = [&](int t0) {
      const int tok = (t0 + (lane / 16) * kWarps) * 16 + lane % 16;
      if (lane / 16 < kUnroll && tok < n) {
        PrefetchL2(k_cache +
                   KvPoolRow(table, start + tok, block_size, block_shift, num_kv_heads, kv_head) *
                       kRowBytes);
      }
    };
    auto prefetch_v = [&](int t0) {
      const int tok = (t0 + (lane / 16) * kWarps) * 16 + lane % 16;
      if (lane / 16 < kUnroll && tok < n) {
        PrefetchL2(v_cache + static_cast<int64_t>(row_s[tok]) * kRowBytes);
      }
    };
    if constexpr (kPrefetch) {
      for (int d = 1; d <= prefetch; ++d) prefetch_k(warp + d * kStride);
    }

    // Phase 1: scores (log2 domain); the lanes of column 0 also keep each key's pool row and V
    // scales for phase 3.
    for (int t0 = warp; t0 < num_tiles; t0 += kWarps * kUnroll) {
      if constexpr (kPrefetch) prefetch_k(t0 + (prefetch + 1) * kStride);
      KLoad kw[kUnroll][2][kChunks];
      float ks[kUnroll][2][kGroups];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int tok = (t0 + u * kWarps) * 16 + r + 8 * h;
          if (tok < n) {  // also false for a tile past the last
            const int64_t row =
                KvPoolRow(table, start + tok, block_size, block_shift, num_kv_heads, kv_head);
            const uint8_t* p = k_cache + row * kRowBytes + c * (kI4 ? 8 : 16);
#pragma unroll
            for (int ch = 0; ch < kChunks; ++ch) {
              if constexpr (kI4) {
                kw[u][h][ch] = LoadStreaming8(p + 32 * ch);
              } else {
                kw[u][h][ch] = LoadStreaming(p + 64 * ch);
              }
            }
#pragma unroll
            for (int g = 0; g < kGroups; ++g) ks[u][h][g] = __ldg(k_scales + row * kGroups + g);
            if (c == 0) {
              row_s[tok] = static_cast<int32_t>(row);
#pragma unroll
              for (int g = 0; g < kGroups; ++g) vs_s[tok][g] = __ldg(v_scales + row * kGroups + g);
            }
          } else {
#pragma unroll
            for (int ch = 0; ch < kChunks; ++ch) kw[u][h][ch] = KLoad{};
#pragma unroll
            for (int g = 0; g < kGroups; ++g) ks[u][h][g] = 0.0f;
            // int4's phase 3 scales P' by these: finite zeros past the context in the last tile.
            if (c == 0 && tok < num_tiles * 16) {
#pragma unroll
              for (int g = 0; g < kGroups; ++g) vs_s[tok][g] = 0.0f;
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int tile = t0 + u * kWarps;
        if (tile >= num_tiles) continue;  // warp-uniform
        float acc[kGroups][4] = {};
#pragma unroll
        for (int ch = 0; ch < kChunks; ++ch) {
          float(&a)[4] = acc[kI4 ? ch : 0];
          if constexpr (kI4) {
            const uint32_t w0[2] = {kw[u][0][ch].x, kw[u][0][ch].y};
            const uint32_t w1[2] = {kw[u][1][ch].x, kw[u][1][ch].y};
#pragma unroll
            for (int wi = 0; wi < 2; ++wi) {
              uint32_t h0[4], h1[4];
              I4WordToHalf2(w0[wi], h0);
              I4WordToHalf2(w1[wi], h1);
              Mma16816F16(a, h0[0], h1[0], h0[1], h1[1], qb[4 * ch + 2 * wi][0],
                          qb[4 * ch + 2 * wi][1]);
              Mma16816F16(a, h0[2], h1[2], h0[3], h1[3], qb[4 * ch + 2 * wi + 1][0],
                          qb[4 * ch + 2 * wi + 1][1]);
            }
          } else {
            const uint32_t w0[4] = {kw[u][0][ch].x, kw[u][0][ch].y, kw[u][0][ch].z, kw[u][0][ch].w};
            const uint32_t w1[4] = {kw[u][1][ch].x, kw[u][1][ch].y, kw[u][1][ch].z, kw[u][1][ch].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              Mma16816F16(a, CodePairToHalf2<Kv, false>(w0[i]), CodePairToHalf2<Kv, false>(w1[i]),
                          CodePairToHalf2<Kv, true>(w0[i]), CodePairToHalf2<Kv, true>(w1[i]),
                          qb[4 * ch + i][0], qb[4 * ch + i][1]);
            }
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = tile * 16 + r + 8 * (e / 2), g = 2 * c + e % 2;
          float sc = 0.0f;
#pragma unroll
          for (int gr = 0; gr < kGroups; ++gr) sc += acc[gr][e] * ks[u][e / 2][gr];
          if (g < kG && tok < n) p_s[g][tok] = sc * scale_log2;
        }
      }
    }
    __syncthreads();

    // The first V tiles of phase 3 load while the softmax runs.
    VLoad vw[kUnroll][4];
    auto load_v = [&](int t0) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = (t0 + u * kWarps) * 16 + 4 * c + e;
          vw[u][e] = VLoad{};
          if (tok < n) {
            const uint8_t* p = v_cache + static_cast<int64_t>(row_s[tok]) * kRowBytes;
            if constexpr (kI4) {
#pragma unroll
              for (int g = 0; g < kGroups; ++g) vw[u][e].w[g] = LoadStreaming4(p + 32 * g + 4 * r);
            } else if constexpr (kVBytes == 16) {
              const uint4 x = LoadStreaming(p + kVBytes * r);
              vw[u][e] = VLoad{{x.x, x.y, x.z, x.w}};
            } else {
              const uint2 x = LoadStreaming8(p + kVBytes * r);
              vw[u][e] = VLoad{{x.x, x.y}};
            }
          }
        }
      }
    };
    load_v(warp);
    if constexpr (kPrefetch) {
      for (int d = 1; d <= prefetch; ++d) prefetch_v(warp + d * kStride);
    }

    // Phase 2: softmax numerators per head (one warp per head). 8 bits: p_s becomes P' = p *
    // vscale / vmax; int4 (a scale per group): p, and phase 3 applies the group's scale.
    // Zero for the keys past the context in the last tile.
    float vmax = 0.0f;
    for (int i = lane; i < n; i += 32) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) vmax = fmaxf(vmax, fabsf(vs_s[i][g]));
    }
    vmax = WarpMax(vmax);
    const float inv_vmax = vmax > 0.0f ? 1.0f / vmax : 0.0f;
    for (int g = warp; g < kG; g += kWarps) {
      float m = -INFINITY;
      for (int i = lane; i < n; i += 32) m = fmaxf(m, p_s[g][i]);
      m = WarpMax(m);
      float l = 0.0f;
      for (int i = lane; i < num_tiles * 16; i += 32) {
        float pv = 0.0f;
        if (i < n) {
          const float p = exp2f(p_s[g][i] - m);
          l += p;
          pv = kI4 ? p : p * (vs_s[i][0] * inv_vmax);
        }
        p_s[g][i] = pv;
      }
      l = WarpSum(l);
      if (lane == 0) {
        m_s[g] = m;
        l_s[g] = l;
      }
    }
    if (tid == 0) vmax_s = vmax;
    __syncthreads();

    // Phase 3: O^T += V^T P'^T per tile.
    float acc[kSteps][4];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    }
    for (int t0 = warp; t0 < num_tiles; t0 += kWarps * kUnroll) {
      if constexpr (kPrefetch) prefetch_v(t0 + (prefetch + 1) * kStride);
      if (t0 != warp) load_v(t0);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int tile = t0 + u * kWarps;
        if (tile >= num_tiles) continue;  // warp-uniform
        // P' of head r, keys 4c .. 4c + 3, per scale group.
        uint32_t b0[kGroups], b1[kGroups];
#pragma unroll
        for (int g = 0; g < kGroups; ++g) b0[g] = b1[g] = 0u;
        if (r < kG) {
          const int k0 = tile * 16 + 4 * c;
          const float4 p = *reinterpret_cast<const float4*>(&p_s[r][k0]);
#pragma unroll
          for (int g = 0; g < kGroups; ++g) {
            if constexpr (kI4) {
              b0[g] =
                  Float2ToHalf2(p.x * (vs_s[k0][g] * inv_vmax), p.y * (vs_s[k0 + 1][g] * inv_vmax));
              b1[g] = Float2ToHalf2(p.z * (vs_s[k0 + 2][g] * inv_vmax),
                                    p.w * (vs_s[k0 + 3][g] * inv_vmax));
            } else {
              b0[g] = Float2ToHalf2(p.x, p.y);
              b1[g] = Float2ToHalf2(p.z, p.w);
            }
          }
        }
        if constexpr (kI4) {
#pragma unroll
          for (int g = 0; g < kGroups; ++g) {
            const uint32_t v[4] = {vw[u][0].w[g], vw[u][1].w[g], vw[u][2].w[g], vw[u][3].w[g]};
            I4PvMma<0>(acc[4 * g + 0], v, b0[g], b1[g]);
            I4PvMma<1>(acc[4 * g + 1], v, b0[g], b1[g]);
            I4PvMma<2>(acc[4 * g + 2], v, b0[g], b1[g]);
            I4PvMma<3>(acc[4 * g + 3], v, b0[g], b1[g]);
          }
        } else {
#pragma unroll
          for (int w = 0; w < kVBytes / 4; ++w) {
            const uint32_t v0 = vw[u][0].w[w], v1 = vw[u][1].w[w], v2 = vw[u][2].w[w],
                           v3 = vw[u][3].w[w];
            // Bytes (b of key 4c, b of key 4c + 1, b + 1 of 4c, b + 1 of 4c + 1), b = 0 and 2.
            const uint32_t k01_lo = __byte_perm(v0, v1, 0x5140);
            const uint32_t k01_hi = __byte_perm(v0, v1, 0x7362);
            const uint32_t k23_lo = __byte_perm(v2, v3, 0x5140);
            const uint32_t k23_hi = __byte_perm(v2, v3, 0x7362);
            Mma16816F16(acc[2 * w], CodePairToHalf2<Kv, false>(k01_lo),
                        CodePairToHalf2<Kv, true>(k01_lo), CodePairToHalf2<Kv, false>(k23_lo),
                        CodePairToHalf2<Kv, true>(k23_lo), b0[0], b1[0]);
            Mma16816F16(acc[2 * w + 1], CodePairToHalf2<Kv, false>(k01_hi),
                        CodePairToHalf2<Kv, true>(k01_hi), CodePairToHalf2<Kv, false>(k23_hi),
                        CodePairToHalf2<Kv, true>(k23_hi), b0[0], b1[0]);
          }
        }
      }
    }
    // The warps' partial outputs (in p_s, now dead), summed in warp order and scaled by vmax.
    __syncthreads();
    auto* ow = reinterpret_cast<float(*)[kG][kD]>(&p_s[0][0]);
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const int d0 = kI4 ? 64 * (j / 4) + 8 * r + 2 * (j % 4) : kVBytes * r + 2 * j;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int g = 2 * c + e % 2;
        if (g < kG) ow[warp][g][d0 + e / 2] = acc[j][e];
      }
    }
    __syncthreads();
    for (int i = tid; i < kG * kD; i += kThreads) {
      const int g = i / kD, d = i % kD;
      float s = ow[0][g][d];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) s += ow[w][g][d];
      o_s[g][d] = s * vmax_s;
    }
    __syncthreads();
    FinishSplit<kD, kG, 1>(o_s, m_s, l_s,
                           OneToken(q_row, seq, ctx, partition, group, num_heads / kG, counters),
                           split, num_splits, head0, num_heads, records, out);
  }
}

// Deterministic mode's decode kernel for bf16 caches at head_dim 64 and 128 (DecodeKernel::
// kMmaBf16): both products on mma.m16n8k16 (bf16 operands, f32 accumulation), so that a
// prefill's tokens can be the MMA's columns and share a block's K/V reads at tensor-core cost.
// The two-phase kernel's CUDA-core arithmetic took ~0.9 G warp instructions a layer for a
// 2048-token deterministic prefill even in token groups (kernels/cuda/NOTES.md, session 26).
// A block: one split of `partition` (<= kMmaBf16MaxPartition) keys, columns (token i, head g) =
// i kG + g, at most 16 (kF n8 fragments: a decode block has kG columns, a prefill group's block
// 16); a warp takes 16-key tiles. Lane (r, c) = (lane / 4,
// lane % 4):
// - scores, S^T[16 keys, 8 columns] = K q^T: K is the A operand straight from the cache rows in
//   registers: the lane loads keys r and r + 8 at dims kD / 4 c + [0, kD / 4), and k step s takes
//   dims kD / 4 c + 4 s + [0, 4) as the fragment's columns (2c, 2c + 1, 2c + 8, 2c + 9); q (the
//   B operand, column r) puts the same dims in the same places. Each score is scaled after the
//   product (q enters unrounded).
// - output, O^T[kD, 8 columns] = V^T P^T: V^T is the A operand, its rows the dims: block j's
//   fragment rows r and r + 8 are dims kD / 8 r + 2j and + 1, its columns (2c, 2c + 1, 2c + 8,
//   2c + 9) the keys 4c .. 4c + 3 (the lane loads kD / 8 dims of each of its 4 keys; byte
//   permutes pair two keys' elements of one dim). P, rounded to bf16, is the B operand.
// Why a column's bits do not depend on the others (so a token gives the same bits alone, in a
// batch of any size, and as a column of a prefill group): an MMA computes each output from its
// own row of A and column of B (the chain-GEMM and stream-GEMM tests showed it, NOTES.md);
// the softmax of a column runs over its own keys in a fixed order; a key past a column's
// context has p = +0 (its V is a real row of the group's chunk, so the product is an exact
// zero, which leaves an accumulator unchanged); the warps' partial outputs are added in warp
// order; FinishSplit merges a token's splits as for any kernel.
// kLoopSplits (a prompt's token groups, DeterministicSplitLoop): one block a (group, head group)
// instead of one a split runs the group's splits in turn and folds each into its columns' running
// merges (FoldSplit, state in dynamic shared memory) in the order MergeColumn folds the records,
// then writes them (CombineFolds): the same bits, without the workspace round trip, the arrival
// counters and the last block's merge; one launch takes every group of the step, heaviest first
// (an H100's 2,048-token deterministic prefill: 96.7 ms with a block a split, 74.6 with the loop;
// the loop at 4 blocks an SM, its output in p_s and q reloaded each split, took 85.0). Shared
// memory leaves the loop 3 blocks an SM, and so do its launch bounds: 168 registers instead of
// 128, and its 136 / 260 bytes of spills gone (75.2 -> 70.9 ms on another H100). Both forms
// look a split's pool rows up at once before phase 1 (ncu: phase 1's K loads waited on a table
// load each) and keep their tokens' contexts, splits and output rows in shared memory for the loops
// that index them by column (they were local memory, missing the small L1): 69.5 ms.
constexpr int kMmaBf16MaxPartition = 512;
// Deterministic decode launches of at least this many (sequence, head group) blocks loop over
// their splits (kLoopSplits, kQ = 1) instead of taking a block a split: the H100's batch-64 step
// at context 1024 (6.7B shape, 256-key splits) 18.48 -> 17.85 ms, against 17.73 in the default
// mode; smaller launches keep a block a split, which batch 1 needs for its parallelism.
constexpr int kDecodeLoopMinBlocks = 1024;
template <typename Kv, int kD>
inline constexpr bool kMmaBf16Supported = !Kv::kQuantized && (kD == 64 || kD == 128);
template <typename Kv, int kD, int kG>
inline constexpr int kMmaBf16GroupTokens = kMmaBf16Supported<Kv, kD> ? std::max(1, kTokenGroup / kG)
                                                                     : 1;

// kWide, for a decode launch (kQ = 1, a block a split) of at most one wave at
// kMmaBf16WideBlocksPerSm blocks an SM (the 6.7B shape: batch 1, or 2 at context 1024): all of a
// warp's tiles of a 256-key split in flight at once (kUnroll 4: one round trip for its K tiles
// and one for its V tiles, where 2 took two each), at 2 blocks an SM for the registers (ptxas:
// 194-198 at head_dim 128, no spills). A warp adds its tiles in the same order: the same bits.
// H100: batch 1's attention 11.15 -> 10.74 us a call at context 160, 16.53 -> 16.32 at 768; but
// taken for every such launch, the batch-16 step at context 1024 (2,048 blocks) took 9.24 ms
// against 8.74 without it (kernels/cuda/NOTES.md, session 41).
inline constexpr int kMmaBf16WideBlocksPerSm = 2;
template <typename Kv, int kD, int kG, int kQ, bool kLoopSplits = false, bool kWide = false>
__global__ void __launch_bounds__(kThreads, kLoopSplits ? 3
                                            : kWide     ? kMmaBf16WideBlocksPerSm
                                                        : 4)
    DecodeMmaBf16Kernel(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k_cache,
                        const uint8_t* __restrict__ v_cache, const float* __restrict__ /*ks*/,
                        const float* __restrict__ /*vs*/, const int32_t* __restrict__ query_start,
                        const int32_t* __restrict__ context_lens,
                        const int32_t* __restrict__ block_tables,
                        const int32_t* __restrict__ table_rows, const int2* __restrict__ groups,
                        int max_blocks_per_seq, int block_size, int num_heads, int num_kv_heads,
                        int partition, float scale_log2, unsigned* __restrict__ counters,
                        float* __restrict__ records, __nv_bfloat16* __restrict__ out,
                        int block_shift, int order, int /*prefetch*/) {
  if constexpr (kMmaBf16Supported<Kv, kD> && kG * kQ <= 16) {
    constexpr int kC = kG * kQ;
    constexpr int kF = (kC + 7) / 8;  // n8 fragments of columns
    constexpr int kSteps = kD / 16;   // k steps of a score tile = dim blocks of an output tile
    constexpr int kKDims = kD / 4;    // dims of a K row a lane loads
    constexpr int kVDims = kD / 8;    // dims of a V row a lane loads
    constexpr int kRowBytes = kD * 2;
    constexpr int kWarps = kThreads / 32;
    // Tiles in flight per warp (the order in which a warp adds its tiles does not change).
    static_assert(!kWide || (kQ == 1 && !kLoopSplits), "the wide form is a decode block a split");
    constexpr int kUnroll = kWide ? 4 : kF == 1 ? 2 : 1;
    constexpr int kMaxP = kMmaBf16MaxPartition;
    static_assert(kWarps * kD <= kMaxP, "the warps' outputs fit in p_s");
    __shared__ __align__(16) float p_s[kC][kMaxP];
    __shared__ int32_t row_s[kMaxP];
    __shared__ float o_s[kC][kD];
    __shared__ float m_s[kC], l_s[kC];
    // The tokens' contexts, splits and output rows, for the loops that index them by column (a
    // register array indexed so would live in local memory, which misses the small L1 here).
    __shared__ int ctx_s[kQ], used_s[kQ];
    __shared__ int64_t qrow_s[kQ];

    PdlLaunchDependents();
    SplitTokens<kQ> tk;
    int split, num_splits, start, group, seq, head0, n, n_tok[kQ];
    if (!BeginSplitBlock<kD, kG, kQ, kLoopSplits>(order, groups, query_start, context_lens,
                                                  partition, num_heads, counters, out, tk, split,
                                                  num_splits, start, group, seq, head0, n, n_tok)) {
      return;
    }
    const int kv_head = head0 / (num_heads / num_kv_heads);
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, r = lane / 4, c = lane % 4;
    const int32_t* table =
        block_tables +
        static_cast<int64_t>(table_rows != nullptr ? table_rows[seq] : seq) * max_blocks_per_seq;
    if (tid == 0) {
#pragma unroll
      for (int i = 0; i < kQ; ++i) {
        ctx_s[i] = tk.ctx[i];
        used_s[i] = tk.used[i];
        qrow_s[i] = tk.q_row[i];
      }
    }
    // kLoopSplits: what the loop needs of tk to step to the next split.
    const int used_max = tk.used_max, ctx_max = MaxContext(tk);

    PdlWait();  // q and this step's K/V rows come from the previous kernels
    // q of column 8f + r as the score MMAs' B operand: step s takes dims kKDims c + 4s + [0, 4).
    uint32_t qb[kF][kSteps][2];
#pragma unroll
    for (int f = 0; f < kF; ++f) {
      const int col = min(8 * f + r, kC - 1);
      const int t = kQ == 1 ? 0 : col / kG, g = col % kG;
      const bool live = 8 * f + r < kC && n_tok[t] > 0;
      const __nv_bfloat16* qrow = q + (tk.q_row[t] * num_heads + head0 + g) * kD + kKDims * c;
#pragma unroll
      for (int u = 0; u < kKDims / 8; ++u) {
        const uint4 w =
            live ? LoadProduced(reinterpret_cast<const uint4*>(qrow) + u) : uint4{0, 0, 0, 0};
        qb[f][2 * u][0] = w.x;
        qb[f][2 * u][1] = w.y;
        qb[f][2 * u + 1][0] = w.z;
        qb[f][2 * u + 1][1] = w.w;
      }
    }

    // kLoopSplits: the running merges of the columns' splits (four folds a column, FoldSplit's
    // state: kD numerator elements, then m and the denominator), in dynamic shared memory.
    extern __shared__ float fold_s[];  // [kC][4][kD + 2]
    if constexpr (kLoopSplits) {
      for (int i = tid; i < kC * 4 * (kD + 2); i += kThreads) {
        fold_s[i] = i % (kD + 2) == kD ? -INFINITY : 0.0f;
      }
    }

    // One split (kLoopSplits: every split of the block's tokens in turn).
    for (;;) {
      const int num_tiles = (n + 15) / 16;
      // The split's pool rows, every table lookup at once (phase 1's K loads then wait for no
      // table load of their own; phase 3 reads them too).
      for (int i = tid; i < n; i += kThreads) {
        row_s[i] = static_cast<int32_t>(
            KvPoolRow(table, start + i, block_size, block_shift, num_kv_heads, kv_head));
      }
      __syncthreads();
      // Phase 1: scores (log2 domain).
      for (int t0 = warp; t0 < num_tiles; t0 += kWarps * kUnroll) {
        uint4 kw[kUnroll][2][kKDims / 8];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int tok = (t0 + u * kWarps) * 16 + r + 8 * h;
            if (tok < n) {  // also false for a tile past the last
              const uint8_t* p =
                  k_cache + static_cast<int64_t>(row_s[tok]) * kRowBytes + c * (kKDims * 2);
#pragma unroll
              for (int i = 0; i < kKDims / 8; ++i) kw[u][h][i] = LoadStreaming(p + 16 * i);
            } else {
#pragma unroll
              for (int i = 0; i < kKDims / 8; ++i) kw[u][h][i] = uint4{0, 0, 0, 0};
            }
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int tile = t0 + u * kWarps;
          if (tile >= num_tiles) continue;  // warp-uniform
          float acc[kF][4] = {};
#pragma unroll
          for (int i = 0; i < kKDims / 8; ++i) {
            const uint4 k0 = kw[u][0][i], k1 = kw[u][1][i];
#pragma unroll
            for (int f = 0; f < kF; ++f) {
              Mma16816(acc[f], k0.x, k1.x, k0.y, k1.y, qb[f][2 * i][0], qb[f][2 * i][1]);
              Mma16816(acc[f], k0.z, k1.z, k0.w, k1.w, qb[f][2 * i + 1][0], qb[f][2 * i + 1][1]);
            }
          }
#pragma unroll
          for (int f = 0; f < kF; ++f) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int tok = tile * 16 + r + 8 * (e / 2), col = 8 * f + 2 * c + e % 2;
              if (col < kC && tok < n) p_s[col][tok] = acc[f][e] * scale_log2;
            }
          }
        }
      }
      __syncthreads();

      // The first V tiles of phase 3 load while the softmax runs: keys 4c .. 4c + 3 of a tile,
      // dims kVDims r + [0, kVDims) (zeros past the split's keys).
      uint4 vw[kUnroll][4][kVDims / 8];
      auto load_v = [&](int t0) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tok = (t0 + u * kWarps) * 16 + 4 * c + e;
            const uint8_t* p = v_cache +
                               static_cast<int64_t>(tok < n ? row_s[tok] : 0) * kRowBytes +
                               r * (kVDims * 2);
#pragma unroll
            for (int i = 0; i < kVDims / 8; ++i) {
              vw[u][e][i] = tok < n ? LoadStreaming(p + 16 * i) : uint4{0, 0, 0, 0};
            }
          }
        }
      };
      load_v(warp);

      // Phase 2: softmax numerators per column (one warp per column) over its token's keys;
      // zero for the keys past them up to the last tile's end.
      for (int col = warp; col < kC; col += kWarps) {
        const int nc = min(partition, ctx_s[kQ == 1 ? 0 : col / kG] - start);  // n_tok
        float m = -INFINITY;
        for (int i = lane; i < nc; i += 32) m = fmaxf(m, p_s[col][i]);
        m = WarpMax(m);
        float l = 0.0f;
        for (int i = lane; i < num_tiles * 16; i += 32) {
          float p = 0.0f;
          if (i < nc) {
            p = exp2f(p_s[col][i] - m);
            l += p;
          }
          p_s[col][i] = p;
        }
        l = WarpSum(l);
        if (lane == 0) {
          m_s[col] = m;
          l_s[col] = l;
        }
      }
      __syncthreads();

      // Phase 3: O^T += V^T P^T per tile.
      float acc[kF][kSteps][4] = {};
      for (int t0 = warp; t0 < num_tiles; t0 += kWarps * kUnroll) {
        if (t0 != warp) load_v(t0);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int tile = t0 + u * kWarps;
          if (tile >= num_tiles) continue;  // warp-uniform
          // P of column 8f + r, keys 4c .. 4c + 3.
          uint32_t b0[kF], b1[kF];
#pragma unroll
          for (int f = 0; f < kF; ++f) {
            b0[f] = b1[f] = 0u;
            if (8 * f + r < kC) {
              const float4 p = *reinterpret_cast<const float4*>(&p_s[8 * f + r][tile * 16 + 4 * c]);
              b0[f] = PackBf16(p.x, p.y);
              b1[f] = PackBf16(p.z, p.w);
            }
          }
#pragma unroll
          for (int i = 0; i < kVDims / 8; ++i) {
            const uint32_t w0[4] = {vw[u][0][i].x, vw[u][0][i].y, vw[u][0][i].z, vw[u][0][i].w};
            const uint32_t w1[4] = {vw[u][1][i].x, vw[u][1][i].y, vw[u][1][i].z, vw[u][1][i].w};
            const uint32_t w2[4] = {vw[u][2][i].x, vw[u][2][i].y, vw[u][2][i].z, vw[u][2][i].w};
            const uint32_t w3[4] = {vw[u][3][i].x, vw[u][3][i].y, vw[u][3][i].z, vw[u][3][i].w};
#pragma unroll
            for (int x = 0; x < 4; ++x) {
              // Word x: dims 2j and 2j + 1 of the lane's run, j = 4i + x; a key pair's element
              // of one dim per register.
              const uint32_t a0 = __byte_perm(w0[x], w1[x], 0x5410),
                             a1 = __byte_perm(w0[x], w1[x], 0x7632),
                             a2 = __byte_perm(w2[x], w3[x], 0x5410),
                             a3 = __byte_perm(w2[x], w3[x], 0x7632);
#pragma unroll
              for (int f = 0; f < kF; ++f)
                Mma16816(acc[f][4 * i + x], a0, a1, a2, a3, b0[f], b1[f]);
            }
          }
        }
      }
      // The warps' partial outputs (in p_s, now dead), summed in warp order.
      __syncthreads();
      auto* ow = reinterpret_cast<float(*)[kC][kD]>(&p_s[0][0]);
#pragma unroll
      for (int f = 0; f < kF; ++f) {
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          const int d0 = kVDims * r + 2 * j;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = 8 * f + 2 * c + e % 2;
            if (col < kC) ow[warp][col][d0 + e / 2] = acc[f][j][e];
          }
        }
      }
      __syncthreads();
      for (int i = tid; i < kC * kD; i += kThreads) {
        const int col = i / kD, d = i % kD;
        float s = ow[0][col][d];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) s += ow[w][col][d];
        o_s[col][d] = s;
      }
      __syncthreads();
      if constexpr (!kLoopSplits) {
        FinishSplit<kD, kG, kQ, /*kColumnMerge=*/true>(o_s, m_s, l_s, tk, split, num_splits, head0,
                                                       num_heads, records, out);
        return;
      } else {
        // What FinishSplit and MergeColumn do with this split, without the records: a token of one
        // split is written now; otherwise its columns fold the split into fold split % 4.
        constexpr int kVec = kD / 32;
        for (int col = warp; col < kC; col += kWarps) {
          const int t = kQ == 1 ? 0 : col / kG, g = col % kG, used = used_s[t];
          __nv_bfloat16* orow = out + (qrow_s[t] * num_heads + head0 + g) * kD;
          if (used == 1) {
            if (split == 0) {
              const float l = l_s[col];
#pragma unroll
              for (int e = 0; e < kVec; ++e) {
                const int d = lane * kVec + e;
                orow[d] = SingleSplitOut(o_s[col][d], l);
              }
            }
          } else if (split < used) {
            float* f = fold_s + (col * 4 + split % 4) * (kD + 2);
            float num[kVec], o[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
              num[e] = f[lane * kVec + e];
              o[e] = o_s[col][lane * kVec + e];
            }
            float m_run = f[kD], den = f[kD + 1];
            FoldSplit<kD>(m_run, den, num, m_s[col], l_s[col], o);
#pragma unroll
            for (int e = 0; e < kVec; ++e) f[lane * kVec + e] = num[e];
            __syncwarp();
            if (lane == 0) {
              f[kD] = m_run;
              f[kD + 1] = den;
            }
          }
        }
        __syncthreads();  // o_s, m_s, l_s, p_s and row_s are the next split's
        if (++split >= used_max) break;
        SplitRange(split, partition, ctx_max, start, n);  // true: split < used_max
      }
    }  // the split loop
    if constexpr (kLoopSplits) {
      constexpr int kVec = kD / 32;
      for (int col = warp; col < kC; col += kWarps) {
        const int t = kQ == 1 ? 0 : col / kG, g = col % kG;
        if (used_s[t] <= 1) continue;  // warp-uniform
        const float* f = fold_s + col * 4 * (kD + 2);
        float fm[4], fden[4], fnum[4][kVec];
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          fm[v] = f[v * (kD + 2) + kD];
          fden[v] = f[v * (kD + 2) + kD + 1];
#pragma unroll
          for (int e = 0; e < kVec; ++e) fnum[v][e] = f[v * (kD + 2) + lane * kVec + e];
        }
        CombineFolds<kD>(fm, fden, fnum, lane, out + (qrow_s[t] * num_heads + head0 + g) * kD);
      }
    }
  }
}

// Small batches: one block per split of `partition` keys, kG query heads of one KV head, one
// sequence. Keys are processed 64 at a time: every thread issues all its K and V loads of the
// sub-tile before using any (32 KB in flight per block at head_dim 128), scores go to shared
// memory, and the softmax is online across sub-tiles.
template <typename Kv, int kD, int kG>
__global__ void __launch_bounds__(kThreads) DecodePartitionKernel(
    const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k_cache,
    const uint8_t* __restrict__ v_cache, const float* __restrict__ k_scales,
    const float* __restrict__ v_scales, const int32_t* __restrict__ query_start,
    const int32_t* __restrict__ context_lens, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ table_rows, const int2* __restrict__ /*groups*/,
    int max_blocks_per_seq, int block_size, int num_heads, int num_kv_heads, int partition,
    float scale_log2, unsigned* __restrict__ counters, float* __restrict__ records,
    __nv_bfloat16* __restrict__ out, int block_shift, int order, int prefetch) {
  constexpr int kLanesPerToken = kD / 8;                     // 8-element chunks per row
  constexpr int kTokensPerStep = kThreads / kLanesPerToken;  // rows read per block step
  constexpr int kUnroll = kSub / kTokensPerStep;
  constexpr int kGroup = kKvGroup<Kv, kD>;
  __shared__ float q_s[kG][kD];
  __shared__ float s_s[kG][kSub];
  __shared__ float o_s[kG][kD];
  __shared__ float m_s[kG], l_s[kG], alpha_s[kG];

  PdlLaunchDependents();
  const DecodeBlock blk = DecodeBlockIndex(order);
  const int split = blk.split, group = blk.group, seq = blk.seq, num_splits = blk.num_splits;
  const int ctx = context_lens[seq];
  const int start = split * partition;
  const int head0 = group * kG;
  const int64_t q_row = query_start[seq];
  if (start >= ctx) {
    if (ctx == 0 && split == 0) {
      PdlWait();
      WriteZeroRows<kD, kG>(q_row, num_heads, head0, out);
    }
    return;
  }
  const int n = min(partition, ctx - start);
  const int kv_head = head0 / (num_heads / num_kv_heads);
  const int tid = threadIdx.x;
  const int32_t* table =
      block_tables +
      static_cast<int64_t>(table_rows != nullptr ? table_rows[seq] : seq) * max_blocks_per_seq;
  const int chunk = tid % kLanesPerToken, tok_lane = tid / kLanesPerToken;
  const int warp = tid / 32, lane = tid % 32;

  // K and V rows of a sub-tile (and their scales); `skip_pos` is left for later (zeros).
  typename Kv::Vec8 kv[kUnroll], vv[kUnroll];
  float ks[kUnroll], vs[kUnroll];
  auto load_row = [&](int u, int pos) {
    const int64_t off =
        KvPoolRow(table, pos, block_size, block_shift, num_kv_heads, kv_head) * kD + chunk * 8;
    kv[u] = Kv::Load8(k_cache + KvBytes<Kv>(off));
    vv[u] = Kv::Load8(v_cache + KvBytes<Kv>(off));
    if constexpr (Kv::kQuantized) {
      ks[u] = __ldg(k_scales + KvScaleIndex<kGroup>(off));
      vs[u] = __ldg(v_scales + KvScaleIndex<kGroup>(off));
    }
  };
  auto load_tile = [&](int sub, int cnt, int skip_pos) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = u * kTokensPerStep + tok_lane;
      int pos = start + sub + tok;
      if (tok < cnt && pos != skip_pos) {
        load_row(u, pos);
      } else {
        kv[u] = vv[u] = typename Kv::Vec8{};
        ks[u] = vs[u] = 0.0f;
      }
    }
  };
  // Earlier steps wrote every key but the last (ctx - 1), which the previous kernel writes now:
  // the first sub-tile's other rows are loaded before waiting for it.
  load_tile(0, min(kSub, n), ctx - 1);
  PdlWait();
  if (ctx - 1 - start < kSub) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = u * kTokensPerStep + tok_lane;
      if (start + tok == ctx - 1) load_row(u, ctx - 1);
    }
  }

  for (int i = tid; i < kG * kD; i += kThreads) {
    int g = i / kD, d = i % kD;
    q_s[g][d] =
        __bfloat162float(LoadProduced(q + (q_row * num_heads + head0 + g) * kD + d)) * scale_log2;
    o_s[g][d] = 0.0f;
  }
  if (tid < kG) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  __syncthreads();

  float qf[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[g][e] = q_s[g][chunk * 8 + e];
  }
  float acc[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  }

  for (int sub = 0; sub < n; sub += kSub) {
    const int cnt = min(kSub, n - sub);
    if (sub > 0) load_tile(sub, cnt, -1);
      // Scores (log2 domain).
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = u * kTokensPerStep + tok_lane;
      float kf[8];
      Kv::Decode8(kv[u], kf);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        float sc = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) sc = fmaf(qf[g][e], kf[e], sc);
        if constexpr (Kv::kQuantized) sc *= ks[u];  // the chunk lies in one scale group
#pragma unroll
        for (int o = kLanesPerToken / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
        if (chunk == 0 && tok < cnt) s_s[g][tok] = sc;
      }
    }
    __syncthreads();
    // Online softmax update, one warp per head.
    for (int g = warp; g < kG; g += kThreads / 32) {
      float a = lane < cnt ? s_s[g][lane] : -INFINITY;
      float b = lane + 32 < cnt ? s_s[g][lane + 32] : -INFINITY;
      float m_old = m_s[g];
      float m_new = fmaxf(m_old, WarpMax(fmaxf(a, b)));
      float pa = lane < cnt ? exp2f(a - m_new) : 0.0f;
      float pb = lane + 32 < cnt ? exp2f(b - m_new) : 0.0f;
      if (lane < cnt) s_s[g][lane] = pa;
      if (lane + 32 < cnt) s_s[g][lane + 32] = pb;
      float sum = WarpSum(pa + pb);
      if (lane == 0) {
        float alpha = exp2f(m_old - m_new);  // 0 on the first sub-tile (m_old = -inf)
        alpha_s[g] = alpha;
        l_s[g] = l_s[g] * alpha + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();
    // o = alpha * o + sum_t p_t v_t.
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      float alpha = alpha_s[g];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = u * kTokensPerStep + tok_lane;
      if (tok < cnt) {
        float vf[8];
        Kv::Decode8(vv[u], vf);
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          float p = s_s[g][tok];
          if constexpr (Kv::kQuantized) p *= vs[u];  // p v = (p scale) code
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
        }
      }
    }
    __syncthreads();  // s_s is rewritten by the next sub-tile
  }
  SumTokenLanes<kD, kG>(acc, o_s, q_s);  // q_s is dead: q is in registers
  FinishSplit<kD, kG, 1>(o_s, m_s, l_s,
                         OneToken(q_row, seq, ctx, partition, group, num_heads / kG, counters),
                         split, num_splits, head0, num_heads, records, out);
}

// Calls f(std::integral_constant<int, D>{}) with the head size D (32, 64 or 128; the launcher
// checked it).
template <typename F>
void DispatchHeadDim(int head_dim, F&& f) {
  if (head_dim == 32) {
    f(std::integral_constant<int, 32>{});
  } else if (head_dim == 64) {
    f(std::integral_constant<int, 64>{});
  } else {
    f(std::integral_constant<int, 128>{});
  }
}

// Which kernel and how many keys per split a launch uses. Deterministic mode keeps its fixed
// partition and the kernel it implies (results must not depend on the batch). Otherwise: under
// 128 (sequence, head group) pairs the sub-tile kernel with 64-key splits, from there the
// two-phase kernel with 128- or 256-key splits (DecodePartition; 512 for a quantized cache), or
// the mma kernel in its place where kMmaDecodeSupported; TPSERVE_DECODE_KERNEL and
// TPSERVE_DECODE_PARTITION (SetDecodeOverride) force one.
struct DecodePlan {
  DecodeKernel kernel;
  int partition;
};
template <typename Kv, int kD>
DecodePlan PlanDecode(const DeviceBatch& b, int num_heads, int num_kv_heads) {
  if (b.decode_partition > 0) {
    // Deterministic mode: the bf16 tensor-core kernel where it applies (DeterministicDecodeMma:
    // TPSERVE_DETERMINISTIC_DECODE), else the two-phase or, at 64-key splits, the sub-tile kernel.
    if (kMmaBf16Supported<Kv, kD> && DeterministicDecodeMma()) {
      return {DecodeKernel::kMmaBf16, b.decode_partition};
    }
    return {b.decode_partition == kSub ? DecodeKernel::kSubTile : DecodeKernel::kTwoPhase,
            b.decode_partition};
  }
  const int auto_p = DecodePartition(b.num_seqs, num_heads, num_kv_heads);
  const DecodeKernel named = DecodeKernelOverride();
  if (named == DecodeKernel::kMmaBf16) {  // by name only (A/B runs and tests)
    const int p = DecodePartitionOverride();
    return {kMmaBf16Supported<Kv, kD> ? DecodeKernel::kMmaBf16 : DecodeKernel::kTwoPhase,
            std::min(p > 0 ? p : auto_p, kMmaBf16MaxPartition)};
  }
  DecodeKernel kernel = named;
  if (kernel == DecodeKernel::kAuto) {
    kernel = auto_p == kSub ? DecodeKernel::kSubTile : DecodeKernel::kTwoPhase;
  }
  // The tensor-core kernel where it applies, unless the two-phase kernel was asked for by name.
  if (kernel == DecodeKernel::kMma ||
      (kernel == DecodeKernel::kTwoPhase && named == DecodeKernel::kAuto)) {
    kernel = kMmaDecodeSupported<Kv, kD> ? DecodeKernel::kMma : DecodeKernel::kTwoPhase;
  }
  int p = DecodePartitionOverride();
  if (p == 0) {
    // A quantized cache's rows are half or a quarter of bf16's: its two-phase blocks take the
    // largest partition so that the per-block costs (q, softmax, the merge) spread over more
    // keys (H200, d 128, G = 1, batches 8-128 at context 1024 and batch 8 at 4096: 512-key
    // splits beat 256 by 5-10% and 128 by 15-25% for fp8, int8 and int4; bf16 is flat).
    p = Kv::kQuantized && kernel != DecodeKernel::kSubTile ? kMaxTwoPhasePartition : auto_p;
  }
  if (kernel != DecodeKernel::kSubTile) {
    // 1024-key splits only for the mma kernel asked for by name (A/B runs).
    const bool long_splits = kernel == DecodeKernel::kMma && named == DecodeKernel::kMma;
    p = std::min(p, long_splits ? kMaxMmaPartition : kMaxTwoPhasePartition);
  }
  return {kernel, p};
}

// The order of a decode launch's blocks. Sequence-major (the default): blockIdx.x is the
// sequence, so the blocks that run together read the same key range of the same heads of many
// sequences; where those sequences share cached prefix blocks (prefix caching), most of their
// reads hit L2 (H200, shared-prefix preset: 4,357-4,420 output tokens/s against 4,089-4,107
// split-major, TPOT p50 13.9-14.1 ms against 14.9-15.0). Split-major (TPSERVE_DECODE_ORDER=split):
// blockIdx.x is the split, so the blocks that run together cover few sequences, all their splits
// and heads. Without sharing the two are within 1% (engine batch 8-64 steps, batch64 preset).
int DecodeOrderOf();
// TPSERVE_DECODE_PREFETCH: the mma kernel's L2 prefetch distance in loop iterations (0 = none).
int DecodePrefetchOf();
dim3 DecodeGrid(int splits, int groups, int seqs) {
  switch (DecodeOrderOf()) {
    case kDecodeSeqMajor:
      return dim3(seqs, groups, splits);
    case kDecodeHeadMajor:
      return dim3(groups, seqs, splits);
    default:
      return dim3(splits, groups, seqs);
  }
}

template <typename Kv, int kD, int kG>
void LaunchTyped(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                 int num_kv_heads, float scale, const DeviceBatch& b, float* workspace,
                 unsigned* counters, Tensor out, cudaStream_t stream) {
  const DecodePlan plan = PlanDecode<Kv, kD>(b, num_heads, num_kv_heads);
  // The mma kernel's shared memory holds MmaMaxPartition(kG) keys (1024 up to 4 heads a block).
  const int partition = plan.kernel == DecodeKernel::kMma
                            ? std::min(plan.partition, MmaMaxPartition(kG))
                            : plan.partition;
  auto kernel = plan.kernel == DecodeKernel::kSubTile ? DecodePartitionKernel<Kv, kD, kG>
                : plan.kernel == DecodeKernel::kMma
                    ? (DecodePrefetchOf() > 0 ? DecodeMmaKernel<Kv, kD, kG, true>
                                              : DecodeMmaKernel<Kv, kD, kG, false>)
                : plan.kernel == DecodeKernel::kMmaBf16 ? DecodeMmaBf16Kernel<Kv, kD, kG, 1>
                                                        : DecodeTwoPhaseKernel<Kv, kD, kG, 1>;
  const int block_shift = KvBlockShift(b.block_size);
  const auto* kc = static_cast<const uint8_t*>(k_cache.data);
  const auto* vc = static_cast<const uint8_t*>(v_cache.data);
  const auto* k_scales = static_cast<const float*>(k_cache.scales);
  const auto* v_scales = static_cast<const float*>(v_cache.scales);
  if (b.token_context_lens == nullptr) {
    if constexpr (kMmaBf16Supported<Kv, kD>) {
      // Deterministic decode of many sequences: one block a (sequence, head group) runs its
      // splits in turn and folds them (the prefill's split loop, kQ = 1: the same bits as a block
      // a split merged by MergeColumn), without the records and the last block's merge.
      if (plan.kernel == DecodeKernel::kMmaBf16 && DeterministicSplitLoop() &&
          b.num_seqs * (num_heads / kG) >= kDecodeLoopMinBlocks) {
        constexpr size_t kFoldBytes = sizeof(float) * kG * 4 * (kD + 2);
        LaunchPdl(DecodeMmaBf16Kernel<Kv, kD, kG, 1, true>, dim3(1, num_heads / kG, b.num_seqs),
                  dim3(kThreads), kFoldBytes, stream, q.ptr<const __nv_bfloat16>(), kc, vc,
                  k_scales, v_scales, b.query_start, b.context_lens, b.block_tables,
                  static_cast<const int32_t*>(nullptr), static_cast<const int2*>(nullptr),
                  b.max_blocks_per_seq, b.block_size, num_heads, num_kv_heads, partition,
                  scale * kLog2e, counters, workspace, out.ptr<__nv_bfloat16>(), block_shift,
                  static_cast<int>(kDecodeSplitMajor), DecodePrefetchOf());
        TP_CUDA_CHECK_LAUNCH();
        return;
      }
    }
    const dim3 grid = DecodeGrid(DecodeSplits(b, partition), num_heads / kG, b.num_seqs);
    static const int sms = CurrentDeviceSms();  // read once: a process drives one device
    if (plan.kernel == DecodeKernel::kMmaBf16 &&
        int64_t{grid.x} * grid.y * grid.z <= int64_t{kMmaBf16WideBlocksPerSm} * sms) {
      kernel = DecodeMmaBf16Kernel<Kv, kD, kG, 1, false, /*kWide=*/true>;
    }
    LaunchPdl(kernel, grid, dim3(kThreads), 0, stream, q.ptr<const __nv_bfloat16>(), kc, vc,
              k_scales, v_scales, b.query_start, b.context_lens, b.block_tables,
              static_cast<const int32_t*>(nullptr), static_cast<const int2*>(nullptr),
              b.max_blocks_per_seq, b.block_size, num_heads, num_kv_heads, partition,
              scale * kLog2e, counters, workspace, out.ptr<__nv_bfloat16>(), block_shift,
              DecodeOrderOf(), DecodePrefetchOf());
    TP_CUDA_CHECK_LAUNCH();
    return;
  }
  // Deterministic mode's prefill in token groups: a block of the two-phase or the bf16 mma
  // kernel reads a split's K/V once for kQ tokens of a group (each token's bits as in a launch
  // of its own, below); one launch per chunk of kDecodeQueryChunk token queries (its groups;
  // the chunks share the workspace).
  // loop_smem > 0: the bf16 mma kernel's split loop, with that much dynamic shared memory. It
  // keeps no records, so one launch takes every chunk's groups (grid x 1: a block's splits are
  // its loop), the token arrays whole.
  auto launch_groups = [&](auto group_kernel, auto q_tokens, size_t loop_smem = 0) {
    constexpr int kQ = decltype(q_tokens)::value;
    const int queries = b.num_token_queries > 0 ? b.num_token_queries : b.num_tokens;
    const int chunks = CeilDiv(queries, kDecodeQueryChunk);
    const bool whole = loop_smem > 0;
    const int splits = whole ? 1 : DecodeSplits(b, partition);
    for (int k = 0; k < (whole ? 1 : chunks); ++k) {
      const int g0 = whole ? 0 : b.token_group_chunks[k];
      const int groups = b.token_group_chunks[whole ? chunks : k + 1] - g0;
      const int t0 = whole ? 0 : k * kDecodeQueryChunk;
      if (groups == 0) continue;
      const dim3 grid(splits, num_heads / kG * (kTokenGroup / kQ), groups);
      LaunchPdl(group_kernel, grid, dim3(kThreads), loop_smem, stream, q.ptr<const __nv_bfloat16>(),
                kc, vc, k_scales, v_scales, b.token_query_start + t0, b.token_context_lens + t0,
                b.block_tables, b.token_table_rows + t0, b.token_groups + g0, b.max_blocks_per_seq,
                b.block_size, num_heads, num_kv_heads, partition, scale * kLog2e, counters,
                workspace, out.ptr<__nv_bfloat16>(), block_shift,
                static_cast<int>(kDecodeSplitMajor), DecodePrefetchOf());
      TP_CUDA_CHECK_LAUNCH();
    }
  };
  constexpr int kQm = kMmaBf16GroupTokens<Kv, kD, kG>;
  if constexpr (kQm > 1) {
    if (b.token_groups != nullptr && plan.kernel == DecodeKernel::kMmaBf16) {
      if (DeterministicSplitLoop()) {
        // One block a group loops over its splits, merging as it goes: no records.
        constexpr size_t kFoldBytes = sizeof(float) * kG * kQm * 4 * (kD + 2);
        auto kernel_loop = DecodeMmaBf16Kernel<Kv, kD, kG, kQm, true>;
        static const bool configured = [&] {
          TP_CUDA_CHECK(cudaFuncSetAttribute(
              kernel_loop, cudaFuncAttributeMaxDynamicSharedMemorySize, int{kFoldBytes}));
          return true;
        }();
        (void)configured;
        launch_groups(kernel_loop, std::integral_constant<int, kQm>{}, kFoldBytes);
      } else {
        launch_groups(DecodeMmaBf16Kernel<Kv, kD, kG, kQm>, std::integral_constant<int, kQm>{});
      }
      return;
    }
  }
  constexpr int kQ = kTwoPhaseGroupTokens<Kv, kD, kG>;
  if constexpr (kQ > 1) {
    if (b.token_groups != nullptr && plan.kernel == DecodeKernel::kTwoPhase) {
      launch_groups(DecodeTwoPhaseKernel<Kv, kD, kG, kQ>, std::integral_constant<int, kQ>{});
      return;
    }
  }
  // Every query token as a decode query of its own (deterministic mode): token t reads the
  // cache of its sequence up to its own position, in launches of kDecodeQueryChunk tokens
  // that share the workspace (stream order keeps them apart). SetBatch turned programmatic
  // launch off for the step: a token reads K/V rows that the previous kernel writes. The decode
  // rows of a mixed step (num_token_queries of them) read only their own sequences' rows, of
  // which the previous kernel writes the last, as in an all-decode step: launched as that is.
  const int queries = b.num_token_queries > 0 ? b.num_token_queries : b.num_tokens;
  for (int t0 = 0; t0 < queries; t0 += kDecodeQueryChunk) {
    const int n = std::min(kDecodeQueryChunk, queries - t0);
    DeviceBatch chunk = b;
    chunk.num_seqs = chunk.num_tokens = n;
    const dim3 grid = DecodeGrid(DecodeSplits(chunk, partition), num_heads / kG, n);
    LaunchPdl(kernel, grid, dim3(kThreads), 0, stream, q.ptr<const __nv_bfloat16>(), kc, vc,
              k_scales, v_scales, b.token_query_start + t0, b.token_context_lens + t0,
              b.block_tables, b.token_table_rows + t0, static_cast<const int2*>(nullptr),
              b.max_blocks_per_seq, b.block_size, num_heads, num_kv_heads, partition,
              scale * kLog2e, counters, workspace, out.ptr<__nv_bfloat16>(), block_shift,
              DecodeOrderOf(), DecodePrefetchOf());
    TP_CUDA_CHECK_LAUNCH();
  }
}

template <typename Kv, int kD>
void LaunchForDim(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                  int num_kv_heads, float scale, const DeviceBatch& b, float* workspace,
                  unsigned* counters, Tensor out, cudaStream_t stream) {
  const int g = DecodeHeadsPerBlock(num_heads, num_kv_heads);
  auto launch = g == 8   ? LaunchTyped<Kv, kD, 8>
                : g == 4 ? LaunchTyped<Kv, kD, 4>
                : g == 2 ? LaunchTyped<Kv, kD, 2>
                         : LaunchTyped<Kv, kD, 1>;
  launch(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, workspace, counters, out, stream);
}

DecodeKernel ParseDecodeKernel(const std::string& name) {
  return name == "subtile"    ? DecodeKernel::kSubTile
         : name == "twophase" ? DecodeKernel::kTwoPhase
         : name == "mma"      ? DecodeKernel::kMma
         : name == "mma-bf16" ? DecodeKernel::kMmaBf16
                              : DecodeKernel::kAuto;
}

// The process-wide override (launchers.h), first read from the environment.
struct DecodeOverrides {
  std::atomic<int> kernel;
  std::atomic<int> partition;
};
DecodeOverrides& Overrides() {
  static DecodeOverrides o{{static_cast<int>(ParseDecodeKernel(EnvString(env::kDecodeKernel)))},
                           {std::stoi(EnvString(env::kDecodePartition))}};
  return o;
}

std::atomic<bool>& DeterministicMmaFlag() {
  static std::atomic<bool> mma{EnvString(env::kDeterministicDecode) != "twophase"};
  return mma;
}

std::atomic<bool>& SplitLoopFlag() {
  static std::atomic<bool> loop{EnvBool(env::kDeterministicSplitLoop)};
  return loop;
}

std::atomic<int>& PrefetchOverride() {
  static std::atomic<int> prefetch{static_cast<int>(EnvInt(env::kDecodePrefetch))};
  return prefetch;
}
int DecodePrefetchOf() { return PrefetchOverride().load(); }

int DecodeOrderOf() {
  static const int order = [] {
    const std::string o = EnvString(env::kDecodeOrder);
    return o == "seq" ? kDecodeSeqMajor : o == "head" ? kDecodeHeadMajor : kDecodeSplitMajor;
  }();
  return order;
}

}  // namespace

void SetDecodeOverride(DecodeKernel kernel, int partition) {
  Overrides().kernel = static_cast<int>(kernel);
  Overrides().partition = partition;
}
void SetDecodePrefetch(int distance) { PrefetchOverride() = distance; }
void SetDeterministicDecodeMma(bool mma) { DeterministicMmaFlag() = mma; }
bool DeterministicDecodeMma() { return DeterministicMmaFlag().load(); }
void SetDeterministicSplitLoop(bool loop) { SplitLoopFlag() = loop; }
bool DeterministicSplitLoop() { return SplitLoopFlag().load(); }
int DecodePrefetch() { return DecodePrefetchOf(); }

DecodeKernel DecodeKernelOverride() { return static_cast<DecodeKernel>(Overrides().kernel.load()); }
int DecodePartitionOverride() { return Overrides().partition.load(); }

int DecodeLaunchPartition(const DeviceBatch& b, int num_heads, int num_kv_heads, int head_dim,
                          DType kv) {
  int p = 0;
  DispatchKvType(kv, [&](auto kv_type) {
    DispatchHeadDim(head_dim, [&](auto d) {
      p = PlanDecode<decltype(kv_type), decltype(d)::value>(b, num_heads, num_kv_heads).partition;
    });
  });
  return p;
}

void LaunchAttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                           int num_heads, int num_kv_heads, int head_dim, float scale,
                           const DeviceBatch& b, float* workspace, unsigned* counters, Tensor out,
                           cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(q, DType::kBF16);
  CheckKvCaches("AttentionDecode", k_cache, v_cache);
  TP_CHECK_CUDA_TENSOR(out, DType::kBF16);
  TP_CHECK(b.num_tokens == b.num_seqs || b.token_context_lens != nullptr)
      << "AttentionDecode needs one query per sequence (tokens " << b.num_tokens << ", seqs "
      << b.num_seqs << "); use AttentionPrefill";
  TP_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && CudaSupportsHeadDim(head_dim) &&
           k_cache.ndim == 4 && k_cache.dim(1) == b.block_size && k_cache.dim(2) == num_kv_heads &&
           k_cache.dim(3) == head_dim && v_cache.numel() == k_cache.numel() &&
           q.numel() == int64_t{b.num_tokens} * num_heads * head_dim && out.numel() == q.numel())
      << "AttentionDecode: q " << q.ShapeString() << ", k_cache " << k_cache.ShapeString()
      << ", out " << out.ShapeString() << ", heads " << num_heads << "/" << num_kv_heads
      << ", head_dim " << head_dim << " (" << kCudaHeadDims << "), block_size " << b.block_size;
  TP_CHECK(workspace != nullptr && counters != nullptr)
      << "AttentionDecode: no workspace or counters";
  // The tensor-core kernel keeps a split's pool rows as 32-bit ints.
  TP_CHECK(k_cache.numel() / head_dim <= INT32_MAX)
      << "AttentionDecode: a cache of " << k_cache.numel() / head_dim << " rows (at most 2^31 - 1)";
  if (b.num_tokens == 0) return;
  DispatchKvType(k_cache.dtype, [&](auto kv_type) {
    DispatchHeadDim(head_dim, [&](auto d) {
      LaunchForDim<decltype(kv_type), decltype(d)::value>(
          q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, workspace, counters, out, stream);
    });
  });
}

}  // namespace tpserve::cuda
