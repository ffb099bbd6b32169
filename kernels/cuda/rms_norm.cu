// RMSNorm and the fused residual-add + RMSNorm: one block per row, fp32 sum of squares,
// 16-byte bf16 accesses. The residual is stored in bf16 and normalized as stored. Launched with
// programmatic dependent launch (cuda_util.cuh), so the next kernel's blocks (a skinny GEMM
// prefetching its weights) start while these run.
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gemm_epilogue.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {
namespace {

// Each thread keeps up to kMaxVecs vectors of 8 in registers (hidden <= 256 * 8 * kMaxVecs).
constexpr int kThreads = 256;
constexpr int kMaxVecs = 8;

// kFixed (deterministic mode): the sum of squares and the output as gemm_epilogue.cuh defines
// them, so that a deferred norm split over two chain GEMMs gives the same bits.
template <bool kAdd, bool kFixed = false>
__global__ void __launch_bounds__(kThreads)
    RmsNormKernel(Bf16x8* __restrict__ residual, const Bf16x8* __restrict__ x,
                  const Bf16x8* __restrict__ weight, float eps, int vecs, int hidden,
                  Bf16x8* __restrict__ out) {
  __shared__ float scratch[32];
  __shared__ unsigned long long fixed_scratch[32];
  PdlLaunchDependents();
  PdlWait();  // x and the residual come from the previous kernels
  int64_t base = static_cast<int64_t>(blockIdx.x) * vecs;
  float v[kMaxVecs][8];
  float ss = 0.0f;
  unsigned long long ss_fixed = 0ull;
#pragma unroll
  for (int j = 0; j < kMaxVecs; ++j) {
    int i = threadIdx.x + j * kThreads;
    if (i < vecs) {
      Bf16x8 a = x[base + i];
      if constexpr (kAdd) {
        float fa[8], fr[8];
        Bf16x8ToFloat(a, fa);
        Bf16x8ToFloat(residual[base + i], fr);
#pragma unroll
        for (int e = 0; e < 8; ++e) fr[e] += fa[e];
        a = FloatToBf16x8(fr);
        residual[base + i] = a;
      }
      Bf16x8ToFloat(a, v[j]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if constexpr (kFixed) {
          ss_fixed += NormSquareFixed(v[j][e]);
        } else {
          ss += v[j][e] * v[j][e];
        }
      }
    }
  }
  float rstd;
  if constexpr (kFixed) {
    rstd = RowScaleOfTotal(BlockSum(ss_fixed, fixed_scratch), hidden, eps);
  } else {
    rstd = rsqrtf(BlockSum(ss, scratch) / hidden + eps);
  }
#pragma unroll
  for (int j = 0; j < kMaxVecs; ++j) {
    int i = threadIdx.x + j * kThreads;
    if (i < vecs) {
      float w[8];
      Bf16x8ToFloat(weight[i], w);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if constexpr (kFixed) {
          v[j][e] = __fmul_rn(__bfloat162float(__float2bfloat16(__fmul_rn(v[j][e], w[e]))), rstd);
        } else {
          v[j][e] = v[j][e] * rstd * w[e];
        }
      }
      out[base + i] = FloatToBf16x8(v[j]);
    }
  }
}

void CheckNormArgs(const char* op, const Tensor& x, const Tensor& weight, const Tensor& out) {
  TP_CHECK_CUDA_TENSOR(x, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(weight, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(out, DType::kBF16);
  int64_t hidden = x.dim(-1);
  TP_CHECK(x.numel() == out.numel() && weight.numel() == hidden && hidden % 8 == 0 &&
           hidden <= kThreads * 8 * kMaxVecs)
      << op << ": x " << x.ShapeString() << ", weight " << weight.ShapeString() << ", out "
      << out.ShapeString() << " (hidden must be a multiple of 8, at most "
      << kThreads * 8 * kMaxVecs << ")";
}

}  // namespace

void LaunchRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor out,
                   cudaStream_t stream) {
  CheckNormArgs("RmsNorm", x, weight, out);
  int hidden = static_cast<int>(x.dim(-1));
  int rows = static_cast<int>(x.numel() / hidden);
  if (rows == 0) return;
  LaunchPdl(RmsNormKernel<false>, dim3(rows), dim3(kThreads), 0, stream,
            static_cast<Bf16x8*>(nullptr), x.ptr<const Bf16x8>(), weight.ptr<const Bf16x8>(), eps,
            hidden / 8, hidden, out.ptr<Bf16x8>());
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchAddRmsNorm(Tensor residual, const Tensor& x, const Tensor& weight, float eps, Tensor out,
                      cudaStream_t stream, bool fixed_point) {
  CheckNormArgs("AddRmsNorm", x, weight, out);
  TP_CHECK_CUDA_TENSOR(residual, DType::kBF16);
  TP_CHECK(residual.numel() == x.numel())
      << "AddRmsNorm: residual " << residual.ShapeString() << " vs x " << x.ShapeString();
  int hidden = static_cast<int>(x.dim(-1));
  int rows = static_cast<int>(x.numel() / hidden);
  if (rows == 0) return;
  LaunchPdl(fixed_point ? RmsNormKernel<true, true> : RmsNormKernel<true>, dim3(rows),
            dim3(kThreads), 0, stream, residual.ptr<Bf16x8>(), x.ptr<const Bf16x8>(),
            weight.ptr<const Bf16x8>(), eps, hidden / 8, hidden, out.ptr<Bf16x8>());
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
