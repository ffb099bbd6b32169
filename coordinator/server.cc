// The coordinator process (see server.h): RunCoordinator wires named parts together (resolve
// the layout, start the servers, start the workers, warm up, activate, serve until a signal,
// drain, shut down); the waits in between are notifications, not polls.
#include "coordinator/server.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <thread>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cluster_secret.h"
#include "common/credential_files.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/model_files.h"
#include "common/status.h"
#include "coordinator/api_keys.h"
#include "coordinator/chat_template/chat_template.h"
#include "coordinator/http/http_server.h"
#include "coordinator/inference_service.h"
#include "coordinator/metrics.h"
#include "coordinator/parse_error_interceptor.h"
#include "coordinator/scheduler.h"
#include "coordinator/serving_metrics.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "coordinator/worker_group.h"
#include "parallel/shard_plan.h"

namespace tpserve {
namespace {

std::string SelfDir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : p.parent_path().string();
}

std::string FindWorkerBinary(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (EnvIsSet(env::kWorker)) return EnvString(env::kWorker);
  const std::string dir = SelfDir();
  for (const std::string& c : {dir + "/tpserve-worker", dir + "/../worker/tpserve-worker"}) {
    if (access(c.c_str(), X_OK) == 0) return c;
  }
  return "tpserve-worker";
}

int VisibleGpuCount() {
  std::error_code ec;
  int n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec);
       !ec && it != std::filesystem::directory_iterator(); ++it) {
    ++n;
  }
  if (EnvIsSet(env::kCudaVisibleDevices)) {
    const std::string s = EnvString(env::kCudaVisibleDevices);
    if (s.empty()) return 0;
    int listed = 1;
    for (char c : s) listed += c == ',';
    n = std::min(n, listed);
  }
  return n;
}

// Spawns the local workers: one process for one worker, mpirun for several. The cluster secret
// goes in their environment (mpirun -x forwards it), never on a command line that `ps` shows.
absl::StatusOr<pid_t> SpawnWorkers(const CoordinatorOptions& o, int world, const std::string& addr,
                                   const std::string& device, const std::string& secret) {
  const std::string worker = FindWorkerBinary(o.worker_binary);
  std::vector<std::string> args;
  if (world > 1) {
    args = {EnvString(env::kMpirun),
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            std::to_string(world),
            "-x",
            "OPENBLAS_NUM_THREADS",
            "-x",
            "TPSERVE_LOG_LEVEL",
            "-x",
            env::kClusterSecret.name,
            worker,
            "--coordinator",
            addr,
            "--device",
            device};
  } else {
    args = {worker, "--coordinator", addr, "--rank", "0", "--world-size", "1", "--device", device};
  }
  TP_LOG(INFO) << "spawning workers: " << absl::StrJoin(args, " ");
  // For the children (overwrite = 0 keeps what the user set, even a value we ignore).
  if (!EnvIsSet(env::kOpenblasNumThreads)) setenv(env::kOpenblasNumThreads.name, "1", 0);
  if (!EnvIsSet(env::kLogLevel)) setenv(env::kLogLevel.name, "info", 0);
  // The children's environment, built before fork (the child only calls exec).
  std::vector<std::string> env_strings = EnvironmentWith(env::kClusterSecret, secret);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed while spawning the workers");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlive the coordinator
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execvpe(argv[0], argv.data(), envp.data());
    std::fprintf(stderr, "tpserve: could not run %s\n", argv[0]);
    _exit(127);
  }
  return pid;
}

// The write end of the signal self-pipe: the handler only writes the signal number to it.
int g_signal_pipe = -1;
void OnSignal(int sig) {
  const unsigned char c = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t n = write(g_signal_pipe, &c, 1);
}

// What the coordinator's main thread waits for: SIGTERM / SIGINT (a thread reads them from a
// self-pipe), the exit of the spawned workers (a thread blocked in waitpid) and the failure of
// the worker group (its failure callback). While an abort action is set (startup, warm-up), the
// first of these events runs it so that the wait ends.
class ProcessEvents {
 public:
  // Runs on the first event while set: `signal` tells a signal from a child exit or a failure.
  using Abort = std::function<void(const std::string& reason, bool signal)>;

  ProcessEvents() {
    if (pipe2(pipe_, O_CLOEXEC) != 0) {
      TP_LOG(ERROR) << "pipe2 failed: SIGTERM / SIGINT will not drain";
      return;
    }
    g_signal_pipe = pipe_[1];
    struct sigaction sa = {};
    sa.sa_handler = OnSignal;
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGINT, &sa, &old_int_);
    signal_thread_ = std::thread([this] {
      while (true) {
        unsigned char c = 0;
        const ssize_t n = read(pipe_[0], &c, 1);
        if (n < 0 && errno == EINTR) continue;  // a signal landed on this thread
        if (n != 1 || c == 0) break;            // 0: the destructor stops the thread
        {
          absl::MutexLock lock(&mu_);
          if (signal_ == 0) signal_ = c;
        }
        RunAbortIfSet();
      }
    });
  }
  ~ProcessEvents() {
    StopChild(absl::Seconds(3), absl::Seconds(3));
    if (signal_thread_.joinable()) {
      sigaction(SIGTERM, &old_term_, nullptr);
      sigaction(SIGINT, &old_int_, nullptr);
      const unsigned char stop = 0;
      [[maybe_unused]] const ssize_t n = write(pipe_[1], &stop, 1);
      signal_thread_.join();
      g_signal_pipe = -1;
      close(pipe_[0]);
      close(pipe_[1]);
    }
  }
  ProcessEvents(const ProcessEvents&) = delete;
  ProcessEvents& operator=(const ProcessEvents&) = delete;

  // Watches a spawned child process until it exits (one at a time: StopChild the last first).
  void WatchChild(pid_t pid) {
    {
      absl::MutexLock lock(&mu_);
      child_ = pid;
      child_exited_ = false;
      child_status_ = 0;
    }
    child_thread_ = std::thread([this, pid] {
      int status = 0;
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      {
        absl::MutexLock lock(&mu_);
        child_exited_ = true;
        child_status_ = status;
      }
      RunAbortIfSet();
    });
  }
  pid_t child() {
    absl::MutexLock lock(&mu_);
    return child_;
  }

  // The worker group failed (from its failure callback); ClearGroupFailure once handled.
  void NotifyGroupFailure() {
    {
      absl::MutexLock lock(&mu_);
      group_failed_ = true;
    }
    RunAbortIfSet();
  }
  void ClearGroupFailure() {
    absl::MutexLock lock(&mu_);
    group_failed_ = false;
  }

  // Runs `abort` on the first event from now on (at once if one is pending); nullptr clears it.
  void SetAbort(Abort abort) {
    {
      absl::MutexLock lock(&mu_);
      abort_ = std::move(abort);
    }
    RunAbortIfSet();
  }

  // Blocks until SIGTERM or SIGINT (returns the signal) or a group failure (returns 0).
  int WaitForSignalOrGroupFailure() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &ProcessEvents::SignalOrFailureLocked));
    return signal_;
  }

  // Waits `d` unless a signal comes first; false then.
  bool SleepUnlessSignal(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    return !mu_.AwaitWithTimeout(absl::Condition(
                                     +[](int* signal) { return *signal != 0; }, &signal_),
                                 d);
  }

  // After the workers were told to shut down (or killed): waits up to `exit_wait` for the
  // spawned child to exit, then SIGTERM and up to `term_wait`, then SIGKILL.
  void StopChild(absl::Duration exit_wait, absl::Duration term_wait) {
    pid_t pid = -1;
    {
      absl::MutexLock lock(&mu_);
      pid = child_;
    }
    if (pid <= 0) return;
    auto exited = [this](absl::Duration timeout) {
      absl::MutexLock lock(&mu_);
      return mu_.AwaitWithTimeout(absl::Condition(&child_exited_), timeout);
    };
    if (!exited(exit_wait)) {
      kill(pid, SIGTERM);
      if (!exited(term_wait)) {
        TP_LOG(WARNING) << "the spawned workers (pid " << pid << ") ignored SIGTERM; killing them";
        kill(pid, SIGKILL);
      }
    }
    child_thread_.join();
    absl::MutexLock lock(&mu_);
    child_ = -1;
    child_exited_ = false;
  }

 private:
  bool SignalOrFailureLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return signal_ != 0 || group_failed_;
  }

  // The pending event's description, empty when none.
  std::string PendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (signal_ != 0) return absl::StrCat("signal ", signal_);
    if (child_ > 0 && child_exited_) {
      return absl::StrCat("the spawned workers exited (status ", child_status_, ")");
    }
    if (group_failed_) return "the worker group failed";
    return "";
  }

  void RunAbortIfSet() {
    Abort abort;
    std::string reason;
    bool signal = false;
    {
      absl::MutexLock lock(&mu_);
      if (abort_ == nullptr) return;
      reason = PendingLocked();
      if (reason.empty()) return;
      signal = signal_ != 0;
      abort.swap(abort_);  // once
    }
    abort(reason, signal);
  }

  absl::Mutex mu_;
  int signal_ ABSL_GUARDED_BY(mu_) = 0;
  pid_t child_ ABSL_GUARDED_BY(mu_) = -1;
  bool child_exited_ ABSL_GUARDED_BY(mu_) = false;
  int child_status_ ABSL_GUARDED_BY(mu_) = 0;
  bool group_failed_ ABSL_GUARDED_BY(mu_) = false;
  Abort abort_ ABSL_GUARDED_BY(mu_);
  int pipe_[2] = {-1, -1};
  struct sigaction old_term_ = {}, old_int_ = {};
  std::thread signal_thread_;
  std::thread child_thread_;
};

// The model and the layout it is served with.
struct Layout {
  CoordinatorOptions options;  // world_size resolved
  ModelConfig config;
  std::vector<int32_t> eos;
  std::unique_ptr<Tokenizer> tokenizer;  // null: token-id prompts only
  std::string spawn_device;
  std::string cluster_secret;      // what the workers prove when registering
  int64_t max_token_bytes = 16;    // the longest token's text (at least 16)
  ChatRenderer chat_renderer;      // empty: the model has no chat template (chat answers 400)
  ChatPromptRenderer chat_prompt;  // the same template for gRPC's messages prompts
};

absl::StatusOr<Layout> ResolveLayout(const CoordinatorOptions& opts) {
  Layout l;
  l.options = opts;
  CoordinatorOptions& o = l.options;
  TP_ASSIGN_OR_RETURN(ModelFiles files, ModelFiles::Open(o.model_dir));
  l.config = files.config();
  l.eos = files.generation_config().eos_token_ids;
  if (l.eos.empty()) l.eos = l.config.eos_token_ids;
  if (std::filesystem::exists(std::filesystem::path(o.model_dir) / "tokenizer.json")) {
    TP_ASSIGN_OR_RETURN(l.tokenizer, Tokenizer::Load(o.model_dir));
    for (int32_t id = 0; id < l.tokenizer->vocab_size(); ++id) {
      l.max_token_bytes = std::max<int64_t>(
          l.max_token_bytes, l.tokenizer->Decode({id}, /*skip_special_tokens=*/false).size());
    }
  } else {
    TP_LOG(WARNING) << o.model_dir << " has no tokenizer.json: only token-id prompts are served";
  }
  // The model's chat template, checked now: a construct the interpreter cannot render stops the
  // start with a message naming it, rather than giving wrong prompts later.
  absl::StatusOr<std::unique_ptr<ChatTemplate>> chat = ChatTemplate::Load(o.model_dir);
  if (chat.ok()) {
    std::shared_ptr<const ChatTemplate> t = std::move(*chat);
    l.chat_prompt = [t](const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
      return t->Render(messages, add_generation_prompt);
    };
    l.chat_renderer = [t](const std::vector<openai::HttpChatMessage>& messages,
                          bool add_generation_prompt) {
      std::vector<ChatMessage> m;
      m.reserve(messages.size());
      for (const openai::HttpChatMessage& x : messages) m.push_back({x.role, x.content});
      return t->Render(m, add_generation_prompt);
    };
  } else if (absl::IsNotFound(chat.status())) {
    TP_LOG(WARNING) << o.model_dir << " has no chat template: chat completions answer 400";
  } else {
    return Annotate(chat.status(), "loading the chat template");
  }
  l.spawn_device = o.device;
  // The control plane: loopback when the workers are spawned here; its secret from the file,
  // else made for this launch (only workers this process spawns can know it).
  if (o.control_host.empty()) o.control_host = o.spawn_workers ? "127.0.0.1" : o.host;
  if (o.control_port < 0) o.control_port = o.spawn_workers ? 0 : 50052;
  if (!o.cluster_secret_file.empty()) {
    TP_ASSIGN_OR_RETURN(l.cluster_secret, ReadClusterSecretFile(o.cluster_secret_file));
  } else if (o.spawn_workers) {
    l.cluster_secret = NewClusterSecret();
  } else {
    return absl::InvalidArgumentError(
        "--cluster-secret-file is required when the workers are launched apart (mpirun, Slurm, "
        "Kubernetes): give the coordinator and every tpserve-worker the same file, e.g. made by "
        "`head -c 32 /dev/urandom | base64 > secret && chmod 600 secret`");
  }
  if (o.world_size == 0) {
    if (o.spawn_workers) {
      const int gpus = (o.device == "cpu") ? 0 : VisibleGpuCount();
      if (gpus > 0) {
        o.world_size = gpus;
      } else {
        const auto valid = ValidTpValues(l.config);
        o.world_size = std::find(valid.begin(), valid.end(), 2) != valid.end() ? 2 : 1;
      }
    } else {
      o.world_size = 1;
    }
  }
  if (o.spawn_workers && l.spawn_device == "auto" && VisibleGpuCount() == 0) {
    l.spawn_device = "cpu";
  }
  // Refuse a layout the planner cannot split before waiting for any worker.
  PlanOptions check;
  check.tp = o.tp > 0 ? o.tp : o.world_size;
  check.pp = o.tp > 0 ? o.pp : 1;
  check.device_map = o.device_map;
  if (check.tp * check.pp != o.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--tp ", check.tp, " x --pp ", check.pp,
                                                   " does not match --workers ", o.world_size));
  }
  TP_RETURN_IF_ERROR(PlanShards(l.config, check).status());
  return l;
}

WorkerGroupOptions GroupOptions(const Layout& layout) {
  const CoordinatorOptions& o = layout.options;
  WorkerGroupOptions g;
  g.cluster_secret = layout.cluster_secret;
  g.model_dir = std::filesystem::absolute(o.model_dir).string();
  g.world_size = o.world_size;
  g.tp = o.tp;
  g.pp = o.pp;
  g.device_map = o.device_map;
  g.kv_cache_bytes = o.kv_cache_mb << 20;
  g.gpu_memory_utilization = o.gpu_memory_utilization;
  g.deterministic = o.deterministic;
  g.all_reduce = o.all_reduce;
  g.kv_cache_dtype = o.kv_cache_dtype;
  g.block_size = o.block_size;
  g.max_num_batched_tokens = o.max_num_batched_tokens;
  g.max_num_seqs = o.max_num_seqs;
  g.heartbeat_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(o.heartbeat_timeout_s * 1000));
  g.step_timeout = std::chrono::seconds(o.step_timeout_s);
  return g;
}

// The listening servers and their health state.
class Servers {
 public:
  // The public gRPC server (API, health, reflection), the workers' control plane on a server and
  // port of its own (--control-host / --control-port) and, unless --http-port is 0, the
  // OpenAI-compatible HTTP front end (/v1, /health, /metrics).
  static absl::StatusOr<std::unique_ptr<Servers>> Start(
      const CoordinatorOptions& o, WorkerGroup* group, InferenceService* service,
      MetricsRegistry* metrics, ChatRenderer render_chat, const ApiKeys& api_keys) {
    auto s = std::unique_ptr<Servers>(new Servers());
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    const std::string listen = absl::StrCat(o.host, ":", o.port);
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
    if (!o.tls_cert.empty()) {
      grpc::SslServerCredentialsOptions ssl(
          o.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                  : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
      grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
      TP_ASSIGN_OR_RETURN(pair.private_key, ReadPemFile(o.tls_key));
      TP_ASSIGN_OR_RETURN(pair.cert_chain, ReadPemFile(o.tls_cert));
      ssl.pem_key_cert_pairs.push_back(pair);
      if (!o.tls_client_ca.empty()) {
        TP_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPemFile(o.tls_client_ca));
      }
      credentials = grpc::SslServerCredentials(ssl);
    }
    builder.AddListeningPort(listen, credentials, &s->port_);
    // A port another process listens on is an error, not shared (gRPC's SO_REUSEPORT default
    // would let a second server take part of the clients).
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.SetMaxReceiveMessageSize(static_cast<int>(o.max_request_bytes));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
    builder.RegisterService(service);
    // Unparsable request bytes: INVALID_ARGUMENT naming the message, not an empty UNIMPLEMENTED.
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors;
    interceptors.push_back(MakeParseErrorInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    s->grpc_ = builder.BuildAndStart();
    if (s->grpc_ == nullptr || s->port_ == 0) {
      return absl::UnavailableError(
          absl::StrCat("could not listen on ", listen, " (is another process listening there?)"));
    }
    // The control plane: streams without the secret end at once (WorkerGroup::Control); a
    // connection that never finishes its handshake or holds no stream is closed; threads are
    // bounded.
    grpc::ServerBuilder control;
    const std::string control_listen = absl::StrCat(o.control_host, ":", o.control_port);
    control.AddListeningPort(control_listen, grpc::InsecureServerCredentials(), &s->control_port_);
    control.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    control.SetMaxReceiveMessageSize(64 << 20);
    control.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    control.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
    control.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, 5000);
    control.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 10000);
    control.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 4);
    grpc::ResourceQuota quota("tpserve-control");
    quota.SetMaxThreads(2 * o.world_size + 64);
    control.SetResourceQuota(quota);
    control.RegisterService(group);
    s->control_ = control.BuildAndStart();
    if (s->control_ == nullptr || s->control_port_ == 0) {
      s->grpc_->Shutdown(std::chrono::system_clock::now());
      return absl::UnavailableError(
          absl::StrCat("could not listen on ", control_listen,
                       " (the control plane; is another process listening there?)"));
    }
    if (o.http_port > 0) {
      HttpFrontendOptions ho;
      // A thread per request in flight: the scheduler's queue, not the pool, answers 429.
      ho.threads = std::min(1024, o.max_num_seqs + o.max_queued_requests + 16);
      ho.model_aliases = {o.model_dir, std::filesystem::absolute(o.model_dir).string()};
      ho.api_keys = api_keys;
      ho.max_body_bytes = static_cast<size_t>(o.max_request_bytes);
      ho.tls_cert = o.tls_cert;
      ho.tls_key = o.tls_key;
      ho.tls_client_ca = o.tls_client_ca;
      s->http_ = std::make_unique<HttpFrontend>(service, metrics, std::move(render_chat), ho);
      absl::StatusOr<int> http_port = s->http_->Start(o.host, o.http_port);
      if (!http_port.ok()) {
        s->grpc_->Shutdown(std::chrono::system_clock::now());
        return http_port.status();
      }
      s->http_port_ = *http_port;
    }
    s->SetHealth(false);
    return s;
  }

  int port() const { return port_; }
  int control_port() const { return control_port_; }
  int http_port() const { return http_port_; }  // 0: no HTTP front end
  void SetHealth(bool serving) {
    if (http_ != nullptr) http_->SetServing(serving);
    grpc::HealthCheckServiceInterface* health = grpc_->GetHealthCheckService();
    health->SetServingStatus(serving);
    health->SetServingStatus("tpserve.v1.Inference", serving);
  }
  void Shutdown() {
    if (http_ != nullptr) http_->Stop();
    grpc_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    control_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }

 private:
  Servers() = default;
  std::unique_ptr<grpc::Server> grpc_;
  std::unique_ptr<grpc::Server> control_;
  std::unique_ptr<HttpFrontend> http_;
  int port_ = 0;
  int control_port_ = 0;
  int http_port_ = 0;
};

// Spawns the local workers (when asked) and waits until every worker registered and loaded
// its shard; a signal (the group shuts down), the spawned workers exiting or the group failing
// (it is aborted) end the wait.
absl::Status StartWorkers(const Layout& layout, const Servers& servers, WorkerGroup* group,
                          ProcessEvents* events) {
  const CoordinatorOptions& o = layout.options;
  if (o.spawn_workers) {
    const bool any =
        o.control_host == "0.0.0.0" || o.control_host == "::" || o.control_host == "[::]";
    const std::string addr =
        absl::StrCat(any ? std::string("127.0.0.1") : o.control_host, ":", servers.control_port());
    TP_ASSIGN_OR_RETURN(const pid_t child, SpawnWorkers(o, o.world_size, addr, layout.spawn_device,
                                                        layout.cluster_secret));
    events->WatchChild(child);
  }
  events->SetAbort([group](const std::string& reason, bool signal) {
    TP_LOG(ERROR) << "worker start aborted: " << reason;
    if (signal) {
      group->Shutdown(absl::StrCat(reason, " during startup"));
    } else {
      group->Abort(absl::StrCat(reason, " while the workers were starting"));
    }
  });
  absl::Status st = group->Start(std::chrono::seconds(o.register_timeout_s),
                                 std::chrono::seconds(o.load_timeout_s));
  events->SetAbort(nullptr);
  return Annotate(st, "starting the workers");
}

// The scheduler over the worker group. A group failure turns health NOT_SERVING at once; when
// the group can be replaced (`recoverable`), the scheduler keeps the requests without output for
// the next group, else it fails everything.
std::unique_ptr<Scheduler> StartScheduler(const Layout& layout, WorkerGroup* group,
                                          Servers* servers, ServingMetrics* metrics,
                                          ProcessEvents* events, bool recoverable) {
  const CoordinatorOptions& o = layout.options;
  SchedulerOptions so;
  so.max_num_seqs = o.max_num_seqs;
  so.max_num_batched_tokens = o.max_num_batched_tokens;
  so.max_queued_requests = o.max_queued_requests;
  so.num_blocks = group->num_blocks();
  so.block_size = o.block_size;
  so.context_length = layout.config.max_position_embeddings;
  so.eos_token_ids = layout.eos;
  so.enable_prefix_caching = o.enable_prefix_caching;
  so.overlap = o.overlap_scheduling;
  so.overlap_lead_seconds = o.overlap_lead_ms / 1000;
  so.on_request_finished = [metrics](const absl::Status& status, const FinalInfo& info) {
    metrics->OnRequestFinished(status, info);
  };
  so.on_step = [metrics](double seconds) { metrics->OnStep(seconds); };
  auto scheduler = std::make_unique<Scheduler>(so, layout.tokenizer.get(), group);
  scheduler->Start();
  Scheduler* sched = scheduler.get();
  group->SetFailureCallback(
      [servers, sched, metrics, events, recoverable](const absl::Status& status) {
        servers->SetHealth(false);
        if (recoverable) {
          sched->Suspend(status);
        } else {
          sched->Fail(status);
        }
        metrics->OnWorkerGroupFailure();
        events->NotifyGroupFailure();
      });
  return scheduler;
}

// One short request through the whole path before reporting SERVING; it waits on the request's
// completion (a signal fails it at once; a child exit or a group failure cancels it).
absl::Status WarmUp(const Layout& layout, WorkerGroup* group, Scheduler* scheduler,
                    ProcessEvents* events) {
  RequestParams w;
  w.request_id = "warm-up";
  for (int i = 0; i < 8; ++i) {
    w.prompt.push_back(static_cast<int32_t>((i + 1) % layout.config.vocab_size));
  }
  w.max_new_tokens = 2;
  w.ignore_eos = true;
  auto state = std::make_shared<RequestState>(w);
  const auto t0 = std::chrono::steady_clock::now();
  TP_RETURN_IF_ERROR(Annotate(scheduler->Submit(state), "warm-up"));
  events->SetAbort([scheduler, state](const std::string& reason, bool signal) {
    if (signal) {
      scheduler->Fail(absl::UnavailableError(absl::StrCat(reason, " during the warm-up")));
    } else {
      state->Cancel();  // a suspended scheduler keeps it otherwise
      scheduler->Wake();
    }
  });
  const bool finished =
      state->WaitFinished(t0 + std::chrono::seconds(layout.options.load_timeout_s));
  events->SetAbort(nullptr);
  absl::Status warm =
      finished ? state->Take().status : absl::DeadlineExceededError("warm-up timed out");
  if (!group->failure().ok()) warm = group->failure();
  TP_RETURN_IF_ERROR(Annotate(warm, "warm-up"));
  TP_LOG(INFO) << "warm-up done in "
               << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
               << " s";
  return absl::OkStatus();
}

// Opens the public API: model info and limits, health SERVING, the ready file.
void Activate(const Layout& layout, WorkerGroup* group, Scheduler* scheduler,
              InferenceService* service, Servers* servers, ServingMetrics* metrics) {
  const CoordinatorOptions& o = layout.options;
  const ModelConfig& config = layout.config;
  ServiceLimits limits;
  limits.context_length = config.max_position_embeddings;
  limits.vocab_size = config.vocab_size;
  limits.kv_capacity_tokens = static_cast<int64_t>(group->num_blocks()) * o.block_size;
  limits.default_max_new_tokens = o.default_max_new_tokens;
  limits.max_prompt_tokens = o.max_prompt_tokens > 0
                                 ? std::min<int64_t>(o.max_prompt_tokens, limits.context_length)
                                 : limits.context_length;
  // No token decodes to more than max_token_bytes, so a text longer than max_prompt_tokens
  // times that (x 4 for normalizers that shrink text) has too many tokens: refused unread.
  const int64_t text_bound = limits.max_prompt_tokens * 4 * layout.max_token_bytes;
  limits.max_prompt_text_bytes =
      static_cast<int>(std::min<int64_t>({text_bound, o.max_request_bytes, 1 << 30}));
  v1::ModelInfo info;
  info.set_model(std::filesystem::path(std::filesystem::absolute(o.model_dir)).filename().string());
  info.set_architecture(config.architecture);
  info.set_context_length(config.max_position_embeddings);
  info.set_vocab_size(config.vocab_size);
  info.set_tp(group->plan().tp);
  info.set_pp(group->plan().pp);
  info.set_device_map(group->plan().DeviceMapString());
  for (const std::string& d : group->rank_devices()) info.add_rank_devices(d);
  info.set_kv_capacity_tokens(limits.kv_capacity_tokens);
  info.set_has_tokenizer(layout.tokenizer != nullptr);
  info.set_max_num_seqs(o.max_num_seqs);
  info.set_max_num_batched_tokens(o.max_num_batched_tokens);
  info.set_deterministic(o.deterministic);
  const std::vector<worker::KvReport> reports = group->kv_reports();
  if (!reports.empty()) info.set_kv_cache_dtype(reports[0].kv_cache_dtype());
  service->Activate(scheduler, limits, info);
  metrics->SetScheduler(scheduler);
  metrics->SetKvCache(info.kv_cache_dtype(), limits.kv_capacity_tokens);
  for (size_t r = 0; r < reports.size(); ++r) {
    metrics->SetWorkerMemory(static_cast<int>(r), reports[r].device_memory_used_bytes(),
                             reports[r].device_memory_total_bytes());
  }
  if (group->failure().ok()) servers->SetHealth(true);
  if (!o.ready_file.empty()) {
    const std::string tmp = o.ready_file + ".tmp";
    std::ofstream(tmp) << o.host << ":" << servers->port() << "\n";
    std::filesystem::rename(tmp, o.ready_file);
  }
  TP_LOG(INFO) << "SERVING on port " << servers->port()
               << (servers->http_port() > 0 ? absl::StrCat(" (HTTP ", servers->http_port(), ")")
                                            : std::string())
               << ": KV cache " << group->num_blocks() << " blocks x " << o.block_size
               << " tokens in " << info.kv_cache_dtype();
}

// After a signal: refuse new requests and let the running ones finish, up to --drain-timeout.
void Drain(const CoordinatorOptions& o, int signal, Scheduler* scheduler, Servers* servers) {
  TP_LOG(INFO) << "signal " << signal << ": draining (up to " << o.drain_timeout_s
               << " s), accepting nothing new";
  servers->SetHealth(false);
  scheduler->StopAccepting(absl::UnavailableError("the server is draining (shutting down)"));
  if (!scheduler->WaitIdle(std::chrono::steady_clock::now() +
                           std::chrono::seconds(o.drain_timeout_s))) {
    TP_LOG(WARNING) << "drain timed out: the requests still running end UNAVAILABLE";
  }
}

// True when /proc/PID/environ holds `entry` ("NAME=value"): the process was started with it.
bool HasEnvironmentEntry(int64_t pid, const std::string& entry) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/environ"), std::ios::binary);
  std::string e;
  while (std::getline(in, e, '\0')) {
    if (e == entry) return true;
  }
  return false;
}

// The spawned group failed: its workers are killed (a silent one may be stopped, and the others
// are of no use without it), then their launcher is reaped. Only processes that carry this
// launch's cluster secret in their environment are killed, whatever pid a worker reported.
void StopSpawnedWorkers(const Layout& layout, WorkerGroup* group, ProcessEvents* events) {
  const std::string entry = absl::StrCat(env::kClusterSecret.name, "=", layout.cluster_secret);
  for (int64_t pid : group->worker_pids()) {
    if (pid > 1 && pid != getpid() && HasEnvironmentEntry(pid, entry)) {
      kill(static_cast<pid_t>(pid), SIGKILL);
    }
  }
  events->StopChild(absl::Seconds(3), absl::Seconds(2));
}

// Failures and restarts of the worker group, for GetModelInfo and the restart budget
// (--max-restarts within kRestartWindow).
class RestartRecord {
 public:
  static constexpr absl::Duration kRestartWindow = absl::Minutes(10);
  RestartRecord(int max_restarts, InferenceService* service) : service_(service) {
    status_.set_serving(false);
    status_.set_max_restarts(max_restarts);
  }
  void Serving() {
    status_.set_serving(true);
    service_->SetWorkerGroupStatus(status_);
  }
  void Failed(int rank, const absl::Status& failure) {
    status_.set_serving(false);
    status_.set_failures(status_.failures() + 1);
    status_.clear_failed_ranks();
    if (rank >= 0) status_.add_failed_ranks(rank);
    status_.set_last_failure(std::string(failure.message()));
    service_->SetWorkerGroupStatus(status_);
  }
  // Counts a restart when the budget allows one; false when it is spent.
  bool TakeRestart() {
    const absl::Time now = absl::Now();
    while (!times_.empty() && now - times_.front() > kRestartWindow) times_.pop_front();
    if (static_cast<int>(times_.size()) >= status_.max_restarts()) return false;
    times_.push_back(now);
    status_.set_restarts(status_.restarts() + 1);
    service_->SetWorkerGroupStatus(status_);
    return true;
  }
  int restarts() const { return status_.restarts(); }

 private:
  InferenceService* service_;
  v1::WorkerGroupStatus status_;
  std::deque<absl::Time> times_;  // of the restarts within the window
};

// The serving part of the coordinator: the parts Serve and Recover work on.
struct Parts {
  const Layout* layout;
  WorkerGroup* group;
  Scheduler* scheduler;
  Servers* servers;
  ServingMetrics* metrics;
  ProcessEvents* events;
  RestartRecord* record;
};

// Replaces a failed group: spawned workers are killed and spawned again after a backoff (1 s,
// doubling per attempt that does not reach SERVING, at most 30 s); with --rejoin, workers
// launched apart register again (one wait of --register-timeout). True once a new group passed its
// warm-up (health SERVING), false after a signal (nothing can be drained then); the reason when the
// group cannot be replaced.
absl::StatusOr<bool> Recover(const Parts& p) {
  const CoordinatorOptions& o = p.layout->options;
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status failure = p.group->failure();
  p.record->Failed(p.group->failed_rank(), failure);
  if (!o.spawn_workers && !o.rejoin) {
    return absl::UnavailableError(absl::StrCat(
        failure.message(),
        "; the workers were launched apart (mpirun, Slurm, Kubernetes): the coordinator exits so "
        "that the launcher restarts the job (--rejoin lets workers register again instead)"));
  }
  for (int attempt = 0;; ++attempt) {
    if (!p.record->TakeRestart()) {
      return absl::UnavailableError(absl::StrCat(
          o.max_restarts == 0 ? "the worker group failed and restarts are off (--max-restarts 0)"
                              : absl::StrCat("the worker group failed and its restarts are spent "
                                             "(--max-restarts ",
                                             o.max_restarts, " within 10 minutes)"),
          "; the last failure: ", failure.message()));
    }
    p.metrics->OnWorkerGroupRestart();
    const absl::Duration backoff =
        o.spawn_workers
            ? std::min(absl::Seconds(1) * (1 << std::min(attempt, 5)), absl::Seconds(30))
            : absl::ZeroDuration();
    TP_LOG(WARNING) << "restarting the worker group (restart " << p.record->restarts()
                    << ", attempt " << attempt + 1 << ") in " << absl::FormatDuration(backoff)
                    << " after: " << failure.message();
    // The backoff runs from the failure, the old workers' teardown included.
    const absl::Time restart_at = absl::Now() + backoff;
    if (o.spawn_workers) StopSpawnedWorkers(*p.layout, p.group, p.events);
    if (!p.events->SleepUnlessSignal(std::max(absl::ZeroDuration(), restart_at - absl::Now()))) {
      return false;
    }
    TP_RETURN_IF_ERROR(
        Annotate(p.group->Reset(std::chrono::seconds(5)), "replacing the failed worker group"));
    p.events->ClearGroupFailure();
    if (!o.spawn_workers) {
      TP_LOG(INFO) << "--rejoin: waiting up to " << o.register_timeout_s
                   << " s for every rank to register again";
    }
    absl::Status st = StartWorkers(*p.layout, *p.servers, p.group, p.events);
    if (st.ok()) {
      p.scheduler->Resume(p.group->num_blocks());
      st = WarmUp(*p.layout, p.group, p.scheduler, p.events);
    }
    if (st.ok() && p.group->failure().ok()) {
      p.servers->SetHealth(true);
      p.record->Serving();
      TP_LOG(INFO) << "SERVING again "
                   << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
                   << " s after the failure (restart " << p.record->restarts() << ")";
      return true;
    }
    if (!p.events->SleepUnlessSignal(absl::ZeroDuration())) return false;
    const bool group_failed = !p.group->failure().ok();
    failure = group_failed ? p.group->failure() : st;
    if (!o.spawn_workers) {
      // --rejoin waits once, with its deadline; then the launcher restarts the job.
      return Annotate(failure, "the workers did not rejoin");
    }
    if (!group_failed) p.metrics->OnWorkerGroupFailure();  // else its callback counted it
    p.record->Failed(p.group->failed_rank(), failure);
    p.scheduler->Suspend(failure);  // a start that failed before the group did keeps it too
    TP_LOG(ERROR) << "the new worker group did not come up: " << failure.message();
  }
}

// Serves until a signal (then drains; OK) or a group failure that cannot be recovered (its
// status).
absl::Status Serve(const Parts& p) {
  p.record->Serving();
  while (true) {
    const int signal = p.events->WaitForSignalOrGroupFailure();
    if (signal != 0) {
      // A failed group runs nothing: there is nothing to drain then.
      if (p.group->failure().ok()) Drain(p.layout->options, signal, p.scheduler, p.servers);
      return absl::OkStatus();
    }
    TP_ASSIGN_OR_RETURN(const bool serving, Recover(p));
    if (!serving) {
      TP_LOG(INFO) << "a signal came while the worker group was replaced: shutting down";
      return absl::OkStatus();
    }
  }
}

}  // namespace

absl::Status RunCoordinator(const CoordinatorOptions& options) {
  SetLogPrefix("coordinator");
  TP_ASSIGN_OR_RETURN(Layout layout, ResolveLayout(options));
  auto group = std::make_unique<WorkerGroup>(GroupOptions(layout), layout.config);
  InferenceService service(layout.tokenizer.get(), layout.chat_prompt);
  TP_ASSIGN_OR_RETURN(ApiKeys api_keys,
                      ApiKeys::Load(layout.options.api_key_file, layout.options.api_key));
  service.SetApiKeys(api_keys);
  const std::string& host = layout.options.host;
  if (!api_keys.enabled() && !IsLoopbackHost(host)) {
    TP_LOG(WARNING) << "the public API listens on " << host
                    << " without an API key: anyone who can reach it can use it (give "
                       "--api-key-file, or --host 127.0.0.1)";
  }
  MetricsRegistry metrics;
  ServingMetrics serving_metrics(&metrics);
  TP_ASSIGN_OR_RETURN(std::unique_ptr<Servers> servers,
                      Servers::Start(layout.options, group.get(), &service, &metrics,
                                     layout.chat_renderer, api_keys));
  TP_LOG(INFO) << "listening on " << layout.options.host << ":" << servers->port() << " ("
               << layout.options.model_dir << ", " << layout.config.architecture << ", "
               << layout.options.world_size << " worker"
               << (layout.options.world_size > 1 ? "s" : "") << "); control plane on "
               << layout.options.control_host << ":" << servers->control_port();
  ProcessEvents events;
  std::unique_ptr<Scheduler> scheduler;
  // A failure during startup ends the coordinator; after it, a spawned group (or one that may
  // rejoin) is replaced.
  const bool recoverable = layout.options.spawn_workers || layout.options.rejoin;
  absl::Status status = StartWorkers(layout, *servers, group.get(), &events);
  if (status.ok()) {
    scheduler =
        StartScheduler(layout, group.get(), servers.get(), &serving_metrics, &events, recoverable);
    status = group->failure();
  }
  if (status.ok()) status = WarmUp(layout, group.get(), scheduler.get(), &events);
  if (status.ok()) {
    Activate(layout, group.get(), scheduler.get(), &service, servers.get(), &serving_metrics);
    RestartRecord record(layout.options.max_restarts, &service);
    status = Serve(Parts{&layout, group.get(), scheduler.get(), servers.get(), &serving_metrics,
                         &events, &record});
  }
  // Shut down (after a drain, a failed start or a group that cannot be replaced): end what is
  // left, stop the workers and the servers, then the spawned processes.
  if (scheduler != nullptr) {
    scheduler->Fail(
        status.ok() ? absl::UnavailableError("the server shut down before this request finished")
                    : status);
  }
  group->Shutdown(status.ok() ? "the coordinator is shutting down" : "the coordinator is exiting");
  servers->Shutdown();
  service.Shutdown();  // long prompts still waiting to be tokenized: UNAVAILABLE
  scheduler.reset();
  if (!status.ok() && layout.options.spawn_workers) {
    StopSpawnedWorkers(layout, group.get(), &events);
  } else {
    events.StopChild(absl::Seconds(3), absl::Seconds(3));
  }
  if (status.ok()) {
    TP_LOG(INFO) << "shut down";
  }
  return status;
}

}  // namespace tpserve
