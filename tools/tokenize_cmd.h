// `tpserve tokenize` and `tpserve detokenize`: text <-> token ids through a tokenizer.json.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tpserve {

// tokenize --tokenizer PATH [--add-special-tokens]: reads UTF-8 text on stdin, prints the ids as
// one JSON array on stdout. PATH is a tokenizer.json or a model directory. `args` exclude the
// subcommand name.
absl::Status RunTokenizeCommand(const std::vector<std::string>& args);
// detokenize --tokenizer PATH [--skip-special-tokens]: reads a JSON array of ids on stdin,
// prints the decoded text on stdout.
absl::Status RunDetokenizeCommand(const std::vector<std::string>& args);

}  // namespace tpserve
