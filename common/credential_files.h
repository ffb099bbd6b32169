// Files that hold credentials, read alike by the server and the client commands: API key files
// and PEM certificates and keys.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tpserve {

// The keys of an API key file: one a line, surrounding whitespace dropped, blank lines and lines
// starting with # skipped. A file that cannot be read or holds no key is an error naming it.
absl::StatusOr<std::vector<std::string>> ReadApiKeyFile(const std::string& path);

// The whole text of a PEM file; one that cannot be read or is empty is an error naming it.
absl::StatusOr<std::string> ReadPemFile(const std::string& path);

}  // namespace tpserve
