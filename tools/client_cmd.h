// The gRPC client subcommands of `tpserve` (generate, info, health) and `tpserve serve` (the
// coordinator with its local workers). `args` excludes the subcommand name.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tpserve {

// tpserve generate --server ADDR (--prompt TEXT | --prompt-ids 1,2,3) [--stream] [--json]
//   [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
//   [--repetition-penalty R] [--stop STR] [--stop-token-ids 1,2] [--ignore-eos]
//   [--request-id ID] [--timeout S]
absl::Status RunGenerateCommand(const std::vector<std::string>& args);
// tpserve info --server ADDR: the model info as JSON.
absl::Status RunInfoCommand(const std::vector<std::string>& args);
// tpserve health --server ADDR [--service NAME]: grpc.health.v1 Check; error unless SERVING.
absl::Status RunHealthCommand(const std::vector<std::string>& args);
// tpserve serve --model DIR [--workers N | --tp T --pp P] [--device cpu|cuda|auto] [--port P]
absl::Status RunServeCommand(const std::vector<std::string>& args);

}  // namespace tpserve
