// The public API's keys (see api_keys.h).
#include "coordinator/api_keys.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/cluster_secret.h"
#include "common/credential_files.h"
#include "common/status.h"

namespace tpserve {

absl::StatusOr<ApiKeys> ApiKeys::Load(const std::string& file, const std::string& key) {
  std::vector<std::string> keys;
  if (!key.empty()) keys.push_back(key);
  if (!file.empty()) {
    TP_ASSIGN_OR_RETURN(std::vector<std::string> from_file, ReadApiKeyFile(file));
    keys.insert(keys.end(), from_file.begin(), from_file.end());
  }
  return ApiKeys(std::move(keys));
}

absl::Status ApiKeys::Check(std::string_view authorization) const {
  if (keys_.empty()) return absl::OkStatus();
  constexpr std::string_view kBearer = "bearer ";  // the scheme is case-insensitive (RFC 9110)
  bool ok = false;
  const std::string_view scheme = authorization.substr(0, kBearer.size());
  if (absl::EqualsIgnoreCase(absl::string_view(scheme.data(), scheme.size()),
                             absl::string_view(kBearer.data(), kBearer.size()))) {
    const std::string_view given = authorization.substr(kBearer.size());
    for (const std::string& k : keys_) ok |= ConstantTimeEquals(given, k);  // no early exit
  }
  if (ok) return absl::OkStatus();
  return absl::UnauthenticatedError(
      authorization.empty()
          ? "this server needs an API key: send `authorization: Bearer <key>` (HTTP header or "
            "gRPC metadata)"
          : "the API key is not valid (send `authorization: Bearer <key>`)");
}

bool IsLoopbackHost(std::string_view host) {
  return host.substr(0, 4) == "127." || host == "::1" || host == "[::1]" || host == "localhost";
}

}  // namespace tpserve
