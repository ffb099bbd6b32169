// What the standalone CUDA probes (tpserve-regchain-probe, tpserve-stream-probe) and
// tpserve-cuda-bench share: a CUDA call check that exits with the call and its error, and the
// median time of repeated launches.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

// fn(i) for i = 0..2 as warm-up, then `iters` times between CUDA events recorded on `s`: the
// median of those launches' times in ms. (tpserve-cuda-bench times its rows with it too.)
inline double MedianMs(cudaStream_t s, int iters, const std::function<void(int)>& fn) {
  for (int i = 0; i < 3; ++i) fn(i);
  std::vector<cudaEvent_t> ev(iters + 1);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  std::vector<float> tm(iters);
  CK(cudaEventRecord(ev[0], s));
  for (int i = 0; i < iters; ++i) {
    fn(i);
    CK(cudaEventRecord(ev[i + 1], s));
  }
  CK(cudaEventSynchronize(ev[iters]));
  CK(cudaGetLastError());
  for (int i = 0; i < iters; ++i) CK(cudaEventElapsedTime(&tm[i], ev[i], ev[i + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(tm.begin(), tm.end());
  return tm[iters / 2];
}
// The same on the legacy default stream (the probes launch there).
inline double MedianMs(int iters, const std::function<void(int)>& fn) {
  return MedianMs(nullptr, iters, fn);
}
