// Command-line flags: each command declares its flags once in a table (name, kind, range, a
// one-line meaning); parsing is checked against the table and the usage text is generated from it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tpserve {

enum class FlagKind { kString, kInt, kFloat, kBool };

struct FlagSpec {
  std::string name;  // without the leading "--"
  FlagKind kind = FlagKind::kString;
  std::string meaning;  // one line, shown by --help
  std::string value;    // placeholder in the usage, e.g. "DIR"; empty: from the kind
  int64_t int_min = 0;  // kInt: inclusive range
  int64_t int_max = 0;
  double min = 0;  // kFloat: inclusive range ...
  double max = 0;
  bool min_exclusive = false;  // ... except (min, max] when set
  bool repeated = false;       // may be given several times (GetAll); else the last one counts
};

struct CommandSpec {
  std::string name;     // "tpserve serve", "tpserve-worker"
  std::string summary;  // one line on what the command does
  std::vector<FlagSpec> flags;
  std::string notes;  // optional text after the flag list (examples, grouping, formats)
};

// Shorthands for the tables.
FlagSpec StringFlag(std::string name, std::string value, std::string meaning);
FlagSpec BoolFlag(std::string name, std::string meaning);
FlagSpec IntFlag(std::string name, int64_t min, int64_t max, std::string meaning,
                 std::string value = "N");
FlagSpec FloatFlag(std::string name, double min, double max, std::string meaning,
                   std::string value = "F", bool min_exclusive = false);
// `f`, given any number of times.
FlagSpec Repeated(FlagSpec f);

// --kv-cache-dtype, one text for every command that takes it (serve, run, the worker, the
// benchmarks); its value is parsed with ParseKvCacheDType (common/dtype.h).
FlagSpec KvCacheDTypeFlag();

// "--name VALUE", "--name=VALUE" and boolean "--name" (or "--name=true|false|1|0", or
// "--no-name" for false). A value that
// is not of the flag's kind or not in its range, an unknown flag, a missing value and any
// positional argument are errors naming what was wrong. "--help" / "-h" anywhere (but as a value)
// stops parsing and sets help().
class Flags {
 public:
  static absl::StatusOr<Flags> Parse(const CommandSpec& spec, const std::vector<std::string>& args);

  bool help() const { return help_; }
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  // A boolean flag given as --name or --name=true|1 (false when absent, --name=false|0 or
  // --no-name).
  bool Flag(const std::string& name) const { return GetOr(name, "false") == "true"; }
  // A boolean flag's value, or `fallback` when it was not given (for flags on by default).
  bool GetBool(const std::string& name, bool fallback) const;
  std::optional<std::string> Get(const std::string& name) const;
  absl::StatusOr<std::string> Required(const std::string& name) const;
  std::string GetOr(const std::string& name, const std::string& fallback) const;
  // Values were checked by Parse; these return `fallback` when the flag was not given.
  int64_t GetInt(const std::string& name, int64_t fallback) const;
  double GetDouble(const std::string& name, double fallback) const;
  // Every value of a repeated flag, in the order given (empty when absent).
  std::vector<std::string> GetAll(const std::string& name) const;

 private:
  bool help_ = false;
  std::map<std::string, std::string> values_;
  std::map<std::string, std::vector<std::string>> all_;  // repeated flags
};

// A comma-separated list of token ids given to --`flag` ("1,2,3"; spaces around ids allowed):
// an empty list, an empty entry ("1,,2") or a non-integer is an error naming the flag.
absl::StatusOr<std::vector<int32_t>> ParseTokenIds(const std::string& flag,
                                                   const std::string& text);

// A gRPC server address given to --`flag`: a port after the last ':' must be in [1, 65535]
// (gRPC itself would wrap a larger one around).
absl::Status CheckServerAddress(const std::string& flag, const std::string& address);

// The usage text generated from the table: every declared flag with its range and meaning.
std::string Usage(const CommandSpec& spec);

// For the commands: prints Usage(spec) to stdout (a --help answer) and returns OK.
absl::Status PrintUsage(const CommandSpec& spec);

}  // namespace tpserve
