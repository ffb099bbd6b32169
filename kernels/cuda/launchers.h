// Internal interface between CudaOps and the per-op .cu files: the device copy of the batch and
// one launcher per kernel. Every launcher checks shapes and dtypes and the launch itself.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/dtype.h"

namespace tpserve::cuda {

// Query rows per prefill-attention tile (one CUDA block per tile and head): 128 (8 warps), or 64
// (4 warps) with TPSERVE_PREFILL_TILE=64 (read once). SetBatch cuts the work list with it.
int PrefillTileM();
// The smallest tile PrefillTileM() returns (sizes the work list's reservation).
inline constexpr int kPrefillTileMinM = 64;
// The prefill-attention kernels: kMma (attention_prefill.cu: mma.sync, every head_dim and cache
// dtype) and kWgmma (attention_prefill_wgmma.cu: Hopper's wgmma, for bf16, fp8 and int8 caches
// at head_dim 64 and 128 on an sm_90 device; elsewhere the mma kernel runs); kWgmmaPipe: the
// wgmma kernel with a tile's softmax overlapping the previous tile's P V (bf16 caches; the 8-bit
// ones run kWgmma); kWgmmaWs: the same with a producer warp feeding an mbarrier ring, so the
// warpgroups run apart (bf16; 8-bit caches run kWgmma); kWgmmaTma: kWgmmaWs whose producer
// loads the pages with TMA (block sizes that are multiples of 8 dividing 64; others run
// kWgmmaWs); kWgmmaFa3: FlashAttention-3's structure, a TMA producer warpgroup that gives its
// registers to two consumer warpgroups (setmaxnreg) so that they compute 128-key tiles (bf16,
// block sizes that are multiples of 8 dividing 128; other block sizes and 8-bit caches run
// kWgmma); kWgmmaFa3Pp: kWgmmaFa3 with FlashAttention-3's ping-pong of the two consumer
// warpgroups' MMAs (named barriers); kWgmmaFa3P: kWgmmaFa3 on a persistent grid (a block an SM
// looping over the work items, the K/V ring and Q's loads running on across items, so that a
// block's prologue overlaps the previous item's end). Starts from TPSERVE_PREFILL_KERNEL
// (default wgmma-fa3p: 323 TFLOP/s on a 2048-token prompt against wgmma-fa3 302, wgmma 288, mma
// 194 on an H100); SetPrefillKernel (benchmarks and tests) sets
// it for every later launch of this process.
enum class PrefillKernel {
  kMma,
  kWgmma,
  kWgmmaPipe,
  kWgmmaWs,
  kWgmmaTma,
  kWgmmaFa3,
  kWgmmaFa3Pp,
  kWgmmaFa3P
};
// Every prefill kernel with its TPSERVE_PREFILL_KERNEL name.
struct PrefillKernelName {
  PrefillKernel kernel;
  const char* name;
};
inline constexpr PrefillKernelName kPrefillKernels[] = {
    {PrefillKernel::kMma, "mma"},
    {PrefillKernel::kWgmma, "wgmma"},
    {PrefillKernel::kWgmmaPipe, "wgmma-pipe"},
    {PrefillKernel::kWgmmaWs, "wgmma-ws"},
    {PrefillKernel::kWgmmaTma, "wgmma-tma"},
    {PrefillKernel::kWgmmaFa3, "wgmma-fa3"},
    {PrefillKernel::kWgmmaFa3Pp, "wgmma-fa3pp"},
    {PrefillKernel::kWgmmaFa3P, "wgmma-fa3p"},
};
void SetPrefillKernel(PrefillKernel kernel);
PrefillKernel PrefillKernelChoice();
// Prefill attention over 8-bit caches (fp8, int8) through a bf16 scratch: the wgmma kernel that
// decodes codes inside its tile loop reaches 183 TFLOP/s on a 2048-token prompt where the bf16
// kernels reach 300-320 (H100): each query tile decodes every K/V tile it reads again, with one
// stage in flight. With the scratch, SetBatch picks the sequences whose attention reads each key
// often enough (PrefillDequantTakes), LaunchDequantizeKvPages writes their pages as bf16 once a
// layer, and the bf16 kernel runs their query tiles; the others keep the in-kernel decode. The
// scratch holds bf16(code * scale) (one more rounding than the in-kernel path, which scales the
// fp32 scores and P: a relative 2^-9 on K and V, 1/32 of fp8's own step). kAuto:
// PrefillDequantTakes; kOff: never; kAll: every sequence whose pages fit (tests). From
// TPSERVE_PREFILL_DEQUANT; SetPrefillDequant sets it for every later SetBatch of this process.
enum class PrefillDequant { kOff, kAuto, kAll };
void SetPrefillDequant(PrefillDequant mode);
PrefillDequant PrefillDequantChoice();
// kAuto's rule: the sequence's query-key pairs (causal) are at least kPrefillDequantPairsPerKey
// times its keys (a key's dequantization then costs less than the in-kernel decode would spend
// on its reads: ~180 by a model from the H100 rows, 183 against 300+ TFLOP/s and ~24 KB of
// copy a key and layer at ~3 TB/s; the rule itself was not swept).
inline constexpr int kPrefillDequantPairsPerKey = 256;
bool PrefillDequantTakes(PrefillDequant mode, int query_len, int context_len);

// A step with prompt tokens beside decode rows (continuous batching): SetBatch puts the decode
// rows' work items last (DeviceBatch::num_mixed_decode) and describes them as token queries
// (mixed_*), so that CudaOps::AttentionPrefill can run them through the decode kernel (split
// over keys, as in an all-decode step) and only the prompt chunks through the prefill kernel,
// which gives each (row, head) one block over all its keys. kAuto splits for quantized caches:
// there the prefill kernel decodes every tile of a decode row with one stage in flight (H100,
// 63 decode rows at context 1024 beside a 449-token chunk, fp8: attention 247 against 566 us a
// layer), while the bf16 FA3 kernel reads them as fast as the decode kernel (395 split against
// 379 us). kOn / kOff: always / never (kOff plans nothing). From TPSERVE_MIXED_DECODE;
// SetMixedDecode sets it for every later SetBatch of this process.
enum class MixedDecode { kOff, kAuto, kOn };
void SetMixedDecode(MixedDecode mode);
MixedDecode MixedDecodeChoice();
// Whether a planned step's decode rows take the decode kernel over a cache of dtype `kv`.
bool MixedDecodeSplits(MixedDecode mode, DType kv);

// The prefill kernels' grid: (heads, work items), so that a work item's heads are neighbours in
// dispatch order and, with SetBatch's heaviest-first work list, every head's heaviest query tiles
// start before any lighter one (PrefillBlockOf reads it). The order before 2026-12-05, a head's
// tiles together, left head 31's heaviest tile among the last blocks: a 2048-token prefill at
// one block an SM modeled at 43 tile-times against 34 (ideal 33), measured on an H200 241 against
// 295 TFLOP/s (wgmma) and 156 against 193 (mma). Checks the work items fit a grid dimension.
struct DeviceBatch;
dim3 PrefillGrid(const DeviceBatch& b, int num_heads);
// Whether the wgmma kernel runs a prefill over a cache of dtype `kv` at `head_dim` here.
bool WgmmaPrefillFits(DType kv, int head_dim);

// The current batch as the kernels read it: device arrays (filled on the ops' stream by
// SetBatch) and host copies of the scalar sizes, which fix the grids.
struct DeviceBatch {
  int num_seqs = 0;
  int num_tokens = 0;
  int max_blocks_per_seq = 0;
  int block_size = 16;
  int num_logits_rows = 0;
  int max_query_len = 0;
  int max_context_len = 0;
  int num_prefill_work = 0;               // entries of prefill_work
  const int32_t* token_ids = nullptr;     // [num_tokens]
  const int32_t* positions = nullptr;     // [num_tokens]
  const int32_t* slot_mapping = nullptr;  // [num_tokens]
  const int32_t* query_start = nullptr;   // [num_seqs + 1]
  const int32_t* context_lens = nullptr;  // [num_seqs]
  const int32_t* block_tables = nullptr;  // [num_seqs * max_blocks_per_seq]
  const int32_t* logits_rows = nullptr;   // [num_logits_rows]
  const int2* prefill_work = nullptr;     // [num_prefill_work] (seq, first query row of tile)
  // Deterministic mode (CudaOps::SetDeterministic): keys per decode-attention split for every
  // batch (0: chosen by the batch, DecodePartition). When the batch is not all decode, every
  // query token is also described as a decode query of its own, [num_tokens] each: its row
  // (t), its context (position + 1) and the row of block_tables of its sequence; else null.
  int decode_partition = 0;
  const int32_t* token_query_start = nullptr;
  const int32_t* token_context_lens = nullptr;
  const int32_t* token_table_rows = nullptr;
  // Prefill over an 8-bit cache through the bf16 scratch (PrefillDequant): the first
  // num_scratch_work entries of prefill_work are the query tiles of the sequences whose pages
  // LaunchDequantizeKvPages copies, scratch_tables [num_seqs * max_blocks_per_seq] their pages
  // in the scratch (other rows unused), scratch_pages [num_scratch_pages] for each scratch page
  // (its cache page, the rows of the context in it).
  int num_scratch_work = 0;
  int num_scratch_pages = 0;
  const int32_t* scratch_tables = nullptr;
  const int2* scratch_pages = nullptr;
  // Continuous batching (MixedDecodeChoice): the last num_mixed_decode entries of prefill_work
  // are decode rows (one query, a context), described for the decode kernel by mixed_query_rows
  // (the row in q), mixed_context_lens and mixed_table_rows (the row of block_tables), each
  // [num_mixed_decode]; 0 / null otherwise.
  int num_mixed_decode = 0;
  const int32_t* mixed_query_rows = nullptr;
  const int32_t* mixed_context_lens = nullptr;
  const int32_t* mixed_table_rows = nullptr;
  // Token-query mode of the decode launcher (token_context_lens set): how many of the token_*
  // entries to run (0: num_tokens).
  int num_token_queries = 0;
  // Deterministic mode's prefill: the token queries in groups of consecutive tokens of one
  // sequence, so that a block reads a split's K/V once for several of them (null: one token a
  // block). A group has at most kDecodeTokenGroup tokens and lies in one kDecodeQueryChunk of
  // token queries: [first token - the chunk's first, count + (chunk << 16)]; those of chunk k are
  // [token_group_chunks[k], token_group_chunks[k + 1]) (HOST memory, owned by the ops, valid
  // until the next SetBatch).
  const int2* token_groups = nullptr;
  const int* token_group_chunks = nullptr;
};

// Decode attention: query heads handled by one block (the largest of 8, 4, 2, 1 dividing the
// GQA group), and keys per split (flash-decoding partition), chosen from the number of
// (sequence, head group) pairs so that small batches still spread over the whole GPU. Both
// depend only on sizes fixed for a captured graph.
inline int DecodeHeadsPerBlock(int num_heads, int num_kv_heads) {
  int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 1;
  return group % 8 == 0 ? 8 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
}
// Measured on the H200 (32 heads, d 128, context 1024): under 128 pairs the 64-key sub-tile
// kernel (all K and V loads of a block in flight at once) wins (B=1: 17.5 vs 26.6 us); from
// 128 pairs the low-register two-phase kernel with 128/256-key splits wins (B=8: 64% vs 49% of
// copy bandwidth), because many more blocks stay resident.
inline int DecodePartition(int num_seqs, int num_heads, int num_kv_heads) {
  int pairs = num_seqs * (num_heads / DecodeHeadsPerBlock(num_heads, num_kv_heads));
  return pairs >= 512 ? 256 : pairs >= 128 ? 128 : 64;
}
// The decode-attention kernels (attention_decode.cu). kAuto: by the batch. kMma: the two-phase
// kernel's phases on the tensor cores, for quantized caches (fp8, int8, int4) at head_dim 64
// and 128; elsewhere it runs the two-phase kernel. Auto picks it wherever it would pick the
// two-phase kernel for such a cache.
// kMmaBf16: deterministic mode's tensor-core kernel for bf16 caches at head_dim 64 and 128
// (other bits than the two-phase kernel); by name it runs in any mode (tests, A/B runs).
enum class DecodeKernel { kAuto, kSubTile, kTwoPhase, kMma, kMmaBf16 };
// Benchmarks and tests: every later decode launch of this process uses `kernel` (kAuto: by the
// batch) and `partition` keys per split (0: by the batch; else 64, 128, 256, 512 or 1024; the
// two-phase kernel takes at most 512, the mma kernel 1024 when asked for by name, else 512). Starts
// from TPSERVE_DECODE_KERNEL and TPSERVE_DECODE_PARTITION. Deterministic mode's fixed partition is
// not overridden.
void SetDecodeOverride(DecodeKernel kernel, int partition);
// Deterministic mode's kernel for bf16 caches at head_dim 64 and 128: the tensor-core one
// (true) or the two-phase one, for every later launch of this process. Starts from
// TPSERVE_DETERMINISTIC_DECODE (mma). Every process of a deployment must use the same choice.
void SetDeterministicDecodeMma(bool mma);
bool DeterministicDecodeMma();
// Deterministic mode's prefill through that tensor-core kernel: one block a token group and head
// group looping over the group's splits and merging them as it goes (true), or one block a split
// with the partials merged through the workspace by the last to arrive; the same bits. Starts from
// TPSERVE_DETERMINISTIC_SPLIT_LOOP.
void SetDeterministicSplitLoop(bool loop);
bool DeterministicSplitLoop();
// Benchmarks: the mma decode kernel's L2 prefetch distance in loop iterations for every later
// launch (0 = none; starts from TPSERVE_DECODE_PREFETCH).
void SetDecodePrefetch(int distance);
int DecodePrefetch();
DecodeKernel DecodeKernelOverride();
int DecodePartitionOverride();
// The partition of this batch: fixed in deterministic mode, else by its size or the override.
// A launch never uses a smaller one (the two-phase kernel caps a forced one), so workspaces
// sized with this one are large enough.
inline int DecodeBatchPartition(const DeviceBatch& b, int num_heads, int num_kv_heads) {
  if (b.decode_partition > 0) return b.decode_partition;
  const int forced = DecodePartitionOverride();
  const int p = DecodePartition(b.num_seqs, num_heads, num_kv_heads);
  return forced > 0 ? std::min(forced, p) : p;
}
// The keys per split a decode launch over a cache of dtype `kv` and head size `head_dim` uses
// (>= DecodeBatchPartition).
int DecodeLaunchPartition(const DeviceBatch& b, int num_heads, int num_kv_heads, int head_dim,
                          DType kv);
// Deterministic mode: query tokens per launch when every token of a prefill is run as a decode
// query (bounds the workspace: the launches reuse it).
inline constexpr int kDecodeQueryChunk = 256;
// Deterministic mode's token groups (DeviceBatch::token_groups): at most this many tokens a
// group.
inline constexpr int kDecodeTokenGroup = 16;
// Splits of `partition` keys that cover the batch's block-table capacity.
inline int DecodeSplits(const DeviceBatch& b, int partition) {
  const int cap = b.max_blocks_per_seq * b.block_size;
  return cap <= 0 ? 1 : (cap + partition - 1) / partition;
}
inline int DecodeNumSplits(const DeviceBatch& b, int num_heads, int num_kv_heads) {
  return DecodeSplits(b, DecodeBatchPartition(b, num_heads, num_kv_heads));
}
// log2(block_size) when it is a power of two (the kernels' page math by shifts), else -1
// (by division); see KvPoolRow.
inline int KvBlockShift(int block_size) {
  for (int sh = 0; sh < 31; ++sh) {
    if ((1 << sh) == block_size) return sh;
  }
  return -1;
}

// Decode attention: the partial results of the splits [seq][head][split] -> (o[head_dim], max,
// sum), and one arrival counter per (sequence, head group) in a buffer of their own. The last
// block of a (sequence, head group) to finish merges the partials and resets its counter, so
// the counters must be zero before the first launch (CudaOps clears them when allocating) and
// stay zero between launches.
inline size_t DecodeWorkspaceFloats(const DeviceBatch& b, int num_heads, int num_kv_heads,
                                    int head_dim) {
  return static_cast<size_t>(b.num_seqs) * num_heads * DecodeNumSplits(b, num_heads, num_kv_heads) *
         (head_dim + 2);
}
inline size_t DecodeNumCounters(const DeviceBatch& b, int num_heads, int num_kv_heads) {
  return static_cast<size_t>(b.num_seqs) *
         (num_heads / DecodeHeadsPerBlock(num_heads, num_kv_heads));
}

// token_ids[pairs[i].x] = ids[pairs[i].y] for i < n (BatchMeta::fed_tokens on the device).
void LaunchFeedTokens(int32_t* token_ids, const int2* pairs, int n, const int32_t* ids,
                      cudaStream_t stream);
void LaunchEmbedding(const Tensor& table, int64_t row_offset, const DeviceBatch& b, Tensor out,
                     cudaStream_t stream);
void LaunchRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor out,
                   cudaStream_t stream);
// fixed_point (deterministic mode): the sum of squares in fixed point and out = bf16(bf16(h *
// weight) * scale), the arithmetic a deferred norm over the chain GEMMs gives (gemm_epilogue.cuh).
void LaunchAddRmsNorm(Tensor residual, const Tensor& x, const Tensor& weight, float eps, Tensor out,
                      cudaStream_t stream, bool fixed_point = false);
void LaunchRope(Tensor q, Tensor k, const Tensor& inv_freq, int head_dim, const DeviceBatch& b,
                cudaStream_t stream);
// KvWrite and RopeKvWrite write bf16 caches or quantized ones (kF8E4M3, kI8, kI4 with scales,
// head_dim 32, 64, 128 or 256), each token's head quantized as QuantizeKvHead (kv_quant.h).
void LaunchKvWrite(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                   const DeviceBatch& b, cudaStream_t stream);
// Ops::RopeKvWrite: qkv [T, (Hq + 2 Hk) * D] -> q_out (rotated), k (rotated) and v in the caches
// (quantized: k from its fp32 rotation, v from its bf16 values).
void LaunchRopeKvWrite(const Tensor& qkv, const Tensor& inv_freq, int num_q_heads, int num_kv_heads,
                       int head_dim, const DeviceBatch& b, Tensor q_out, Tensor k_cache,
                       Tensor v_cache, cudaStream_t stream);
void LaunchSiluMul(const Tensor& gate_up, Tensor out, cudaStream_t stream);
void LaunchAdd(const Tensor& a, const Tensor& b, Tensor out, cudaStream_t stream);
void LaunchGatherRows(const Tensor& in, const DeviceBatch& b, Tensor out, cudaStream_t stream);
void LaunchInterleaveShards(const Tensor& in, Tensor out, cudaStream_t stream);
// The attention launchers take q and out in bf16 and caches in bf16, or both fp8 (e4m3), int8 or
// int4 with their scales (kernels/kv_quant.h), decoded in the kernels (kv_read.cuh).
void LaunchAttentionPrefill(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                            int num_heads, int num_kv_heads, int head_dim, float scale,
                            const DeviceBatch& b, Tensor out, cudaStream_t stream);
// Scratch page i of k_scratch / v_scratch (bf16 [pages, block_size, Hk, D]) := bf16(code *
// scale) of the rows [0, b.scratch_pages[i].y) of cache page b.scratch_pages[i].x, zeros past
// them (so that no stale code of a last page reaches a product); 8-bit caches (fp8, int8).
void LaunchDequantizeKvPages(const Tensor& k_cache, const Tensor& v_cache, const DeviceBatch& b,
                             Tensor k_scratch, Tensor v_scratch, cudaStream_t stream);
// The wgmma kernels (WgmmaPrefillFits must hold; `kernel` not kMma); LaunchAttentionPrefill
// calls it when one is chosen.
void LaunchAttentionPrefillWgmma(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                 int num_heads, int num_kv_heads, int head_dim, float scale,
                                 const DeviceBatch& b, Tensor out, PrefillKernel kernel,
                                 cudaStream_t stream);
// workspace: DecodeWorkspaceFloats(b, num_heads, num_kv_heads, head_dim) floats; counters:
// DecodeNumCounters(b, num_heads, num_kv_heads), zero.
// One kernel (the last block of each sequence and head group merges the splits). A batch that
// is not all decode is accepted in deterministic mode (b.token_context_lens set): one decode
// query per token, in launches of kDecodeQueryChunk tokens. A decode step may read
// the cache rows (and scales) of positions < context_len - 1 before the previous kernel in the
// stream has finished (programmatic dependent launch): only the current token's row may be
// written by it.
void LaunchAttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                           int num_heads, int num_kv_heads, int head_dim, float scale,
                           const DeviceBatch& b, float* workspace, unsigned* counters, Tensor out,
                           cudaStream_t stream);

// Fixed-order GEMM y[M, N] = x[M, K] w[N, K]^T (+ bias) for deterministic serving: every output
// is computed with the same instructions in the same order for every M and every variant
// (gemm_fixed_order.cu says which), so a row's bits do not depend on the rows beside it. kSplit
// streams w once per 8-32 tokens (decode sizes, close to copy bandwidth at M = 1); kSliced
// splits K over a cluster of blocks (batches); kTiled stages tiles through shared memory
// (prefill sizes); kAuto picks kSplit up to kFixedOrderSplitMaxM rows, kSliced up to
// kFixedOrderSlicedMaxM. Needs K % 8 == 0 and 16-byte aligned x and w (FixedOrderGemmFits).
enum class FixedOrderGemmVariant { kAuto, kSplit, kSliced, kTiled };
// By the H200 sweep (tpserve-cuda-bench --det-gemm, 6.7B shapes): split is the fastest up to
// M = 32, sliced at 64-128, tiled from 256.
inline constexpr int64_t kFixedOrderSplitMaxM = 32;
inline constexpr int64_t kFixedOrderSlicedMaxM = 128;
bool FixedOrderGemmFits(const Tensor& x, const Tensor& w, const Tensor& y);
void LaunchFixedOrderGemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                          cudaStream_t stream,
                          FixedOrderGemmVariant variant = FixedOrderGemmVariant::kAuto);

// Deterministic mode's decode GEMMs (gemm_lt_chain.cu): y[M, N] = x[M, K] w[N, K]^T (+ bias) for
// M <= kChainGemvMaxM with the bits of cuBLASLt's fixed algorithm (LtGemm::set_fixed_algorithm),
// each output one chain of mma.m16n8k16 over K in order. Needs K % 16 == 0 and 16-byte aligned
// x and w (ChainGemvFits). The fused forms (M <= kSkinnyFusedMaxM) give the bits of the unfused
// ops in deterministic mode: SwiGLU input (SiluMul then the GEMM), a deferred norm's row scale
// on the input (ApplyRowScale then the GEMM), the RoPE/KV epilogue (RopeKvWrite after the GEMM;
// head_dim % 32 == 0, bf16 caches), and the deferred norm's producer (AddRmsNorm's arithmetic in
// deterministic mode: LaunchAddRmsNorm's `fixed_point`).
inline constexpr int64_t kChainGemvMaxM = 16;
bool ChainGemvFits(int64_t m, int64_t k, const void* x, const void* w);
// config 0 = the kernels' pipeline; 1 .. ChainGemvNumConfigs(m) - 1 other pipelines (threads, K
// per stage, stages, copies by the chain-less warps only, tiles a block, L2 prefetch) for
// benchmarking at M <= 2.
void LaunchChainGemv(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                     cudaStream_t stream, int config = 0);
// The configurations LaunchChainGemv takes at M = m: all at M <= 2 (the tiled ones only with
// `tiled`: the weight's tiles registered), config 0 up to kChainGemvMaxM, none above.
int ChainGemvNumConfigs(int64_t m, bool tiled = false);
// A tile-contiguous copy of a weight for the M <= 2 forms (TPSERVE_DETERMINISTIC_TILES): tile T
// (rows 16 T .. 16 T + 15, rows past N zero) holds its K / 16 steps one after another, each as
// the 32 lanes' 16-byte A fragments of mma.m16n8k16, so a block streams a tile's stage with one
// bulk copy (TMA) and a chain warp reads a step with one 16-byte shared load, in the same
// hardware positions as ldmatrix gives them: the same bits. ChainTileBytes(N, K) bytes (N
// rounded up to 32 rows); MakeChainTiles fills them on `stream`. RegisterChainTiles(w, tiles)
// makes every M <= 2 chain launch on w (or on a view of its first rows) read them: the copy
// must stay alive and equal to w until UnregisterChainTiles(w.data). FindChainTiles: the copy a
// launch on w reads, or null.
size_t ChainTileBytes(int64_t n, int64_t k);
void MakeChainTiles(const Tensor& w, void* tiles, cudaStream_t stream);
void RegisterChainTiles(const Tensor& w, const void* tiles);
void UnregisterChainTiles(const void* w);
const void* FindChainTiles(const Tensor& w);
// y = SiluMul(gate_up) w^T for gate_up [M, 2K].
void LaunchChainSwiGluGemv(const Tensor& gate_up, const Tensor& w, Tensor y, cudaStream_t stream);
// y = ApplyRowScale(x) w^T (+ bias): x a deferred norm's output, `record` its producer's.
void LaunchChainGemvScaledRows(const Tensor& x, const unsigned long long* record, float eps,
                               const Tensor& w, const Tensor* bias, Tensor y, cudaStream_t stream);
// The deferred norm's producer (as LaunchSkinnyGemmAddNorm): y = x w^T (+ bias) (swiglu: x =
// gate_up [M, 2K] through SiluMul); residual += y; normed = bf16(residual * gamma); the rows'
// fixed-point sums of squares added into `record` (zero before the call).
void LaunchChainGemvAddNorm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                            Tensor residual, const Tensor& gamma, Tensor normed, bool swiglu,
                            unsigned long long* record, cudaStream_t stream);
// Ops::QkvRopeKvWrite for M = b.num_tokens <= kSkinnyFusedMaxM (x_sums: x is a deferred norm's
// output, scaled on the way in).
bool ChainQkvRopeKvFits(int head_dim);
void LaunchChainQkvRopeKvWrite(const Tensor& x, const Tensor& w_qkv, const Tensor* bias,
                               const Tensor& inv_freq, int num_q_heads, int num_kv_heads,
                               int head_dim, const DeviceBatch& b, Tensor q_out, Tensor k_cache,
                               Tensor v_cache, cudaStream_t stream,
                               const unsigned long long* x_sums = nullptr, float eps = 0.0f);
// Reference GEMM y = x w^T (+ bias) as one chain of mma.m16n8k16 per output over K in order, from
// zero, one warp per output tile: w in the A operand (weights_a) or in B. Needs K % 16 == 0.
// Tests only.
void LaunchChainGemmReference(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                              bool weights_a, cudaStream_t stream);

// Skinny GEMM y[M, N] = x[M, K] w[N, K]^T (+ bias) for small M, streaming w once.
inline constexpr int kSkinnyMaxM = 16;
// config 0 = automatic; others pick (rows per block, K unroll) for benchmarking.
void LaunchSkinnyGemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                      cudaStream_t stream, int config = 0);
int SkinnyGemmNumConfigs();
// The fused variants below (SwiGLU input, RoPE/KV epilogue) exist for M <= 2.
inline constexpr int kSkinnyFusedMaxM = 2;
// y[M, N] = (silu(gate) * up) w[N, K]^T for gate_up [M, 2K] (gate then up): the MLP's down
// projection reading SiluMul's result without storing it.
void LaunchSkinnySwiGluGemm(const Tensor& gate_up, const Tensor& w, Tensor y, cudaStream_t stream,
                            int config = 0);
// Ops::QkvRopeKvWrite for M = b.num_tokens <= 2: the skinny GEMM of x by the fused q/k/v weight
// [(Hq + 2 Hk) * D, K] with RopeKvWrite as its epilogue (the projection itself is not stored).
// x_sums non-null: x is a deferred norm's output (see below), scaled per row in the epilogue.
// bf16 caches only (CudaOps::QkvRopeKvWrite says why).
void LaunchSkinnyQkvRopeKvWrite(const Tensor& x, const Tensor& w_qkv, const Tensor* bias,
                                const Tensor& inv_freq, int num_q_heads, int num_kv_heads,
                                int head_dim, const DeviceBatch& b, Tensor q_out, Tensor k_cache,
                                Tensor v_cache, cudaStream_t stream,
                                const unsigned long long* x_sums = nullptr, float eps = 0.0f);

// Deferred RMSNorm (Ops::GemmAddRmsNorm at M <= kSkinnyFusedMaxM): a record holds, for each of
// kSkinnyFusedMaxM token rows, kNormSumSlots 64-bit counters whose total is the row's sum of
// squares in fixed point (kNormSumScale units per 1.0). Integer atomics make the total
// independent of the order in which blocks add. Range: totals below 2^64 / 2^28 = 6.9e10, an
// RMS of up to ~4100 at hidden size 4096 (larger saturates and under-normalizes).
inline constexpr int kNormSumSlots = 32;
inline constexpr float kNormSumScale = 268435456.0f;  // 2^28
inline constexpr int kNormRecordWords = kSkinnyFusedMaxM * kNormSumSlots;
// The producer: y = x w^T (+ bias) (or the SwiGLU variant's (silu(gate) * up) w^T for
// x = gate_up [M, 2K]); residual += y; normed = residual * gamma (bf16, not yet scaled); each
// row's sum of squares added into `record` (zero before the call).
void LaunchSkinnyGemmAddNorm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                             Tensor residual, const Tensor& gamma, Tensor normed, bool swiglu,
                             unsigned long long* record, cudaStream_t stream);
// The consumer: y = (x scaled per row by rsqrt(sum / K + eps)) w^T (+ bias), M <= 2.
void LaunchSkinnyGemmScaledRows(const Tensor& x, const unsigned long long* record, float eps,
                                const Tensor& w, const Tensor* bias, Tensor y, cudaStream_t stream);
// x[m, :] *= rsqrt(sum_m / K + eps) in place (a consumer that cannot scale in its epilogue).
void LaunchApplyRowScale(Tensor x, const unsigned long long* record, float eps,
                         cudaStream_t stream);
// Zeroes `words` 64-bit counters (a multiple of 2), in the programmatic-launch chain.
void LaunchZeroNormSums(unsigned long long* sums, int64_t words, cudaStream_t stream);

// Sampling: one row of logits per params entry. Writes ids[rows] on the device.
struct DeviceSampleParams {
  float temperature;
  int32_t top_k;
  float top_p;
  float u;               // PhiloxUniform(seed, position), drawn on the host
  int32_t logprobs;      // -1: none; else how many alternatives (<= kMaxLogprobs)
  int32_t logprob_slot;  // index of this row's entry among the rows that want logprobs
};

}  // namespace tpserve::cuda
