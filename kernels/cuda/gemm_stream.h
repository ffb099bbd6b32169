// Weight-streaming GEMM for decode batches on Hopper (gemm_stream.cu): y[M, N] = x[M, K] w[N, K]^T
// (+ bias), bf16, for 1 <= M <= kStreamGemmMaxM, with wgmma (the weight rows as its M dimension,
// the tokens as N), a TMA ring fed by a producer warp, and stream-K over a grid that fills the
// GPU once. Results are the same bits on every run of the same shape (split tiles are added in a
// fixed order), not across M.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace tpserve::cuda {

inline constexpr int64_t kStreamGemmMaxM = 128;

// Device scratch of the split tiles, owned by the caller (CudaOps): 2 * max_grid slots of
// slot_floats fp32 partial sums, and max_tiles counters that must be zero before the first launch
// (every launch leaves them zero). One launch at a time per workspace (one stream).
struct StreamGemmWorkspace {
  float* partials = nullptr;
  int* counters = nullptr;
  int num_sms = 0;
  int max_grid = 0;
  size_t slot_floats = 0;
  int max_tiles = 0;
};
// What a workspace for `num_sms` SMs needs (bytes of partials, counters).
inline constexpr int kStreamGemmBlocksPerSm = 2;
inline constexpr size_t kStreamGemmSlotFloats = 128 * 128;  // 128 threads x 2 tiles x n128 / 2
inline constexpr int kStreamGemmMaxTiles = 8192;

// An sm_90 device (the kernels are built for sm_90a only).
bool StreamGemmSupported();
// bf16 x, w, y; K % 8 == 0; 16-byte aligned x, w, y; 1 <= M <= kStreamGemmMaxM; a supported
// device.
bool StreamGemmFits(const Tensor& x, const Tensor& w, const Tensor& y);
// config -1: by M (StreamGemmAutoConfig); 0 .. StreamGemmNumConfigs() - 1 for benchmarks and
// tests. max_grid > 0 caps the grid (tests: more or fewer split tiles).
void LaunchStreamGemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                      const StreamGemmWorkspace& ws, cudaStream_t stream, int config = -1,
                      int max_grid = 0);
int StreamGemmNumConfigs();
std::string StreamGemmConfigName(int config);
// The largest M a configuration takes (its wgmma N).
int StreamGemmConfigTokens(int config);
// The configuration auto takes for M (-1 when M > kStreamGemmMaxM).
int StreamGemmAutoConfig(int64_t m);

}  // namespace tpserve::cuda
