// hw_limits.h for builds without CUDA: nothing to measure.
#include "tools/hw_limits.h"

namespace tpserve {
HwLimits MeasureHwLimits() { return {}; }
int64_t DeviceMemoryInUse() { return 0; }
}  // namespace tpserve
