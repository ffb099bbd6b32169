// GEMM through cuBLASLt: y[M, N] = x[M, K] w[N, K]^T (+ bias), bf16 in/out, fp32 accumulate.
// The algorithm is chosen once per (M, N, K, bias, alignment) and cached: the heuristic's first
// choice, the same in every process, so that a request gives the same bits in the engine, in a
// worker and after a restart. With TPSERVE_CUBLASLT_AUTOTUNE=1, for M <= 256 (decode batches,
// where the first choice is often not the fastest) the heuristic's best 8 are timed on the
// first call made outside stream capture instead; two processes may then pick differently
// (measured gain on the 6.7B shape: batch-64 decode 14.37 -> 14.29 ms/step, batch 1 none).
// Where the process's cuBLASLt table (gemm_table.h, TPSERVE_CUBLASLT_TABLE) has an entry for the
// problem on this GPU and cuBLASLt version, the plan takes that candidate of the heuristic
// instead of its first (still the same in every process), and is not autotuned.
// Fixed-algorithm mode (deterministic serving): one algorithm per (N, K, bias), the heuristic's
// choice at M = TPSERVE_DETERMINISTIC_GEMM_M without split-K, for every M, so that a row's
// result does not depend on how many rows are beside it (one kernel, one tile, one K order).
// GEMMs of more than kFixedLargeM rows (prefill chunks) may take a second algorithm, the
// heuristic's unsplit choice at M = 2048 (TPSERVE_DETERMINISTIC_GEMM_PREFILL): only when a
// probe (random rows against the real weight, before the first such GEMM) gives every output
// the same bits through both, which holds when both compute an output as one chain of
// tensor-core k16 steps over K in order (kernels/cuda/NOTES.md, session 27).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/dtype.h"
#include "kernels/cuda/gemm_table.h"

namespace tpserve::cuda {

class LtGemm {
 public:
  explicit LtGemm(size_t workspace_bytes = size_t{32} << 20);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  void Run(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y, cudaStream_t stream);
  // y += x w^T (+ bias) in the GEMM's epilogue (beta = 1, y both C and D): the fp32 product is
  // added to y and rounded once. Never autotuned (timing would add into y): the plan's
  // algorithm as Run would take it untuned.
  void RunAccumulate(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                     cudaStream_t stream);
  size_t num_plans() const { return plans_.size(); }
  int num_table_plans() const {
    int count = 0;
    for (const auto& [key, plan] : plans_) count += plan.from_table;
    return count;
  }
  // The configuration of the algorithm a plan of (m, n, k) runs (cuBLASLt's algorithm id, tile,
  // stages, split-K, ...), or "" when no such plan was made.
  std::string DescribePlan(int64_t m, int64_t n, int64_t k) const;
  // The configuration of an algorithm, as DescribePlan writes it (the cuBLASLt table's "config").
  static std::string DescribeAlgo(const cublasLtMatmulAlgo_t& algo);
  // Whether the plan of (m, n, k) took its algorithm from the cuBLASLt table.
  bool PlanFromTable(int64_t m, int64_t n, int64_t k) const {
    const Plan* plan = FindPlan(m, n, k);
    return plan != nullptr && plan->from_table;
  }
  // Tests and benchmarks: the table new plans consult instead of the process's (nullptr: none).
  // Plans made before are dropped. `table` must outlive its use.
  void set_table(const LtTable* table);
  // This GPU and cuBLASLt, as the table keys them.
  const std::string& device_name() const { return device_name_; }
  int device_sms() const { return device_sms_; }
  int cublaslt_version() const { return cublaslt_version_; }
  // The split-K override the plan of this problem took (0: none, or no such plan).
  int PlanSplitK(int64_t m, int64_t n, int64_t k) const {
    const Plan* plan = FindPlan(m, n, k);
    return plan != nullptr ? plan->split_k : 0;
  }
  // Fixed-algorithm mode (see above); plans made before the switch are dropped.
  void set_fixed_algorithm(bool on);
  bool fixed_algorithm() const { return fixed_; }
  // Benchmarks: every new plan (not in fixed mode) takes the heuristic's first algorithm with
  // CUBLASLT_ALGO_CONFIG_SPLITK_NUM = `split` when cuBLASLt accepts it (0: the heuristic's own
  // choice). Plans made before are dropped; PlanSplitK says whether a plan took it.
  void set_split_k_override(int split);
  int split_k_override() const { return split_override_; }
  // Benchmarks: every new plan (not in fixed mode) takes the heuristic's `index`-th algorithm (0
  // its first; up to 32 are asked for), as it comes, split-K included (-1: the usual choice).
  // Plans made before are dropped; PlanCandidate says which a plan took (-1: none of them).
  void set_candidate_override(int index);
  int PlanCandidate(int64_t m, int64_t n, int64_t k) const {
    const Plan* plan = FindPlan(m, n, k);
    return plan != nullptr ? plan->candidate : -1;
  }
  // The smallest pointer alignment (bytes, up to 256) of a GEMM's operands: a plan's key, and the
  // cuBLASLt table's "alignment".
  static int OperandAlignment(const void* x, const void* w, const void* y,
                              const void* bias = nullptr);
  // The cuBLASLt descriptor and layouts of y [m, n] = x [m, k] w [n, k]^T (+ bias) as every plan
  // lays them out (bf16 in and out, fp32 compute): for tools that drive cuBLASLt themselves, such
  // as tpserve-cuda-bench's probes. DestroyProblem frees them.
  struct Problem {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  };
  static Problem MakeProblem(int64_t m, int64_t n, int64_t k, bool bias);
  static void DestroyProblem(Problem& problem);

 private:
  struct Plan : Problem {
    cublasLtMatmulAlgo_t algo;
    std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's, best first
    bool tuned = false;
    int split_k = 0;     // set_split_k_override's value when taken
    int candidate = -1;  // set_candidate_override's index when taken
    bool from_table = false;
    bool large_checked = false;  // fixed mode: FixedLargeAlgo was asked (outside capture)
  };
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, int>;
  // The first plan of (m, n, k), any bias and alignment, or nullptr.
  const Plan* FindPlan(int64_t m, int64_t n, int64_t k) const;
  Plan& GetPlan(int64_t m, int64_t n, int64_t k, bool bias, int alignment);
  // The heuristic's best `max_results` algorithms for `plan`'s problem at this alignment.
  std::vector<cublasLtMatmulHeuristicResult_t> Heuristic(const Plan& plan, int alignment,
                                                         int max_results) const;
  // Fixed-algorithm mode: the algorithm of every plan of (n, k, bias, alignment).
  const cublasLtMatmulAlgo_t& FixedAlgo(int64_t n, int64_t k, bool bias, int alignment);
  // Fixed-algorithm mode, GEMMs of more than kFixedLargeM rows: the faster algorithm with
  // FixedAlgo's bits (probed on `w` and `bias` on `stream`), or nullptr: FixedAlgo's. Decided
  // once per (n, k, bias, alignment); the caller keeps it out of stream capture (the probe
  // synchronizes the stream).
  const cublasLtMatmulAlgo_t* FixedLargeAlgo(const Tensor& w, const Tensor* bias, int alignment,
                                             cudaStream_t stream);
  // The split-K count of an algorithm's configuration (1: unsplit).
  static int32_t SplitK(const cublasLtMatmulAlgo_t& algo);
  // Whether cuBLASLt runs `algo` on `problem` within this GEMM's workspace.
  bool AlgoRuns(const Problem& problem, const cublasLtMatmulAlgo_t& algo) const;
  // Whether it runs on y [m, n] = x [m, k] w [n, k]^T (+ bias) for each m of `ms`.
  bool AlgoRunsAt(std::initializer_list<int64_t> ms, int64_t n, int64_t k, bool bias,
                  const cublasLtMatmulAlgo_t& algo) const;
  // Whether algorithms a and b give y = x w^T (+ bias) the same bits for kProbeRows random rows.
  bool SameBits(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b, const Tensor& w,
                const Tensor* bias, cudaStream_t stream);
  // Times the candidates on these operands and keeps the fastest in plan.algo.
  void Tune(Plan& plan, const Tensor& x, const Tensor& w, Tensor y, cudaStream_t stream);
  void Launch(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const Tensor& x, const Tensor& w,
              Tensor y, cudaStream_t stream, float beta = 0.0f);
  void RunImpl(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y, cudaStream_t stream,
               bool accumulate);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Plan> plans_;
  bool autotune_ = false;
  bool fixed_ = false;
  int split_override_ = 0;
  int candidate_override_ = -1;
  const LtTable* table_ = nullptr;
  std::string device_name_;
  int device_sms_ = 0;
  int cublaslt_version_ = 0;
  std::map<std::tuple<int64_t, int64_t, bool, int>, cublasLtMatmulAlgo_t> fixed_algos_;
  // FixedLargeAlgo's decisions: the algorithm, or none (FixedAlgo's for every M).
  std::map<std::tuple<int64_t, int64_t, bool, int>, std::optional<cublasLtMatmulAlgo_t>>
      fixed_large_algos_;
  bool fixed_large_ = true;  // TPSERVE_DETERMINISTIC_GEMM_PREFILL

 public:
  // Fixed-algorithm mode: GEMMs of more rows than this may take FixedLargeAlgo's algorithm.
  static constexpr int64_t kFixedLargeM = 256;
};

}  // namespace tpserve::cuda
