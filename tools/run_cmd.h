// `tpserve run`: in-process generation on one model directory.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tpserve {

absl::Status RunRunCommand(const std::vector<std::string>& args);

}  // namespace tpserve
