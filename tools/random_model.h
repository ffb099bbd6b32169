// `tpserve random-model`: writes a model directory (config.json, generation_config.json and
// safetensors weights, optionally sharded) with deterministic random weights for any config.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "common/model_config.h"

namespace tpserve {

struct RandomModelOptions {
  std::string config_path;  // a config.json to copy (torch_dtype is set to `dtype`)
  std::string out_dir;      // created if missing; old weight files in it are removed
  uint64_t seed = 0;
  DType dtype = DType::kBF16;    // kBF16, kF32 or kF16
  int64_t shard_size_bytes = 0;  // 0: one model.safetensors; else shards + index
  int threads = 0;               // 0: all hardware threads
};

absl::Status WriteRandomModel(const RandomModelOptions& options);

// The fp32 value of element `index` of tensor `name` (before rounding to the output dtype):
// norms are 1 + 0.05·n, everything else initializer_range·n, n ~ approx. N(0, 1), a pure
// function of (seed, name, index).
float RandomWeightValue(const ModelConfig& config, uint64_t seed, std::string_view name,
                        uint64_t index);

// `tpserve random-model --config FILE --out DIR [--seed N] [--dtype bf16|fp32|fp16]
//  [--shard-size-mb N] [--threads N]`; `args` excludes the subcommand name.
absl::Status RunRandomModelCommand(const std::vector<std::string>& args);

}  // namespace tpserve
