// Elementwise out = a + b on bf16 tensors (fp32 add, 16-byte accesses).
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {
namespace {

__global__ void AddVecKernel(const Bf16x8* __restrict__ a, const Bf16x8* __restrict__ b,
                             Bf16x8* __restrict__ out, int64_t vecs) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < vecs;
       i += int64_t{gridDim.x} * blockDim.x) {
    float fa[8], fb[8];
    Bf16x8ToFloat(a[i], fa);
    Bf16x8ToFloat(b[i], fb);
#pragma unroll
    for (int e = 0; e < 8; ++e) fa[e] += fb[e];
    out[i] = FloatToBf16x8(fa);
  }
}

__global__ void AddScalarKernel(const __nv_bfloat16* __restrict__ a,
                                const __nv_bfloat16* __restrict__ b,
                                __nv_bfloat16* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2bfloat16(__bfloat162float(a[i]) + __bfloat162float(b[i]));
  }
}

}  // namespace

void LaunchAdd(const Tensor& a, const Tensor& b, Tensor out, cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(a, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(b, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(out, DType::kBF16);
  TP_CHECK(a.numel() == b.numel() && a.numel() == out.numel())
      << "Add: a " << a.ShapeString() << ", b " << b.ShapeString() << ", out " << out.ShapeString();
  int64_t n = a.numel();
  if (n == 0) return;
  int threads = 256;
  if (n % 8 == 0 && IsAligned16(a.data) && IsAligned16(b.data) && IsAligned16(out.data)) {
    int64_t vecs = n / 8;
    int blocks = static_cast<int>(std::min<int64_t>((vecs + threads - 1) / threads, 132 * 16));
    AddVecKernel<<<blocks, threads, 0, stream>>>(a.ptr<const Bf16x8>(), b.ptr<const Bf16x8>(),
                                                 out.ptr<Bf16x8>(), vecs);
  } else {
    int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 132 * 16));
    AddScalarKernel<<<blocks, threads, 0, stream>>>(
        a.ptr<const __nv_bfloat16>(), b.ptr<const __nv_bfloat16>(), out.ptr<__nv_bfloat16>(), n);
  }
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
