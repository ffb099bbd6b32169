// The ops interface: every operation the forward pass needs, implemented once on the CPU
// (fp32 reference, kernels/cpu) and once on CUDA (bf16 storage, fp32 math, kernels/cuda).
// The model (worker/model.cc) is written once against this interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "common/dtype.h"
#include "common/logprobs.h"
#include "common/model_config.h"
#include "common/sampling.h"
#include "kernels/head_dims.h"

namespace tpserve {

// Sampling parameters (common/sampling.h). The random draw uses a counter-based RNG keyed by
// (seed, position), so it does not depend on the batch; the logits it draws from do only in
// deterministic mode (Ops::SetDeterministic); otherwise another batch shape may round them
// differently and flip a near-tie.

// The layout of one step's batch, in host memory. Tokens of all sequences are packed along
// one axis; sequence s owns query rows [query_start[s], query_start[s+1]).
// Ops::SetBatch copies what the kernels need (to device memory on CUDA) before the forward.
struct BatchMeta {
  int num_seqs = 0;
  int num_tokens = 0;
  std::vector<int32_t> token_ids;     // [num_tokens] (used by the first pipeline stage)
  std::vector<int32_t> positions;     // [num_tokens] absolute position of each token
  std::vector<int32_t> slot_mapping;  // [num_tokens] KV slot = block * block_size + offset
  std::vector<int32_t> query_start;   // [num_seqs + 1]
  std::vector<int32_t> context_lens;  // [num_seqs] cached tokens after this step (incl. new)
  std::vector<int32_t> block_tables;  // [num_seqs * max_blocks_per_seq], -1 padded
  int max_blocks_per_seq = 0;
  int block_size = 16;
  std::vector<int32_t> logits_rows;  // token rows whose logits are wanted (sampled rows)
  // Input tokens the host does not know yet (a step launched before the previous one finished):
  // token_ids[fed_tokens[i]] is replaced by row fed_rows[i] of the latest Ops::SampleAsync
  // (SetBatch does it where the ids are, on the device on CUDA).
  std::vector<int32_t> fed_tokens;
  std::vector<int32_t> fed_rows;
  int max_query_len() const;
  int max_context_len() const;
  bool all_decode() const { return num_tokens == num_seqs; }
};

// Bulk host-to-device copies for loading weights. Copies may be queued: a source must stay
// valid and unchanged until the next Flush(), which completes every queued copy.
class DeviceUploader {
 public:
  struct Stats {
    int64_t bytes = 0;       // bytes copied
    double host_copy_s = 0;  // wall time spent copying sources into staging memory
    double wait_s = 0;       // wall time spent waiting for device copies to free staging
    int threads = 1;         // host threads copying into staging
  };
  virtual ~DeviceUploader() = default;
  // `bytes` from host `src` to device `dst`.
  virtual void Upload(void* dst, const void* src, size_t bytes) = 0;
  // `rows` rows of `row_bytes`, `src_pitch` bytes apart in host memory, packed contiguously at
  // `dst` (a column slice of a row-major matrix).
  virtual void UploadRows(void* dst, const void* src, size_t rows, size_t row_bytes,
                          size_t src_pitch) = 0;
  virtual void Flush() = 0;
  virtual Stats stats() const = 0;
};

// A deferred RMSNorm (Ops::GemmAddRmsNorm): the rows of the norm's output still have to be
// multiplied by rsqrt(sum_of_squares / dim + eps). `record` is the backend's device record of
// the rows' sums of squares, valid until the next SetBatch. Empty: nothing is pending.
struct RowScale {
  const void* record = nullptr;
  int64_t dim = 0;
  float eps = 0.0f;
  bool empty() const { return record == nullptr; }
};

class Ops {
 public:
  virtual ~Ops() = default;

  virtual Device device() const = 0;
  // dtype of weights and activations: kF32 on the CPU reference, kBF16 on CUDA.
  virtual DType compute_dtype() const = 0;

  // Device memory. Alloc never returns null (it aborts with the sizes when out of memory).
  virtual void* Alloc(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  virtual void CopyToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual void CopyToHost(void* dst, const void* src, size_t bytes) = 0;
  virtual void CopyDeviceToDevice(void* dst, const void* src, size_t bytes) = 0;
  // Waits for all queued work (no-op on the CPU).
  virtual void Synchronize() = 0;
  // Device memory in bytes (free, total). False when the backend has no device memory of its
  // own (the CPU ops): then nothing is sized from it.
  virtual bool MemoryInfo(size_t* free_bytes, size_t* total_bytes) const {
    (void)free_bytes;
    (void)total_bytes;
    return false;
  }
  // A bulk copier for weight loading. The default copies synchronously through CopyToDevice;
  // CUDA streams through pinned staging buffers on a copy stream.
  virtual std::unique_ptr<DeviceUploader> MakeUploader();
  // Another layout of a loaded GEMM weight w[N, K] that this backend's decode kernels read
  // instead (CUDA, deterministic mode: the chain GEMV's tile-contiguous copy,
  // TPSERVE_DETERMINISTIC_TILES), owned by the returned handle: the kernels use it while the
  // handle lives, and w must outlive the handle and stay unchanged. Null when the backend keeps
  // none. Call after SetDeterministic; PreparedGemmWeightBytes says what it allocates.
  struct PreparedWeight {
    virtual ~PreparedWeight() = default;
  };
  virtual std::unique_ptr<PreparedWeight> PrepareGemmWeight(const Tensor& w) {
    (void)w;
    return nullptr;
  }
  virtual int64_t PreparedGemmWeightBytes(int64_t n, int64_t k) const {
    (void)n;
    (void)k;
    return 0;
  }

  // Makes `meta` the current batch for the ops below.
  virtual void SetBatch(const BatchMeta& meta) = 0;

  // Deterministic mode (--deterministic): every op computes a token row with the same
  // arithmetic, in the same order, whatever else is in the batch: its size, the row's position
  // in it, the other sequences and their lengths, and whether the row's sequence is in prefill
  // (any chunking) or decode. So one token's row (hidden states, KV, logits) has the same bits
  // alone or in any batch on one build, device type and layout. GEMMs use one fixed path for
  // every M, attention one kernel with key partitions fixed per context length, norms and
  // sampling work per row. Without it a backend may pick kernels by batch shape (faster;
  // another shape may round differently). Set before the first SetBatch; the default is off.
  virtual void SetDeterministic(bool on) { deterministic_ = on; }
  bool deterministic() const { return deterministic_; }

  // out[t] = table[token_ids[t] - row_offset] when in [0, table rows), else zeros
  // (vocab-parallel embedding: each rank holds rows [row_offset, row_offset + rows)).
  virtual void Embedding(const Tensor& table, int64_t row_offset, Tensor out) = 0;
  // out = x / rms(x) * weight, rows of x independent.
  virtual void RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor out) = 0;
  // residual += x; out = RmsNorm(residual). Fused to save one pass over the activations.
  virtual void AddRmsNorm(Tensor residual, const Tensor& x, const Tensor& weight, float eps,
                          Tensor out) = 0;
  // y[M, N] = x[M, K] * w[N, K]^T (+ bias[N]); the layout of torch.nn.Linear.
  virtual void Gemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y) = 0;
  // Rope and KvWrite: only tests call them. They stay as the unfused reference that every
  // backend's fused RopeKvWrite / QkvRopeKvWrite is checked against (cpu_ops_test,
  // cuda_ops_test); the forward pass uses the fused ops.
  // Rotates q [T, Hq * D] and k [T, Hk * D] in place (rotate-half layout, HF Llama) by the
  // batch positions; inv_freq [D / 2] (f32, on the device) already holds any scaling.
  virtual void Rope(Tensor q, Tensor k, const Tensor& inv_freq, int head_dim) = 0;
  // KV caches: every op below that takes k_cache / v_cache accepts the compute dtype and every
  // KV dtype SupportsKvCacheDType says yes to. A quantized cache (kF8E4M3, kI8, kI4 with its
  // scales, kernels/kv_quant.h) is written by quantizing each token's head exactly as
  // QuantizeKvHead does, and read by dequantizing (KvDecode(code) * scale) in the attention.
  virtual bool SupportsKvCacheDType(DType t) const { return t == compute_dtype(); }
  // Writes k, v [T, Hk * D] into the paged caches [blocks, block_size, Hk, D] at slot_mapping.
  virtual void KvWrite(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache) = 0;
  // Rope and KvWrite in one pass over the fused projection qkv [T, (Hq + 2 Hk) * D] (each
  // token's q heads, then k heads, then v heads): q_out [T, Hq * D] = rotated q; rotated k and
  // v go into the caches at slot_mapping (slots < 0 are padding: nothing is written for them).
  virtual void RopeKvWrite(const Tensor& qkv, const Tensor& inv_freq, int num_q_heads,
                           int num_kv_heads, int head_dim, Tensor q_out, Tensor k_cache,
                           Tensor v_cache) = 0;
  // The attention input of a layer: Gemm(x, w_qkv, bias, qkv), then RopeKvWrite(qkv, ...), the
  // default. `qkv` [T, (Hq + 2 Hk) * D] is scratch a backend that fuses the two may leave
  // unwritten (CUDA at small T: the skinny GEMM rotates and stores in its epilogue).
  // `x_scale`: x is the output of a deferred norm (GemmAddRmsNorm), its rows still to be scaled;
  // only a backend that returns non-empty RowScales accepts a non-empty one.
  virtual void QkvRopeKvWrite(const Tensor& x, const RowScale& x_scale, const Tensor& w_qkv,
                              const Tensor* bias, const Tensor& inv_freq, int num_q_heads,
                              int num_kv_heads, int head_dim, Tensor qkv, Tensor q_out,
                              Tensor k_cache, Tensor v_cache);
  // Causal attention of q [T, Hq * D] over the paged cache, which already holds this step's
  // keys and values; query token i of a sequence sees cache positions
  // [0, context_len - query_len + i]. GQA: q head h reads KV head h / (Hq / Hk).
  // Prefill handles any query lengths (chunked prefill with a cached prefix, mixed batches);
  // Decode requires one query per sequence (BatchMeta::all_decode()).
  virtual void AttentionPrefill(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                int num_heads, int num_kv_heads, int head_dim, float scale,
                                Tensor out) = 0;
  virtual void AttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               int num_heads, int num_kv_heads, int head_dim, float scale,
                               Tensor out) = 0;
  // gate_up [M, 2I] (gate then up) -> out [M, I] = silu(gate) * up.
  virtual void SiluMul(const Tensor& gate_up, Tensor out) = 0;
  // y [M, N] = SiluMul(gate_up) * w[N, I]^T: the MLP's down projection. `act` [M, I] is scratch
  // a backend may use for the activation (its contents afterwards are unspecified). The default
  // is SiluMul into act, then Gemm; CUDA reads gate_up directly in its small-M GEMM.
  virtual void SiluMulGemm(const Tensor& gate_up, const Tensor& w, Tensor act, Tensor y) {
    SiluMul(gate_up, act);
    Gemm(act, w, nullptr, y);
  }
  // The residual stream between two projections: Gemm(x, w, bias, y) (or, in the SiluMul form,
  // SiluMulGemm(gate_up, w, act, y)), then AddRmsNorm(residual, y, gamma, eps, normed). A backend
  // may defer the norm's last step, the row scale rsqrt(mean(residual^2) + eps), to the op that
  // reads `normed` (no norm kernel between the two projections; CUDA does at M <= 2): `normed`
  // then holds residual * gamma and the returned RowScale must be passed with it to the next
  // GemmScaledRows or QkvRopeKvWrite. The default runs the two ops and returns an empty one.
  // y receives the projection where the backend computes it apart; a backend that adds it into
  // the residual inside the GEMM (CUDA for prefills) may leave y unwritten.
  virtual RowScale GemmAddRmsNorm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                                  Tensor residual, const Tensor& gamma, float eps, Tensor normed);
  virtual RowScale SiluMulGemmAddRmsNorm(const Tensor& gate_up, const Tensor& w, Tensor act,
                                         Tensor y, Tensor residual, const Tensor& gamma, float eps,
                                         Tensor normed);
  // Gemm(x, w, bias, y) of x whose rows are first scaled by x_scale (see GemmAddRmsNorm).
  virtual void GemmScaledRows(const Tensor& x, const RowScale& x_scale, const Tensor& w,
                              const Tensor* bias, Tensor y);
  // out = a + b (elementwise, same shape).
  virtual void Add(const Tensor& a, const Tensor& b, Tensor out) = 0;
  // out[i] = in[rows[i]] for the batch's logits_rows.
  virtual void GatherLogitRows(const Tensor& in, Tensor out) = 0;
  // in [S, B, Vs] (one slab per vocab shard, as all-gathered) -> out [B, S * Vs] (f32).
  virtual void InterleaveShards(const Tensor& in, Tensor out) = 0;
  // Samples one token per row of logits [B, V_padded]; only the first `vocab_size` columns
  // count. Returns ids on the host. The rule (shared by every backend): a greedy temperature
  // (IsGreedy: <= kGreedyTemperature) takes the argmax (lowest id on ties). Otherwise logits /
  // temperature, candidates sorted by (probability desc, id asc), cut to the top_k first, then to
  // the shortest prefix whose probability mass reaches top_p (at least one), renormalized; the
  // token is the first candidate whose cumulative mass exceeds u * total, u = PhiloxUniform(seed,
  // position). Rows with params.logprobs >= 0 also get, in (*logprobs)[row] (resized to the rows;
  // other rows stay empty), log-probabilities under log_softmax(logits[:vocab_size]) (the raw
  // distribution, not the tempered / cut one) computed in fp32 or better: the chosen token's
  // and the top min(N, vocab_size) tokens by (logprob desc, id asc). `logprobs` may be null
  // only when no row asks.
  virtual std::vector<int32_t> Sample(const Tensor& logits, int64_t vocab_size,
                                      const std::vector<SamplingParams>& params,
                                      std::vector<std::optional<TokenLogprobs>>* logprobs) = 0;
  // Sample without log-probabilities (no row may ask for them).
  std::vector<int32_t> Sample(const Tensor& logits, int64_t vocab_size,
                              const std::vector<SamplingParams>& params) {
    return Sample(logits, vocab_size, params, nullptr);
  }

  // Sampling one step ahead (ShardRunner::Launch / Finish). SampleAsync enqueues Sample's work
  // (the rule above; `logprobs`: some row asks for them) and returns; SampleWait waits for the
  // oldest SampleAsync not yet waited for (at most kMaxAsyncSamples in flight) and returns its
  // ids and, when asked, its logprobs; SampleReady says without blocking whether SampleWait
  // would return at once. The ids of the latest SampleAsync also stay where the ops keep them,
  // so that the next SetBatch can take a sequence's input token from them (BatchMeta::fed_rows)
  // before the host has seen them. Sample may not be called while a SampleAsync is in flight.
  // The base class samples at once (the CPU: nothing to overlap).
  static constexpr int kMaxAsyncSamples = 2;
  virtual void SampleAsync(const Tensor& logits, int64_t vocab_size,
                           const std::vector<SamplingParams>& params, bool logprobs);
  virtual std::vector<int32_t> SampleWait(std::vector<std::optional<TokenLogprobs>>* logprobs);
  virtual bool SampleReady() { return true; }
  // Whether SampleAsync returns before the sampling has run, so that a step launched ahead
  // overlaps the host's work with the device's (CUDA).
  virtual bool AsyncSampling() const { return false; }

 protected:
  // For a backend whose SetBatch keeps the batch on the host: applies meta's fed tokens from the
  // latest SampleAsync (the base class's).
  void ApplyFedTokens(BatchMeta& meta) const;

  bool deterministic_ = false;  // SetDeterministic

 private:
  struct AsyncSample {
    std::vector<int32_t> ids;
    std::vector<std::optional<TokenLogprobs>> logprobs;
  };
  std::vector<AsyncSample> async_samples_;  // the base class's SampleAsync results, oldest first
  std::vector<int32_t> latest_async_ids_;   // the latest SampleAsync's ids (fed tokens)
};

// A buffer owned through an Ops allocator, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Ops* ops, size_t bytes) : ops_(ops), bytes_(bytes) {
    ptr_ = bytes ? ops->Alloc(bytes) : nullptr;
  }
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      ops_ = o.ops_;
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void Reset() {
    if (ptr_ != nullptr) ops_->Free(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

 private:
  Ops* ops_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// log(sum_i exp(row[i])) over n values, in double precision (the max subtracted first).
double LogSumExp(const float* row, int64_t n);

// The reference log-probabilities of one row of logits (double precision): `chosen`'s and the
// top min(n, vocab) alternatives, as Ops::Sample defines them.
TokenLogprobs ReferenceLogprobs(const float* row, int64_t vocab, int32_t chosen, int n);

// The CPU reference implementation (fp32 math, OpenBLAS GEMM).
std::unique_ptr<Ops> MakeCpuOps();

// Computes RoPE inverse frequencies [head_dim / 2] as Hugging Face transformers does for the
// config's rope type (default, linear: divided by factor, llama3: smoothed wavelengths).
std::vector<float> RopeInvFreq(const RopeConfig& rope, int head_dim);

}  // namespace tpserve
