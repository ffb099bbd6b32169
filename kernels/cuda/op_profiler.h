// Op-level profiler of CudaOps: a pair of CUDA events around each op launched eagerly (never
// while the stream is capturing a graph), summed per (op, shape). Off unless asked for
// (CudaOps::set_op_profiling or TPSERVE_OP_PROFILE=1); when off, an op pays one null check.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace tpserve {

// One line of the profile: every call of `op` with `shape` since the profile was last taken.
struct OpProfileRow {
  std::string op;     // e.g. "Gemm.skinny"; "step" for a BeginProfiledStep/EndProfiledStep range
  std::string shape;  // e.g. "M=1 N=4096 K=4096"
  int64_t calls = 0;
  double total_us = 0;
  double bytes = 0;  // main-memory bytes the calls move (0 where not counted)
};

// A table: op, shape, calls per step, us per call, us per step, % of the step (of the "step"
// rows' time when present, else of the ops' sum) and GB/s where bytes are counted. `steps`
// divides the totals.
std::string FormatOpProfile(const std::vector<OpProfileRow>& rows, int steps);

namespace cuda {

class OpProfiler {
 public:
  explicit OpProfiler(cudaStream_t stream) : stream_(stream) {}
  ~OpProfiler();
  OpProfiler(const OpProfiler&) = delete;
  OpProfiler& operator=(const OpProfiler&) = delete;

  // Records the start event; returns the token for End, or -1 (nothing recorded) while the
  // stream is capturing.
  int Begin(const char* op, const std::string& shape, double bytes);
  void End(int token);
  // Synchronizes the stream, adds up everything recorded and returns the rows (largest total
  // first), then starts over.
  std::vector<OpProfileRow> Take();

 private:
  struct Pending {
    int row;
    cudaEvent_t start, end;
    bool ended;
  };
  cudaEvent_t NewEvent();
  void Drain();

  cudaStream_t stream_;
  std::vector<cudaEvent_t> free_events_;
  std::map<int, Pending> pending_;  // by token
  int next_token_ = 0;
  std::map<std::pair<std::string, std::string>, int> index_;
  std::vector<OpProfileRow> rows_;
};

// Keeps the stream busy for `us` microseconds (device-side sleep), so that the host can queue
// the next ops ahead of the GPU and profiled ops run back to back.
void LaunchStall(int us, cudaStream_t stream);

}  // namespace cuda
}  // namespace tpserve
