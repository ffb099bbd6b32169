// Copy bandwidth and cuBLAS bf16 GEMM peak on the current GPU (see hw_limits.h).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "common/check.h"
#include "tools/hw_limits.h"

namespace tpserve {
namespace {

__global__ void FillRandom(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = __float2bfloat16((static_cast<float>(x & 0xffff) / 65536.0f - 0.5f));
  }
}

template <typename F>
double MedianMs(F&& body, int warmup, int repeats) {
  cudaEvent_t a, b;
  TP_CUDA_CHECK(cudaEventCreate(&a));
  TP_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) body();
  std::vector<float> ms;
  for (int i = 0; i < repeats; ++i) {
    TP_CUDA_CHECK(cudaEventRecord(a));
    body();
    TP_CUDA_CHECK(cudaEventRecord(b));
    TP_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    TP_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  TP_CUDA_CHECK(cudaEventDestroy(a));
  TP_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

HwLimits MeasureHwLimits() {
  HwLimits limits;
  size_t free_b = 0, total_b = 0;
  TP_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  limits.total_memory = static_cast<int64_t>(total_b);

  // Copy: 2 GiB buffers, far past the 60 MB L2.
  const size_t bytes = size_t{2} << 30;
  void *src = nullptr, *dst = nullptr;
  TP_CUDA_CHECK(cudaMalloc(&src, bytes));
  TP_CUDA_CHECK(cudaMalloc(&dst, bytes));
  FillRandom<<<1024, 256>>>(static_cast<__nv_bfloat16*>(src), bytes / 2, 1);
  TP_CUDA_CHECK_LAUNCH();
  const double copy_ms = MedianMs(
      [&] { TP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 3, 10);
  limits.copy_bytes_per_s = 2.0 * bytes / (copy_ms * 1e-3);
  TP_CUDA_CHECK(cudaFree(src));
  TP_CUDA_CHECK(cudaFree(dst));

  // GEMM: 8192^3 bf16, random data.
  const int n = 8192;
  limits.gemm_size = n;
  __nv_bfloat16 *a, *b, *c;
  const size_t elems = size_t(n) * n;
  TP_CUDA_CHECK(cudaMalloc(&a, elems * 2));
  TP_CUDA_CHECK(cudaMalloc(&b, elems * 2));
  TP_CUDA_CHECK(cudaMalloc(&c, elems * 2));
  FillRandom<<<1024, 256>>>(a, elems, 2);
  FillRandom<<<1024, 256>>>(b, elems, 3);
  TP_CUDA_CHECK_LAUNCH();
  cublasHandle_t handle;
  TP_CUBLAS_CHECK(cublasCreate(&handle));
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&] {
    TP_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF,
                                 n, b, CUDA_R_16BF, n, &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
  };
  const double gemm_ms = MedianMs(gemm, 3, 10);
  limits.gemm_flops_per_s = 2.0 * n * double(n) * n / (gemm_ms * 1e-3);
  // Sustained: ~1 s of GEMMs, the last third timed as one interval.
  {
    const int total = std::max(30, static_cast<int>(1000.0 / gemm_ms));
    const int timed = total / 3;
    cudaEvent_t e0, e1;
    TP_CUDA_CHECK(cudaEventCreate(&e0));
    TP_CUDA_CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < total; ++i) {
      if (i == total - timed) TP_CUDA_CHECK(cudaEventRecord(e0));
      gemm();
    }
    TP_CUDA_CHECK(cudaEventRecord(e1));
    TP_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    TP_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    limits.gemm_sustained_flops_per_s = 2.0 * n * double(n) * n * timed / (ms * 1e-3);
    TP_CUDA_CHECK(cudaEventDestroy(e0));
    TP_CUDA_CHECK(cudaEventDestroy(e1));
  }
  TP_CUBLAS_CHECK(cublasDestroy(handle));
  TP_CUDA_CHECK(cudaFree(a));
  TP_CUDA_CHECK(cudaFree(b));
  TP_CUDA_CHECK(cudaFree(c));
  return limits;
}

int64_t DeviceMemoryInUse() {
  size_t free_b = 0, total_b = 0;
  TP_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return static_cast<int64_t>(total_b - free_b);
}

}  // namespace tpserve
