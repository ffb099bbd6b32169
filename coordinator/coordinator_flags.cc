// The coordinator's flag table and its translation into CoordinatorOptions (see
// coordinator_flags.h).
#include "coordinator/coordinator_flags.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"

namespace tpserve {
namespace {

// The small bundled model: installed (<prefix>/share/tpserve/models/tiny-coder beside
// <prefix>/bin) or in the source tree of a build (build/tools/tpserve).
absl::StatusOr<std::string> BundledModelDir() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::string dir = ec ? std::string(".") : exe.parent_path().string();
  for (const std::string& c :
       {dir + "/../share/tpserve/models/tiny-coder", dir + "/../../models/tiny-coder"}) {
    if (std::filesystem::exists(c + "/config.json")) {
      return std::filesystem::canonical(c).string();
    }
  }
  return absl::InvalidArgumentError(
      "no --model given and no bundled model found (looked in ../share/tpserve/models/tiny-coder "
      "beside this binary)");
}

CommandSpec MakeSpec(bool serve_command) {
  CommandSpec s;
  s.name = serve_command ? "tpserve serve" : "tpserve-coordinator";
  s.summary = serve_command
                  ? "Serves a model over gRPC with local workers (one per visible GPU, or CPU "
                    "workers) that it spawns."
                  : "The coordinator: public gRPC API, scheduler, KV block manager and the "
                    "workers' control plane.";
  s.flags = {
      StringFlag("model", "DIR",
                 serve_command ? "model directory (config.json, *.safetensors); default: the "
                                 "bundled tiny-coder"
                               : "model directory (config.json, *.safetensors) [required]"),
      StringFlag("host", "H", "address to listen on (default 0.0.0.0)"),
      IntFlag("port", 0, 65535, "gRPC port; 0: any free port (see --ready-file) (default 50051)",
              "P"),
      IntFlag("http-port", 0, 65535,
              "OpenAI-compatible HTTP API, /health and /metrics; 0: off (default 8000)", "P"),
      StringFlag("api-key", "K",
                 "gRPC calls and HTTP /v1 requests need `authorization: Bearer K` (visible in "
                 "ps: prefer --api-key-file)"),
      StringFlag("tls-cert", "PEM",
                 "TLS certificate (chain) of the gRPC and HTTP API (needs --tls-key)"),
      StringFlag("tls-key", "PEM", "the private key of --tls-cert"),
      StringFlag("tls-client-ca", "PEM",
                 "with --tls-cert: clients need a certificate signed by this CA"),
      StringFlag("api-key-file", "PATH",
                 "API keys, one a line: gRPC and HTTP /v1 need `authorization: Bearer <key>` "
                 "(health exempt)"),
      IntFlag("control-port", 0, 65535,
              "the workers' control plane (apart from the public API); 0: any free port "
              "(default 50052; any free port when spawning)",
              "P"),
      StringFlag("control-host", "H",
                 "address of the control plane (default 127.0.0.1 when spawning, else --host)"),
      StringFlag("cluster-secret-file", "PATH",
                 "secret the workers prove when registering (the same file for tpserve-worker); "
                 "required unless the workers are spawned (then one is made per launch)"),
      IntFlag("workers", 1, 4096, "number of workers (default tp x pp, or the visible GPUs)"),
      IntFlag("tp", 1, 4096, "tensor-parallel degree (default --workers)", "T"),
      IntFlag("pp", 1, 4096, "pipeline-parallel stages (needs --tp; default 1)", "P"),
      StringFlag("device-map", "MAP", "manual layer split over stages, e.g. 0-15:0,16-31:1"),
      BoolFlag("spawn-workers", "start the local workers (always on for tpserve serve)"),
      BoolFlag("overlap-scheduling",
               "at pp = 1, plan and send step n + 1 while step n runs (on by default; "
               "--no-overlap-scheduling turns it off)"),
      FloatFlag("overlap-lead-ms", 0, 1000,
                "with overlap, plan step n + 1 this long before step n should end, so that "
                "requests arriving meanwhile join it (default 1.5; 0: plan it as soon as step n "
                "is sent)",
                "MS"),
      BoolFlag("enable-prefix-caching",
               "reuse the KV blocks of cached prompt prefixes (on by default; "
               "--no-enable-prefix-caching turns it off)"),
      BoolFlag("deterministic",
               "a request gets the same tokens and logprobs whatever else is in the batch "
               "(batch-invariant kernels; see the README for what it covers and costs)"),
      StringFlag("all-reduce", "auto|nccl|custom",
                 "the workers' TP all-reduce: nccl (the backend's), custom (a CUDA IPC kernel, "
                 "also between workers sharing one GPU) or auto (custom where every rank can map "
                 "every peer); default: the workers' TPSERVE_ALL_REDUCE, else nccl"),
      StringFlag("device", "cpu|cuda|auto", "device of spawned workers (default auto)"),
      StringFlag("worker-binary", "B",
                 "tpserve-worker to spawn (default: TPSERVE_WORKER, next to this binary, PATH)"),
      KvCacheDTypeFlag(),
      IntFlag("kv-cache-mb", 0, int64_t{1} << 30,
              "KV cache per worker in MiB; 0: sized from --gpu-memory-utilization", "MB"),
      FloatFlag("gpu-memory-utilization", 0, 1,
                "fraction of each GPU for weights, workspace and KV cache (default 0.9)", "F",
                /*min_exclusive=*/true),
      IntFlag("block-size", 1, 1024, "tokens per KV-cache block (default 16)"),
      IntFlag("max-num-seqs", 1, 1 << 16, "sequences in one step (default 64)"),
      IntFlag("max-num-batched-tokens", 1, 1 << 20, "tokens in one step (default 512)"),
      IntFlag("max-queued-requests", 1, 1 << 20,
              "requests waiting beyond that answer RESOURCE_EXHAUSTED (default 256; every request "
              "waits in the queue until a step admits it)"),
      IntFlag("max-prompt-tokens", 1, 1 << 24,
              "longest prompt in tokens; longer text is refused before it is tokenized "
              "(default: the context length)"),
      IntFlag("max-request-bytes", 1024, int64_t{1} << 30,
              "largest gRPC request message or HTTP body (default 8388608)", "B"),
      IntFlag("default-max-new-tokens", 1, 1 << 20,
              "max_new_tokens of requests that set none (default 256)"),
      IntFlag("register-timeout", 1, 86400, "seconds for all workers to register (default 120)",
              "S"),
      IntFlag("load-timeout", 1, 86400, "seconds for the workers to load and warm up (default 600)",
              "S"),
      IntFlag("drain-timeout", 0, 86400,
              "seconds to finish running requests after SIGTERM (default 15: drain and shutdown "
              "fit Kubernetes' 30 s grace period)",
              "S"),
      IntFlag("max-restarts", 0, 1000,
              "restarts of a failed group of spawned workers within 10 minutes; one failure more "
              "exits non-zero (default 5; 0: never restart)",
              "N"),
      BoolFlag("rejoin",
               "workers launched apart (mpirun, Slurm, Kubernetes) may register again after a "
               "failure (within --register-timeout); without it the coordinator exits non-zero "
               "so that the launcher restarts the job"),
      FloatFlag("heartbeat-timeout", 0.5, 86400,
                "seconds without a worker heartbeat before the group fails (default 4)", "S"),
      IntFlag("step-timeout", 1, 86400, "seconds one step may take (default 120)", "S"),
      StringFlag("ready-file", "PATH", "written with HOST:PORT once the server is SERVING"),
  };
  s.notes = serve_command
                ? "example: tpserve serve --model models/tiny-coder --device cpu --port 50051"
                : "example (MPMD): mpirun -np 1 tpserve-coordinator --model DIR : -np 8 "
                  "tpserve-worker --coordinator HOST:50052 (both with --cluster-secret-file F)";
  return s;
}

}  // namespace

const CommandSpec& CoordinatorFlagSpec(bool serve_command) {
  static const CommandSpec* const coordinator = new CommandSpec(MakeSpec(false));
  static const CommandSpec* const serve = new CommandSpec(MakeSpec(true));
  return serve_command ? *serve : *coordinator;
}

absl::StatusOr<CoordinatorOptions> ParseCoordinatorFlags(const std::vector<std::string>& args,
                                                         bool serve_command) {
  TP_ASSIGN_OR_RETURN(Flags a, Flags::Parse(CoordinatorFlagSpec(serve_command), args));
  CoordinatorOptions o;
  if (a.help()) {
    o.help = true;
    return o;
  }
  if (serve_command && !a.Has("model")) {
    TP_ASSIGN_OR_RETURN(o.model_dir, BundledModelDir());
  } else {
    TP_ASSIGN_OR_RETURN(o.model_dir, a.Required("model"));
  }
  o.api_key = a.GetOr("api-key", "");
  o.api_key_file = a.GetOr("api-key-file", "");
  o.tls_cert = a.GetOr("tls-cert", "");
  o.tls_key = a.GetOr("tls-key", "");
  o.tls_client_ca = a.GetOr("tls-client-ca", "");
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!o.tls_client_ca.empty() && o.tls_cert.empty()) {
    return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
  }
  o.host = a.GetOr("host", o.host);
  o.control_host = a.GetOr("control-host", "");
  o.cluster_secret_file = a.GetOr("cluster-secret-file", "");
  o.device_map = a.GetOr("device-map", "");
  o.device = a.GetOr("device", "auto");
  o.worker_binary = a.GetOr("worker-binary", "");
  o.ready_file = a.GetOr("ready-file", "");
  o.spawn_workers = serve_command || a.Flag("spawn-workers");
  o.enable_prefix_caching = a.GetBool("enable-prefix-caching", true);
  o.deterministic = a.Flag("deterministic");
  o.all_reduce = a.GetOr("all-reduce", "");
  if (!o.all_reduce.empty() && o.all_reduce != "auto" && o.all_reduce != "nccl" &&
      o.all_reduce != "custom") {
    return absl::InvalidArgumentError(
        absl::StrCat("--all-reduce must be auto, nccl or custom, got \"", o.all_reduce, "\""));
  }
  o.overlap_scheduling = a.GetBool("overlap-scheduling", true);
  o.overlap_lead_ms = a.GetDouble("overlap-lead-ms", o.overlap_lead_ms);
  o.rejoin = a.Flag("rejoin");
  o.kv_cache_mb = a.GetInt("kv-cache-mb", 0);
  o.kv_cache_dtype = a.GetOr("kv-cache-dtype", "auto");
  if (absl::Status s = ParseKvCacheDType(o.kv_cache_dtype).status(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--kv-cache-dtype: ", s.message()));
  }
  o.max_request_bytes = a.GetInt("max-request-bytes", o.max_request_bytes);
  o.gpu_memory_utilization = a.GetDouble("gpu-memory-utilization", o.gpu_memory_utilization);
  o.heartbeat_timeout_s = a.GetDouble("heartbeat-timeout", o.heartbeat_timeout_s);
  struct IntField {
    const char* name;
    int* value;
  };
  const IntField ints[] = {
      {"port", &o.port},
      {"http-port", &o.http_port},
      {"control-port", &o.control_port},
      {"workers", &o.world_size},
      {"tp", &o.tp},
      {"pp", &o.pp},
      {"block-size", &o.block_size},
      {"max-num-seqs", &o.max_num_seqs},
      {"max-num-batched-tokens", &o.max_num_batched_tokens},
      {"max-queued-requests", &o.max_queued_requests},
      {"default-max-new-tokens", &o.default_max_new_tokens},
      {"max-prompt-tokens", &o.max_prompt_tokens},
      {"register-timeout", &o.register_timeout_s},
      {"load-timeout", &o.load_timeout_s},
      {"drain-timeout", &o.drain_timeout_s},
      {"max-restarts", &o.max_restarts},
      {"step-timeout", &o.step_timeout_s},
  };
  for (const IntField& f : ints) *f.value = static_cast<int>(a.GetInt(f.name, *f.value));
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

}  // namespace tpserve
