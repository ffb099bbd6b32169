// The control plane's shared secret: how a worker proves it belongs to this launch. Read from a
// file (--cluster-secret-file on both sides) or, for workers the coordinator spawns, generated
// per launch and handed over in the environment (TPSERVE_CLUSTER_SECRET); compared in constant
// time. Sent as the metadata below on the worker's control stream.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tpserve {

// The gRPC metadata key (lower case, as gRPC requires) carrying the secret.
inline constexpr char kClusterSecretMetadata[] = "tpserve-cluster-secret";

// The secret in `path`: its text without trailing whitespace; an empty file, an unreadable one
// or one longer than 4 KiB is an error naming the path.
absl::StatusOr<std::string> ReadClusterSecretFile(const std::string& path);

// 32 random bytes from OpenSSL's CSPRNG, as 64 hex digits.
std::string NewClusterSecret();

// Constant-time equality (the time does not depend on where the texts differ).
bool ConstantTimeEquals(std::string_view a, std::string_view b);

}  // namespace tpserve
