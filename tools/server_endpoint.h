// How the client commands (generate, info, health, bench) reach a server: its address, TLS and
// the API key, from --server / --tls-ca / --tls-client-cert / --tls-client-key / --api-key-file
// or TPSERVE_SERVER and TPSERVE_API_KEY.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "common/flags.h"

namespace tpserve {

struct ServerEndpoint {
  std::string address = "localhost:50051";
  std::string api_key;       // sent as `authorization: Bearer <key>` on every call when set
  std::string tls_ca_pem;    // TLS when set: the CA (or the certificate) that signed the server's
  std::string tls_cert_pem;  // a client certificate and its key (mutual TLS)
  std::string tls_key_pem;

  // A channel to the server (messages up to 64 MiB both ways).
  std::shared_ptr<grpc::Channel> Channel() const;
  // Adds the API key, if any, to a call.
  void Authorize(grpc::ClientContext* ctx) const;
};

// A command's flag table: the flags of ServerEndpointFromFlags (--server, TLS, the API key),
// then `own`.
std::vector<FlagSpec> WithServerEndpointFlags(std::vector<FlagSpec> own);

// The endpoint the flags name: --server (else TPSERVE_SERVER), the first key of --api-key-file
// (the server's format, ReadApiKeyFile; else TPSERVE_API_KEY) and the PEM files. A port outside [1,
// 65535], a file that cannot be read, or a client certificate without its key (or the reverse) is
// an error.
absl::StatusOr<ServerEndpoint> ServerEndpointFromFlags(const Flags& a);

}  // namespace tpserve
