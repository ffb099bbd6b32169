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
// tests. max_grid > 0 caps the grid (tests: more or fewer split tiles); exact_grid: the grid is
// max_grid blocks (capped by the pairs and the workspace) even where fewer are resident at once.
void LaunchStreamGemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                      const StreamGemmWorkspace& ws, cudaStream_t stream, int config = -1,
                      int max_grid = 0, bool exact_grid = false);
// Deterministic mode (TPSERVE_DETERMINISTIC_GEMM=stream): any M >= 1, in chunks of
// kStreamGemmMaxM rows, each through the auto configuration of its size on a grid of exactly
// kStreamGemmBlocksPerSm blocks an SM. The (weight tile, K block) pairs a block owns, and so
// the K ranges whose sums are added in block order, depend only on the weight's shape: a row's
// bits are the same for every M and every position in the batch, as long as wgmma computes an
// output column the same way whatever its N and whatever the other columns (a chain of k16
// steps, as mma.sync; deterministic_ops_test GemmRowsDoNotDependOnM checks it on the GPU).
// StreamGemmFits without the bound on M.
bool StreamGemmFixedFits(const Tensor& x, const Tensor& w, const Tensor& y);
void LaunchStreamGemmFixed(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                           const StreamGemmWorkspace& ws, cudaStream_t stream);
int StreamGemmNumConfigs();
std::string StreamGemmConfigName(int config);
// The largest M a configuration takes (its wgmma N).
int StreamGemmConfigTokens(int config);
// The weight rows of a configuration's tile (64 or 128).
int StreamGemmConfigRows(int config);
// The configuration auto takes for M (-1 when M > kStreamGemmMaxM).
int StreamGemmAutoConfig(int64_t m);

}  // namespace tpserve::cuda
