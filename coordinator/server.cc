// The coordinator process (see server.h).
#include "coordinator/server.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/model_files.h"
#include "common/status.h"
#include "coordinator/inference_service.h"
#include "coordinator/scheduler.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "coordinator/worker_group.h"
#include "parallel/shard_plan.h"
#include "tools/cli_args.h"

namespace tpserve {

const char kCoordinatorUsage[] =
    "usage: tpserve-coordinator --model DIR [--port P] [--host H] [--workers N | --tp T --pp P]\n"
    "         [--device-map MAP] [--spawn-workers [--device cpu|cuda|auto] [--worker-binary B]]\n"
    "         [--gpu-memory-utilization F] [--kv-cache-mb MB] [--max-num-seqs N]\n"
    "         [--max-num-batched-tokens N] [--max-queued-requests N] [--register-timeout S]\n"
    "         [--drain-timeout S] [--heartbeat-timeout S] [--ready-file PATH]\n"
    "         [--no-overlap-scheduling]\n"
    "       tpserve serve --model DIR [--workers N | --tp T --pp P] [--device cpu|cuda|auto]\n"
    "         [--port P] (same flags; spawns the local workers)";

namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal.store(sig); }

std::string SelfDir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : p.parent_path().string();
}

std::string FindWorkerBinary(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("TPSERVE_WORKER")) return env;
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
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) {
    const std::string s(v);
    if (s.empty()) return 0;
    int listed = 1;
    for (char c : s) listed += c == ',';
    n = std::min(n, listed);
  }
  return n;
}

// Spawns the local workers: one process for one worker, mpirun for several.
absl::StatusOr<pid_t> SpawnWorkers(const CoordinatorOptions& o, int world, const std::string& addr,
                                   const std::string& device) {
  const std::string worker = FindWorkerBinary(o.worker_binary);
  std::vector<std::string> args;
  if (world > 1) {
    const char* mpirun = std::getenv("TPSERVE_MPIRUN");
    args = {mpirun ? mpirun : "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            std::to_string(world),
            "-x",
            "OPENBLAS_NUM_THREADS",
            "-x",
            "TPSERVE_LOG_LEVEL",
            worker,
            "--coordinator",
            addr,
            "--device",
            device};
  } else {
    args = {worker, "--coordinator", addr, "--rank", "0", "--world-size", "1", "--device", device};
  }
  TP_LOG(INFO) << "spawning workers: " << absl::StrJoin(args, " ");
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) setenv("OPENBLAS_NUM_THREADS", "1", 0);
  if (std::getenv("TPSERVE_LOG_LEVEL") == nullptr) setenv("TPSERVE_LOG_LEVEL", "info", 0);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed while spawning the workers");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlive the coordinator
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "tpserve: could not run %s\n", argv[0]);
    _exit(127);
  }
  return pid;
}

void StopChild(pid_t pid) {
  if (pid <= 0) return;
  int status = 0;
  for (int i = 0; i < 100; ++i) {  // 10 s for a clean exit after the shutdown message
    if (waitpid(pid, &status, WNOHANG) == pid) return;
    if (i == 30) kill(pid, SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
}

}  // namespace

absl::StatusOr<CoordinatorOptions> ParseCoordinatorFlags(const std::vector<std::string>& args,
                                                         bool serve_command) {
  auto parsed = CliArgs::Parse(args,
                               {"model",
                                "port",
                                "host",
                                "workers",
                                "tp",
                                "pp",
                                "device-map",
                                "device",
                                "worker-binary",
                                "kv-cache-mb",
                                "gpu-memory-utilization",
                                "block-size",
                                "max-num-seqs",
                                "max-num-batched-tokens",
                                "max-queued-requests",
                                "default-max-new-tokens",
                                "register-timeout",
                                "load-timeout",
                                "drain-timeout",
                                "heartbeat-timeout",
                                "step-timeout",
                                "ready-file"},
                               {"spawn-workers", "no-overlap-scheduling"});
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(),
                        absl::StrCat(parsed.status().message(), "\n", kCoordinatorUsage));
  }
  const CliArgs& a = *parsed;
  CoordinatorOptions o;
  TP_ASSIGN_OR_RETURN(o.model_dir, a.Required("model"));
  o.host = a.GetOr("host", o.host);
  o.device_map = a.GetOr("device-map", "");
  o.device = a.GetOr("device", "auto");
  o.worker_binary = a.GetOr("worker-binary", "");
  o.ready_file = a.GetOr("ready-file", "");
  o.spawn_workers = serve_command || a.Flag("spawn-workers");
  o.overlap_scheduling = !a.Flag("no-overlap-scheduling");
  struct IntFlag {
    const char* name;
    int* value;
    int64_t min, max;
  };
  int64_t kv_mb = 0;
  TP_ASSIGN_OR_RETURN(kv_mb, a.GetInt("kv-cache-mb", 0));
  if (kv_mb < 0) return absl::InvalidArgumentError("--kv-cache-mb must be >= 0");
  o.kv_cache_mb = kv_mb;
  TP_ASSIGN_OR_RETURN(o.gpu_memory_utilization,
                      a.GetDouble("gpu-memory-utilization", o.gpu_memory_utilization));
  if (!(o.gpu_memory_utilization > 0 && o.gpu_memory_utilization <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu-memory-utilization must be in (0, 1] (got ", o.gpu_memory_utilization, ")"));
  }
  const IntFlag ints[] = {
      {"port", &o.port, 0, 65535},
      {"workers", &o.world_size, 1, 4096},
      {"tp", &o.tp, 1, 4096},
      {"pp", &o.pp, 1, 4096},
      {"block-size", &o.block_size, 1, 1024},
      {"max-num-seqs", &o.max_num_seqs, 1, 1 << 16},
      {"max-num-batched-tokens", &o.max_num_batched_tokens, 1, 1 << 20},
      {"max-queued-requests", &o.max_queued_requests, 0, 1 << 20},
      {"default-max-new-tokens", &o.default_max_new_tokens, 1, 1 << 20},
      {"register-timeout", &o.register_timeout_s, 1, 86400},
      {"load-timeout", &o.load_timeout_s, 1, 86400},
      {"drain-timeout", &o.drain_timeout_s, 0, 86400},
      {"step-timeout", &o.step_timeout_s, 1, 86400},
  };
  for (const IntFlag& f : ints) {
    if (!a.Has(f.name)) continue;
    TP_ASSIGN_OR_RETURN(int64_t v, a.GetInt(f.name, 0));
    if (v < f.min || v > f.max) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", f.name, " must be between ", f.min, " and ", f.max, " (got ", v, ")"));
    }
    *f.value = static_cast<int>(v);
  }
  TP_ASSIGN_OR_RETURN(o.heartbeat_timeout_s, a.GetDouble("heartbeat-timeout", 4.0));
  if (o.heartbeat_timeout_s < 0.5) {
    return absl::InvalidArgumentError("--heartbeat-timeout must be at least 0.5 seconds");
  }
  if (a.Has("workers") && a.Has("tp") && o.world_size != o.tp * o.pp) {
    return absl::InvalidArgumentError(absl::StrCat("--workers ", o.world_size, " but --tp ", o.tp,
                                                   " x --pp ", o.pp, " = ", o.tp * o.pp));
  }
  if (!a.Has("tp") && a.Has("pp")) {
    return absl::InvalidArgumentError("--pp needs --tp as well");
  }
  if (o.tp > 0 && o.world_size == 0) o.world_size = o.tp * o.pp;
  return o;
}

absl::Status RunCoordinator(const CoordinatorOptions& opts) {
  CoordinatorOptions o = opts;
  SetLogPrefix("coordinator");
  TP_ASSIGN_OR_RETURN(ModelFiles files, ModelFiles::Open(o.model_dir));
  const ModelConfig config = files.config();
  std::vector<int32_t> eos = files.generation_config().eos_token_ids;
  if (eos.empty()) eos = config.eos_token_ids;
  std::unique_ptr<Tokenizer> tokenizer;
  if (std::filesystem::exists(std::filesystem::path(o.model_dir) / "tokenizer.json")) {
    TP_ASSIGN_OR_RETURN(tokenizer, Tokenizer::Load(o.model_dir));
  } else {
    TP_LOG(WARNING) << o.model_dir << " has no tokenizer.json: only token-id prompts are served";
  }

  std::string spawn_device = o.device;
  if (o.world_size == 0) {
    if (o.spawn_workers) {
      const int gpus = (o.device == "cpu") ? 0 : VisibleGpuCount();
      if (gpus > 0) {
        o.world_size = gpus;
      } else {
        const auto valid = ValidTpValues(config);
        o.world_size = std::find(valid.begin(), valid.end(), 2) != valid.end() ? 2 : 1;
      }
    } else {
      o.world_size = 1;
    }
  }
  if (o.spawn_workers && spawn_device == "auto" && VisibleGpuCount() == 0) spawn_device = "cpu";

  {
    // Refuse a layout the planner cannot split before waiting for any worker.
    PlanOptions check;
    check.tp = o.tp > 0 ? o.tp : o.world_size;
    check.pp = o.tp > 0 ? o.pp : 1;
    check.device_map = o.device_map;
    if (check.tp * check.pp != o.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("--tp ", check.tp, " x --pp ", check.pp,
                                                     " does not match --workers ", o.world_size));
    }
    auto plan = PlanShards(config, check);
    if (!plan.ok()) return plan.status();
  }
  WorkerGroupOptions g;
  g.model_dir = std::filesystem::absolute(o.model_dir).string();
  g.world_size = o.world_size;
  g.tp = o.tp;
  g.pp = o.pp;
  g.device_map = o.device_map;
  g.kv_cache_bytes = o.kv_cache_mb << 20;
  g.gpu_memory_utilization = o.gpu_memory_utilization;
  g.block_size = o.block_size;
  g.max_num_batched_tokens = o.max_num_batched_tokens;
  g.max_num_seqs = o.max_num_seqs;
  g.heartbeat_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(o.heartbeat_timeout_s * 1000));
  g.step_timeout = std::chrono::seconds(o.step_timeout_s);
  auto group = std::make_unique<WorkerGroup>(g, config);
  InferenceService service(tokenizer.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string listen = absl::StrCat(o.host, ":", o.port);
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.RegisterService(group.get());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("could not listen on ", listen));
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  auto set_health = [&](bool serving) {
    health->SetServingStatus(serving);
    health->SetServingStatus("tpserve.v1.Inference", serving);
  };
  set_health(false);
  TP_LOG(INFO) << "listening on " << o.host << ":" << port << " (" << config.architecture << ", "
               << o.world_size << " worker" << (o.world_size > 1 ? "s" : "") << ")";

  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  pid_t child = -1;
  if (o.spawn_workers) {
    TP_ASSIGN_OR_RETURN(
        child, SpawnWorkers(o, o.world_size, absl::StrCat("127.0.0.1:", port), spawn_device));
  }
  std::atomic<bool> started{false};
  std::thread watcher([&] {
    // During startup: a signal or the spawned workers exiting abort the wait.
    while (!started.load()) {
      if (g_signal.load() != 0) {
        group->Shutdown("signal during startup");
        return;
      }
      int status = 0;
      if (child > 0 && waitpid(child, &status, WNOHANG) == child) {
        child = -1;
        group->Shutdown("the spawned workers exited during startup");
        TP_LOG(ERROR) << "the spawned worker processes exited during startup (status " << status
                      << "); see their log above";
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  auto cleanup = [&](absl::Status status) {
    started.store(true);
    if (watcher.joinable()) watcher.join();
    group->Shutdown("the coordinator is exiting");
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    StopChild(child);
    return status;
  };

  absl::Status st = group->Start(std::chrono::seconds(o.register_timeout_s),
                                 std::chrono::seconds(o.load_timeout_s));
  started.store(true);
  watcher.join();
  if (!st.ok()) return cleanup(Annotate(st, "starting the workers"));

  SchedulerOptions so;
  so.max_num_seqs = o.max_num_seqs;
  so.max_num_batched_tokens = o.max_num_batched_tokens;
  so.max_queued_requests = o.max_queued_requests;
  so.num_blocks = group->num_blocks();
  so.block_size = o.block_size;
  so.context_length = config.max_position_embeddings;
  so.eos_token_ids = eos;
  so.overlap = o.overlap_scheduling;
  auto scheduler = std::make_unique<Scheduler>(so, tokenizer.get(), group.get());
  scheduler->Start();
  Scheduler* sched = scheduler.get();
  group->SetFailureCallback([&, sched](const absl::Status& status) {
    set_health(false);
    sched->Fail(status);
  });
  if (!group->failure().ok()) {
    scheduler.reset();
    return cleanup(group->failure());
  }

  // Warm-up: one short request through the whole path before reporting SERVING.
  {
    RequestParams w;
    w.request_id = "warm-up";
    for (int i = 0; i < 8; ++i)
      w.prompt.push_back(static_cast<int32_t>((i + 1) % config.vocab_size));
    w.max_new_tokens = 2;
    w.ignore_eos = true;
    auto state = std::make_shared<RequestState>(w);
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status submitted = scheduler->Submit(state);
    while (submitted.ok() && !state->finished() && g_signal.load() == 0 &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(o.load_timeout_s)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const absl::Status warm = !submitted.ok() ? submitted
                              : state->finished()
                                  ? state->Take().status
                                  : absl::DeadlineExceededError("warm-up timed out");
    if (!warm.ok()) {
      scheduler.reset();
      return cleanup(Annotate(warm, "warm-up"));
    }
    TP_LOG(INFO) << "warm-up done in "
                 << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
                 << " s";
  }

  ServiceLimits limits;
  limits.context_length = config.max_position_embeddings;
  limits.vocab_size = config.vocab_size;
  limits.kv_capacity_tokens = static_cast<int64_t>(group->num_blocks()) * o.block_size;
  limits.default_max_new_tokens = o.default_max_new_tokens;
  v1::ModelInfo info;
  info.set_model(std::filesystem::path(g.model_dir).filename().string());
  info.set_architecture(config.architecture);
  info.set_context_length(config.max_position_embeddings);
  info.set_vocab_size(config.vocab_size);
  info.set_tp(group->plan().tp);
  info.set_pp(group->plan().pp);
  info.set_device_map(group->plan().DeviceMapString());
  for (const std::string& d : group->rank_devices()) info.add_rank_devices(d);
  info.set_kv_capacity_tokens(limits.kv_capacity_tokens);
  info.set_has_tokenizer(tokenizer != nullptr);
  info.set_max_num_seqs(o.max_num_seqs);
  info.set_max_num_batched_tokens(o.max_num_batched_tokens);
  service.Activate(sched, limits, info);
  if (group->failure().ok()) set_health(true);
  if (!o.ready_file.empty()) {
    const std::string tmp = o.ready_file + ".tmp";
    std::ofstream(tmp) << o.host << ":" << port << "\n";
    std::filesystem::rename(tmp, o.ready_file);
  }
  TP_LOG(INFO) << "SERVING on port " << port << ": KV cache " << group->num_blocks() << " blocks x "
               << o.block_size << " tokens";

  int status = 0;
  while (g_signal.load() == 0) {
    if (child > 0 && waitpid(child, &status, WNOHANG) == child) child = -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  TP_LOG(INFO) << "signal " << g_signal.load() << ": draining (up to " << o.drain_timeout_s
               << " s), accepting nothing new";
  set_health(false);
  scheduler->StopAccepting(absl::UnavailableError("the server is draining (shutting down)"));
  const auto drain_end = std::chrono::steady_clock::now() + std::chrono::seconds(o.drain_timeout_s);
  while (!scheduler->Idle() && std::chrono::steady_clock::now() < drain_end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  scheduler->Fail(absl::UnavailableError("the server shut down before this request finished"));
  group->Shutdown("the coordinator is shutting down");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  scheduler.reset();
  StopChild(child);
  TP_LOG(INFO) << "shut down";
  return absl::OkStatus();
}

}  // namespace tpserve
