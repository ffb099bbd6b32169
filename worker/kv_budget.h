// How many KV-cache blocks a rank gets: from an explicit size (--kv-cache-mb, num_kv_blocks),
// or from the device memory budget --gpu-memory-utilization F:
//   blocks = (F * total - in use - weights - workspace) / bytes per block,
// with the errors that name the numbers when the model or a full-length sequence does not fit.
// Pure arithmetic, so that the rules are tested on the CPU; worker/shard_loader.cc measures the
// inputs on the device.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace tpserve {

struct KvBudgetInput {
  // Device memory (cudaMemGetInfo). total_bytes == 0: unknown (CPU ops): no budget, no checks.
  int64_t total_bytes = 0;
  // In use on the device before this rank's weights and workspace: the CUDA context, cuBLAS and
  // communicator buffers, and every other process on the same device.
  int64_t in_use_bytes = 0;
  int64_t weight_bytes = 0;              // this rank's shard of the weights
  int64_t workspace_bytes = 0;           // activations for --max-num-batched-tokens, batch buffers
  double gpu_memory_utilization = 0.90;  // in (0, 1]
  // One block: block_size tokens of K and V for every local layer.
  int64_t block_bytes = 0;
  int block_size = 16;
  // The longest sequence a request may need (the model's context length): the budgeted pool
  // must hold one, or requests the server accepts could never run.
  int64_t max_seq_len = 0;
  // Explicit sizes take precedence over the budget, kv_cache_bytes first (0: unset). They are
  // only checked against the free memory, not the utilization fraction.
  int64_t kv_cache_bytes = 0;
  int64_t num_kv_blocks = 0;
  // Used when there is neither an explicit size nor device memory information.
  int64_t default_blocks = 0;
};

struct KvBudget {
  int64_t num_blocks = 0;
  int64_t kv_bytes = 0;         // num_blocks * block_bytes
  int64_t capacity_tokens = 0;  // num_blocks * block_size
  std::string source;           // "--gpu-memory-utilization 0.90", "--kv-cache-mb", ...
};

// Slot ids (block * block_size + offset) are int32 on the device and in the block tables.
int64_t MaxKvBlocks(int block_size);

// The pool size, or an error that names weight, workspace, free and total bytes, the fraction,
// and what to change. RESOURCE_EXHAUSTED when it does not fit, INVALID_ARGUMENT for bad inputs.
absl::StatusOr<KvBudget> ComputeKvBudget(const KvBudgetInput& in);

// "13.48 GB (13476298752 bytes)": sizes in messages, readable and exact.
std::string BytesString(int64_t bytes);

}  // namespace tpserve
