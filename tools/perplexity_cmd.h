// `tpserve perplexity`: a model's held-out perplexity on text files, through the engine.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/flags.h"

namespace tpserve {

const CommandSpec& PerplexityFlagSpec();  // the flag table (--help prints it)
absl::Status RunPerplexityCommand(const std::vector<std::string>& args);

}  // namespace tpserve
