// The control plane's shared secret (see cluster_secret.h).
#include "common/cluster_secret.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>

#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/logging.h"

namespace tpserve {

absl::StatusOr<std::string> ReadClusterSecretFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read the cluster secret file ", path));
  }
  std::string text(4097, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("the cluster secret file ", path, " is longer than 4 KiB"));
  }
  std::string secret(absl::StripTrailingAsciiWhitespace(text));
  if (secret.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the cluster secret file ", path, " is empty"));
  }
  return secret;
}

std::string NewClusterSecret() {
  unsigned char bytes[32];
  TP_CHECK(RAND_bytes(bytes, sizeof(bytes)) == 1) << "OpenSSL's RAND_bytes failed";
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // The length is not secret (a generated secret always has 64 digits).
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace tpserve
