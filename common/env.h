// The environment switches: every variable tpserve reads is declared once here (type, default,
// one-line meaning), parsed once on first use, logged when a TPSERVE_* switch is set to a
// non-default value and listed by `tpserve env`. No other source file reads the environment.
// (Included by CUDA sources too: C++17, standard headers only.)
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace tpserve {

enum class EnvType { kBool, kInt, kString, kChoice };

struct EnvVar {
  const char* name;
  EnvType type;
  const char* default_value;  // as text: "1", "128", "" (none)
  const char* meaning;        // one line, listed by `tpserve env`
  int64_t min = 0;            // kInt: inclusive range
  int64_t max = 0;
  const char* choices = "";  // kChoice: "debug|info|warning|error"
  bool bench_only = false;   // read only by the benchmarks (tools/), never by the service
  bool external = false;     // set by a launcher (MPI, Slurm, CUDA), not a tpserve switch
  bool secret = false;       // never logged or listed with its value
};

namespace env {
// The service and the command line.
extern const EnvVar kLogLevel;
extern const EnvVar kServer;
extern const EnvVar kApiKey;
extern const EnvVar kWorker;
extern const EnvVar kMpirun;
extern const EnvVar kRank;
extern const EnvVar kWorldSize;
extern const EnvVar kWorkerCudaGraphs;
extern const EnvVar kAllReduce;
extern const EnvVar kClusterSecret;
// The CUDA kernels.
extern const EnvVar kFusedAllReduceNorm;
extern const EnvVar kPdl;
extern const EnvVar kLaunchAhead;
extern const EnvVar kPrefillTile;
extern const EnvVar kPrefillKernel;
extern const EnvVar kPrefillDequant;
extern const EnvVar kMixedDecode;
extern const EnvVar kDecodeKernel;
extern const EnvVar kDecodePartition;
extern const EnvVar kDecodeOrder;
extern const EnvVar kDecodePrefetch;
extern const EnvVar kCublasLtAutotune;
extern const EnvVar kCublasLtTable;
extern const EnvVar kStreamGemmMaxM;
extern const EnvVar kDeterministicGemm;
extern const EnvVar kDeterministicGemmM;
extern const EnvVar kDeterministicPartition;
extern const EnvVar kDeterministicTokenGroups;
extern const EnvVar kDeterministicDecode;
extern const EnvVar kDeterministicSplitLoop;
extern const EnvVar kDeterministicGemmPrefill;
extern const EnvVar kDeterministicTiles;
extern const EnvVar kLoadThreads;
// Benchmarks only (kernels/cuda/bench_knobs.h, applied by tpserve-engine-bench).
extern const EnvVar kOpProfile;
extern const EnvVar kFusedSkinny;
extern const EnvVar kFusedNorm;
extern const EnvVar kAblateOps;
// Set by launchers.
extern const EnvVar kCudaVisibleDevices;
extern const EnvVar kOpenblasNumThreads;
extern const EnvVar kOmpiCommWorldSize;
extern const EnvVar kPmiSize;
extern const EnvVar kPmixRank;
extern const EnvVar kSlurmProcid;
extern const EnvVar kSlurmNtasks;
extern const EnvVar kSlurmLocalid;
extern const EnvVar kLocalRank;
}  // namespace env

// Every declared variable, in the order of the listing.
const std::vector<const EnvVar*>& DeclaredEnvVars();

// The parsed values of all declared variables. A value that does not parse (not a bool, an
// integer out of range, not one of the choices) is ignored with a warning: the default applies.
class EnvRegistry {
 public:
  using Lookup = std::function<std::optional<std::string>(const char* name)>;
  explicit EnvRegistry(const Lookup& lookup);

  bool IsSet(const EnvVar& var) const;  // present and valid
  bool Bool(const EnvVar& var) const;
  int64_t Int(const EnvVar& var) const;
  std::string String(const EnvVar& var) const;  // kString / kChoice (and the text of any)
  // Warnings about ignored values, then the TPSERVE_* switches set to a non-default value.
  const std::vector<std::string>& warnings() const { return warnings_; }
  const std::vector<std::string>& changed() const { return changed_; }
  // The `tpserve env` table: name, type, default, current value, meaning.
  std::string Table() const;

 private:
  struct Value {
    bool set = false;  // present and valid
    std::string text;  // the effective text (the default when not set)
  };
  const Value& Get(const EnvVar& var) const;

  std::map<std::string, Value> values_;
  std::vector<std::string> warnings_;
  std::vector<std::string> changed_;
};

// The process's registry, parsed from the environment on first use (thread-safe); the first
// call through the accessors below logs its warnings and changed switches once.
const EnvRegistry& Env();

inline bool EnvIsSet(const EnvVar& var) { return Env().IsSet(var); }
inline bool EnvBool(const EnvVar& var) { return Env().Bool(var); }
inline int64_t EnvInt(const EnvVar& var) { return Env().Int(var); }
inline std::string EnvString(const EnvVar& var) { return Env().String(var); }

// Started by mpirun / an MPI process manager (OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK set).
bool UnderMpi();

// This process's whole environment ("NAME=value" strings) with `var` set to `value` (any value
// it had is dropped): the environment of a child process, built before fork.
std::vector<std::string> EnvironmentWith(const EnvVar& var, const std::string& value);

// For common/logging only: the registry without logging its notes (logging reads its level
// from it, so it must not log while doing so).
const EnvRegistry& EnvWithoutLogging();

}  // namespace tpserve
