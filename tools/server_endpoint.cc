// The client commands' connection to a server (see server_endpoint.h).
#include "tools/server_endpoint.h"

#include "absl/strings/str_cat.h"
#include "common/credential_files.h"
#include "common/env.h"
#include "common/status.h"

namespace tpserve {

std::shared_ptr<grpc::Channel> ServerEndpoint::Channel() const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!tls_ca_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = tls_ca_pem;
    ssl.pem_private_key = tls_key_pem;
    ssl.pem_cert_chain = tls_cert_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  return grpc::CreateCustomChannel(address, credentials, args);
}

void ServerEndpoint::Authorize(grpc::ClientContext* ctx) const {
  if (!api_key.empty()) ctx->AddMetadata("authorization", absl::StrCat("Bearer ", api_key));
}

std::vector<FlagSpec> WithServerEndpointFlags(std::vector<FlagSpec> own) {
  std::vector<FlagSpec> flags = {
      StringFlag("server", "ADDR", "server address (default: TPSERVE_SERVER, localhost:50051)"),
      StringFlag("api-key-file", "FILE",
                 "the API key to send: the first key of a key file as serve reads it (default: "
                 "TPSERVE_API_KEY)"),
      StringFlag("tls-ca", "PEM", "connect with TLS, trusting this CA for the server"),
      StringFlag("tls-client-cert", "PEM", "client certificate for mutual TLS (with --tls-ca)"),
      StringFlag("tls-client-key", "PEM", "the client certificate's key"),
  };
  flags.insert(flags.end(), own.begin(), own.end());
  return flags;
}

absl::StatusOr<ServerEndpoint> ServerEndpointFromFlags(const Flags& a) {
  ServerEndpoint e;
  e.address = a.GetOr("server", EnvString(env::kServer));
  TP_RETURN_IF_ERROR(
      CheckServerAddress(a.Has("server") ? "server" : "server (TPSERVE_SERVER)", e.address));
  if (a.Has("api-key-file")) {
    // The server's own format: its first key (a server's key file works as it is).
    absl::StatusOr<std::vector<std::string>> keys = ReadApiKeyFile(*a.Get("api-key-file"));
    if (!keys.ok()) return Annotate(keys.status(), "--api-key-file");
    e.api_key = keys->front();
  } else {
    e.api_key = EnvString(env::kApiKey);
  }
  if (a.Has("tls-client-cert") != a.Has("tls-client-key")) {
    return absl::InvalidArgumentError("give --tls-client-cert and --tls-client-key together");
  }
  if (a.Has("tls-client-cert") && !a.Has("tls-ca")) {
    return absl::InvalidArgumentError("--tls-client-cert needs --tls-ca (mutual TLS is TLS)");
  }
  // A PEM file's error names its flag, as the client commands' other flag errors do.
  auto pem = [&](const std::string& flag) -> absl::StatusOr<std::string> {
    absl::StatusOr<std::string> text = ReadPemFile(*a.Get(flag));
    if (!text.ok()) return Annotate(text.status(), "--" + flag);
    return text;
  };
  if (a.Has("tls-ca")) {
    TP_ASSIGN_OR_RETURN(e.tls_ca_pem, pem("tls-ca"));
  }
  if (a.Has("tls-client-cert")) {
    TP_ASSIGN_OR_RETURN(e.tls_cert_pem, pem("tls-client-cert"));
    TP_ASSIGN_OR_RETURN(e.tls_key_pem, pem("tls-client-key"));
  }
  return e;
}

}  // namespace tpserve
