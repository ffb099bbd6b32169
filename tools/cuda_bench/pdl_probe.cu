// See pdl_probe.h.
#include <cuda_bf16.h>

#include <vector>

#include "common/check.h"
#include "kernels/cuda/cuda_util.cuh"
#include "tools/cuda_bench/pdl_probe.h"

namespace tpserve::cuda_bench {
namespace {

__global__ void SpinThenOnes(__nv_bfloat16* x, int64_t n, long long spin_cycles) {
  cuda::PdlLaunchDependents();
  const long long t0 = clock64();
  while (clock64() - t0 < spin_cycles) {
  }
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = __float2bfloat16(1.0f);
  }
}

__global__ void PdlTouch(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t n) {
  cuda::PdlLaunchDependents();
  cuda::PdlWait();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = src[i];
  }
}

}  // namespace

void LaunchSpinThenOnes(void* x, int64_t n, int spin_us, cudaStream_t s) {
  int device = 0, khz = 0;
  TP_CUDA_CHECK(cudaGetDevice(&device));
  TP_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device));
  SpinThenOnes<<<132, 256, 0, s>>>(static_cast<__nv_bfloat16*>(x), n,
                                   static_cast<long long>(spin_us) * khz / 1000);
  TP_CUDA_CHECK(cudaGetLastError());
}

void LaunchPdlTouch(const void* src, void* dst, int64_t n, cudaStream_t s) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(132);
  config.blockDim = dim3(256);
  config.stream = s;
  config.attrs = attr;
  config.numAttrs = 1;
  TP_CUDA_CHECK(cudaLaunchKernelEx(&config, PdlTouch, static_cast<const __nv_bfloat16*>(src),
                                   static_cast<__nv_bfloat16*>(dst), n));
}

const void* SpinThenOnesFunc() { return reinterpret_cast<const void*>(&SpinThenOnes); }
const void* PdlTouchFunc() { return reinterpret_cast<const void*>(&PdlTouch); }

int MakeEdgesFromProgrammatic(cudaGraph_t g, const void* from_func) {
  size_t n = 0;
  TP_CUDA_CHECK(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n));
  std::vector<cudaGraphNode_t> from(n), to(n);
  std::vector<cudaGraphEdgeData> data(n);
  TP_CUDA_CHECK(cudaGraphGetEdges(g, from.data(), to.data(), data.data(), &n));
  auto kernel_func = [](cudaGraphNode_t node) -> const void* {
    cudaGraphNodeType type;
    TP_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeKernel) return nullptr;
    cudaKernelNodeParams p = {};
    // A kernel the runtime did not register (cuBLASLt launches through the driver API) may not
    // say which function it runs: any kernel node that is not `from_func`.
    if (cudaGraphKernelNodeGetParams(node, &p) != cudaSuccess || p.func == nullptr) {
      (void)cudaGetLastError();
      static const char other = 0;
      return &other;
    }
    return p.func;
  };
  int changed = 0;
  for (size_t i = 0; i < n; ++i) {
    if (data[i].type == cudaGraphDependencyTypeProgrammatic) continue;
    const void* f = kernel_func(from[i]);
    const void* t = kernel_func(to[i]);
    if (f != from_func || t == nullptr || t == from_func) continue;
    TP_CUDA_CHECK(cudaGraphRemoveDependencies(g, &from[i], &to[i], &data[i], 1));
    cudaGraphEdgeData e = {};
    e.from_port = cudaGraphKernelNodePortProgrammatic;
    e.type = cudaGraphDependencyTypeProgrammatic;
    TP_CUDA_CHECK(cudaGraphAddDependencies(g, &from[i], &to[i], &e, 1));
    ++changed;
  }
  return changed;
}

}  // namespace tpserve::cuda_bench
