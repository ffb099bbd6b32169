// Token sampling on the GPU with the rule of kernels/ops.h (greedy, temperature, top-k, top-p,
// Philox draw), and the requested log-probabilities (a logsumexp and the top N per row that asks,
// on the GPU). Only the ids and those small arrays cross to the host; Sample is the one op that
// synchronizes, once (Launch / Wait split it, so that a step can be enqueued before the previous
// one's ids reach the host).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "common/dtype.h"
#include "kernels/ops.h"

namespace tpserve::cuda {

class GpuSampler {
 public:
  GpuSampler() = default;
  ~GpuSampler();
  GpuSampler(const GpuSampler&) = delete;
  GpuSampler& operator=(const GpuSampler&) = delete;

  // Launch + Wait (nothing may be in flight).
  std::vector<int32_t> Sample(const Tensor& logits, int64_t vocab_size,
                              const std::vector<SamplingParams>& params,
                              std::vector<std::optional<TokenLogprobs>>* logprobs,
                              cudaStream_t stream);
  // Enqueues the sampling of `logits` on `stream` (at most two in flight: each has its own pinned
  // host buffers) and returns. `logprobs`: some row asks for them.
  void Launch(const Tensor& logits, int64_t vocab_size, const std::vector<SamplingParams>& params,
              bool logprobs, cudaStream_t stream);
  // Waits for the oldest launch in flight; its ids (and logprobs, when not null).
  std::vector<int32_t> Wait(std::vector<std::optional<TokenLogprobs>>* logprobs);
  // Whether the oldest launch in flight has finished (true when none is).
  bool Ready();
  int in_flight() const { return static_cast<int>(in_flight_.size()); }
  // The device ids of the latest launch ([latest_rows()]), valid in stream order until the next
  // launch writes them.
  const int32_t* latest_ids() const { return ids_dev_; }
  int latest_rows() const { return latest_rows_; }

 private:
  // Pinned host buffers and the completion event of one launch.
  struct Slot {
    int cap = 0;
    void* params_host = nullptr;    // [cap] DeviceSampleParams
    int32_t* ids_host = nullptr;    // [cap]
    void* logprobs_host = nullptr;  // [cap] DeviceLogprobs
    cudaEvent_t done = nullptr;
    int rows = 0;
    int logprob_rows = 0;
  };
  void ReserveRows(int rows, Slot& slot, cudaStream_t stream);
  void ReserveSort(int64_t elems, int segments, cudaStream_t stream);

  int cap_rows_ = 0;
  int64_t sort_elems_cap_ = 0;
  uint64_t* keys_in_ = nullptr;   // [rows * vocab] (probability bits << 32 | ~id)
  uint64_t* keys_out_ = nullptr;  // sorted, descending
  int32_t* seg_begin_ = nullptr;  // [rows]
  int32_t* seg_end_ = nullptr;    // [rows]
  void* params_dev_ = nullptr;    // [rows] DeviceSampleParams
  int32_t* ids_dev_ = nullptr;    // [rows]
  void* sort_temp_ = nullptr;
  size_t sort_temp_bytes_ = 0;
  void* logprobs_dev_ = nullptr;  // [rows] DeviceLogprobs, packed: rows that asked only
  Slot slots_[2];
  int next_slot_ = 0;
  std::vector<int> in_flight_;  // slots, oldest first
  int latest_rows_ = 0;
};

}  // namespace tpserve::cuda
