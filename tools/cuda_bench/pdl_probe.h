// Kernels and graph surgery for `tpserve-cuda-bench --pdl-gemm`: whether cuBLASLt's GEMM kernels
// wait for their predecessor when launched as programmatic dependents (a kernel that does not
// execute griddepcontrol.wait would read its input before the previous kernel wrote it), and
// what such a launch saves between a small kernel and a GEMM in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tpserve::cuda_bench {

// A kernel that lets its dependents launch at once (griddepcontrol.launch_dependents), spins
// for about `spin_us` microseconds, then writes `n` bf16 ones into x. Launched normally.
void LaunchSpinThenOnes(void* x, int64_t n, int spin_us, cudaStream_t s);
// A small kernel launched with programmatic stream serialization (as tpserve's kernels between
// the GEMMs of a decode step are): triggers its dependents, waits for the previous kernel, then
// copies n bf16 from src to dst.
void LaunchPdlTouch(const void* src, void* dst, int64_t n, cudaStream_t s);
const void* SpinThenOnesFunc();
const void* PdlTouchFunc();
// In `g`, every edge from a kernel node that runs `from_func` to a kernel node that runs another
// function becomes programmatic (the downstream kernel may start once the upstream one has
// triggered; it must then wait with griddepcontrol.wait before reading what the upstream
// wrote). Returns the number of edges changed.
int MakeEdgesFromProgrammatic(cudaGraph_t g, const void* from_func);

}  // namespace tpserve::cuda_bench
