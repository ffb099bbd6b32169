// Token sampling on the GPU with the rule of kernels/ops.h (greedy, temperature, top-k, top-p,
// Philox draw), and the requested log-probabilities (a logsumexp and the top N per row that asks,
// on the GPU). Only the ids and those small arrays cross to the host; Sample is the one op that
// synchronizes, once.
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

  std::vector<int32_t> Sample(const Tensor& logits, int64_t vocab_size,
                              const std::vector<SamplingParams>& params,
                              std::vector<std::optional<TokenLogprobs>>* logprobs,
                              cudaStream_t stream);

 private:
  void ReserveRows(int rows);
  void ReserveSort(int64_t elems, int segments);

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
  void* params_host_ = nullptr;    // pinned
  int32_t* ids_host_ = nullptr;    // pinned
  void* logprobs_dev_ = nullptr;   // [rows] DeviceLogprobs, packed: rows that asked only
  void* logprobs_host_ = nullptr;  // pinned
};

}  // namespace tpserve::cuda
