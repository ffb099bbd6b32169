// Loading a shard and sizing its KV pool (see shard_loader.h).
#include "worker/shard_loader.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status.h"
#include "kernels/kv_quant.h"

namespace tpserve {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

absl::StatusOr<DType> ResolveKvCacheDType(const Ops& ops, std::optional<DType> requested,
                                          int64_t head_dim) {
  const DType t = requested.value_or(ops.compute_dtype());
  if (!ops.SupportsKvCacheDType(t)) {
    std::vector<std::string> can;
    for (DType c : {DType::kBF16, DType::kF32, DType::kF8E4M3, DType::kI8, DType::kI4}) {
      if (ops.SupportsKvCacheDType(c)) can.emplace_back(KvCacheDTypeName(c));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-cache-dtype ", std::string(KvCacheDTypeName(t)), " is not supported on ",
        ops.device() == Device::kCuda ? "CUDA" : "the CPU", " (compute dtype ",
        std::string(KvCacheDTypeName(ops.compute_dtype())),
        "); this build can store the KV cache in ", absl::StrJoin(can, ", "), " (or auto)"));
  }
  if (IsQuantizedKv(t) && head_dim % KvScaleGroup(t, static_cast<int>(head_dim)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-dtype ", std::string(KvCacheDTypeName(t)),
                     " needs a head_dim that is a multiple of ",
                     KvScaleGroup(t, static_cast<int>(head_dim)), "; the model's is ", head_dim));
  }
  return t;
}

absl::StatusOr<LoadedShard> LoadShard(const ModelFiles& files, const ShardPlan& plan, int rank,
                                      Ops* ops, ParallelContext comms,
                                      const ShardLoadOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelConfig& config = files.config();
  TP_ASSIGN_OR_RETURN(ShardMemory estimate,
                      LlamaModel::EstimateMemory(files, plan, rank, ops, options.model));
  const RankShard shard = plan.ForRank(config, rank);
  const int bs = options.block_size;
  const int64_t blocks_per_seq = (config.max_position_embeddings + bs - 1) / bs;
  TP_ASSIGN_OR_RETURN(const DType kv_dtype,
                      ResolveKvCacheDType(*ops, options.kv_cache_dtype, config.head_dim));

  KvBudgetInput in;
  in.gpu_memory_utilization = options.gpu_memory_utilization;
  in.block_bytes = static_cast<int64_t>(
      KvCache::BlockBytes(std::max(1, shard.layer_end - shard.layer_begin), bs, shard.num_kv_heads,
                          static_cast<int>(config.head_dim), kv_dtype));
  in.block_size = bs;
  in.max_seq_len = config.max_position_embeddings;
  in.kv_cache_bytes = options.kv_cache_bytes;
  in.num_kv_blocks = options.num_kv_blocks;
  in.default_blocks =
      std::min<int64_t>(blocks_per_seq * std::max(1, options.default_full_sequences), 1 << 16);
  size_t free_bytes = 0, total_bytes = 0;
  const bool measured = ops->MemoryInfo(&free_bytes, &total_bytes);
  if (measured) {
    in.total_bytes = static_cast<int64_t>(total_bytes);
    in.in_use_bytes = static_cast<int64_t>(total_bytes - free_bytes);
  }
  in.weight_bytes = estimate.weight_bytes;
  in.workspace_bytes = estimate.activation_bytes;
  // Fail before reading any weight when they, or the smallest useful cache, cannot fit.
  TP_RETURN_IF_ERROR(ComputeKvBudget(in).status());
  const int64_t in_use_before = in.in_use_bytes;
  const double check_s = SecondsSince(t0);

  const auto t1 = std::chrono::steady_clock::now();
  LoadedShard out;
  TP_ASSIGN_OR_RETURN(out.model, LlamaModel::Load(files, plan, rank, ops, comms, options.model));
  const double load_s = SecondsSince(t1);
  const auto t2 = std::chrono::steady_clock::now();
  if (options.before_kv) options.before_kv(*out.model);
  const double before_kv_s = SecondsSince(t2);

  const auto t3 = std::chrono::steady_clock::now();
  in.weight_bytes = static_cast<int64_t>(out.model->weight_bytes());
  in.workspace_bytes = static_cast<int64_t>(out.model->activation_bytes());
  if (measured && ops->MemoryInfo(&free_bytes, &total_bytes)) {
    // Whatever the load allocated beyond the weights (activations, batch buffers, allocator
    // rounding) counts as workspace.
    const int64_t in_use_now = static_cast<int64_t>(total_bytes - free_bytes);
    in.workspace_bytes = std::max<int64_t>(0, in_use_now - in_use_before - in.weight_bytes);
  }
  TP_ASSIGN_OR_RETURN(out.kv, ComputeKvBudget(in));
  out.cache = out.model->MakeKvCache(static_cast<int>(out.kv.num_blocks), bs, kv_dtype);
  const double kv_s = SecondsSince(t3);

  TP_LOG(INFO) << absl::StrFormat(
      "KV cache: %s, %d blocks of %d tokens = %d tokens (%.1f full contexts of %d), %s, from %s; "
      "weights %s, workspace %s%s",
      std::string(KvCacheDTypeName(kv_dtype)).c_str(), out.kv.num_blocks, bs,
      out.kv.capacity_tokens,
      out.kv.capacity_tokens / static_cast<double>(config.max_position_embeddings),
      config.max_position_embeddings, BytesString(out.kv.kv_bytes), out.kv.source,
      BytesString(in.weight_bytes), BytesString(in.workspace_bytes),
      measured ? absl::StrCat(", device memory in use before loading ", BytesString(in_use_before),
                              " of ", BytesString(in.total_bytes))
               : "");
  TP_LOG(INFO) << absl::StrFormat(
      "shard load phases: memory check %.3f s, weights and activations %.3f s, fixed buffers "
      "%.3f s, KV pool %.3f s",
      check_s, load_s, before_kv_s, kv_s);
  return out;
}

}  // namespace tpserve
