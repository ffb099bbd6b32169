// The flags of tpserve-coordinator and `tpserve serve`: one table, parsed into CoordinatorOptions.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/flags.h"
#include "coordinator/server.h"

namespace tpserve {

// The declaration table; `serve_command` names `tpserve serve` (which spawns its workers).
const CommandSpec& CoordinatorFlagSpec(bool serve_command);

// `args` excludes the program / subcommand name. A --help request returns options with
// `help` set (the caller prints Usage(CoordinatorFlagSpec(...)) and exits 0).
absl::StatusOr<CoordinatorOptions> ParseCoordinatorFlags(const std::vector<std::string>& args,
                                                         bool serve_command);

}  // namespace tpserve
