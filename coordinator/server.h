// The coordinator process: the gRPC server (public API, control plane, health, reflection), the
// HTTP server (OpenAI-compatible API, /health, /metrics), the
// worker group, the scheduler, optional local worker processes, warm-up, SIGTERM drain.
// Used by `tpserve-coordinator` and `tpserve serve`.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tpserve {

struct CoordinatorOptions {
  std::string model_dir;
  std::string host = "0.0.0.0";
  int port = 50051;      // 0: any free port (see ready_file)
  int http_port = 8000;  // OpenAI-compatible HTTP API, /health, /metrics; 0: off
  // Keys of the public API (gRPC and HTTP /v1 need `authorization: Bearer <key>`; health
  // exempt): one given on the command line, and a file of them (one a line).
  std::string api_key;
  std::string api_key_file;
  // TLS of the public API (gRPC and HTTP): PEM files; with tls_client_ca, mutual TLS.
  std::string tls_cert, tls_key, tls_client_ca;
  // The workers' control plane, a server apart from the public API. Host default: 127.0.0.1
  // when the workers are spawned here, else `host`. Port -1: 0 (any free port) when spawning,
  // else 50052.
  std::string control_host;
  int control_port = -1;
  // The secret workers prove when registering (one line); required unless the workers are
  // spawned here (then a random secret is made per launch and passed in their environment).
  std::string cluster_secret_file;
  int world_size = 0;  // workers; 0: tp * pp, or 1
  int tp = 0;          // 0: world_size
  int pp = 1;
  std::string device_map;
  // Local workers: spawn them (one per visible GPU with --device cuda, else CPU workers).
  bool spawn_workers = false;
  std::string device = "auto";           // of spawned workers
  std::string worker_binary;             // default: tpserve-worker next to this binary or on PATH
  int64_t kv_cache_mb = 0;               // per worker; 0: sized from gpu_memory_utilization
  double gpu_memory_utilization = 0.90;  // of each GPU's memory, for weights, workspace and KV
  int block_size = 16;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 512;
  int max_queued_requests = 256;
  int default_max_new_tokens = 256;
  int max_prompt_tokens = 0;            // 0: the model's context length
  int64_t max_request_bytes = 8 << 20;  // one gRPC message or HTTP body
  int register_timeout_s = 120;
  int load_timeout_s = 600;
  // After SIGTERM: the drain, then at most ~10 s to stop the workers and servers; together under
  // Kubernetes' default 30 s termination grace period.
  int drain_timeout_s = 15;
  // A failed group of spawned workers is restarted (fresh processes, communicators and KV
  // caches) up to max_restarts times within 10 minutes (0: never); then the coordinator exits
  // non-zero. Workers launched apart: with rejoin they may register again after a failure (the
  // same count applies), else the coordinator exits non-zero so that the launcher restarts all.
  int max_restarts = 5;
  bool rejoin = false;
  double heartbeat_timeout_s = 4;
  int step_timeout_s = 120;
  std::string ready_file;  // written with "HOST:PORT" once the server is SERVING
  // --enable-prefix-caching[=false], --no-enable-prefix-caching
  bool enable_prefix_caching = true;
  // --deterministic: the workers' kernels give a request the same tokens whatever the batch.
  bool deterministic = false;
  // --all-reduce: the workers' TP all-reduce ("auto", "nccl", "custom"); empty: each worker's
  // own --all-reduce or TPSERVE_ALL_REDUCE.
  std::string all_reduce;
  // --kv-cache-dtype: "auto", "bf16", "fp32", "fp8", "int8", "int4" (checked by the flags).
  std::string kv_cache_dtype = "auto";
  bool help = false;               // --help was given: print the usage, run nothing
  bool overlap_scheduling = true;  // --no-overlap-scheduling: one step at a time at pp = 1
  double overlap_lead_ms = 1.5;    // --overlap-lead-ms (SchedulerOptions::overlap_lead_seconds)
};

// Runs until SIGTERM / SIGINT (then drains) or a startup failure.
absl::Status RunCoordinator(const CoordinatorOptions& options);

}  // namespace tpserve
