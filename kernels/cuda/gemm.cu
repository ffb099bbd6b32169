// cuBLASLt GEMM with a per-shape algorithm cache (see gemm.h). Row-major y = x w^T is computed
// as the column-major product y^T[N, M] = w^T(op T of the [K, N] view) * x^T[K, M].
#include "kernels/cuda/gemm.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/bf16.h"
#include "common/env.h"
#include "common/logging.h"
#include "kernels/cuda/cuda_util.cuh"

namespace tpserve::cuda {
namespace {

int PointerAlignment(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 2 && (v % a) != 0) a /= 2;
  return a;
}

}  // namespace

LtGemm::LtGemm(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  TP_CUBLAS_CHECK(cublasLtCreate(&handle_));
  TP_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  autotune_ = EnvBool(env::kCublasLtAutotune);
  fixed_large_ = EnvBool(env::kDeterministicGemmPrefill);
  int device = 0;
  TP_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  TP_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  device_name_ = prop.name;
  device_sms_ = prop.multiProcessorCount;
  cublaslt_version_ = static_cast<int>(cublasLtGetVersion());
  table_ = &LtTable::Process();
  // Once a process: how many of the table's choices apply here (none on another GPU or cuBLASLt).
  static const bool logged = [&] {
    TP_LOG(INFO) << "cuBLASLt " << cublaslt_version_ << " on " << device_name_ << " ("
                 << device_sms_
                 << " SMs): " << table_->CountFor(device_name_, device_sms_, cublaslt_version_)
                 << " algorithm choices of the table " << table_->source() << " apply";
    return true;
  }();
  (void)logged;
}

LtGemm::~LtGemm() {
  for (auto& [key, plan] : plans_) DestroyProblem(plan);
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

void LtGemm::set_fixed_algorithm(bool on) {
  if (on == fixed_) return;
  for (auto& [key, plan] : plans_) DestroyProblem(plan);
  plans_.clear();
  fixed_ = on;
}

void LtGemm::set_split_k_override(int split) {
  if (split == split_override_) return;
  for (auto& [key, plan] : plans_) DestroyProblem(plan);
  plans_.clear();
  split_override_ = split;
}

void LtGemm::set_candidate_override(int index) {
  if (index == candidate_override_) return;
  for (auto& [key, plan] : plans_) DestroyProblem(plan);
  plans_.clear();
  candidate_override_ = index;
}

void LtGemm::set_table(const LtTable* table) {
  if (table == table_) return;
  for (auto& [key, plan] : plans_) DestroyProblem(plan);
  plans_.clear();
  table_ = table;
}

LtGemm::Problem LtGemm::MakeProblem(int64_t m, int64_t n, int64_t k, bool bias) {
  Problem p;
  TP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  TP_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  TP_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (bias) {
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    TP_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    cudaDataType_t bt = CUDA_R_16BF;
    TP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt,
                                                   sizeof(bt)));
  }
  // Column-major: A = w viewed [K, N] (ld K), B = x viewed [K, M] (ld K), C = y^T [N, M] (ld N).
  TP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, k));
  TP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
  TP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, n, m, n));
  return p;
}

void LtGemm::DestroyProblem(Problem& p) {
  if (p.a != nullptr) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b != nullptr) cublasLtMatrixLayoutDestroy(p.b);
  if (p.c != nullptr) cublasLtMatrixLayoutDestroy(p.c);
  if (p.desc != nullptr) cublasLtMatmulDescDestroy(p.desc);
  p = Problem{};
}

std::vector<cublasLtMatmulHeuristicResult_t> LtGemm::Heuristic(const Plan& plan, int alignment,
                                                               int max_results) const {
  cublasLtMatmulPreference_t pref;
  TP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = workspace_bytes_;
  TP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  uint32_t align = static_cast<uint32_t>(alignment);
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    TP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(max_results);
  int found = 0;
  TP_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, plan.desc, plan.a, plan.b, plan.c, plan.c,
                                                 pref, max_results, results.data(), &found));
  cublasLtMatmulPreferenceDestroy(pref);
  results.resize(found);
  return results;
}

int32_t LtGemm::SplitK(const cublasLtMatmulAlgo_t& algo) {
  int32_t splits = 1;
  size_t written = 0;
  TP_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                       &splits, sizeof(splits), &written));
  return splits;
}

bool LtGemm::AlgoRuns(const Problem& p, const cublasLtMatmulAlgo_t& algo) const {
  cublasLtMatmulHeuristicResult_t check{};
  return cublasLtMatmulAlgoCheck(handle_, p.desc, p.a, p.b, p.c, p.c, &algo, &check) ==
             CUBLAS_STATUS_SUCCESS &&
         check.workspaceSize <= workspace_bytes_;
}

bool LtGemm::AlgoRunsAt(std::initializer_list<int64_t> ms, int64_t n, int64_t k, bool bias,
                        const cublasLtMatmulAlgo_t& algo) const {
  for (int64_t m : ms) {
    Problem probe = MakeProblem(m, n, k, bias);
    const bool runs = AlgoRuns(probe, algo);
    DestroyProblem(probe);
    if (!runs) return false;
  }
  return true;
}

const cublasLtMatmulAlgo_t& LtGemm::FixedAlgo(int64_t n, int64_t k, bool bias, int alignment) {
  auto key = std::make_tuple(n, k, bias, alignment);
  auto it = fixed_algos_.find(key);
  if (it != fixed_algos_.end()) return it->second;
  const int64_t ref_m = EnvInt(env::kDeterministicGemmM);
  Plan ref;
  static_cast<Problem&>(ref) = MakeProblem(ref_m, n, k, bias);
  constexpr int kCandidates = 16;
  std::vector<cublasLtMatmulHeuristicResult_t> results = Heuristic(ref, alignment, kCandidates);
  DestroyProblem(ref);
  TP_CHECK(!results.empty()) << "deterministic GEMM: cuBLASLt has no algorithm for N=" << n
                             << " K=" << k << " at M=" << ref_m;
  // Split-K cuts K into parts whose sums are added afterwards, and other M would not pick the
  // same parts: the heuristic's best without it, then the others made unsplit, the first that
  // runs at every M from a decode row to a long prefill (an M it would refuse later aborts).
  std::stable_sort(results.begin(), results.end(), [](const auto& a, const auto& b) {
    return SplitK(a.algo) <= 1 && SplitK(b.algo) > 1;
  });
  const cublasLtMatmulAlgo_t* chosen = nullptr;
  cublasLtMatmulAlgo_t algo;
  for (const auto& r : results) {
    if (r.state != CUBLAS_STATUS_SUCCESS) continue;
    algo = r.algo;
    int32_t one = 1;
    uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    TP_CUBLAS_CHECK(cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                         &one, sizeof(one)));
    TP_CUBLAS_CHECK(cublasLtMatmulAlgoConfigSetAttribute(
        &algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof(none)));
    const bool runs_everywhere = AlgoRunsAt(
        {int64_t{1}, int64_t{7}, ref_m, int64_t{4096}, int64_t{32768}}, n, k, bias, algo);
    if (runs_everywhere) {
      chosen = &algo;
      break;
    }
  }
  TP_CHECK(chosen != nullptr) << "deterministic GEMM: none of cuBLASLt's " << results.size()
                              << " algorithms for N=" << n << " K=" << k
                              << " runs unsplit at every M; set TPSERVE_DETERMINISTIC_GEMM_M to "
                                 "another batch size or serve without --deterministic";
  return fixed_algos_.emplace(key, algo).first->second;
}

bool LtGemm::SameBits(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b, const Tensor& w,
                      const Tensor* bias, cudaStream_t stream) {
  // Rows of normal values (exponents spread by a per-row factor) against the real weight: a
  // different K order or split changes some of the outputs' last bits.
  constexpr int64_t kProbeRows = 320;  // more than kFixedLargeM, not a multiple of a tile
  const int64_t n = w.dim(0), k = w.dim(1);
  std::mt19937 rng(12345);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> xh(kProbeRows * k);
  for (int64_t r = 0; r < kProbeRows; ++r) {
    const float row_scale = std::ldexp(1.0f, static_cast<int>(r % 9) - 4);
    for (int64_t i = 0; i < k; ++i) xh[r * k + i] = F32ToBf16(dist(rng) * row_scale);
  }
  const size_t x_bytes = xh.size() * 2, y_bytes = static_cast<size_t>(kProbeRows * n) * 2;
  void *x = nullptr, *y0 = nullptr, *y1 = nullptr;
  bool same = false;
  const bool allocated = cudaMalloc(&x, x_bytes) == cudaSuccess &&
                         cudaMalloc(&y0, y_bytes) == cudaSuccess &&
                         cudaMalloc(&y1, y_bytes) == cudaSuccess;
  if (!allocated) {
    // A failed allocation leaves its error as the last error; clear it (the probe is skipped
    // and the fixed algorithm kept), and only then: another error is not this function's.
    cudaGetLastError();
    TP_LOG(INFO) << "deterministic GEMM N=" << n << " K=" << k
                 << ": no device memory for the probe; the fixed algorithm stays";
  } else {
    TP_CUDA_CHECK(cudaMemcpyAsync(x, xh.data(), x_bytes, cudaMemcpyHostToDevice, stream));
    Plan probe;
    static_cast<Problem&>(probe) = MakeProblem(kProbeRows, n, k, bias != nullptr);
    if (bias != nullptr) {
      const void* bp = bias->data;
      TP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(probe.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &bp, sizeof(bp)));
    }
    if (AlgoRuns(probe, a) && AlgoRuns(probe, b)) {
      Tensor tx(x, {kProbeRows, k}, DType::kBF16, Device::kCuda);
      Launch(probe, a, tx, w, Tensor(y0, {kProbeRows, n}, DType::kBF16, Device::kCuda), stream);
      Launch(probe, b, tx, w, Tensor(y1, {kProbeRows, n}, DType::kBF16, Device::kCuda), stream);
      std::vector<uint16_t> h0(kProbeRows * n), h1(kProbeRows * n);
      TP_CUDA_CHECK(cudaMemcpyAsync(h0.data(), y0, y_bytes, cudaMemcpyDeviceToHost, stream));
      TP_CUDA_CHECK(cudaMemcpyAsync(h1.data(), y1, y_bytes, cudaMemcpyDeviceToHost, stream));
      TP_CUDA_CHECK(cudaStreamSynchronize(stream));
      same = h0 == h1;
    }
    DestroyProblem(probe);
  }
  for (void* p : {x, y0, y1}) {
    if (p != nullptr) cudaFree(p);
  }
  return same;
}

const cublasLtMatmulAlgo_t* LtGemm::FixedLargeAlgo(const Tensor& w, const Tensor* bias,
                                                   int alignment, cudaStream_t stream) {
  const int64_t n = w.dim(0), k = w.dim(1);
  auto key = std::make_tuple(n, k, bias != nullptr, alignment);
  auto it = fixed_large_algos_.find(key);
  if (it != fixed_large_algos_.end()) return it->second ? &*it->second : nullptr;
  const cublasLtMatmulAlgo_t& small = FixedAlgo(n, k, bias != nullptr, alignment);
  std::optional<cublasLtMatmulAlgo_t> chosen;
  Plan ref;
  static_cast<Problem&>(ref) = MakeProblem(2048, n, k, bias != nullptr);
  std::vector<cublasLtMatmulHeuristicResult_t> results = Heuristic(ref, alignment, 4);
  DestroyProblem(ref);
  for (const auto& r : results) {
    if (r.state != CUBLAS_STATUS_SUCCESS) continue;
    if (SplitK(r.algo) > 1) continue;  // a split K adds parts in another order
    if (DescribeAlgo(r.algo) == DescribeAlgo(small)) break;  // the same: nothing to gain
    const bool runs_everywhere = AlgoRunsAt({kFixedLargeM + 1, int64_t{2048}, int64_t{32768}}, n, k,
                                            bias != nullptr, r.algo);
    if (runs_everywhere && SameBits(small, r.algo, w, bias, stream)) {
      chosen = r.algo;
      break;
    }
  }
  TP_LOG(INFO) << "deterministic GEMM N=" << n << " K=" << k << ": more than " << kFixedLargeM
               << " rows take "
               << (chosen ? "'" + DescribeAlgo(*chosen) + "' (the same bits as '" +
                                DescribeAlgo(small) + "' on a probe)"
                          : "'" + DescribeAlgo(small) +
                                "' too (no unsplit algorithm of M = 2048 "
                                "with its bits)");
  auto& slot = fixed_large_algos_[key];
  slot = chosen;
  return slot ? &*slot : nullptr;
}

LtGemm::Plan& LtGemm::GetPlan(int64_t m, int64_t n, int64_t k, bool bias, int alignment) {
  Key key{m, n, k, bias, alignment};
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Plan plan;
  static_cast<Problem&>(plan) = MakeProblem(m, n, k, bias);
  if (fixed_) {
    plan.algo = FixedAlgo(n, k, bias, alignment);
    cublasLtMatmulHeuristicResult_t check{};
    const cublasStatus_t st = cublasLtMatmulAlgoCheck(handle_, plan.desc, plan.a, plan.b, plan.c,
                                                      plan.c, &plan.algo, &check);
    TP_CHECK(st == CUBLAS_STATUS_SUCCESS && check.workspaceSize <= workspace_bytes_)
        << "deterministic GEMM: the fixed cuBLASLt algorithm of N=" << n << " K=" << k
        << " does not run at M=" << m << " (status " << static_cast<int>(st)
        << "); set TPSERVE_DETERMINISTIC_GEMM_M to another batch size or serve without "
           "--deterministic";
    plan.tuned = true;
    return plans_.emplace(key, plan).first->second;
  }
  int wanted = m <= 256 ? 8 : 1;  // the autotuner's candidates
  if (candidate_override_ >= 0) wanted = 32;
  const LtTableEntry* entry =
      table_ == nullptr || candidate_override_ >= 0 || split_override_ > 0
          ? nullptr
          : table_->Find(device_name_, device_sms_, cublaslt_version_, m, n, k, bias, alignment);
  if (entry != nullptr) wanted = std::max(wanted, entry->candidate + 1);
  std::vector<cublasLtMatmulHeuristicResult_t> results = Heuristic(plan, alignment, wanted);
  TP_CHECK(!results.empty()) << "cuBLASLt has no algorithm for GEMM M=" << m << " N=" << n
                             << " K=" << k << (bias ? " with bias" : "") << " alignment "
                             << alignment;
  plan.algo = results[0].algo;
  for (const auto& r : results) {
    if (r.state == CUBLAS_STATUS_SUCCESS) plan.candidates.push_back(r.algo);
  }
  plan.tuned = !autotune_ || plan.candidates.size() <= 1;
  if (entry != nullptr) {
    const int c = entry->candidate;
    if (c < static_cast<int>(results.size()) && results[c].state == CUBLAS_STATUS_SUCCESS &&
        DescribeAlgo(results[c].algo) == entry->config) {
      plan.algo = results[c].algo;
      plan.tuned = true;
      plan.from_table = true;
    } else {
      TP_LOG(WARNING) << "cuBLASLt table " << table_->source() << ": the entry for M=" << m
                      << " N=" << n << " K=" << k << " names candidate " << c << " ("
                      << entry->config << "), but the heuristic's candidate " << c << " is "
                      << (c < static_cast<int>(results.size())
                              ? "'" + DescribeAlgo(results[c].algo) + "'"
                              : std::string("missing"))
                      << "; taking the heuristic's first";
    }
  }
  if (candidate_override_ >= 0 && candidate_override_ < static_cast<int>(results.size()) &&
      results[candidate_override_].state == CUBLAS_STATUS_SUCCESS) {
    plan.algo = results[candidate_override_].algo;
    plan.tuned = true;
    plan.candidate = candidate_override_;
  }
  if (split_override_ > 0) {
    cublasLtMatmulAlgo_t algo = results[0].algo;
    const int32_t split = split_override_;
    if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split,
                                             sizeof(split)) == CUBLAS_STATUS_SUCCESS &&
        AlgoRuns(plan, algo)) {
      plan.algo = algo;
      plan.tuned = true;
      plan.split_k = split;
    }
  }
  return plans_.emplace(key, plan).first->second;
}

void LtGemm::Launch(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const Tensor& x,
                    const Tensor& w, Tensor y, cudaStream_t stream, float beta) {
  const float alpha = 1.0f;
  TP_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &alpha, w.data, plan.a, x.data, plan.b, &beta,
                                 y.data, plan.c, y.data, plan.c, &algo, workspace_,
                                 workspace_bytes_, stream));
}

void LtGemm::Tune(Plan& plan, const Tensor& x, const Tensor& w, Tensor y, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TP_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) return;  // tuned at the next eager call
  cudaEvent_t start, stop;
  TP_CUDA_CHECK(cudaEventCreate(&start));
  TP_CUDA_CHECK(cudaEventCreate(&stop));
  float best_ms = 0;
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    constexpr int kReps = 5;
    Launch(plan, plan.candidates[i], x, w, y, stream);  // warm-up
    TP_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int r = 0; r < kReps; ++r) Launch(plan, plan.candidates[i], x, w, y, stream);
    TP_CUDA_CHECK(cudaEventRecord(stop, stream));
    TP_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i == 0 || ms < best_ms) {
      best_ms = ms;
      plan.algo = plan.candidates[i];
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  plan.tuned = true;
}

std::string LtGemm::DescribeAlgo(const cublasLtMatmulAlgo_t& algo) {
  std::string out;
  const std::pair<const char*, cublasLtMatmulAlgoConfigAttributes_t> attrs[] = {
      {"id", CUBLASLT_ALGO_CONFIG_ID},
      {"tile", CUBLASLT_ALGO_CONFIG_TILE_ID},
      {"stages", CUBLASLT_ALGO_CONFIG_STAGES_ID},
      {"splitk", CUBLASLT_ALGO_CONFIG_SPLITK_NUM},
      {"reduction", CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME},
      {"swizzle", CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING},
      {"custom", CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION},
      {"inner", CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID},
      {"cluster", CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID}};
  for (const auto& [name, attr] : attrs) {
    int32_t v = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) ==
        CUBLAS_STATUS_SUCCESS) {
      out += std::string(out.empty() ? "" : " ") + name + "=" + std::to_string(v);
    }
  }
  return out;
}

const LtGemm::Plan* LtGemm::FindPlan(int64_t m, int64_t n, int64_t k) const {
  for (const auto& [key, plan] : plans_) {
    if (std::get<0>(key) == m && std::get<1>(key) == n && std::get<2>(key) == k) return &plan;
  }
  return nullptr;
}

int LtGemm::OperandAlignment(const void* x, const void* w, const void* y, const void* bias) {
  return std::min({PointerAlignment(x), PointerAlignment(w), PointerAlignment(y),
                   bias != nullptr ? PointerAlignment(bias) : 256});
}

std::string LtGemm::DescribePlan(int64_t m, int64_t n, int64_t k) const {
  const Plan* plan = FindPlan(m, n, k);
  return plan != nullptr ? DescribeAlgo(plan->algo) : "";
}

void LtGemm::Run(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                 cudaStream_t stream) {
  RunImpl(x, w, bias, y, stream, /*accumulate=*/false);
}

void LtGemm::RunAccumulate(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                           cudaStream_t stream) {
  RunImpl(x, w, bias, y, stream, /*accumulate=*/true);
}

void LtGemm::RunImpl(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                     cudaStream_t stream, bool accumulate) {
  TP_CHECK_CUDA_TENSOR(x, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(w, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  int64_t k = x.dim(-1);
  int64_t m = k == 0 ? 0 : x.numel() / k;
  int64_t n = w.dim(0);
  TP_CHECK(w.ndim == 2 && w.dim(1) == k && y.dim(-1) == n && y.numel() == m * n)
      << "Gemm: x " << x.ShapeString() << ", w " << w.ShapeString() << ", y " << y.ShapeString();
  CheckGemmBias("Gemm", bias, n);
  if (m == 0 || n == 0) return;
  int alignment = OperandAlignment(x.data, w.data, y.data, bias ? bias->data : nullptr);
  // Fixed-algorithm mode: every alignment of 16 bytes or more gets the same algorithm.
  if (fixed_) alignment = std::min(alignment, 16);
  Plan& plan = GetPlan(m, n, k, bias != nullptr, alignment);
  if (fixed_ && fixed_large_ && m > kFixedLargeM && !plan.large_checked) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    TP_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    if (status == cudaStreamCaptureStatusNone) {
      plan.large_checked = true;
      const cublasLtMatmulAlgo_t* large = FixedLargeAlgo(w, bias, alignment, stream);
      if (large != nullptr && AlgoRuns(plan, *large)) {
        plan.algo = *large;
      }
    }
  }
  if (bias != nullptr) {
    const void* bp = bias->data;
    TP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                   &bp, sizeof(bp)));
  }
  if (!plan.tuned && !accumulate) Tune(plan, x, w, y, stream);
  Launch(plan, plan.algo, x, w, y, stream, accumulate ? 1.0f : 0.0f);
}

}  // namespace tpserve::cuda
