// The public API's keys (--api-key-file, one key per line; --api-key): checked on every gRPC call
// (metadata `authorization: Bearer <key>`) and HTTP /v1 request (the same header), health
// exempt. Compared in constant time.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tpserve {

class ApiKeys {
 public:
  ApiKeys() = default;  // no keys: every request is allowed
  explicit ApiKeys(std::vector<std::string> keys) : keys_(std::move(keys)) {}
  // The keys of `file` (one a line; blank lines and lines starting with # skipped) plus `key`
  // when not empty. A file that cannot be read or holds no key is an error naming it.
  static absl::StatusOr<ApiKeys> Load(const std::string& file, const std::string& key);

  bool enabled() const { return !keys_.empty(); }
  // OK when no keys are set or `authorization` is `Bearer <one of the keys>`; UNAUTHENTICATED
  // with a message saying what to send otherwise.
  absl::Status Check(std::string_view authorization) const;

 private:
  std::vector<std::string> keys_;
};

// True for an address only this machine reaches (127.0.0.0/8, ::1, localhost): an API there needs
// no key; elsewhere the coordinator warns when it has none.
bool IsLoopbackHost(std::string_view host);

}  // namespace tpserve
