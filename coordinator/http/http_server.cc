// The HTTP front end (see http_server.h): routes, auth, the wait for a whole answer and the
// Server-Sent Events stream of a streamed one.
#include "coordinator/http/http_server.h"

#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>

#include <httplib.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "coordinator/inference_service.h"
#include "coordinator/metrics.h"
#include "coordinator/request.h"
#include "coordinator/scheduler.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace tpserve {

using nlohmann::json;
using openai::Endpoint;

namespace {

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string RandomId(const char* prefix) {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  return absl::StrFormat("%s%016x", prefix, rng());
}

// Wakes the HTTP thread that waits on a request.
class Waiter final : public RequestListener {
 public:
  void OnRequestUpdate() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      updated_ = true;
    }
    cv_.notify_all();
  }
  void Wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [this] { return updated_; });
    updated_ = false;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool updated_ = false;
};

void SendJson(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void SendError(httplib::Response& res, const absl::Status& status) {
  SendJson(res, openai::HttpStatus(status), openai::ErrorJson(status));
}

std::string SseEvent(const json& data) {
  return absl::StrCat("data: ", data.dump(-1, ' ', false, json::error_handler_t::replace), "\n\n");
}

// The numeric host and the port of a socket address, as httplib writes Request::remote_addr.
bool HostAndPort(const sockaddr_storage& addr, socklen_t len, std::string* host, int* port) {
  char h[NI_MAXHOST], p[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, h, sizeof h, p, sizeof p,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return false;
  }
  *host = h;
  *port = std::atoi(p);
  return true;
}

// The socket of the connection `req` came on, or -1: its TLS session's, else the socket whose
// local and peer addresses are req's (httplib 0.11 gives handlers no socket). It is this
// connection's until the handler returns; httplib closes it after.
int ConnectionFd(const httplib::Request& req) {
  if (req.ssl != nullptr) return SSL_get_fd(req.ssl);
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (dirent* e = readdir(dir)) {
    const int fd = std::atoi(e->d_name);
    if (e->d_name[0] < '0' || e->d_name[0] > '9' || fd == dirfd(dir)) continue;
    sockaddr_storage local{}, peer{};
    socklen_t local_len = sizeof local, peer_len = sizeof peer;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
        getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
      continue;
    }
    std::string local_host, peer_host;
    int local_port = 0, peer_port = 0;
    if (HostAndPort(local, local_len, &local_host, &local_port) &&
        HostAndPort(peer, peer_len, &peer_host, &peer_port) && peer_port == req.remote_port &&
        peer_host == req.remote_addr && local_port == req.local_port) {
      found = fd;
      break;
    }
  }
  closedir(dir);
  return found;
}

// The client closed its side of the connection (it left: HTTP clients do not half-close while
// they wait for an answer), or the connection broke.
bool PeerClosed(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace

struct HttpFrontend::Impl {
  InferenceService* service;
  MetricsRegistry* metrics;
  ChatRenderer render_chat;
  HttpFrontendOptions options;
  const std::atomic<bool>* serving;
  std::unique_ptr<httplib::Server> server;  // an SSLServer with TLS
  std::thread thread;
  std::atomic<bool> stopping{false};

  void Routes();
  absl::Status CheckAuth(const httplib::Request& req) const;
  absl::Status CheckModel(const std::string& model) const;
  void Generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res);
  void Whole(const openai::ParsedRequest& request, std::shared_ptr<RequestState> state,
             const std::string& model, int connection_fd, httplib::Response& res);
  void Stream(const openai::ParsedRequest& request, std::shared_ptr<RequestState> state,
              const std::string& model, httplib::Response& res);
  openai::TokenText TokenTextFn() const {
    const Tokenizer* t = service->tokenizer();
    return [t](int32_t id) {
      return t != nullptr ? t->Decode({id}, /*skip_special_tokens=*/false) : std::string();
    };
  }
};

HttpFrontend::HttpFrontend(InferenceService* service, MetricsRegistry* metrics,
                           ChatRenderer render_chat, HttpFrontendOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->service = service;
  impl_->metrics = metrics;
  impl_->render_chat = std::move(render_chat);
  impl_->options = std::move(options);
  impl_->serving = &serving_;
  const HttpFrontendOptions& o = impl_->options;
  if (o.tls_cert.empty()) {
    impl_->server = std::make_unique<httplib::Server>();
  } else {
    impl_->server = std::make_unique<httplib::SSLServer>(
        o.tls_cert.c_str(), o.tls_key.c_str(),
        o.tls_client_ca.empty() ? nullptr : o.tls_client_ca.c_str());
  }
}

HttpFrontend::~HttpFrontend() { Stop(); }

absl::StatusOr<int> HttpFrontend::Start(const std::string& host, int port) {
  signal(SIGPIPE, SIG_IGN);  // a client that hung up makes send() fail, not kill the process
  Impl& m = *impl_;
  if (!m.server->is_valid()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HTTP: the TLS certificate ", m.options.tls_cert, " or key ", m.options.tls_key,
        m.options.tls_client_ca.empty() ? ""
                                        : absl::StrCat(" or client CA ", m.options.tls_client_ca),
        " could not be loaded"));
  }
  const int threads = std::max(1, m.options.threads);
  m.server->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  m.server->set_read_timeout(m.options.read_timeout_s, 0);
  m.server->set_write_timeout(m.options.write_timeout_s, 0);
  m.server->set_keep_alive_timeout(m.options.keep_alive_timeout_s);
  m.server->set_payload_max_length(m.options.max_body_bytes);
  // httplib's default also sets SO_REUSEPORT, which lets a second server bind the same port and
  // take part of the clients: only SO_REUSEADDR (a restart may rebind at once).
  m.server->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  m.Routes();
  int bound = port;
  if (port == 0) {
    bound = m.server->bind_to_any_port(host);
    if (bound <= 0) return absl::UnavailableError(absl::StrCat("HTTP: could not listen on ", host));
  } else if (!m.server->bind_to_port(host, port)) {
    return absl::UnavailableError(absl::StrCat("HTTP: could not listen on ", host, ":", port,
                                               " (is another process listening there?)"));
  }
  m.thread = std::thread([&m] { m.server->listen_after_bind(); });
  // Return once the accept loop runs: httplib's stop() does nothing before it does, so a Stop()
  // right after Start() would otherwise wait for a loop that never ends.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!m.server->is_running()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::InternalError("HTTP: the accept loop did not start within 10 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  TP_LOG(INFO) << "HTTP (OpenAI API, /metrics, /health) listening on " << host << ":" << bound;
  return bound;
}

void HttpFrontend::Stop() {
  if (!impl_ || !impl_->thread.joinable()) return;
  impl_->stopping.store(true);
  impl_->server->stop();
  impl_->thread.join();
}

void HttpFrontend::Impl::Routes() {
  server->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const bool ok = serving->load();
    SendJson(res, ok ? 200 : 503, {{"status", ok ? "SERVING" : "NOT_SERVING"}});
  });
  server->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics->Render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  // GET /v1/models, and /v1/models/{id} (the openai SDKs' models.retrieve) for the served model
  // or one of its aliases.
  auto models = [this](const httplib::Request& req, httplib::Response& res) {
    if (absl::Status auth = CheckAuth(req); !auth.ok()) return SendError(res, auth);
    if (service->scheduler() == nullptr) {
      return SendError(res, absl::UnavailableError("the server is starting: the workers are "
                                                   "loading the model"));
    }
    // The longest sequence it can serve: the context, or a smaller KV cache (--kv-cache-mb).
    int64_t max_len = service->static_info().context_length();
    if (const int64_t kv = service->limits().kv_capacity_tokens; kv > 0 && kv < max_len) {
      max_len = kv;
    }
    const std::string& model = service->static_info().model();
    if (req.matches.size() < 2) {
      return SendJson(res, 200, openai::ModelsJson(model, UnixSeconds(), max_len));
    }
    if (absl::Status m = CheckModel(req.matches[1]); !m.ok()) return SendError(res, m);
    SendJson(res, 200, openai::ModelJson(model, UnixSeconds(), max_len));
  };
  server->Get("/v1/models", models);
  server->Get(R"(/v1/models/(.+))", models);
  server->Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    Generate(Endpoint::kCompletions, req, res);
  });
  server->Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    Generate(Endpoint::kChat, req, res);
  });
  // Unrouted paths, methods and httplib's own errors (413, 400...) in OpenAI's error shape;
  // handlers' own error bodies are left alone.
  server->set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        const absl::Status status =
            res.status == 404
                ? absl::NotFoundError(absl::StrCat("no route for ", req.method, " ", req.path))
            : res.status == 413 ? absl::InvalidArgumentError("the request body is too large")
                                : absl::InvalidArgumentError(absl::StrCat(
                                      "the HTTP request could not be read (status ", res.status,
                                      "): a POST needs a JSON body with Content-Length or chunked "
                                      "transfer encoding"));
        const int code = res.status;
        SendJson(res, code, openai::ErrorJson(status));
        return httplib::Server::HandlerResponse::Handled;
      }));
  server->set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        SendError(res, absl::InternalError(absl::StrCat("internal error: ", what)));
      });
}

absl::Status HttpFrontend::Impl::CheckAuth(const httplib::Request& req) const {
  return options.api_keys.Check(req.get_header_value("Authorization"));
}

absl::Status HttpFrontend::Impl::CheckModel(const std::string& model) const {
  if (model == service->static_info().model()) return absl::OkStatus();
  for (const std::string& a : options.model_aliases) {
    if (model == a) return absl::OkStatus();
  }
  return openai::WithParam(absl::NotFoundError(absl::StrCat(
                               "the model `", model, "` does not exist; this server serves `",
                               service->static_info().model(), "`")),
                           "model");
}

void HttpFrontend::Impl::Generate(Endpoint endpoint, const httplib::Request& req,
                                  httplib::Response& res) {
  if (absl::Status auth = CheckAuth(req); !auth.ok()) return SendError(res, auth);
  absl::StatusOr<openai::ParsedRequest> parsed = openai::ParseRequest(endpoint, req.body);
  if (!parsed.ok()) return SendError(res, parsed.status());
  if (service->scheduler() == nullptr) {
    return SendError(
        res, absl::UnavailableError("the server is starting: the workers are loading the model"));
  }
  if (absl::Status m = CheckModel(parsed->model); !m.ok()) return SendError(res, m);
  const std::string model = service->static_info().model();

  if (endpoint == Endpoint::kChat) {
    if (!render_chat) {
      return SendError(
          res, openai::InvalidParam("messages",
                                    "this model has no chat template (tokenizer_config.json has no "
                                    "chat_template): use /v1/completions with a prompt"));
    }
    const Tokenizer* tokenizer = service->tokenizer();
    if (tokenizer == nullptr) {
      return SendError(res, openai::InvalidParam("messages",
                                                 "the model directory has no tokenizer.json: chat "
                                                 "needs one; use /v1/completions with token ids"));
    }
    absl::StatusOr<std::string> prompt =
        render_chat(parsed->messages, /*add_generation_prompt=*/true);
    if (!prompt.ok()) {
      return SendError(res,
                       openai::InvalidParam("messages", absl::StrCat("the chat template failed: ",
                                                                     prompt.status().message())));
    }
    if (static_cast<int64_t>(prompt->size()) > service->limits().max_prompt_text_bytes) {
      return SendError(
          res,
          openai::InvalidParam(
              "messages", absl::StrCat("the rendered chat is ", prompt->size(), " bytes; at most ",
                                       service->limits().max_prompt_text_bytes, " are accepted")));
    }
    // The template writes the BOS and the other special tokens itself. A long conversation is
    // tokenized on the intake pool, as a long gRPC prompt is.
    absl::StatusOr<std::vector<int32_t>> ids =
        service->EncodeText(*prompt, /*add_special_tokens=*/false);
    if (!ids.ok()) return SendError(res, ids.status());
    parsed->generate.mutable_token_ids()->mutable_ids()->Assign(ids->begin(), ids->end());
  }
  parsed->generate.set_request_id(RandomId(endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-"));

  absl::StatusOr<std::shared_ptr<RequestState>> state =
      service->Submit(parsed->generate, Clock::time_point::max());
  if (!state.ok()) return SendError(res, openai::ToApiNames(state.status(), endpoint));
  if (parsed->stream) {
    Stream(*parsed, *state, model, res);
  } else {
    Whole(*parsed, *state, model, ConnectionFd(req), res);
  }
}

void HttpFrontend::Impl::Whole(const openai::ParsedRequest& request,
                               std::shared_ptr<RequestState> state, const std::string& model,
                               int connection_fd, httplib::Response& res) {
  auto waiter = std::make_shared<Waiter>();
  state->SetListener(waiter);
  // A whole answer ends with its request (bounded by max_tokens); a server stop or a client that
  // left (checked every half second, also while the request waits in the queue) cancels it.
  while (!state->finished()) {
    if (stopping.load() || (connection_fd >= 0 && PeerClosed(connection_fd))) {
      state->Cancel();
      if (Scheduler* s = service->scheduler()) s->Wake();
    }
    waiter->Wait(std::chrono::milliseconds(500));
  }
  RequestState::Taken t = state->Take();
  if (!t.status.ok()) return SendError(res, t.status);
  openai::Answer a;
  a.id = state->params().request_id;
  a.created = UnixSeconds();
  a.model = model;
  a.info = t.info;
  state->Whole(&a.text, &a.ids, &a.logprobs);
  SendJson(res, 200, openai::ResponseJson(request, a, TokenTextFn()));
}

void HttpFrontend::Impl::Stream(const openai::ParsedRequest& request,
                                std::shared_ptr<RequestState> state, const std::string& model,
                                httplib::Response& res) {
  // State shared by the provider calls (httplib calls the provider until done or failure).
  struct StreamState {
    openai::ParsedRequest request;
    std::shared_ptr<RequestState> state;
    std::shared_ptr<Waiter> waiter = std::make_shared<Waiter>();
    std::string id, model;
    int64_t created = 0;
    bool first = true;  // chat's first chunk carries the role, sent at once
    int64_t text_offset = 0;
  };
  auto ss = std::make_shared<StreamState>();
  ss->request = request;
  ss->state = state;
  ss->id = state->params().request_id;
  ss->model = model;
  ss->created = UnixSeconds();
  state->SetListener(ss->waiter);
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  const openai::TokenText token_text = TokenTextFn();
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, ss, token_text](size_t, httplib::DataSink& sink) {
        auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
        auto idle_since = Clock::now();
        while (true) {
          if (stopping.load()) return false;  // releaser cancels
          RequestState::Taken t = ss->state->Take();
          if (t.finished && !t.status.ok()) {
            write(SseEvent(openai::ErrorJson(t.status)));
            write("data: [DONE]\n\n");
            sink.done();
            return true;
          }
          const bool role_chunk = ss->first && ss->request.endpoint == Endpoint::kChat;
          if (role_chunk || t.finished || !t.text.empty() || !t.ids.empty()) {
            openai::Chunk c;
            c.text = std::move(t.text);
            c.ids = std::move(t.ids);
            c.logprobs = std::move(t.logprobs);
            c.first = ss->first;
            c.last = t.finished;
            c.reason = t.info.reason;
            c.text_offset = ss->text_offset;
            ss->text_offset += static_cast<int64_t>(c.text.size());
            ss->first = false;
            if (!write(SseEvent(openai::ChunkJson(ss->request, ss->id, ss->created, ss->model, c,
                                                  token_text)))) {
              return false;
            }
            if (t.finished) {
              if (ss->request.include_usage) {
                write(SseEvent(
                    openai::UsageChunkJson(ss->request, ss->id, ss->created, ss->model, t.info)));
              }
              write("data: [DONE]\n\n");
              sink.done();
            }
            return true;
          }
          // Nothing new: probe the connection now and then (an SSE comment) so that a client
          // that left while its request waits in the queue is noticed.
          if (Clock::now() - idle_since > std::chrono::seconds(2)) {
            if (!write(": waiting\n\n")) return false;
            return true;
          }
          ss->waiter->Wait(std::chrono::milliseconds(200));
        }
      },
      [this, ss](bool success) {
        if (success && ss->state->finished()) return;
        ss->state->Cancel();  // the client left (or the server stops): free its blocks
        if (Scheduler* s = service->scheduler()) s->Wake();
      });
}

}  // namespace tpserve
