// GEMM through cuBLASLt: y[M, N] = x[M, K] w[N, K]^T (+ bias), bf16 in/out, fp32 accumulate.
// The algorithm is chosen once per (M, N, K, bias, alignment) by the heuristic and cached.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "common/dtype.h"

namespace tpserve::cuda {

class LtGemm {
 public:
  explicit LtGemm(size_t workspace_bytes = size_t{32} << 20);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  void Run(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y, cudaStream_t stream);
  size_t num_plans() const { return plans_.size(); }

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo;
  };
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, int>;
  Plan& GetPlan(int64_t m, int64_t n, int64_t k, bool bias, int alignment);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Plan> plans_;
};

}  // namespace tpserve::cuda
