// The head sizes the CUDA attention kernels are instantiated for: the one list that the kernels'
// launchers, the model's load check and the engine's device choice use. No dependencies, so
// that CUDA sources include it too.
#pragma once

#include <cstdint>

namespace tpserve {

inline constexpr bool CudaSupportsHeadDim(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
}
inline constexpr const char kCudaHeadDims[] = "32, 64 or 128";

}  // namespace tpserve
