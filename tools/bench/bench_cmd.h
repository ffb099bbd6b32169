// `tpserve bench`: the serving load generator over the public gRPC API (closed or open loop,
// presets of the DeepSeek-Coder bf16 guide, streaming latency percentiles, JSON for scripts).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tpserve {

// `args` excludes the subcommand name. See kBenchUsage in bench_cmd.cc (or `--help`).
absl::Status RunBenchCommand(const std::vector<std::string>& args);

}  // namespace tpserve
