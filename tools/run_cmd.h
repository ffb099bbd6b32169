// `tpserve run`: in-process generation on one model directory.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/flags.h"

namespace tpserve {

const CommandSpec& RunFlagSpec();  // the flag table (--help prints it)
absl::Status RunRunCommand(const std::vector<std::string>& args);

}  // namespace tpserve
