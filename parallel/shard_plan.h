// The shard plan: which layers (pipeline stage) and which heads / MLP columns / vocab rows
// (tensor-parallel rank) each worker owns. Plain C++: used by the coordinator and the workers.
// Global rank = stage * tp + tp_rank.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"

namespace tpserve {

struct RankShard {
  int rank = 0;
  int tp_rank = 0;
  int stage = 0;
  int layer_begin = 0;  // [layer_begin, layer_end) of the model's layers
  int layer_end = 0;
  bool first_stage() const { return stage == 0; }
  bool last_stage = false;
  // Attention heads of this rank.
  int q_head_begin = 0;
  int num_q_heads = 0;
  int kv_head_begin = 0;  // with replication (tp > kv heads) several ranks share a KV head
  int num_kv_heads = 0;
  // MLP columns [intermediate_begin, +intermediate_size) of gate/up rows and down columns.
  int64_t intermediate_begin = 0;
  int64_t intermediate_size = 0;
  // Vocab rows [vocab_begin, +vocab_shard) of embed_tokens and lm_head; rows past the real
  // vocabulary are padding (zero weights, logits ignored).
  int64_t vocab_begin = 0;
  int64_t vocab_shard = 0;
};

struct ShardPlan {
  int tp = 1;
  int pp = 1;
  std::vector<int> stage_layer_begin;  // pp + 1 entries: stage s owns [begin[s], begin[s+1])
  int64_t vocab_padded = 0;            // vocab rounded up to a multiple of tp
  bool kv_replicated = false;          // tp > num_kv_heads
  // Planned bytes on one GPU of each stage (weights of one TP rank + its KV cache for the
  // context budget), as the planner weighed them.
  std::vector<int64_t> stage_bytes;
  // Human-readable notes on choices the planner made (KV replication, vocab padding), for logs.
  std::vector<std::string> notes;

  int world_size() const { return tp * pp; }
  int num_layers(int stage) const {
    return stage_layer_begin[stage + 1] - stage_layer_begin[stage];
  }
  RankShard ForRank(const ModelConfig& config, int rank) const;
  std::string DeviceMapString() const;  // "0-15:0,16-31:1"
};

struct PlanOptions {
  int tp = 1;
  int pp = 1;
  std::string device_map;  // optional manual map "0-15:0,16-31:1" (layers:stage)
  // Optional free memory per GPU of each stage (bytes; pp entries) for balancing and
  // validation; empty = all equal and not checked.
  std::vector<int64_t> stage_free_bytes;
  // Bytes of one weight / KV element (2 for bf16 on CUDA, 4 for the fp32 CPU reference).
  int64_t bytes_per_elem = 2;
  // Tokens of KV cache each layer is weighed with (the context budget); 0 means
  // config.max_position_embeddings (room for one full-length sequence).
  int64_t context_tokens = 0;
};

// What one rank reported about its device before loading (the Register message).
struct RankMemory {
  std::string hostname;
  bool cuda = false;
  int gpu_index = -1;
  int64_t free_bytes = 0;   // 0: unknown
  int64_t total_bytes = 0;  // device total; 0: unknown (CPU: free_bytes is the host's available)
};

// The memory each stage's GPUs can use, for PlanOptions::stage_free_bytes (ranks ordered by
// global rank, tp * pp of them): a rank may use its free memory less the part of the device the
// utilization fraction keeps back ((1 - gpu_memory_utilization) * total, when the total is
// known), split evenly among the ranks that share its device (same host and GPU, or the same
// host's memory for CPU ranks); a stage gets the smallest of its ranks. Empty when any rank's
// free memory is unknown (then the plan is balanced by bytes alone and not checked).
std::vector<int64_t> StageFreeBytes(const std::vector<RankMemory>& ranks, int tp, int pp,
                                    double gpu_memory_utilization);

// Builds a balanced plan (layers weighted by weight + KV bytes; embedding on the first stage and
// norm + lm_head on the last counted; the largest per-GPU load relative to the stage's free
// memory minimized over contiguous layer ranges) or validates a manual one. Errors say what
// would work.
absl::StatusOr<ShardPlan> PlanShards(const ModelConfig& config, const PlanOptions& options);

// Parses a manual device map "0-15:0,16-31:1" (entries `first-last:stage` or `layer:stage`) for
// a model of `num_layers` layers and `pp` stages into stage_layer_begin (pp + 1 entries).
// Every layer must appear exactly once, each stage must own one non-empty contiguous range, and
// the ranges must follow the stage order.
absl::StatusOr<std::vector<int>> ParseDeviceMap(const std::string& map, int64_t num_layers, int pp);

// The tp values that split `config` cleanly (heads, KV heads by division or replication,
// intermediate size), ascending; used in error messages.
std::vector<int> ValidTpValues(const ModelConfig& config);

}  // namespace tpserve
