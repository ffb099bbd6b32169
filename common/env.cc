// The declared environment variables and their parsing (see env.h). This is the one place that
// calls getenv.
#include "common/env.h"

#include <unistd.h>
#include <atomic>

#include <cstdlib>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"

namespace tpserve {
namespace env {

constexpr int64_t kMaxRanks = 1 << 20;

const EnvVar kLogLevel = {"TPSERVE_LOG_LEVEL",
                          EnvType::kChoice,
                          "info",
                          "threshold of the log lines on stderr",
                          0,
                          0,
                          "debug|info|warning|error"};
const EnvVar kServer = {"TPSERVE_SERVER", EnvType::kString, "localhost:50051",
                        "server of the client commands (generate, info, health, bench) "
                        "without --server"};
const EnvVar kApiKey = {"TPSERVE_API_KEY",
                        EnvType::kString,
                        "",
                        "API key the client commands (generate, info, health, bench) send "
                        "without --api-key-file",
                        0,
                        0,
                        "",
                        /*bench_only=*/false,
                        /*external=*/false,
                        /*secret=*/true};
const EnvVar kWorker = {"TPSERVE_WORKER", EnvType::kString, "",
                        "tpserve-worker binary the coordinator spawns without --worker-binary "
                        "(default: next to the coordinator, then PATH)"};
const EnvVar kMpirun = {"TPSERVE_MPIRUN", EnvType::kString, "mpirun",
                        "mpirun the coordinator uses to spawn several local workers"};
const EnvVar kRank = {"TPSERVE_RANK",
                      EnvType::kInt,
                      "0",
                      "worker rank without --rank and without MPI (else SLURM_PROCID)",
                      0,
                      kMaxRanks};
const EnvVar kWorldSize = {"TPSERVE_WORLD_SIZE",
                           EnvType::kInt,
                           "1",
                           "number of workers without --world-size and without MPI (else "
                           "SLURM_NTASKS)",
                           1,
                           kMaxRanks};
const EnvVar kWorkerCudaGraphs = {"TPSERVE_WORKER_CUDA_GRAPHS", EnvType::kBool, "1",
                                  "the service's workers replay decode steps as CUDA graphs "
                                  "(stream-ordered TP / PP transfers); 0 runs them eagerly"};
const EnvVar kLaunchAhead = {
    "TPSERVE_LAUNCH_AHEAD",
    EnvType::kChoice,
    "auto",
    "a worker enqueues a step before the previous step's sampled ids reach the host (the ids "
    "feed the next step on the device): auto (where sampling is asynchronous: CUDA, tp = 1, "
    "pp = 1), 1 (also on the CPU, and at tp > 1 where every rank samples), 0 (each step's ids "
    "on the host first)",
    0,
    0,
    "auto|1|0"};
const EnvVar kAllReduce = {"TPSERVE_ALL_REDUCE",
                           EnvType::kChoice,
                           "nccl",
                           "all-reduce of the workers' TP groups without --all-reduce: nccl (the "
                           "backend's), custom (CUDA IPC kernel) or auto (custom where possible)",
                           0,
                           0,
                           "nccl|custom|auto"};
// Set by the coordinator for the workers it spawns (never on a command line, where any local
// user could read it); a worker without --cluster-secret-file proves it when registering.
const EnvVar kClusterSecret = {"TPSERVE_CLUSTER_SECRET",
                               EnvType::kString,
                               "",
                               "the control plane's per-launch secret (set by the coordinator "
                               "for the workers it spawns; else use --cluster-secret-file)",
                               0,
                               0,
                               "",
                               /*bench_only=*/false,
                               /*external=*/false,
                               /*secret=*/true};
const EnvVar kFusedAllReduceNorm = {"TPSERVE_FUSED_ALL_REDUCE_NORM", EnvType::kBool, "1",
                                    "the custom all-reduce of a TP decode step fused with the "
                                    "residual add and the next RMSNorm; 0: two kernels (A/B)"};
const EnvVar kPdl = {"TPSERVE_PDL", EnvType::kBool, "1",
                     "programmatic dependent launch of the CUDA kernels (sm_90+); 0 turns it off"};
const EnvVar kPrefillTile = {"TPSERVE_PREFILL_TILE",
                             EnvType::kChoice,
                             "128",
                             "query rows per block of the prefill attention kernel",
                             0,
                             0,
                             "128|64"};
const EnvVar kPrefillKernel = {"TPSERVE_PREFILL_KERNEL",
                               EnvType::kChoice,
                               "wgmma-fa3p",
                               "prefill-attention kernel: mma (mma.sync, every cache dtype), "
                               "wgmma (Hopper warpgroup MMA: bf16, fp8 and int8 caches at "
                               "head_dim 64/128 on sm_90, else mma), wgmma-pipe (wgmma with a "
                               "tile's softmax beside the previous tile's P V), wgmma-ws (the "
                               "same fed by a producer warp), wgmma-tma (its producer loading "
                               "the pages with TMA), wgmma-fa3 (a TMA producer warpgroup giving "
                               "its registers to the consumers: 128-key tiles; block sizes "
                               "8/16/32/64/128, else wgmma), wgmma-fa3pp (wgmma-fa3 with the "
                               "consumers' MMAs in ping-pong turns) or wgmma-fa3p (wgmma-fa3 on "
                               "a persistent grid: a block an SM over the work items); pipe, ws, "
                               "tma, fa3, fa3pp and fa3p: bf16 caches, else wgmma; A/B runs",
                               0,
                               0,
                               "mma|wgmma|wgmma-pipe|wgmma-ws|wgmma-tma|wgmma-fa3|wgmma-fa3pp|"
                               "wgmma-fa3p"};
const EnvVar kPrefillDequant = {
    "TPSERVE_PREFILL_DEQUANT",
    EnvType::kChoice,
    "auto",
    "prefill attention over fp8/int8 KV caches (sm_90): auto dequantizes the cache pages of "
    "the sequences with enough query rows per key (at least 256 query-key pairs a key) into a "
    "bf16 scratch once a layer and runs the bf16 kernel (TPSERVE_PREFILL_KERNEL) on them; 0 "
    "decodes the codes inside the prefill kernel for every sequence; all takes every sequence "
    "that fits the scratch (tests, A/B runs)",
    0,
    0,
    "auto|0|all"};
const EnvVar kMixedDecode = {
    "TPSERVE_MIXED_DECODE",
    EnvType::kChoice,
    "auto",
    "a step with prompt tokens beside decode rows (continuous batching): 1 runs the decode rows' "
    "attention through the decode kernel (split over keys) and the prompt chunks' through the "
    "prefill kernel; 0 runs every row through the prefill kernel; auto: 1 for fp8 / int8 / int4 "
    "caches, 0 for bf16 (A/B runs; --deterministic keeps its own)",
    0,
    0,
    "auto|1|0"};
const EnvVar kDecodeKernel = {
    "TPSERVE_DECODE_KERNEL",
    EnvType::kChoice,
    "auto",
    "decode-attention kernel: auto (by the batch), subtile, twophase, mma or mma-bf16 "
    "(A/B runs; mma: fp8, int8, int4 caches at head_dim 64/128, mma-bf16: bf16 caches at "
    "head_dim 64/128, else twophase; --deterministic keeps its own)",
    0,
    0,
    "auto|subtile|twophase|mma|mma-bf16"};
const EnvVar kDecodePartition = {"TPSERVE_DECODE_PARTITION",
                                 EnvType::kChoice,
                                 "0",
                                 "decode attention: keys per split, 0 = by the batch (A/B runs; "
                                 "--deterministic keeps its own)",
                                 0,
                                 0,
                                 "0|64|128|256|512|1024"};
const EnvVar kDecodeOrder = {"TPSERVE_DECODE_ORDER",
                             EnvType::kChoice,
                             "seq",
                             "decode attention: block order, seq (the same keys of many sequences "
                             "together: shared prefix blocks hit L2), split (a sequence's splits "
                             "and heads together) or head (a split's heads together)",
                             0,
                             0,
                             "seq|split|head"};
const EnvVar kDecodePrefetch = {"TPSERVE_DECODE_PREFETCH",
                                EnvType::kInt,
                                "0",
                                "decode attention, tensor-core (mma) kernel for 8- and 4-bit "
                                "caches: L2 prefetches of K/V rows this many loop iterations "
                                "ahead of the loads (0 = none; A/B runs)",
                                0,
                                4};
const EnvVar kCublasLtAutotune = {"TPSERVE_CUBLASLT_AUTOTUNE", EnvType::kBool, "0",
                                  "time cuBLASLt's candidate algorithms for M <= 256 instead of "
                                  "taking its heuristic (faster, not bitwise reproducible across "
                                  "processes)"};
const EnvVar kCublasLtTable = {
    "TPSERVE_CUBLASLT_TABLE", EnvType::kString, "builtin",
    "cuBLASLt algorithms measured faster than its heuristic's first on this GPU "
    "(kernels/cuda/cublaslt_table.json): builtin, off, or the path of a table written by "
    "`tpserve-cuda-bench --lt-sweep`"};
const EnvVar kStreamGemmMaxM = {
    "TPSERVE_STREAM_GEMM_MAX_M",
    EnvType::kInt,
    "0",
    "CUDA (sm_90): the largest decode batch whose GEMMs run the weight-streaming wgmma kernel "
    "instead of cuBLASLt (from M = 3; 0 = never: slower than cuBLASLt on the H200)",
    0,
    128};
const EnvVar kDeterministicGemmM = {
    "TPSERVE_DETERMINISTIC_GEMM_M",
    EnvType::kInt,
    "64",
    "--deterministic on CUDA: the batch size whose cuBLASLt algorithm (without split-K) every "
    "GEMM of that shape uses, whatever its M",
    1,
    8192};
const EnvVar kDeterministicGemmPrefill = {
    "TPSERVE_DETERMINISTIC_GEMM_PREFILL",
    EnvType::kBool,
    "1",
    "--deterministic on CUDA: a GEMM of more than 256 rows takes the unsplit cuBLASLt algorithm "
    "cuBLASLt picks at M = 2048 when a probe on the weights finds it bit-identical to the one of "
    "TPSERVE_DETERMINISTIC_GEMM_M (else that one)",
    0,
    0,
    ""};
const EnvVar kDeterministicSplitLoop = {
    "TPSERVE_DETERMINISTIC_SPLIT_LOOP",
    EnvType::kBool,
    "1",
    "--deterministic on CUDA, bf16 KV cache, mma decode kernel: a prefill's token group loops "
    "over its attention splits in one block, merging as it goes (0: a block a split, merged "
    "through a workspace); the same bits",
    0,
    0,
    ""};
const EnvVar kDeterministicGemm = {
    "TPSERVE_DETERMINISTIC_GEMM",
    EnvType::kChoice,
    "cublaslt",
    "--deterministic on CUDA: cublaslt (one unsplit cuBLASLt algorithm per shape, chosen at "
    "TPSERVE_DETERMINISTIC_GEMM_M, with decode batches of 1-2 rows through our chain GEMMs, "
    "which have its bits, and the skinny path's fusions), cublaslt-only (cuBLASLt at every M, "
    "unfused), fixed-order (our GEMM, one arithmetic for every M: faster at batches up to 8, "
    "slower above), or stream (the weight-streaming wgmma GEMM on a fixed grid for every M, in "
    "chunks of 128 rows, unfused; sm_90)",
    0,
    0,
    "cublaslt|cublaslt-only|fixed-order|stream"};
const EnvVar kDeterministicTiles = {
    "TPSERVE_DETERMINISTIC_TILES",
    EnvType::kChoice,
    "on",
    "--deterministic on CUDA with TPSERVE_DETERMINISTIC_GEMM=cublaslt: on keeps a second copy of "
    "every GEMM weight in the chain GEMV's tile-contiguous layout (as many bytes again as the "
    "weights, taken from the KV cache's budget) for decode batches of 1-2 tokens to stream with "
    "bulk copies (batch 1 1.05x the default mode's time instead of 1.20x on an H100); off keeps "
    "that memory for the cache; the same bits either way",
    0,
    0,
    "off|on"};
const EnvVar kDeterministicPartition = {
    "TPSERVE_DETERMINISTIC_PARTITION",
    EnvType::kChoice,
    "256",
    "--deterministic on CUDA: keys per split of the attention kernel, for every batch",
    0,
    0,
    "256|128|64"};
const EnvVar kDeterministicTokenGroups = {
    "TPSERVE_DETERMINISTIC_TOKEN_GROUPS",
    EnvType::kBool,
    "1",
    "--deterministic on CUDA: a prefill's query tokens share a block's K/V reads, up to 8 tokens "
    "of a sequence (the same bits as one token a block, which 0 runs)",
    0,
    0,
    ""};
const EnvVar kDeterministicDecode = {
    "TPSERVE_DETERMINISTIC_DECODE",
    EnvType::kChoice,
    "mma",
    "--deterministic on CUDA, bf16 KV cache at head_dim 64/128: the attention kernel, mma (tensor "
    "cores: a prefill's tokens are MMA columns) or twophase (CUDA cores); they give other bits",
    0,
    0,
    "mma|twophase"};
const EnvVar kLoadThreads = {"TPSERVE_LOAD_THREADS",
                             EnvType::kInt,
                             "0",
                             "host threads copying weights to the GPU; 0: min(8, cores), at most "
                             "64",
                             0,
                             1 << 20};
const EnvVar kOpProfile = {"TPSERVE_OP_PROFILE",
                           EnvType::kBool,
                           "0",
                           "tpserve-engine-bench: time every op with CUDA events",
                           0,
                           0,
                           "",
                           true};
const EnvVar kFusedSkinny = {"TPSERVE_FUSED_SKINNY",
                             EnvType::kBool,
                             "1",
                             "tpserve-engine-bench: 0 forces the unfused decode GEMM paths (A/B)",
                             0,
                             0,
                             "",
                             true};
const EnvVar kFusedNorm = {"TPSERVE_FUSED_NORM",
                           EnvType::kBool,
                           "1",
                           "tpserve-engine-bench: 0 forces a separate RMSNorm kernel and, in "
                           "prefills, a separate residual add (A/B)",
                           0,
                           0,
                           "",
                           true};
const EnvVar kAblateOps = {"TPSERVE_ABLATE_OPS",
                           EnvType::kString,
                           "",
                           "tpserve-engine-bench: skip these ops (AttentionDecode,AddRmsNorm,"
                           "Gemm.square); every result is wrong, timing only",
                           0,
                           0,
                           "",
                           true};
const EnvVar kCudaVisibleDevices = {"CUDA_VISIBLE_DEVICES",
                                    EnvType::kString,
                                    "",
                                    "GPUs a spawned group may use (serve counts them)",
                                    0,
                                    0,
                                    "",
                                    false,
                                    true};
const EnvVar kOpenblasNumThreads = {"OPENBLAS_NUM_THREADS",
                                    EnvType::kString,
                                    "",
                                    "CPU workers' BLAS threads (spawned workers get 1 if unset)",
                                    0,
                                    0,
                                    "",
                                    false,
                                    true};
const EnvVar kOmpiCommWorldSize = {"OMPI_COMM_WORLD_SIZE",
                                   EnvType::kString,
                                   "",
                                   "set by Open MPI's mpirun: ranks come from MPI",
                                   0,
                                   0,
                                   "",
                                   false,
                                   true};
const EnvVar kPmiSize = {"PMI_SIZE", EnvType::kString,
                         "",         "set by a PMI process manager: ranks come from MPI",
                         0,          0,
                         "",         false,
                         true};
const EnvVar kPmixRank = {"PMIX_RANK", EnvType::kString,
                          "",          "set by a PMIx process manager: ranks come from MPI",
                          0,           0,
                          "",          false,
                          true};
const EnvVar kSlurmProcid = {"SLURM_PROCID",
                             EnvType::kInt,
                             "0",
                             "Slurm task id: the worker rank without --rank / TPSERVE_RANK",
                             0,
                             kMaxRanks,
                             "",
                             false,
                             true};
const EnvVar kSlurmNtasks = {"SLURM_NTASKS",
                             EnvType::kInt,
                             "1",
                             "Slurm task count: the world size without --world-size",
                             1,
                             kMaxRanks,
                             "",
                             false,
                             true};
const EnvVar kSlurmLocalid = {"SLURM_LOCALID",
                              EnvType::kInt,
                              "0",
                              "Slurm node-local task id: the GPU without --gpu / LOCAL_RANK",
                              0,
                              kMaxRanks,
                              "",
                              false,
                              true};
const EnvVar kLocalRank = {"LOCAL_RANK",
                           EnvType::kInt,
                           "0",
                           "node-local rank (torchrun, Kubernetes): the GPU without --gpu",
                           0,
                           kMaxRanks,
                           "",
                           false,
                           true};

}  // namespace env

namespace {

const char* TypeName(const EnvVar& v) {
  switch (v.type) {
    case EnvType::kBool:
      return "bool";
    case EnvType::kInt:
      return "int";
    case EnvType::kChoice:
      return "choice";
    default:
      return "string";
  }
}

std::optional<bool> ParseBool(const std::string& text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "1" || t == "true" || t == "on" || t == "yes") return true;
  if (t == "0" || t == "false" || t == "off" || t == "no") return false;
  return std::nullopt;
}

// The normalized text of a valid value, or nullopt with `why` set.
std::optional<std::string> Normalize(const EnvVar& v, const std::string& raw, std::string* why) {
  switch (v.type) {
    case EnvType::kBool: {
      auto b = ParseBool(raw);
      if (!b) *why = "expects 1|0|true|false|on|off|yes|no";
      return b ? std::optional<std::string>(*b ? "1" : "0") : std::nullopt;
    }
    case EnvType::kInt: {
      int64_t i = 0;
      if (absl::SimpleAtoi(raw, &i) && i >= v.min && i <= v.max) return absl::StrCat(i);
      *why = absl::StrCat("expects an integer in [", v.min, ", ", v.max, "]");
      return std::nullopt;
    }
    case EnvType::kChoice:
      for (absl::string_view c : absl::StrSplit(v.choices, '|')) {
        if (raw == c) return raw;
      }
      *why = absl::StrCat("expects one of ", v.choices);
      return std::nullopt;
    default:
      return raw;
  }
}

}  // namespace

const std::vector<const EnvVar*>& DeclaredEnvVars() {
  static const std::vector<const EnvVar*>* const vars = new std::vector<const EnvVar*>{
      &env::kLogLevel,
      &env::kServer,
      &env::kApiKey,
      &env::kWorker,
      &env::kMpirun,
      &env::kRank,
      &env::kWorldSize,
      &env::kWorkerCudaGraphs,
      &env::kAllReduce,
      &env::kClusterSecret,
      &env::kFusedAllReduceNorm,
      &env::kPdl,
      &env::kLaunchAhead,
      &env::kPrefillTile,
      &env::kPrefillKernel,
      &env::kPrefillDequant,
      &env::kMixedDecode,
      &env::kDecodeKernel,
      &env::kDecodePartition,
      &env::kDecodeOrder,
      &env::kDecodePrefetch,
      &env::kCublasLtAutotune,
      &env::kCublasLtTable,
      &env::kStreamGemmMaxM,
      &env::kDeterministicGemm,
      &env::kDeterministicGemmM,
      &env::kDeterministicGemmPrefill,
      &env::kDeterministicTiles,
      &env::kDeterministicPartition,
      &env::kDeterministicTokenGroups,
      &env::kDeterministicDecode,
      &env::kDeterministicSplitLoop,
      &env::kLoadThreads,
      &env::kOpProfile,
      &env::kFusedSkinny,
      &env::kFusedNorm,
      &env::kAblateOps,
      &env::kCudaVisibleDevices,
      &env::kOpenblasNumThreads,
      &env::kOmpiCommWorldSize,
      &env::kPmiSize,
      &env::kPmixRank,
      &env::kSlurmProcid,
      &env::kSlurmNtasks,
      &env::kSlurmLocalid,
      &env::kLocalRank,
  };
  return *vars;
}

EnvRegistry::EnvRegistry(const Lookup& lookup) {
  for (const EnvVar* v : DeclaredEnvVars()) {
    Value value;
    value.text = v->default_value;
    if (std::optional<std::string> raw = lookup(v->name)) {
      std::string why;
      if (std::optional<std::string> text = Normalize(*v, *raw, &why)) {
        value.set = true;
        value.text = *text;
        if (!v->external && value.text != v->default_value) {
          changed_.push_back(
              absl::StrCat(v->name, "=", v->secret ? "(set)" : *raw, " (", v->meaning, ")"));
        }
      } else {
        warnings_.push_back(absl::StrCat(v->name, "='", *raw, "' is ignored: ", why,
                                         "; using the default '", v->default_value, "'"));
      }
    }
    values_[v->name] = value;
  }
}

const EnvRegistry::Value& EnvRegistry::Get(const EnvVar& var) const {
  auto it = values_.find(var.name);
  TP_CHECK(it != values_.end()) << var.name << " is not in DeclaredEnvVars()";
  return it->second;
}

bool EnvRegistry::IsSet(const EnvVar& var) const { return Get(var).set; }

bool EnvRegistry::Bool(const EnvVar& var) const { return Get(var).text == "1"; }

int64_t EnvRegistry::Int(const EnvVar& var) const {
  int64_t i = 0;
  return absl::SimpleAtoi(Get(var).text, &i) ? i : 0;
}

std::string EnvRegistry::String(const EnvVar& var) const { return Get(var).text; }

std::string EnvRegistry::Table() const {
  std::string out = absl::StrFormat("%-28s %-7s %-16s %-16s %s\n", "NAME", "TYPE", "DEFAULT",
                                    "CURRENT", "MEANING");
  auto section = [&](const char* title, auto keep) {
    absl::StrAppend(&out, "\n", title, "\n");
    for (const EnvVar* v : DeclaredEnvVars()) {
      if (!keep(*v)) continue;
      const Value& value = Get(*v);
      std::string def = *v->default_value ? v->default_value : "-";
      std::string cur = value.set ? (v->secret ? "(set)" : value.text) : "(unset)";
      if (v->type == EnvType::kChoice) def += " (" + std::string(v->choices) + ")";
      absl::StrAppend(&out, absl::StrFormat("%-28s %-7s %-16s %-16s %s\n", v->name, TypeName(*v),
                                            def, cur, v->meaning));
    }
  };
  section("# service, command line and kernels",
          [](const EnvVar& v) { return !v.bench_only && !v.external; });
  section("# benchmarks only (tpserve-engine-bench)", [](const EnvVar& v) { return v.bench_only; });
  section("# read from launchers (MPI, Slurm, CUDA)", [](const EnvVar& v) { return v.external; });
  return out;
}

const EnvRegistry& EnvWithoutLogging() {
  static const EnvRegistry* const registry = new EnvRegistry([](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr ? std::optional<std::string>(v) : std::nullopt;
  });
  return *registry;
}

const EnvRegistry& Env() {
  const EnvRegistry& registry = EnvWithoutLogging();
  static std::atomic<bool> logged{false};
  if (!logged.exchange(true)) {
    for (const std::string& w : registry.warnings()) TP_LOG(WARNING) << w;
    for (const std::string& c : registry.changed()) TP_LOG(INFO) << c;
  }
  return registry;
}

bool UnderMpi() {
  return EnvIsSet(env::kOmpiCommWorldSize) || EnvIsSet(env::kPmiSize) || EnvIsSet(env::kPmixRank);
}

std::vector<std::string> EnvironmentWith(const EnvVar& var, const std::string& value) {
  const std::string prefix = std::string(var.name) + "=";
  std::vector<std::string> out;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string_view(*e).substr(0, prefix.size()) != prefix) out.push_back(*e);
  }
  out.push_back(prefix + value);
  return out;
}

}  // namespace tpserve
