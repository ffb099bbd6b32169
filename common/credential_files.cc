// Credential files (see credential_files.h).
#include "common/credential_files.h"

#include <fstream>
#include <iterator>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace tpserve {

absl::StatusOr<std::vector<std::string>> ReadApiKeyFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read the API key file ", path));
  std::vector<std::string> keys;
  std::string line;
  while (std::getline(in, line)) {
    const std::string k(absl::StripAsciiWhitespace(line));
    if (!k.empty() && k[0] != '#') keys.push_back(k);
  }
  if (keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the API key file ", path, " holds no key"));
  }
  return keys;
}

absl::StatusOr<std::string> ReadPemFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof())
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", path));
  if (text.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", path, " (or it is empty)"));
  }
  return text;
}

}  // namespace tpserve
