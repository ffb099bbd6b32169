// KV-cache pool sizing from explicit sizes or the device memory budget (see kv_budget.h).
#include "worker/kv_budget.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tpserve {
namespace {

constexpr char kMoreRanks[] =
    "use more tensor-parallel ranks (--tp) or pipeline stages (--pp) so that each holds less";

}  // namespace

std::string BytesString(int64_t bytes) {
  if (bytes >= 1000000000 || bytes <= -1000000000) {
    return absl::StrFormat("%.2f GB (%d bytes)", bytes / 1e9, bytes);
  }
  if (bytes >= 1000000 || bytes <= -1000000) {
    return absl::StrFormat("%.2f MB (%d bytes)", bytes / 1e6, bytes);
  }
  return absl::StrCat(bytes, " bytes");
}

int64_t MaxKvBlocks(int block_size) {
  return std::numeric_limits<int32_t>::max() / std::max(1, block_size);
}

absl::StatusOr<KvBudget> ComputeKvBudget(const KvBudgetInput& in) {
  const double f = in.gpu_memory_utilization;
  if (!(f > 0 && f <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpu-memory-utilization must be in (0, 1], got ", f));
  }
  if (in.block_bytes <= 0 || in.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV blocks of ", in.block_bytes, " bytes and ", in.block_size, " tokens"));
  }
  if (in.kv_cache_bytes < 0 || in.num_kv_blocks < 0) {
    return absl::InvalidArgumentError("KV cache sizes must not be negative");
  }
  const bool known = in.total_bytes > 0;
  const int64_t free_bytes = in.total_bytes - in.in_use_bytes;
  const int64_t needed = in.weight_bytes + in.workspace_bytes;
  const std::string shard =
      absl::StrCat("this rank's weights take ", BytesString(in.weight_bytes),
                   " and its activation workspace ", BytesString(in.workspace_bytes));
  const std::string device =
      absl::StrCat("the device has ", BytesString(free_bytes), " free of ",
                   BytesString(in.total_bytes), " (", BytesString(in.in_use_bytes), " in use)");
  if (known && needed > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the model does not fit on the device: ", shard, ", ", BytesString(needed),
        " together, but ", device, ". To fix: ", kMoreRanks,
        ", lower --max-num-batched-tokens (it sizes the workspace), or free the device"));
  }

  KvBudget out;
  const int64_t max_blocks = MaxKvBlocks(in.block_size);
  auto finish = [&](int64_t blocks, std::string source) {
    out.num_blocks = blocks;
    out.kv_bytes = blocks * in.block_bytes;
    out.capacity_tokens = blocks * in.block_size;
    out.source = std::move(source);
    return out;
  };

  if (in.kv_cache_bytes > 0 || in.num_kv_blocks > 0) {
    const bool by_bytes = in.kv_cache_bytes > 0;
    const int64_t blocks = by_bytes ? in.kv_cache_bytes / in.block_bytes : in.num_kv_blocks;
    const std::string source =
        by_bytes ? absl::StrCat("--kv-cache-mb (", BytesString(in.kv_cache_bytes), ")")
                 : absl::StrCat(in.num_kv_blocks, " KV blocks requested");
    if (blocks < 1) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "a KV cache of ", BytesString(in.kv_cache_bytes), " holds not even one block of ",
          BytesString(in.block_bytes), " (", in.block_size, " tokens); raise --kv-cache-mb"));
    }
    if (blocks > max_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": ", blocks, " blocks of ",
                                                     in.block_size, " tokens exceed the limit of ",
                                                     max_blocks, " (int32 KV slot ids)"));
    }
    if (known && blocks * in.block_bytes > free_bytes - needed) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the KV cache asked for (", source, ": ", blocks, " blocks, ",
                       BytesString(blocks * in.block_bytes), ") does not fit: ", shard, ", ",
                       device, ", which leaves ", BytesString(free_bytes - needed),
                       ". Lower --kv-cache-mb, or leave it out to size the cache from "
                       "--gpu-memory-utilization"));
    }
    return finish(blocks, source);
  }

  if (!known) {
    if (in.default_blocks < 1) {
      return absl::InvalidArgumentError("no KV cache size: give --kv-cache-mb");
    }
    return finish(std::min(in.default_blocks, max_blocks), "default");
  }

  const int64_t allowed = static_cast<int64_t>(f * static_cast<double>(in.total_bytes));
  const int64_t budget = allowed - in.in_use_bytes - needed;
  const std::string budget_text = absl::StrCat(
      "--gpu-memory-utilization ", f, " allows ", BytesString(allowed), " of the device's ",
      BytesString(in.total_bytes), "; ", BytesString(in.in_use_bytes), " is in use already (",
      BytesString(free_bytes), " free), ", shard, ", which leaves ",
      BytesString(std::max<int64_t>(budget, 0)), " for the KV cache");
  if (budget < in.block_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no room for the KV cache: ", budget_text, ", less than one block of ",
                     BytesString(in.block_bytes), " (", in.block_size,
                     " tokens). To fix: raise --gpu-memory-utilization, ", kMoreRanks,
                     ", or lower --max-num-batched-tokens"));
  }
  const int64_t blocks = std::min(budget / in.block_bytes, max_blocks);
  const int64_t min_blocks = (in.max_seq_len + in.block_size - 1) / in.block_size;
  if (blocks < min_blocks) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the KV cache would hold ", blocks * in.block_size,
        " tokens, less than one sequence of the model's context (", in.max_seq_len, " tokens, ",
        min_blocks, " blocks of ", BytesString(in.block_bytes), "): ", budget_text,
        ". To fix: raise --gpu-memory-utilization, ", kMoreRanks,
        ", lower --max-num-batched-tokens, or set --kv-cache-mb explicitly to accept a smaller "
        "cache (longer requests are then refused)"));
  }
  return finish(blocks, absl::StrCat("--gpu-memory-utilization ", f));
}

}  // namespace tpserve
