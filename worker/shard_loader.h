// One rank's shard and its KV cache, loaded in the order that lets the memory budget be exact:
// check that the weights, workspace and the smallest useful KV cache fit (before reading any
// weight), load the weights and allocate the activations, let the caller allocate its other
// fixed buffers, then measure the device and size the KV pool from what the budget leaves
// (worker/kv_budget.h), allocated once. Used by the Engine and the worker's StepRunner.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "common/model_files.h"
#include "kernels/ops.h"
#include "parallel/shard_plan.h"
#include "worker/kv_budget.h"
#include "worker/kv_cache.h"
#include "worker/model.h"

namespace tpserve {

struct ShardLoadOptions {
  ModelOptions model;
  int block_size = 16;
  // --kv-cache-dtype: nullopt ("auto") is the compute dtype; else it or a quantized dtype
  // (kernels/kv_quant.h) the ops support. Anything else fails the load with a clear message.
  std::optional<DType> kv_cache_dtype;
  // Explicit KV sizes, in this order of precedence (0: unset); else the budget below.
  int64_t kv_cache_bytes = 0;
  int64_t num_kv_blocks = 0;
  // Fraction of the device's total memory this process may use: weights, workspace and KV.
  double gpu_memory_utilization = 0.90;
  // Without an explicit size and without device memory information (CPU ops): room for this
  // many sequences of the full context, at most 65536 blocks.
  int default_full_sequences = 4;
  // Called after the weights and activations are allocated and before the device is measured
  // for the KV budget: allocate other fixed buffers here so that the budget accounts for them.
  std::function<void(LlamaModel&)> before_kv;
};

// The KV dtype `requested` resolves to on `ops` (nullopt: the compute dtype), or
// INVALID_ARGUMENT naming what the backend can store.
absl::StatusOr<DType> ResolveKvCacheDType(const Ops& ops, std::optional<DType> requested,
                                          int64_t head_dim);

struct LoadedShard {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<KvCache> cache;
  KvBudget kv;
};

absl::StatusOr<LoadedShard> LoadShard(const ModelFiles& files, const ShardPlan& plan, int rank,
                                      Ops* ops, ParallelContext comms,
                                      const ShardLoadOptions& options);

}  // namespace tpserve
