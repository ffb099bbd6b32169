// The CUDA implementation of Ops: bf16 storage, fp32 accumulation, one stream per instance.
//
// CUDA graphs: the ops never allocate or synchronize inside the forward (Sample excepted), so a
// decode step can be captured on stream(). A captured graph bakes in the grids, which depend on
// the batch's num_seqs, num_tokens, max_blocks_per_seq, block_size and number of logits rows,
// and the addresses of the batch buffers. To replay: call SetBatch (outside capture) with the
// same five sizes (pad with empty sequences: context_len 0, slot -1) and check that
// layout_generation() is unchanged since the capture (it changes when a buffer grows). Reserve()
// sizes the buffers up front so that nothing grows after warm-up. SetBatch and buffer growth
// abort with a message if called while the stream is capturing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/cuda/gemm_stream.h"
#include "kernels/cuda/op_profiler.h"
#include "kernels/ops.h"

namespace tpserve {

namespace cuda {
class LtGemm;
class GpuSampler;
struct DeviceBatch;
}  // namespace cuda

// Number of CUDA devices; 0 when there is no driver or no device (never fails).
int CudaDeviceCount();

// Upper bounds used to size the batch buffers (and the decode-attention workspace) once.
struct CudaReserve {
  int max_tokens = 0;
  int max_seqs = 0;
  int max_blocks_per_seq = 0;
  int block_size = 16;
  int num_heads = 0;     // query heads on this rank (decode workspace)
  int num_kv_heads = 0;  // KV heads on this rank (0: same as num_heads)
  int head_dim = 0;
};

class CudaOps final : public Ops {
 public:
  explicit CudaOps(int device);
  ~CudaOps() override;

  Device device() const override { return Device::kCuda; }
  DType compute_dtype() const override { return DType::kBF16; }
  // bf16, or quantized: the KV writes quantize (kv_write.cu, rope_kv_write.cu; the skinny QKV
  // epilogue writes bf16 only), every attention kernel dequantizes (kv_read.cuh).
  bool SupportsKvCacheDType(DType t) const override {
    return t == DType::kBF16 || t == DType::kF8E4M3 || t == DType::kI8 || t == DType::kI4;
  }

  void* Alloc(size_t bytes) override;
  void Free(void* ptr) override;
  // Host <-> device copies are ordered on stream() and complete before returning.
  void CopyToDevice(void* dst, const void* src, size_t bytes) override;
  void CopyToHost(void* dst, const void* src, size_t bytes) override;
  // Asynchronous, ordered on stream().
  void CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override;
  void Synchronize() override;
  bool MemoryInfo(size_t* free_bytes, size_t* total_bytes) const override;
  // Pinned staging buffers and a copy stream of its own (kernels/cuda/uploader.h).
  std::unique_ptr<DeviceUploader> MakeUploader() override;
  // Deterministic mode with TPSERVE_DETERMINISTIC_TILES=on (and the chain GEMMs): the weight's
  // tile-contiguous copy (cuda::MakeChainTiles), registered for the chain GEMV while the handle
  // lives; otherwise none.
  std::unique_ptr<PreparedWeight> PrepareGemmWeight(const Tensor& w) override;
  int64_t PreparedGemmWeightBytes(int64_t n, int64_t k) const override;

  void SetBatch(const BatchMeta& meta) override;
  // Deterministic mode (Ops::SetDeterministic): every GEMM through cuBLASLt with one algorithm
  // per weight shape and no split-K (or, with TPSERVE_DETERMINISTIC_GEMM=fixed-order, the
  // fixed-order kernel of kernels/cuda/gemm_fixed_order.cu: one arithmetic per output for every
  // M), no skinny kernel and no small-M fusions, the attention of
  // prefill and decode tokens alike through the decode kernel with a fixed key partition
  // (TPSERVE_DETERMINISTIC_PARTITION), each query token reading its own context. Call before
  // Reserve.
  void SetDeterministic(bool on) override;

  void Embedding(const Tensor& table, int64_t row_offset, Tensor out) override;
  void RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor out) override;
  void AddRmsNorm(Tensor residual, const Tensor& x, const Tensor& weight, float eps,
                  Tensor out) override;
  void Gemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y) override;
  void Rope(Tensor q, Tensor k, const Tensor& inv_freq, int head_dim) override;
  void KvWrite(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache) override;
  void RopeKvWrite(const Tensor& qkv, const Tensor& inv_freq, int num_q_heads, int num_kv_heads,
                   int head_dim, Tensor q_out, Tensor k_cache, Tensor v_cache) override;
  // T <= 2 (and skinny_max_m) and bf16 caches: one skinny GEMM with the RoPE/KV-write epilogue
  // (qkv unwritten); otherwise (quantized caches always) GemmScaledRows into qkv, then
  // RopeKvWrite. A non-empty x_scale is applied in the GEMM's epilogue (or to x first where
  // GemmScaledRows cannot).
  void QkvRopeKvWrite(const Tensor& x, const RowScale& x_scale, const Tensor& w_qkv,
                      const Tensor* bias, const Tensor& inv_freq, int num_q_heads, int num_kv_heads,
                      int head_dim, Tensor qkv, Tensor q_out, Tensor k_cache,
                      Tensor v_cache) override;
  void AttentionPrefill(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                        int num_heads, int num_kv_heads, int head_dim, float scale,
                        Tensor out) override;
  void AttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                       int num_kv_heads, int head_dim, float scale, Tensor out) override;
  void SiluMul(const Tensor& gate_up, Tensor out) override;
  // M <= 2 (and skinny_max_m): one skinny GEMM reading gate_up; otherwise SiluMul + Gemm.
  void SiluMulGemm(const Tensor& gate_up, const Tensor& w, Tensor act, Tensor y) override;
  // M <= 2 (and skinny_max_m, fused_norm): the norm is deferred (see Ops::GemmAddRmsNorm): the
  // skinny GEMM adds into the residual, stores residual * gamma and the rows' sums of squares,
  // and the consumer's epilogue applies the scale. M > kResidualGemmMinM (prefills; fused_norm,
  // not deterministic): cuBLASLt adds the product into the residual in its epilogue (one bf16
  // rounding of residual + the fp32 product, where the separate ops round the product first),
  // then RmsNorm; y is left unwritten. That moves 2 instead of 4 activation tensors through the
  // norm (2048 x 4096 on an H100: AddRmsNorm 27.6 us, 63 a prefill). Otherwise the separate ops.
  RowScale GemmAddRmsNorm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                          Tensor residual, const Tensor& gamma, float eps, Tensor normed) override;
  RowScale SiluMulGemmAddRmsNorm(const Tensor& gate_up, const Tensor& w, Tensor act, Tensor y,
                                 Tensor residual, const Tensor& gamma, float eps,
                                 Tensor normed) override;
  // The skinny GEMM with the row scale in its epilogue; otherwise x is scaled in place first.
  void GemmScaledRows(const Tensor& x, const RowScale& x_scale, const Tensor& w, const Tensor* bias,
                      Tensor y) override;
  void Add(const Tensor& a, const Tensor& b, Tensor out) override;
  void GatherLogitRows(const Tensor& in, Tensor out) override;
  void InterleaveShards(const Tensor& in, Tensor out) override;
  using Ops::Sample;
  std::vector<int32_t> Sample(const Tensor& logits, int64_t vocab_size,
                              const std::vector<SamplingParams>& params,
                              std::vector<std::optional<TokenLogprobs>>* logprobs) override;
  // The sampling kernels and the copies of ids and logprobs to pinned memory are enqueued; the
  // ids stay on the device for the next SetBatch's fed tokens.
  void SampleAsync(const Tensor& logits, int64_t vocab_size,
                   const std::vector<SamplingParams>& params, bool logprobs) override;
  std::vector<int32_t> SampleWait(std::vector<std::optional<TokenLogprobs>>* logprobs) override;
  bool SampleReady() override;
  bool AsyncSampling() const override { return true; }

  cudaStream_t stream() const { return stream_; }
  int device_index() const { return device_; }
  void Reserve(const CudaReserve& r);
  // The bf16 scratch of prefill attention over an fp8 / int8 cache (cuda::PrefillDequant):
  // `pages` pages of block_size x kv_heads x head_dim, for K and for V. Only where the wgmma
  // kernels run (sm_90, head_dim 64 or 128); elsewhere and for other dtypes, none (a
  // reservation made before is no longer planned for). Batches set afterwards plan for it; a
  // cache of another shape or dtype takes the in-kernel path.
  void ReservePrefillScratch(DType kv, int64_t pages, int block_size, int kv_heads, int head_dim);
  // The scratch's size in bytes (0: none), and the sequences and scratch pages the latest
  // SetBatch gave it.
  size_t prefill_scratch_bytes() const { return scratch_.bytes; }
  int prefill_scratch_sequences() const { return scratch_seqs_; }
  int prefill_scratch_pages() const;
  // The decode rows of the latest SetBatch planned for the decode kernel (cuda::MixedDecode;
  // AttentionPrefill takes the plan where cuda::MixedDecodeSplits holds for the cache).
  int mixed_decode_rows() const;
  uint64_t layout_generation() const { return generation_; }
  // GEMMs with M <= this use the skinny kernel, larger ones cuBLASLt (0 = always cuBLASLt).
  void set_skinny_max_m(int m);
  int skinny_max_m() const { return skinny_max_m_; }
  // Decode batches of skinny_max_m < M <= m run the weight-streaming GEMM (0 = never; M <= 128;
  // ignored where the device has no such kernel). Default: TPSERVE_STREAM_GEMM_MAX_M.
  void set_stream_max_m(int m);
  int stream_max_m() const { return stream_max_m_; }
  // Benchmarks: force one path.
  void GemmStream(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y, int config,
                  int max_grid = 0, bool exact_grid = false);
  // Deterministic mode's stream GEMM (LaunchStreamGemmFixed), any M.
  void GemmStreamFixed(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y);
  void GemmCublasLt(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y);
  // The cuBLASLt GEMM plans made so far, and how many of them took the cuBLASLt table's choice.
  std::pair<int, int> CublasLtPlans() const;
  void GemmSkinny(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y, int config);
  void SiluMulGemmSkinny(const Tensor& gate_up, const Tensor& w, Tensor y, int config);

  // Programmatic dependent launch of the decode-path kernels (see cuda_util.cuh), for every
  // CudaOps of the process. On by default on Hopper (for batches of at most 256 tokens);
  // TPSERVE_PDL=0 turns it off (common/env.h).
  static void set_programmatic_launch(bool on);
  static bool programmatic_launch();
  // The small-M fusions into the skinny GEMM (QkvRopeKvWrite, SiluMulGemm); on by default,
  // off for A/B measurements (TPSERVE_FUSED_SKINNY=0 in the benchmarks: bench_knobs.h).
  void set_fused_skinny(bool on) { fused_skinny_ = on; }
  bool fused_skinny() const { return fused_skinny_; }
  // The deferred norm of GemmAddRmsNorm / SiluMulGemmAddRmsNorm; on by default, off for A/B
  // measurements (TPSERVE_FUSED_NORM=0 in the benchmarks: bench_knobs.h).
  void set_fused_norm(bool on) { fused_norm_ = on; }
  bool fused_norm() const { return fused_norm_; }
  // Ablation, for benchmarks only (TPSERVE_ABLATE_OPS, bench_knobs.h): AttentionDecode,
  // AddRmsNorm, Gemm.square (any of them) return without launching anything (Gemm.square: GEMMs
  // with a square weight, in LLaMA shapes the attention output projection), so that the step
  // time without them can be measured inside the CUDA graph. Every result is wrong.
  void set_ablated_ops(std::set<std::string, std::less<>> ops) { ablated_ = std::move(ops); }
  bool Ablated(std::string_view op) const {
    return !ablated_.empty() && ablated_.find(op) != ablated_.end();
  }

  // Op profiler (op_profiler.h): while on, every op launched outside stream capture is timed
  // with a pair of CUDA events (the benchmarks also switch it on by TPSERVE_OP_PROFILE=1).
  void set_op_profiling(bool on);
  bool op_profiling() const { return profiler_ != nullptr; }
  // Times everything queued in between as one "step" row of the profile.
  void BeginProfiledStep();
  void EndProfiledStep();
  // Synchronizes and returns the per-(op, shape) totals since the last call, then clears them.
  std::vector<OpProfileRow> TakeOpProfile();
  // Keeps the stream busy for `us` microseconds so that the host queues the next ops ahead of
  // the GPU (profiled ops then run back to back, as in a graph).
  void StallStream(int us);

 private:
  class OpScope;  // times one op when profiling (cuda_ops.cc)
  struct Section {
    void* dev = nullptr;
    size_t cap = 0;  // bytes
  };
  void EnsureNotCapturing(const char* what) const;
  void GrowSection(Section& s, size_t bytes);
  // Whether a GEMM of m rows of length k (x, w its operands) fits the fused skinny kernels
  // (M <= 2 and skinny_max_m, K % 8 == 0, 16-byte aligned operands).
  bool SkinnyFusedFits(int64_t m, int64_t k, const void* x, const void* w) const;
  // GemmAddRmsNorm's prefill form: whether a projection of m rows adds into the residual inside
  // cuBLASLt (GemmIntoResidual, "GemmAdd.cublasLt" in profiles) before a plain RmsNorm.
  static constexpr int64_t kResidualGemmMinM = 256;
  bool ResidualGemmFits(int64_t m) const;
  void GemmIntoResidual(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor residual);
  // The record of the next deferred norm of this batch (zeroing all of them first when it is
  // the batch's first), or null when the batch has used them all.
  unsigned long long* NextNormRecord();
  // Applies x_scale to x in place (a consumer without the scaled epilogue).
  void ApplyRowScale(const Tensor& x, const RowScale& x_scale);
  void GrowDecodeWorkspace(const cuda::DeviceBatch& b, int num_heads, int num_kv_heads,
                           int head_dim);

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::LtGemm> lt_;
  std::unique_ptr<cuda::GpuSampler> sampler_;
  std::unique_ptr<cuda::DeviceBatch> batch_;
  // Measured on the H200: the skinny kernel beats cuBLASLt at M = 1 and 2 on every 6.7B shape
  // (e.g. gate_up 94.7% / 91.5% vs 85% of copy bandwidth); from M = 4 cuBLASLt is faster.
  int skinny_max_m_ = 2;
  // Decode batches of skinny_max_m_ < M <= stream_max_m_ run the weight-streaming wgmma GEMM
  // (gemm_stream.h) instead of cuBLASLt (TPSERVE_STREAM_GEMM_MAX_M; 0 on other devices).
  int stream_max_m_ = 0;
  cuda::StreamGemmWorkspace stream_ws_;  // allocated on first use (35 MB on an H200)
  void AllocateStreamWorkspace();
  bool fused_skinny_ = true;
  bool fused_norm_ = true;
  // Deterministic mode with cuBLASLt's fixed algorithm: decode GEMMs of up to kDetChainMaxM rows
  // run the chain kernels, which have its bits, with the skinny path's fusions
  // (TPSERVE_DETERMINISTIC_GEMM=cublaslt, the default; cublaslt-only leaves them out); larger M
  // run the fixed cuBLASLt algorithm itself.
  bool det_chain_ = false;
  // The chain kernels (ChainGemvFits: up to kChainGemvMaxM = 16 rows) pay above 2 rows: their
  // ring form streams the input rows with the weights, unfused, where cuBLASLt's fixed algorithm
  // reads the weights once at any M. H100, `tpserve-engine-bench --deterministic`, 6.7B shape,
  // decode steps at context 1024 (two rounds, kernels/cuda/NOTES.md session 41): chain /
  // cuBLASLt alone / default mode, batch 2 5.66 / 6.11 / 5.63 ms, 3 7.86 / 6.36 / 6.20, 4 7.99 /
  // 6.54 / 6.35, 8 9.58 / 7.27 / 7.21, 16 12.85 / 8.74 / 8.54; batch 1 4.93 / 5.79 / 4.68.
  static constexpr int64_t kDetChainMaxM = 2;
  bool ChainFits(int64_t m, int64_t k, const void* x, const void* w) const;
  bool ChainFusedFits(int64_t m, int64_t k, const void* x, const void* w) const;
  // Deferred norms: kMaxNormRecords records of cuda::kNormRecordWords counters; each batch
  // (SetBatch) uses them in order from the first, which zeroes all of them.
  static constexpr int kMaxNormRecords = 256;
  unsigned long long* norm_records_ = nullptr;
  int norm_records_used_ = 0;
  std::set<std::string, std::less<>> ablated_;  // set_ablated_ops
  uint64_t generation_ = 0;
  // Batch buffers on the device and their pinned staging (two, used alternately).
  enum {
    kTokenIds,
    kPositions,
    kSlots,
    kQueryStart,
    kContextLens,
    kBlockTables,
    kLogitsRows,
    kPrefillWork,
    kTokenQueryStart,  // deterministic mode: DeviceBatch::token_* (prefill as decode queries);
                       // otherwise a mixed step's decode rows (DeviceBatch::mixed_*)
    kTokenContextLens,
    kTokenTableRows,
    kTokenGroups,    // deterministic mode: DeviceBatch::token_groups
    kFedTokens,      // BatchMeta::fed_tokens / fed_rows as int2 pairs
    kScratchTables,  // DeviceBatch::scratch_tables / scratch_pages (ReservePrefillScratch)
    kScratchPages,
    kNumSections
  };
  Section sections_[kNumSections];
  void* staging_[2] = {nullptr, nullptr};
  size_t staging_cap_[2] = {0, 0};
  cudaEvent_t staging_done_[2] = {nullptr, nullptr};
  int staging_next_ = 0;
  float* decode_ws_ = nullptr;  // partial results of the decode-attention splits
  size_t decode_ws_floats_ = 0;
  unsigned* decode_counters_ = nullptr;  // their arrival counters (zero between launches)
  size_t decode_counters_cap_ = 0;
  int det_partition_ = 0;  // deterministic mode: keys per decode-attention split (else 0)
  // Deterministic mode: prefill tokens in groups (DeviceBatch::token_groups;
  // TPSERVE_DETERMINISTIC_TOKEN_GROUPS).
  bool det_token_groups_ = false;
  bool det_tiles_ = false;               // TPSERVE_DETERMINISTIC_TILES=on with det_chain_
  std::vector<int> token_group_chunks_;  // DeviceBatch::token_group_chunks of the current batch
  // Deterministic mode's GEMM: cuBLASLt's fixed algorithm (the default), the fixed-order
  // kernel (TPSERVE_DETERMINISTIC_GEMM=fixed-order) or the stream GEMM on a fixed grid
  // (=stream: LaunchStreamGemmFixed wherever it fits, at every M).
  bool det_fixed_order_gemm_ = false;
  bool det_stream_gemm_ = false;
  struct PrefillScratch {
    void* k = nullptr;  // bf16 [pages, block_size, kv_heads, head_dim]
    void* v = nullptr;
    size_t bytes = 0;  // of k and v together
    DType kv = DType::kBF16;
    int64_t pages = 0;
    int block_size = 0, kv_heads = 0, head_dim = 0;
  } scratch_;
  int scratch_seqs_ = 0;
  int reserve_heads_ = 0;
  int reserve_kv_heads_ = 0;
  int reserve_head_dim_ = 0;
  std::unique_ptr<cuda::OpProfiler> profiler_;
  int step_token_ = -1;
};

std::unique_ptr<Ops> MakeCudaOps(int device);

}  // namespace tpserve
