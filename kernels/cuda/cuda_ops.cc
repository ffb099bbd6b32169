// CudaOps: owns the stream, the batch buffers (uploaded by SetBatch from pinned staging), the
// cuBLASLt plans, the decode workspace and the sampler; each op forwards to its launcher.
#include "kernels/cuda/cuda_ops.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "common/check.h"
#include "common/env.h"
#include "common/logging.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/sample.h"
#include "kernels/cuda/uploader.h"
#include "kernels/kv_quant.h"

namespace tpserve {
namespace cuda {
namespace {

std::atomic<int> g_pdl{-1};  // -1: not decided yet
// Set by SetBatch for the kernels launched next: PDL only for decode-sized batches. Measured on
// the H200 (6.7B shape): PDL takes batch-1 decode from 3.96 to 3.78 ms/token and leaves batch 64
// unchanged, but the 2048-token prefill ran 51-54 ms with it against 50.3-50.8 ms without.
thread_local bool t_pdl_batch = true;
constexpr int kPdlMaxTokens = 256;

bool DeviceSupportsPdl() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major >= 9;
}

bool PdlAllowed() {
  int v = g_pdl.load(std::memory_order_relaxed);
  if (v < 0) {
    v = DeviceSupportsPdl() && EnvBool(env::kPdl) ? 1 : 0;
    g_pdl.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

}  // namespace

bool PdlEnabled() { return t_pdl_batch && PdlAllowed(); }

}  // namespace cuda

void CudaOps::set_programmatic_launch(bool on) {
  cuda::g_pdl.store(on && cuda::DeviceSupportsPdl() ? 1 : 0, std::memory_order_relaxed);
}

bool CudaOps::programmatic_launch() { return cuda::PdlAllowed(); }

// Times one op when the profiler is on: the shape string is only built then.
class CudaOps::OpScope {
 public:
  template <typename ShapeFn>
  OpScope(CudaOps* ops, const char* op, ShapeFn&& shape, double bytes = 0) {
    if (ops->profiler_ != nullptr) {
      profiler_ = ops->profiler_.get();
      token_ = profiler_->Begin(op, shape(), bytes);
    }
  }
  ~OpScope() {
    if (profiler_ != nullptr) profiler_->End(token_);
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  cuda::OpProfiler* profiler_ = nullptr;
  int token_ = -1;
};

namespace {

std::string Dims(const Tensor& t) {
  std::string s;
  for (int i = 0; i < t.ndim; ++i) {
    if (i > 0) s += 'x';
    s += std::to_string(t.shape[i]);
  }
  return s;
}

std::string GemmShape(int64_t m, int64_t n, int64_t k) {
  return "M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k);
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Bytes of one token's K (or V) row of a paged cache [blocks, block_size, Hk, D]: its elements
// and, quantized, its scales.
double KvRowBytes(const Tensor& cache) {
  const int64_t heads = cache.dim(2), head_dim = cache.dim(3);
  return double(heads) * (double(head_dim) * DTypeBits(cache.dtype) / 8 +
                          double(KvScaleGroups(cache.dtype, head_dim)) * sizeof(float));
}

}  // namespace

void CudaOps::set_op_profiling(bool on) {
  if (on && profiler_ == nullptr) {
    profiler_ = std::make_unique<cuda::OpProfiler>(stream_);
  } else if (!on) {
    profiler_.reset();
    step_token_ = -1;
  }
}

void CudaOps::BeginProfiledStep() {
  if (profiler_ != nullptr && step_token_ < 0) step_token_ = profiler_->Begin("step", "", 0);
}

void CudaOps::EndProfiledStep() {
  if (profiler_ != nullptr && step_token_ >= 0) profiler_->End(step_token_);
  step_token_ = -1;
}

std::vector<OpProfileRow> CudaOps::TakeOpProfile() {
  return profiler_ != nullptr ? profiler_->Take() : std::vector<OpProfileRow>{};
}

void CudaOps::StallStream(int us) { cuda::LaunchStall(us, stream_); }

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

CudaOps::CudaOps(int device) : device_(device) {
  int count = CudaDeviceCount();
  TP_CHECK(device >= 0 && device < count)
      << "CUDA device " << device << " requested, " << count << " present";
  TP_CUDA_CHECK(cudaSetDevice(device));
  TP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (auto& e : staging_done_) TP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  lt_ = std::make_unique<cuda::LtGemm>();
  sampler_ = std::make_unique<cuda::GpuSampler>();
  batch_ = std::make_unique<cuda::DeviceBatch>();
  const size_t record_bytes = sizeof(unsigned long long) * cuda::kNormRecordWords * kMaxNormRecords;
  TP_CUDA_CHECK(cudaMalloc(&norm_records_, record_bytes));
  TP_CUDA_CHECK(cudaMemset(norm_records_, 0, record_bytes));
  // The stream GEMM's workspace is allocated when it is first enabled (set_stream_max_m).
  if (cuda::StreamGemmSupported()) set_stream_max_m(static_cast<int>(EnvInt(env::kStreamGemmMaxM)));
}

CudaOps::~CudaOps() {
  cudaStreamSynchronize(stream_);
  profiler_.reset();
  sampler_.reset();
  lt_.reset();
  for (auto& s : sections_) cudaFree(s.dev);
  for (auto* p : staging_) cudaFreeHost(p);
  for (auto& e : staging_done_) cudaEventDestroy(e);
  cudaFree(decode_ws_);
  cudaFree(decode_counters_);
  cudaFree(norm_records_);
  cudaFree(stream_ws_.partials);
  cudaFree(stream_ws_.counters);
  cudaFree(scratch_.k);
  cudaFree(scratch_.v);
  cudaStreamDestroy(stream_);
}

void* CudaOps::Alloc(size_t bytes) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (err != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    TP_LOG(FATAL) << "cudaMalloc of " << bytes << " bytes failed on device " << device_ << " ("
                  << cudaGetErrorString(err) << "); free " << free_b << " of " << total_b
                  << " bytes";
  }
  return p;
}

void CudaOps::Free(void* ptr) {
  if (ptr != nullptr) TP_CUDA_CHECK(cudaFree(ptr));
}

void CudaOps::CopyToDevice(void* dst, const void* src, size_t bytes) {
  TP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  TP_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaOps::CopyToHost(void* dst, const void* src, size_t bytes) {
  TP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  TP_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaOps::CopyDeviceToDevice(void* dst, const void* src, size_t bytes) {
  TP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

void CudaOps::Synchronize() { TP_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

bool CudaOps::MemoryInfo(size_t* free_bytes, size_t* total_bytes) const {
  TP_CUDA_CHECK(cudaSetDevice(device_));
  TP_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
  return true;
}

std::unique_ptr<DeviceUploader> CudaOps::MakeUploader() {
  return cuda::MakePinnedUploader(device_);
}

void CudaOps::EnsureNotCapturing(const char* what) const {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TP_CUDA_CHECK(cudaStreamIsCapturing(stream_, &status));
  TP_CHECK(status == cudaStreamCaptureStatusNone)
      << what << " while stream capture is active: call SetBatch before capturing, and "
      << "Reserve() or warm up at the largest sizes so that no buffer grows during capture";
}

void CudaOps::GrowSection(Section& s, size_t bytes) {
  if (bytes <= s.cap) return;
  EnsureNotCapturing("growing a batch buffer");
  size_t cap = std::max<size_t>(bytes, 2 * s.cap);
  cap = (cap + 255) & ~size_t{255};
  TP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (s.dev != nullptr) TP_CUDA_CHECK(cudaFree(s.dev));
  s.dev = Alloc(cap);
  s.cap = cap;
  ++generation_;
}

void CudaOps::GrowDecodeWorkspace(const cuda::DeviceBatch& b, int num_heads, int num_kv_heads,
                                  int head_dim) {
  const size_t floats = cuda::DecodeWorkspaceFloats(b, num_heads, num_kv_heads, head_dim);
  const size_t counters = cuda::DecodeNumCounters(b, num_heads, num_kv_heads);
  if (floats <= decode_ws_floats_ && counters <= decode_counters_cap_) return;
  EnsureNotCapturing("growing the decode-attention workspace");
  TP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (floats > decode_ws_floats_) {
    if (decode_ws_ != nullptr) TP_CUDA_CHECK(cudaFree(decode_ws_));
    decode_ws_ = static_cast<float*>(Alloc(floats * sizeof(float)));
    decode_ws_floats_ = floats;
  }
  if (counters > decode_counters_cap_) {
    if (decode_counters_ != nullptr) TP_CUDA_CHECK(cudaFree(decode_counters_));
    decode_counters_ = static_cast<unsigned*>(Alloc(counters * sizeof(unsigned)));
    decode_counters_cap_ = counters;
    // The kernel leaves every counter it uses at zero again.
    TP_CUDA_CHECK(cudaMemsetAsync(decode_counters_, 0, counters * sizeof(unsigned), stream_));
  }
  ++generation_;
}

void CudaOps::SetDeterministic(bool on) {
  if (on == deterministic_) return;
  Ops::SetDeterministic(on);
  lt_->set_fixed_algorithm(on);
  det_fixed_order_gemm_ = EnvString(env::kDeterministicGemm) == "fixed-order";
  det_chain_ = on && EnvString(env::kDeterministicGemm) == "cublaslt";
  det_stream_gemm_ =
      on && EnvString(env::kDeterministicGemm) == "stream" && cuda::StreamGemmSupported();
  if (det_stream_gemm_) AllocateStreamWorkspace();
  det_partition_ = on ? static_cast<int>(std::stoi(EnvString(env::kDeterministicPartition))) : 0;
  det_token_groups_ = on && EnvBool(env::kDeterministicTokenGroups);
  det_tiles_ = det_chain_ && EnvString(env::kDeterministicTiles) == "on";
  ++generation_;  // graphs captured before bake in the other kernels
}

namespace {

// A weight's tile-contiguous copy, registered for the chain GEMV until destroyed.
struct ChainTiles : Ops::PreparedWeight {
  ChainTiles(Ops* ops, const Tensor& w, cudaStream_t stream)
      : w_data(w.data), tiles(ops, cuda::ChainTileBytes(w.dim(0), w.dim(-1))) {
    cuda::MakeChainTiles(w, tiles.get(), stream);
    cuda::RegisterChainTiles(w, tiles.get());
  }
  ~ChainTiles() override { cuda::UnregisterChainTiles(w_data); }
  const void* w_data;
  DeviceBuffer tiles;
};

}  // namespace

int64_t CudaOps::PreparedGemmWeightBytes(int64_t n, int64_t k) const {
  return det_tiles_ && k % 16 == 0 ? static_cast<int64_t>(cuda::ChainTileBytes(n, k)) : 0;
}

std::unique_ptr<Ops::PreparedWeight> CudaOps::PrepareGemmWeight(const Tensor& w) {
  if (w.ndim != 2 || w.dtype != DType::kBF16 || PreparedGemmWeightBytes(w.dim(0), w.dim(1)) == 0) {
    return nullptr;
  }
  return std::make_unique<ChainTiles>(this, w, stream_);
}

void CudaOps::Reserve(const CudaReserve& r) {
  GrowSection(sections_[kTokenIds], r.max_tokens * sizeof(int32_t));
  GrowSection(sections_[kPositions], r.max_tokens * sizeof(int32_t));
  GrowSection(sections_[kSlots], r.max_tokens * sizeof(int32_t));
  GrowSection(sections_[kLogitsRows], r.max_tokens * sizeof(int32_t));
  GrowSection(sections_[kQueryStart], (r.max_seqs + 1) * sizeof(int32_t));
  GrowSection(sections_[kContextLens], r.max_seqs * sizeof(int32_t));
  GrowSection(sections_[kBlockTables],
              size_t{1} * r.max_seqs * r.max_blocks_per_seq * sizeof(int32_t));
  // Prefill tiles: at most one per sequence plus one per kPrefillTileMinM tokens.
  GrowSection(sections_[kPrefillWork],
              (r.max_seqs + r.max_tokens / cuda::kPrefillTileMinM + 1) * sizeof(int2));
  GrowSection(sections_[kFedTokens], r.max_seqs * sizeof(int2));
  // Deterministic mode: every token a decode query; otherwise the decode rows of a mixed step.
  for (int i : {kTokenQueryStart, kTokenContextLens, kTokenTableRows}) {
    GrowSection(
        sections_[i],
        size_t(deterministic_ ? std::max(r.max_tokens, r.max_seqs) : r.max_seqs) * sizeof(int32_t));
  }
  // At most one group per sequence, plus one per kDecodeTokenGroup tokens and one per launch
  // chunk boundary (a group never crosses one).
  if (deterministic_) {
    GrowSection(sections_[kTokenGroups],
                size_t(r.max_seqs + r.max_tokens / cuda::kDecodeTokenGroup +
                       r.max_tokens / cuda::kDecodeQueryChunk + 1) *
                    sizeof(int2));
  }
  if (r.num_heads > 0) {
    reserve_heads_ = r.num_heads;
    reserve_kv_heads_ = r.num_kv_heads > 0 ? r.num_kv_heads : r.num_heads;
    reserve_head_dim_ = r.head_dim;
    cuda::DeviceBatch b;
    b.decode_partition = det_partition_;
    // Deterministic mode runs prefill tokens as decode queries, kDecodeQueryChunk at a time.
    b.num_seqs = deterministic_
                     ? std::max(r.max_seqs, std::min(r.max_tokens, cuda::kDecodeQueryChunk))
                     : r.max_seqs;
    b.max_blocks_per_seq = r.max_blocks_per_seq;
    b.block_size = r.block_size;
    GrowDecodeWorkspace(b, reserve_heads_, reserve_kv_heads_, reserve_head_dim_);
  }
}

void CudaOps::ReservePrefillScratch(DType kv, int64_t pages, int block_size, int kv_heads,
                                    int head_dim) {
  TP_CHECK(pages >= 0 && block_size > 0 && kv_heads > 0 && head_dim > 0)
      << "ReservePrefillScratch: " << pages << " pages of " << block_size << " x " << kv_heads
      << " x " << head_dim;
  if ((kv != DType::kF8E4M3 && kv != DType::kI8) || !cuda::WgmmaPrefillFits(kv, head_dim)) {
    scratch_.pages = 0;  // later batches plan for none
    return;
  }
  const size_t half = size_t(pages) * block_size * kv_heads * head_dim * sizeof(uint16_t);
  if (half > scratch_.bytes / 2) {
    EnsureNotCapturing("growing the prefill scratch");
    TP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaFree(scratch_.k);
    cudaFree(scratch_.v);
    scratch_.k = Alloc(half);
    scratch_.v = Alloc(half);
    scratch_.bytes = 2 * half;
  }
  scratch_.kv = kv;
  scratch_.pages = pages;
  scratch_.block_size = block_size;
  scratch_.kv_heads = kv_heads;
  scratch_.head_dim = head_dim;
  GrowSection(sections_[kScratchPages], size_t(pages) * sizeof(int2));
  // As large as the block tables Reserve sized, so that no batch grows it after warm-up.
  GrowSection(sections_[kScratchTables], sections_[kBlockTables].cap);
}

int CudaOps::prefill_scratch_pages() const { return batch_ ? batch_->num_scratch_pages : 0; }
int CudaOps::mixed_decode_rows() const { return batch_ ? batch_->num_mixed_decode : 0; }

void CudaOps::SetBatch(const BatchMeta& m) {
  EnsureNotCapturing("SetBatch");
  norm_records_used_ = 0;
  const int T = m.num_tokens, S = m.num_seqs;
  TP_CHECK(T >= 0 && S >= 0 && static_cast<int>(m.positions.size()) == T &&
           static_cast<int>(m.slot_mapping.size()) == T &&
           static_cast<int>(m.query_start.size()) == S + 1 &&
           static_cast<int>(m.context_lens.size()) == S &&
           m.block_tables.size() == size_t{1} * S * m.max_blocks_per_seq && m.block_size > 0 &&
           (m.token_ids.empty() || static_cast<int>(m.token_ids.size()) == T) &&
           m.fed_tokens.size() == m.fed_rows.size())
      << "SetBatch: inconsistent BatchMeta (tokens " << T << ", seqs " << S << ", token_ids "
      << m.token_ids.size() << ", positions " << m.positions.size() << ", slot_mapping "
      << m.slot_mapping.size() << ", query_start " << m.query_start.size() << ", context_lens "
      << m.context_lens.size() << ", block_tables " << m.block_tables.size()
      << ", max_blocks_per_seq " << m.max_blocks_per_seq << ")";
  TP_CHECK(S == 0 || (m.query_start[0] == 0 && m.query_start[S] == T))
      << "SetBatch: query_start must run from 0 to num_tokens " << T;
  int max_q = 0, max_ctx = 0;
  const int tile_m = cuda::PrefillTileM();
  std::vector<int2> work;
  for (int s = 0; s < S; ++s) {
    int qlen = m.query_start[s + 1] - m.query_start[s];
    int ctx = m.context_lens[s];
    // context 0 marks a padding sequence (graph buckets): its outputs are zeros.
    TP_CHECK(qlen >= 0 && (ctx >= qlen || ctx == 0) && ctx <= m.max_blocks_per_seq * m.block_size)
        << "SetBatch: sequence " << s << " has query length " << qlen << " and context " << ctx
        << " (capacity " << m.max_blocks_per_seq * m.block_size << ")";
    max_q = std::max(max_q, qlen);
    max_ctx = std::max(max_ctx, ctx);
    for (int q0 = 0; q0 < qlen; q0 += tile_m) work.push_back({s, q0});
  }
  // Heaviest prefill tiles (most keys) first, so the tail of the grid is short.
  auto keys_of = [&](const int2& w) {
    int qlen = m.query_start[w.x + 1] - m.query_start[w.x];
    return m.context_lens[w.x] - qlen + std::min(w.y + tile_m, qlen);
  };
  std::stable_sort(work.begin(), work.end(),
                   [&](const int2& a, const int2& b) { return keys_of(a) > keys_of(b); });
  // A mixed step (continuous batching, MixedDecodeChoice): the decode rows' tiles last, and
  // the rows as token queries for the decode kernel (the token_* sections, which deterministic
  // mode, the only other user, never shares a step with).
  std::vector<char> mixed_row(S, 0);
  std::vector<int32_t> mixed_rows, mixed_ctx, mixed_tables;
  if (!deterministic_ && max_q > 1 && cuda::MixedDecodeChoice() != cuda::MixedDecode::kOff) {
    for (int s = 0; s < S; ++s) {
      if (m.query_start[s + 1] - m.query_start[s] != 1 || m.context_lens[s] == 0) continue;
      mixed_row[s] = 1;
      mixed_rows.push_back(m.query_start[s]);
      mixed_ctx.push_back(m.context_lens[s]);
      mixed_tables.push_back(s);
    }
    if (!mixed_rows.empty()) {
      std::stable_partition(work.begin(), work.end(),
                            [&](const int2& w) { return mixed_row[w.x] == 0; });
    }
  }
  // Prefill over an 8-bit cache: the sequences PrefillDequantTakes, longest query first while
  // their pages fit the scratch, get scratch pages in order and their tiles first in the work
  // list (each part still heaviest first). Deterministic mode runs no prefill kernel.
  std::vector<int32_t> scratch_tables;
  std::vector<int2> scratch_pages;
  int scratch_work = 0;
  scratch_seqs_ = 0;
  const cuda::PrefillDequant dequant = cuda::PrefillDequantChoice();
  if (scratch_.pages > 0 && scratch_.block_size == m.block_size && !deterministic_ &&
      dequant != cuda::PrefillDequant::kOff &&
      cuda::PrefillKernelChoice() != cuda::PrefillKernel::kMma &&
      (max_q > 1 || dequant == cuda::PrefillDequant::kAll) && !work.empty()) {
    std::vector<int> order;
    for (int s = 0; s < S; ++s) {
      const int qlen = m.query_start[s + 1] - m.query_start[s];
      if (!mixed_row[s] && cuda::PrefillDequantTakes(dequant, qlen, m.context_lens[s])) {
        order.push_back(s);
      }
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return m.query_start[a + 1] - m.query_start[a] > m.query_start[b + 1] - m.query_start[b];
    });
    std::vector<char> takes(S, 0);
    for (int s : order) {
      const int ctx = m.context_lens[s];
      const int pages = (ctx + m.block_size - 1) / m.block_size;
      if (static_cast<int64_t>(scratch_pages.size()) + pages > scratch_.pages) continue;
      if (scratch_tables.empty()) scratch_tables.assign(size_t{1} * S * m.max_blocks_per_seq, 0);
      for (int j = 0; j < pages; ++j) {
        scratch_tables[size_t{1} * s * m.max_blocks_per_seq + j] =
            static_cast<int32_t>(scratch_pages.size());
        scratch_pages.push_back({m.block_tables[size_t{1} * s * m.max_blocks_per_seq + j],
                                 std::min(m.block_size, ctx - j * m.block_size)});
      }
      takes[s] = 1;
      ++scratch_seqs_;
    }
    if (scratch_seqs_ > 0) {
      auto first = std::stable_partition(work.begin(), work.end(),
                                         [&](const int2& w) { return takes[w.x] != 0; });
      scratch_work = static_cast<int>(first - work.begin());
    }
  }
  // Deterministic mode, a batch with prefill tokens: each token as a decode query of its own.
  const bool token_queries = deterministic_ && T != S;
  std::vector<int32_t> token_query_start, token_context_lens, token_table_rows;
  std::vector<int2> token_groups;
  token_group_chunks_.clear();
  const int num_mixed = static_cast<int>(mixed_rows.size());
  if (num_mixed > 0) {
    token_query_start = std::move(mixed_rows);
    token_context_lens = std::move(mixed_ctx);
    token_table_rows = std::move(mixed_tables);
  }
  if (token_queries) {
    token_query_start.resize(T);
    token_context_lens.resize(T);
    token_table_rows.resize(T);
    for (int s = 0; s < S; ++s) {
      const int q0 = m.query_start[s], qlen = m.query_start[s + 1] - q0;
      for (int i = 0; i < qlen; ++i) {
        token_query_start[q0 + i] = q0 + i;
        // Padding (context 0) stays 0: its rows are zeros.
        token_context_lens[q0 + i] = m.context_lens[s] == 0 ? 0 : m.context_lens[s] - qlen + i + 1;
        token_table_rows[q0 + i] = s;
      }
      // Groups of consecutive tokens of this sequence; none crosses a launch's token chunk.
      if (det_token_groups_) {
        for (int i = 0; i < qlen;) {
          const int t = q0 + i;
          const int chunk = t / cuda::kDecodeQueryChunk;
          while (static_cast<int>(token_group_chunks_.size()) <= chunk) {
            token_group_chunks_.push_back(static_cast<int>(token_groups.size()));
          }
          const int room = cuda::kDecodeQueryChunk - t % cuda::kDecodeQueryChunk;
          const int count = std::min({cuda::kDecodeTokenGroup, qlen - i, room});
          token_groups.push_back({t % cuda::kDecodeQueryChunk, count + (chunk << 16)});
          i += count;
        }
      }
    }
    token_group_chunks_.push_back(static_cast<int>(token_groups.size()));
  }

  // Fed tokens: (token index, row of the latest SampleAsync), applied after the upload.
  std::vector<int2> fed(m.fed_tokens.size());
  for (size_t i = 0; i < fed.size(); ++i) {
    TP_CHECK(m.fed_tokens[i] >= 0 && m.fed_tokens[i] < T && !m.token_ids.empty() &&
             m.fed_rows[i] >= 0 && m.fed_rows[i] < sampler_->latest_rows())
        << "SetBatch: fed token " << m.fed_tokens[i] << " from sampled row " << m.fed_rows[i]
        << " (" << T << " tokens, " << sampler_->latest_rows() << " rows sampled last)";
    fed[i] = {m.fed_tokens[i], m.fed_rows[i]};
  }

  struct Part {
    const void* src;
    size_t bytes;
  };
  Part parts[kNumSections] = {
      {m.token_ids.data(), m.token_ids.size() * sizeof(int32_t)},
      {m.positions.data(), m.positions.size() * sizeof(int32_t)},
      {m.slot_mapping.data(), m.slot_mapping.size() * sizeof(int32_t)},
      {m.query_start.data(), m.query_start.size() * sizeof(int32_t)},
      {m.context_lens.data(), m.context_lens.size() * sizeof(int32_t)},
      {m.block_tables.data(), m.block_tables.size() * sizeof(int32_t)},
      {m.logits_rows.data(), m.logits_rows.size() * sizeof(int32_t)},
      {work.data(), work.size() * sizeof(int2)},
      {token_query_start.data(), token_query_start.size() * sizeof(int32_t)},
      {token_context_lens.data(), token_context_lens.size() * sizeof(int32_t)},
      {token_table_rows.data(), token_table_rows.size() * sizeof(int32_t)},
      {token_groups.data(), token_groups.size() * sizeof(int2)},
      {fed.data(), fed.size() * sizeof(int2)},
      {scratch_tables.data(), scratch_tables.size() * sizeof(int32_t)},
      {scratch_pages.data(), scratch_pages.size() * sizeof(int2)},
  };
  size_t total = 0;
  for (int i = 0; i < kNumSections; ++i) {
    GrowSection(sections_[i], parts[i].bytes);
    total += (parts[i].bytes + 15) & ~size_t{15};
  }
  if (reserve_heads_ > 0) {
    cuda::DeviceBatch b;
    b.decode_partition = det_partition_;
    b.num_seqs = token_queries ? std::min(T, cuda::kDecodeQueryChunk) : S;
    b.max_blocks_per_seq = m.max_blocks_per_seq;
    b.block_size = m.block_size;
    GrowDecodeWorkspace(b, reserve_heads_, reserve_kv_heads_, reserve_head_dim_);
  }

  // Pinned staging, used alternately; wait for the copy that last read this one.
  const int p = staging_next_;
  staging_next_ ^= 1;
  TP_CUDA_CHECK(cudaEventSynchronize(staging_done_[p]));
  if (total > staging_cap_[p]) {
    if (staging_[p] != nullptr) TP_CUDA_CHECK(cudaFreeHost(staging_[p]));
    size_t cap = std::max(total, 2 * staging_cap_[p]);
    TP_CUDA_CHECK(cudaMallocHost(&staging_[p], cap));
    staging_cap_[p] = cap;
  }
  char* host = static_cast<char*>(staging_[p]);
  size_t off = 0;
  for (int i = 0; i < kNumSections; ++i) {
    if (parts[i].bytes == 0) continue;
    std::memcpy(host + off, parts[i].src, parts[i].bytes);
    TP_CUDA_CHECK(cudaMemcpyAsync(sections_[i].dev, host + off, parts[i].bytes,
                                  cudaMemcpyHostToDevice, stream_));
    off += (parts[i].bytes + 15) & ~size_t{15};
  }
  TP_CUDA_CHECK(cudaEventRecord(staging_done_[p], stream_));
  // In stream order, after the latest SampleAsync wrote the ids and before anything reads them.
  cuda::LaunchFeedTokens(static_cast<int32_t*>(sections_[kTokenIds].dev),
                         static_cast<const int2*>(sections_[kFedTokens].dev),
                         static_cast<int>(fed.size()), sampler_->latest_ids(), stream_);

  // Token queries read K/V rows the kernel before them writes: no programmatic launch.
  cuda::t_pdl_batch = T <= cuda::kPdlMaxTokens && !token_queries;
  cuda::DeviceBatch& b = *batch_;
  b.num_seqs = S;
  b.num_tokens = T;
  b.max_blocks_per_seq = m.max_blocks_per_seq;
  b.block_size = m.block_size;
  b.num_logits_rows = static_cast<int>(m.logits_rows.size());
  b.max_query_len = max_q;
  b.max_context_len = max_ctx;
  b.num_prefill_work = static_cast<int>(work.size());
  auto ptr = [&](int i) { return static_cast<const int32_t*>(sections_[i].dev); };
  b.token_ids = m.token_ids.empty() ? nullptr : ptr(kTokenIds);
  b.positions = ptr(kPositions);
  b.slot_mapping = ptr(kSlots);
  b.query_start = ptr(kQueryStart);
  b.context_lens = ptr(kContextLens);
  b.block_tables = ptr(kBlockTables);
  b.logits_rows = ptr(kLogitsRows);
  b.prefill_work = static_cast<const int2*>(sections_[kPrefillWork].dev);
  b.decode_partition = det_partition_;
  b.token_query_start = token_queries ? ptr(kTokenQueryStart) : nullptr;
  b.token_context_lens = token_queries ? ptr(kTokenContextLens) : nullptr;
  b.token_table_rows = token_queries ? ptr(kTokenTableRows) : nullptr;
  b.token_groups =
      token_groups.empty() ? nullptr : static_cast<const int2*>(sections_[kTokenGroups].dev);
  b.token_group_chunks = token_groups.empty() ? nullptr : token_group_chunks_.data();
  b.num_mixed_decode = num_mixed;
  b.mixed_query_rows = num_mixed > 0 ? ptr(kTokenQueryStart) : nullptr;
  b.mixed_context_lens = num_mixed > 0 ? ptr(kTokenContextLens) : nullptr;
  b.mixed_table_rows = num_mixed > 0 ? ptr(kTokenTableRows) : nullptr;
  b.num_scratch_work = scratch_work;
  b.num_scratch_pages = static_cast<int>(scratch_pages.size());
  b.scratch_tables = scratch_work > 0 ? ptr(kScratchTables) : nullptr;
  b.scratch_pages =
      scratch_work > 0 ? static_cast<const int2*>(sections_[kScratchPages].dev) : nullptr;
}

void CudaOps::Embedding(const Tensor& table, int64_t row_offset, Tensor out) {
  TP_CHECK(batch_->token_ids != nullptr || batch_->num_tokens == 0)
      << "Embedding: the batch has no token_ids";
  OpScope scope(
      this, "Embedding", [&] { return Dims(out); }, 2.0 * out.bytes());
  cuda::LaunchEmbedding(table, row_offset, *batch_, out, stream_);
}

void CudaOps::RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor out) {
  OpScope scope(
      this, "RmsNorm", [&] { return Dims(x); }, 2.0 * x.bytes());
  cuda::LaunchRmsNorm(x, weight, eps, out, stream_);
}

void CudaOps::AddRmsNorm(Tensor residual, const Tensor& x, const Tensor& weight, float eps,
                         Tensor out) {
  if (Ablated("AddRmsNorm")) return;
  OpScope scope(
      this, "AddRmsNorm", [&] { return Dims(x); }, 4.0 * x.bytes());
  // Deterministic mode: the fixed-point arithmetic of the chain GEMMs' deferred norm.
  cuda::LaunchAddRmsNorm(residual, x, weight, eps, out, stream_, /*fixed_point=*/deterministic_);
}

void CudaOps::set_skinny_max_m(int m) {
  TP_CHECK(m >= 0 && m <= cuda::kSkinnyMaxM) << "skinny_max_m " << m;
  skinny_max_m_ = m;
}

void CudaOps::set_stream_max_m(int m) {
  TP_CHECK(m >= 0 && m <= cuda::kStreamGemmMaxM) << "stream_max_m " << m;
  if (m > 0 && cuda::StreamGemmSupported()) AllocateStreamWorkspace();
  stream_max_m_ = stream_ws_.partials != nullptr ? m : 0;
}

void CudaOps::AllocateStreamWorkspace() {
  if (stream_ws_.partials != nullptr) return;
  EnsureNotCapturing("allocating the stream GEMM workspace");
  int sms = 0;
  TP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
  stream_ws_.num_sms = sms;
  stream_ws_.max_grid = sms * cuda::kStreamGemmBlocksPerSm;
  stream_ws_.slot_floats = cuda::kStreamGemmSlotFloats;
  stream_ws_.max_tiles = cuda::kStreamGemmMaxTiles;
  TP_CUDA_CHECK(cudaMalloc(&stream_ws_.partials,
                           sizeof(float) * 2 * stream_ws_.max_grid * stream_ws_.slot_floats));
  TP_CUDA_CHECK(cudaMalloc(&stream_ws_.counters, sizeof(int) * stream_ws_.max_tiles));
  TP_CUDA_CHECK(cudaMemset(stream_ws_.counters, 0, sizeof(int) * stream_ws_.max_tiles));
}

void CudaOps::Gemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y) {
  if (w.dim(0) == w.dim(1) && Ablated("Gemm.square")) return;
  int64_t k = x.dim(-1);
  int64_t m = k == 0 ? 0 : x.numel() / k;
  // Deterministic mode: cuBLASLt's fixed algorithm (or the fixed-order GEMM) for every M; the
  // skinny kernel's order is not the one of larger M. The fixed-order GEMM's condition
  // (K % 8 == 0, aligned rows) holds for every M of a weight or for none.
  const bool fixed_order =
      deterministic_ && det_fixed_order_gemm_ && m > 0 && cuda::FixedOrderGemmFits(x, w, y);
  const bool skinny = !deterministic_ && m > 0 && m <= skinny_max_m_ && k % 8 == 0 &&
                      Aligned16(x.data) && Aligned16(w.data);
  const bool chain = ChainFits(m, k, x.data, w.data);
  const bool streamed =
      !deterministic_ && !skinny && m <= stream_max_m_ && cuda::StreamGemmFits(x, w, y);
  // Whether a weight fits does not depend on M (K % 8, alignment of buffers allocated aligned).
  const bool det_streamed =
      deterministic_ && det_stream_gemm_ && m > 0 && cuda::StreamGemmFixedFits(x, w, y);
  OpScope scope(
      this,
      fixed_order    ? "Gemm.fixedOrder"
      : skinny       ? "Gemm.skinny"
      : chain        ? "Gemm.chain"
      : streamed     ? "Gemm.stream"
      : det_streamed ? "Gemm.streamFixed"
                     : "Gemm.cublasLt",
      [&] { return GemmShape(m, w.dim(0), k); },
      double(w.bytes()) + double(x.bytes()) + double(y.bytes()));
  if (fixed_order) {
    cuda::LaunchFixedOrderGemm(x, w, bias, y, stream_);
  } else if (skinny) {
    cuda::LaunchSkinnyGemm(x, w, bias, y, stream_);
  } else if (chain) {
    cuda::LaunchChainGemv(x, w, bias, y, stream_);
  } else if (streamed) {
    cuda::LaunchStreamGemm(x, w, bias, y, stream_ws_, stream_);
  } else if (det_streamed) {
    cuda::LaunchStreamGemmFixed(x, w, bias, y, stream_ws_, stream_);
  } else {
    lt_->Run(x, w, bias, y, stream_);
  }
}

void CudaOps::GemmStream(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y, int config,
                         int max_grid, bool exact_grid) {
  TP_CHECK(cuda::StreamGemmSupported()) << "the stream GEMM needs an sm_90 device";
  AllocateStreamWorkspace();
  cuda::LaunchStreamGemm(x, w, bias, y, stream_ws_, stream_, config, max_grid, exact_grid);
}

void CudaOps::GemmStreamFixed(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y) {
  TP_CHECK(cuda::StreamGemmSupported()) << "the stream GEMM needs an sm_90 device";
  AllocateStreamWorkspace();
  cuda::LaunchStreamGemmFixed(x, w, bias, y, stream_ws_, stream_);
}

void CudaOps::GemmCublasLt(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y) {
  lt_->Run(x, w, bias, y, stream_);
}

std::pair<int, int> CudaOps::CublasLtPlans() const {
  return {static_cast<int>(lt_->num_plans()), lt_->num_table_plans()};
}

void CudaOps::GemmSkinny(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                         int config) {
  cuda::LaunchSkinnyGemm(x, w, bias, y, stream_, config);
}

void CudaOps::SiluMulGemm(const Tensor& gate_up, const Tensor& w, Tensor act, Tensor y) {
  const int64_t k = w.dim(-1);
  const int64_t m = k == 0 ? 0 : gate_up.numel() / (2 * k);
  // The skinny kernel outside deterministic mode, the chain GEMM in it (never both).
  const bool skinny = SkinnyFusedFits(m, k, gate_up.data, w.data);
  if (fused_skinny_ && (skinny || ChainFits(m, k, gate_up.data, w.data))) {
    OpScope scope(
        this, skinny ? "SiluMulGemm.skinny" : "SiluMulGemm.chain",
        [&] { return GemmShape(m, w.dim(0), k); },
        double(w.bytes()) + double(gate_up.bytes()) + double(y.bytes()));
    if (skinny) {
      cuda::LaunchSkinnySwiGluGemm(gate_up, w, y, stream_);
    } else {
      cuda::LaunchChainSwiGluGemv(gate_up, w, y, stream_);
    }
    return;
  }
  SiluMul(gate_up, act);
  Gemm(act, w, nullptr, y);
}

bool CudaOps::ChainFits(int64_t m, int64_t k, const void* x, const void* w) const {
  return det_chain_ && m <= kDetChainMaxM && cuda::ChainGemvFits(m, k, x, w);
}

bool CudaOps::ChainFusedFits(int64_t m, int64_t k, const void* x, const void* w) const {
  return ChainFits(m, k, x, w) && m <= cuda::kSkinnyFusedMaxM;
}

bool CudaOps::SkinnyFusedFits(int64_t m, int64_t k, const void* x, const void* w) const {
  return !deterministic_ && m > 0 && m <= std::min(skinny_max_m_, cuda::kSkinnyFusedMaxM) &&
         k % 8 == 0 && Aligned16(x) && Aligned16(w);
}

unsigned long long* CudaOps::NextNormRecord() {
  if (norm_records_used_ >= kMaxNormRecords) return nullptr;
  if (norm_records_used_ == 0) {
    cuda::LaunchZeroNormSums(norm_records_, int64_t{cuda::kNormRecordWords} * kMaxNormRecords,
                             stream_);
  }
  return norm_records_ + int64_t{cuda::kNormRecordWords} * norm_records_used_++;
}

void CudaOps::ApplyRowScale(const Tensor& x, const RowScale& x_scale) {
  TP_CHECK(x_scale.dim == x.dim(-1))
      << "row scale of dim " << x_scale.dim << " for x " << x.ShapeString();
  OpScope scope(
      this, "ApplyRowScale", [&] { return Dims(x); }, 2.0 * x.bytes());
  cuda::LaunchApplyRowScale(x, static_cast<const unsigned long long*>(x_scale.record), x_scale.eps,
                            stream_);
}

bool CudaOps::ResidualGemmFits(int64_t m) const {
  // Above the decode batches (skinny, stream and chain GEMMs), so the GEMM is cuBLASLt's.
  return fused_norm_ && ablated_.empty() && !deterministic_ && m > kResidualGemmMinM &&
         m > skinny_max_m_ && m > stream_max_m_;
}

void CudaOps::GemmIntoResidual(const Tensor& x, const Tensor& w, const Tensor* bias,
                               Tensor residual) {
  const int64_t k = x.dim(-1);
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  OpScope scope(
      this, "GemmAdd.cublasLt", [&] { return GemmShape(m, w.dim(0), k); },
      double(w.bytes()) + double(x.bytes()) + 2.0 * double(residual.bytes()));
  lt_->RunAccumulate(x, w, bias, residual, stream_);
}

RowScale CudaOps::GemmAddRmsNorm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                                 Tensor residual, const Tensor& gamma, float eps, Tensor normed) {
  const int64_t k = x.dim(-1), n = w.dim(0);
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  if (ResidualGemmFits(m)) {
    GemmIntoResidual(x, w, bias, residual);
    RmsNorm(residual, gamma, eps, normed);
    return RowScale();
  }
  const bool skinny = SkinnyFusedFits(m, k, x.data, w.data);
  if (fused_norm_ && ablated_.empty() && (skinny || ChainFusedFits(m, k, x.data, w.data))) {
    if (unsigned long long* record = NextNormRecord()) {
      OpScope scope(
          this, skinny ? "GemmAddRmsNorm.skinny" : "GemmAddRmsNorm.chain",
          [&] { return GemmShape(m, n, k); },
          double(w.bytes()) + double(x.bytes()) + 4.0 * double(y.bytes()));
      (skinny ? cuda::LaunchSkinnyGemmAddNorm : cuda::LaunchChainGemvAddNorm)(
          x, w, bias, y, residual, gamma, normed, /*swiglu=*/false, record, stream_);
      return RowScale{record, n, eps};
    }
  }
  return Ops::GemmAddRmsNorm(x, w, bias, y, residual, gamma, eps, normed);
}

RowScale CudaOps::SiluMulGemmAddRmsNorm(const Tensor& gate_up, const Tensor& w, Tensor act,
                                        Tensor y, Tensor residual, const Tensor& gamma, float eps,
                                        Tensor normed) {
  const int64_t k = w.dim(-1), n = w.dim(0);
  const int64_t m = k == 0 ? 0 : gate_up.numel() / (2 * k);
  if (ResidualGemmFits(m)) {
    SiluMul(gate_up, act);
    GemmIntoResidual(act, w, nullptr, residual);
    RmsNorm(residual, gamma, eps, normed);
    return RowScale();
  }
  const bool skinny = SkinnyFusedFits(m, k, gate_up.data, w.data);
  if (fused_norm_ && fused_skinny_ && ablated_.empty() &&
      (skinny || ChainFusedFits(m, k, gate_up.data, w.data))) {
    if (unsigned long long* record = NextNormRecord()) {
      OpScope scope(
          this, skinny ? "SiluMulGemmAddRmsNorm.skinny" : "SiluMulGemmAddRmsNorm.chain",
          [&] { return GemmShape(m, n, k); },
          double(w.bytes()) + double(gate_up.bytes()) + 4.0 * double(y.bytes()));
      (skinny ? cuda::LaunchSkinnyGemmAddNorm : cuda::LaunchChainGemvAddNorm)(
          gate_up, w, nullptr, y, residual, gamma, normed, /*swiglu=*/true, record, stream_);
      return RowScale{record, n, eps};
    }
  }
  return Ops::SiluMulGemmAddRmsNorm(gate_up, w, act, y, residual, gamma, eps, normed);
}

void CudaOps::GemmScaledRows(const Tensor& x, const RowScale& x_scale, const Tensor& w,
                             const Tensor* bias, Tensor y) {
  if (x_scale.empty()) return Gemm(x, w, bias, y);
  const int64_t k = x.dim(-1);
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  TP_CHECK(x_scale.dim == k) << "GemmScaledRows: row scale of dim " << x_scale.dim << " for x "
                             << x.ShapeString();
  const bool skinny = SkinnyFusedFits(m, k, x.data, w.data);
  if (skinny || ChainFusedFits(m, k, x.data, w.data)) {
    OpScope scope(
        this, skinny ? "GemmScaledRows.skinny" : "GemmScaledRows.chain",
        [&] { return GemmShape(m, w.dim(0), k); },
        double(w.bytes()) + double(x.bytes()) + double(y.bytes()));
    (skinny ? cuda::LaunchSkinnyGemmScaledRows : cuda::LaunchChainGemvScaledRows)(
        x, static_cast<const unsigned long long*>(x_scale.record), x_scale.eps, w, bias, y,
        stream_);
    return;
  }
  ApplyRowScale(x, x_scale);
  Gemm(x, w, bias, y);
}

void CudaOps::SiluMulGemmSkinny(const Tensor& gate_up, const Tensor& w, Tensor y, int config) {
  cuda::LaunchSkinnySwiGluGemm(gate_up, w, y, stream_, config);
}

void CudaOps::Rope(Tensor q, Tensor k, const Tensor& inv_freq, int head_dim) {
  OpScope scope(
      this, "Rope", [&] { return Dims(q) + " " + Dims(k); }, 2.0 * (q.bytes() + k.bytes()));
  cuda::LaunchRope(q, k, inv_freq, head_dim, *batch_, stream_);
}

void CudaOps::KvWrite(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache) {
  OpScope scope(
      this, "KvWrite", [&] { return Dims(k); },
      double(k.bytes() + v.bytes()) + 2.0 * KvRowBytes(k_cache) * batch_->num_tokens);
  cuda::LaunchKvWrite(k, v, k_cache, v_cache, *batch_, stream_);
}

void CudaOps::RopeKvWrite(const Tensor& qkv, const Tensor& inv_freq, int num_q_heads,
                          int num_kv_heads, int head_dim, Tensor q_out, Tensor k_cache,
                          Tensor v_cache) {
  OpScope scope(
      this, "RopeKvWrite", [&] { return Dims(qkv); },
      double(qkv.bytes() + q_out.bytes()) + 2.0 * KvRowBytes(k_cache) * batch_->num_tokens);
  cuda::LaunchRopeKvWrite(qkv, inv_freq, num_q_heads, num_kv_heads, head_dim, *batch_, q_out,
                          k_cache, v_cache, stream_);
}

void CudaOps::QkvRopeKvWrite(const Tensor& x, const RowScale& x_scale, const Tensor& w_qkv,
                             const Tensor* bias, const Tensor& inv_freq, int num_q_heads,
                             int num_kv_heads, int head_dim, Tensor qkv, Tensor q_out,
                             Tensor k_cache, Tensor v_cache) {
  const int64_t k = x.dim(-1);
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  TP_CHECK(x_scale.empty() || x_scale.dim == k)
      << "QkvRopeKvWrite: row scale of dim " << x_scale.dim << " for x " << x.ShapeString();
  // The skinny epilogue stores bf16 caches only. A quantized row needs its head's absmax
  // before any code can be stored, and there each block computes one (i, i + D/2) row pair of a
  // head: the heads would need a reduction across blocks. A quantized cache therefore takes the
  // unfused path, at batch 1 one more kernel per layer (RopeKvWrite after the skinny GEMM; see
  // kernels/cuda/NOTES.md).
  // The skinny kernel outside deterministic mode, the chain GEMM in it (never both).
  const bool skinny = SkinnyFusedFits(m, k, x.data, w_qkv.data) && head_dim % 2 == 0;
  const bool chain = ChainFusedFits(m, k, x.data, w_qkv.data) && cuda::ChainQkvRopeKvFits(head_dim);
  if (fused_skinny_ && k_cache.dtype == DType::kBF16 && m == batch_->num_tokens &&
      (skinny || chain)) {
    OpScope scope(
        this, skinny ? "QkvRopeKvWrite.skinny" : "QkvRopeKvWrite.chain",
        [&] { return GemmShape(m, w_qkv.dim(0), k); },
        double(w_qkv.bytes()) + double(x.bytes()) + 2.0 * double(qkv.bytes()));
    (skinny ? cuda::LaunchSkinnyQkvRopeKvWrite : cuda::LaunchChainQkvRopeKvWrite)(
        x, w_qkv, bias, inv_freq, num_q_heads, num_kv_heads, head_dim, *batch_, q_out, k_cache,
        v_cache, stream_, static_cast<const unsigned long long*>(x_scale.record), x_scale.eps);
    return;
  }
  // A deferred norm's row scale goes into the GEMM's epilogue (fp32, before the bias, as in
  // the fused kernel) where the skinny kernel runs, else onto x first.
  GemmScaledRows(x, x_scale, w_qkv, bias, qkv);
  RopeKvWrite(qkv, inv_freq, num_q_heads, num_kv_heads, head_dim, q_out, k_cache, v_cache);
}

void CudaOps::AttentionPrefill(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               int num_heads, int num_kv_heads, int head_dim, float scale,
                               Tensor out) {
  const cuda::DeviceBatch& b = *batch_;
  // SetBatch's scratch plan (ReservePrefillScratch), for the cache it was made for.
  const bool scratch = !deterministic_ && b.num_scratch_work > 0 && k_cache.dtype == scratch_.kv &&
                       k_cache.ndim == 4 && k_cache.dim(1) == scratch_.block_size &&
                       k_cache.dim(2) == scratch_.kv_heads && k_cache.dim(3) == scratch_.head_dim &&
                       num_kv_heads == scratch_.kv_heads &&
                       cuda::PrefillKernelChoice() != cuda::PrefillKernel::kMma;
  Tensor ks(scratch_.k, {b.num_scratch_pages, b.block_size, num_kv_heads, head_dim}, DType::kBF16,
            Device::kCuda);
  Tensor vs(scratch_.v, {b.num_scratch_pages, b.block_size, num_kv_heads, head_dim}, DType::kBF16,
            Device::kCuda);
  if (scratch) {
    OpScope dq(
        this, "DequantizeKvPages", [&] { return "pages=" + std::to_string(b.num_scratch_pages); },
        double(b.num_scratch_pages) * b.block_size * num_kv_heads * head_dim * 2.0 *
            (DTypeBits(k_cache.dtype) / 8.0 + 2.0));
    cuda::LaunchDequantizeKvPages(k_cache, v_cache, b, ks, vs, stream_);
  }
  OpScope scope(this, "AttentionPrefill", [&] {
    return "T=" + std::to_string(b.num_tokens) + " seqs=" + std::to_string(b.num_seqs) +
           " h=" + std::to_string(num_heads) + "/" + std::to_string(num_kv_heads) +
           " ctx<=" + std::to_string(b.max_context_len);
  });
  if (deterministic_) {
    // One kernel for prefill and decode tokens, so that a token's attention does not depend
    // on whether it was computed in a prefill chunk (of any size) or as a decode step.
    if (b.token_context_lens == nullptr) {
      AttentionDecode(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale, out);
      return;
    }
    cuda::DeviceBatch chunk = b;
    chunk.num_seqs = std::min(b.num_tokens, cuda::kDecodeQueryChunk);
    GrowDecodeWorkspace(chunk, num_heads, num_kv_heads, head_dim);
    cuda::LaunchAttentionDecode(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale, b,
                                decode_ws_, decode_counters_, out, stream_);
    return;
  }
  // The work list: [scratch sequences' tiles][other prompt tiles][mixed decode rows].
  const bool split =
      b.num_mixed_decode > 0 && cuda::MixedDecodeSplits(cuda::MixedDecodeChoice(), k_cache.dtype);
  const int prompt_work = b.num_prefill_work - (split ? b.num_mixed_decode : 0);
  if (scratch) {
    // The scratch sequences' tiles through the bf16 kernel over their pages in the scratch.
    cuda::DeviceBatch mine = b;
    mine.num_prefill_work = b.num_scratch_work;
    mine.block_tables = b.scratch_tables;
    cuda::LaunchAttentionPrefillWgmma(q, ks, vs, num_heads, num_kv_heads, head_dim, scale, mine,
                                      out, cuda::PrefillKernelChoice(), stream_);
  }
  const int first = scratch ? b.num_scratch_work : 0;
  if (prompt_work > first) {
    cuda::DeviceBatch rest = b;
    rest.prefill_work = b.prefill_work + first;
    rest.num_prefill_work = prompt_work - first;
    cuda::LaunchAttentionPrefill(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale,
                                 rest, out, stream_);
  }
  if (split) {
    // The decode rows as token queries, through the decode kernel.
    cuda::DeviceBatch rows = b;
    rows.token_query_start = b.mixed_query_rows;
    rows.token_context_lens = b.mixed_context_lens;
    rows.token_table_rows = b.mixed_table_rows;
    rows.num_token_queries = b.num_mixed_decode;
    rows.token_groups = nullptr;  // the decode rows run one a block
    cuda::DeviceBatch chunk = b;
    chunk.num_seqs = std::min(b.num_mixed_decode, cuda::kDecodeQueryChunk);
    GrowDecodeWorkspace(chunk, num_heads, num_kv_heads, head_dim);
    cuda::LaunchAttentionDecode(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale, rows,
                                decode_ws_, decode_counters_, out, stream_);
  }
}

void CudaOps::AttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              int num_heads, int num_kv_heads, int head_dim, float scale,
                              Tensor out) {
  if (Ablated("AttentionDecode")) return;
  GrowDecodeWorkspace(*batch_, num_heads, num_kv_heads, head_dim);
  // KV bytes when every sequence has the longest context (as in the benchmarks).
  const double kv_bytes = 2.0 * batch_->num_seqs * batch_->max_context_len * KvRowBytes(k_cache);
  OpScope scope(
      this, "AttentionDecode",
      [&] {
        return "seqs=" + std::to_string(batch_->num_seqs) + " h=" + std::to_string(num_heads) +
               "/" + std::to_string(num_kv_heads) +
               " ctx<=" + std::to_string(batch_->max_context_len) + " part=" +
               std::to_string(cuda::DecodeLaunchPartition(*batch_, num_heads, num_kv_heads,
                                                          head_dim, k_cache.dtype));
      },
      kv_bytes);
  cuda::LaunchAttentionDecode(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale,
                              *batch_, decode_ws_, decode_counters_, out, stream_);
}

void CudaOps::SiluMul(const Tensor& gate_up, Tensor out) {
  OpScope scope(
      this, "SiluMul", [&] { return Dims(gate_up); },
      double(gate_up.bytes()) + double(out.bytes()));
  cuda::LaunchSiluMul(gate_up, out, stream_);
}

void CudaOps::Add(const Tensor& a, const Tensor& b, Tensor out) {
  OpScope scope(
      this, "Add", [&] { return Dims(a); }, 3.0 * a.bytes());
  cuda::LaunchAdd(a, b, out, stream_);
}

void CudaOps::GatherLogitRows(const Tensor& in, Tensor out) {
  OpScope scope(
      this, "GatherLogitRows", [&] { return Dims(out); }, 2.0 * out.bytes());
  cuda::LaunchGatherRows(in, *batch_, out, stream_);
}

void CudaOps::InterleaveShards(const Tensor& in, Tensor out) {
  OpScope scope(
      this, "InterleaveShards", [&] { return Dims(in); }, 2.0 * in.bytes());
  cuda::LaunchInterleaveShards(in, out, stream_);
}

std::vector<int32_t> CudaOps::Sample(const Tensor& logits, int64_t vocab_size,
                                     const std::vector<SamplingParams>& params,
                                     std::vector<std::optional<TokenLogprobs>>* logprobs) {
  OpScope scope(
      this, "Sample", [&] { return Dims(logits); }, double(logits.bytes()));
  return sampler_->Sample(logits, vocab_size, params, logprobs, stream_);
}

void CudaOps::SampleAsync(const Tensor& logits, int64_t vocab_size,
                          const std::vector<SamplingParams>& params, bool logprobs) {
  OpScope scope(
      this, "Sample", [&] { return Dims(logits); }, double(logits.bytes()));
  sampler_->Launch(logits, vocab_size, params, logprobs, stream_);
}

std::vector<int32_t> CudaOps::SampleWait(std::vector<std::optional<TokenLogprobs>>* logprobs) {
  return sampler_->Wait(logprobs);
}

bool CudaOps::SampleReady() { return sampler_->Ready(); }

std::unique_ptr<Ops> MakeCudaOps(int device) { return std::make_unique<CudaOps>(device); }

}  // namespace tpserve
