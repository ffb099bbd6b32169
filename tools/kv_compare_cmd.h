// `tpserve kv-compare`: how far quantized KV caches move a model's logits and greedy tokens
// against a baseline KV dtype, measured in this process through the engine's shard runner.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/flags.h"

namespace tpserve {

const CommandSpec& KvCompareFlagSpec();  // the flag table (--help prints it)
absl::Status RunKvCompareCommand(const std::vector<std::string>& args);

}  // namespace tpserve
