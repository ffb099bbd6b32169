// The two hardware ceilings benchmarks are reported against, measured in the same run:
// device-to-device copy bandwidth (bytes read + written) and bf16 GEMM throughput (cuBLAS).
#pragma once

#include <cstdint>

namespace tpserve {

struct HwLimits {
  double copy_bytes_per_s = 0;  // counting bytes read plus bytes written
  double gemm_flops_per_s = 0;  // bf16 in, fp32 accumulate, M = N = K = gemm_size (a burst)
  // The same GEMM after about a second of back-to-back GEMMs: the rate the board sustains under
  // its power limit (the H200 drops its SM clock under the 700 W cap within ~0.2 s).
  double gemm_sustained_flops_per_s = 0;
  int gemm_size = 0;
  int64_t total_memory = 0;
};

// Measures on the current CUDA device (median of repeats after warm-up, random inputs).
// Returns zeros when the build has no CUDA.
HwLimits MeasureHwLimits();
// Bytes of device memory in use now (total - free), 0 without CUDA.
int64_t DeviceMemoryInUse();

}  // namespace tpserve
