// CPU time of the calling thread: the scheduler, delivery and sender threads report what a step
// costs each of them (GetModelInfo step statistics).
#pragma once

#include <time.h>

namespace tpserve {

inline double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

}  // namespace tpserve
