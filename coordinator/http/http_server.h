// The OpenAI-compatible HTTP front end beside gRPC: /v1/completions, /v1/chat/completions
// (Server-Sent Events when streaming), /v1/models, /health, /metrics. It submits through
// InferenceService::Submit, the same path as gRPC. Served by cpp-httplib (a bounded thread pool).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/api_keys.h"
#include "coordinator/http/openai_api.h"

namespace tpserve {

class InferenceService;
class MetricsRegistry;

// Renders chat messages into a prompt (the model's chat template); the rendered text is
// tokenized without adding special tokens (the template writes the BOS).
using ChatRenderer = std::function<absl::StatusOr<std::string>(
    const std::vector<openai::HttpChatMessage>& messages, bool add_generation_prompt)>;

struct HttpFrontendOptions {
  // Requests handled at once (each open stream holds a thread); more connections wait.
  int threads = 64;
  int read_timeout_s = 30;   // a client slower than this to send its request is dropped
  int write_timeout_s = 30;  // ... or to take the answer
  int keep_alive_timeout_s = 5;
  size_t max_body_bytes = 32 << 20;
  // Names the model answers to besides the served name (e.g. the path given to --model).
  std::vector<std::string> model_aliases;
  // When set: every /v1 request needs `Authorization: Bearer <key>` (401 otherwise).
  ApiKeys api_keys;
  // Not empty: HTTPS with this PEM certificate (chain) and key; with tls_client_ca, clients must
  // present a certificate signed by it (mutual TLS).
  std::string tls_cert, tls_key, tls_client_ca;
};

class HttpFrontend {
 public:
  // `render_chat` may be empty: chat completions then answer 400 (no chat template).
  HttpFrontend(InferenceService* service, MetricsRegistry* metrics, ChatRenderer render_chat,
               HttpFrontendOptions options);
  ~HttpFrontend();  // Stop()

  // Binds host:port (0: any free port) and serves on a thread; returns the port.
  absl::StatusOr<int> Start(const std::string& host, int port);
  // /health answers 200 only while serving (the gRPC health status follows the same switch).
  void SetServing(bool serving) { serving_.store(serving); }
  // Stops accepting, closes connections, joins the threads. Open streams see their writes fail
  // and cancel their requests.
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> serving_{false};
};

}  // namespace tpserve
