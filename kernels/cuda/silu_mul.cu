// SwiGLU activation: gate_up [M, 2I] (gate then up) -> out [M, I] = silu(gate) * up, fp32 math.
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {
namespace {

__global__ void SiluMulKernel(const Bf16x8* __restrict__ gate_up, int vecs_per_row,
                              Bf16x8* __restrict__ out) {
  int row = blockIdx.y;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= vecs_per_row) return;
  const Bf16x8* g = gate_up + static_cast<int64_t>(row) * 2 * vecs_per_row;
  float fg[8], fu[8], r[8];
  Bf16x8ToFloat(g[i], fg);
  Bf16x8ToFloat(g[i + vecs_per_row], fu);
#pragma unroll
  for (int e = 0; e < 8; ++e) r[e] = SiluMulValue(fg[e], fu[e]);
  out[static_cast<int64_t>(row) * vecs_per_row + i] = FloatToBf16x8(r);
}

}  // namespace

void LaunchSiluMul(const Tensor& gate_up, Tensor out, cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(gate_up, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(out, DType::kBF16);
  int64_t inter = out.dim(-1);
  TP_CHECK(gate_up.dim(-1) == 2 * inter && gate_up.numel() == 2 * out.numel() && inter % 8 == 0)
      << "SiluMul: gate_up " << gate_up.ShapeString() << ", out " << out.ShapeString()
      << " (intermediate size must be a multiple of 8)";
  int rows = static_cast<int>(out.numel() / inter);
  if (rows == 0) return;
  int vecs = static_cast<int>(inter / 8);
  int threads = 256;
  dim3 grid(CeilDiv(vecs, threads), rows);
  SiluMulKernel<<<grid, threads, 0, stream>>>(gate_up.ptr<const Bf16x8>(), vecs, out.ptr<Bf16x8>());
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
