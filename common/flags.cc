// Implementation of the flag tables: parsing with kind and range checks, and the usage text.
#include "common/flags.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace tpserve {
namespace {

const FlagSpec* Find(const CommandSpec& spec, const std::string& name) {
  for (const FlagSpec& f : spec.flags) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string RangeText(const FlagSpec& f) {
  if (f.kind == FlagKind::kInt) {
    return absl::StrCat("[", f.int_min, ", ", f.int_max, "]");
  }
  return absl::StrCat(f.min_exclusive ? "(" : "[", f.min, ", ", f.max, "]");
}

std::string Placeholder(const FlagSpec& f) {
  if (!f.value.empty()) return f.value;
  switch (f.kind) {
    case FlagKind::kInt:
      return "N";
    case FlagKind::kFloat:
      return "F";
    default:
      return "VALUE";
  }
}

// Checks a value against the flag's kind and range.
absl::Status CheckValue(const CommandSpec& spec, const FlagSpec& f, const std::string& value) {
  if (f.kind == FlagKind::kInt) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(value, &v) || v < f.int_min || v > f.int_max) {
      return absl::InvalidArgumentError(absl::StrCat(spec.name, ": --", f.name,
                                                     " expects an integer in ", RangeText(f),
                                                     ", got '", value, "'"));
    }
  } else if (f.kind == FlagKind::kFloat) {
    double v = 0;
    const bool in_range = absl::SimpleAtod(value, &v) && !std::isnan(v) &&
                          (f.min_exclusive ? v > f.min : v >= f.min) && v <= f.max;
    if (!in_range) {
      return absl::InvalidArgumentError(absl::StrCat(
          spec.name, ": --", f.name, " expects a number in ", RangeText(f), ", got '", value, "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

FlagSpec StringFlag(std::string name, std::string value, std::string meaning) {
  FlagSpec f;
  f.name = std::move(name);
  f.kind = FlagKind::kString;
  f.value = std::move(value);
  f.meaning = std::move(meaning);
  return f;
}

FlagSpec KvCacheDTypeFlag() {
  return StringFlag("kv-cache-dtype", "auto|bf16|fp8|int8|int4",
                    "what the KV cache stores: auto (the compute dtype: bf16 on CUDA, fp32 on the "
                    "CPU), or quantized fp8 (e4m3) / int8 with a scale per token and head, int4 "
                    "with one per 64 elements: ~1.9x / ~3.6x the tokens in the same memory");
}

FlagSpec BoolFlag(std::string name, std::string meaning) {
  FlagSpec f;
  f.name = std::move(name);
  f.kind = FlagKind::kBool;
  f.meaning = std::move(meaning);
  return f;
}

FlagSpec IntFlag(std::string name, int64_t min, int64_t max, std::string meaning,
                 std::string value) {
  FlagSpec f;
  f.name = std::move(name);
  f.kind = FlagKind::kInt;
  f.int_min = min;
  f.int_max = max;
  f.meaning = std::move(meaning);
  f.value = std::move(value);
  return f;
}

FlagSpec FloatFlag(std::string name, double min, double max, std::string meaning, std::string value,
                   bool min_exclusive) {
  FlagSpec f;
  f.name = std::move(name);
  f.kind = FlagKind::kFloat;
  f.min = min;
  f.max = max;
  f.min_exclusive = min_exclusive;
  f.meaning = std::move(meaning);
  f.value = std::move(value);
  return f;
}

absl::StatusOr<Flags> Flags::Parse(const CommandSpec& spec, const std::vector<std::string>& args) {
  Flags out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      out.help_ = true;
      return out;
    }
    if (a.rfind("--", 0) != 0 || a == "--") {
      return absl::InvalidArgumentError(absl::StrCat(spec.name, ": unexpected argument '", a,
                                                     "' (flags are --name VALUE; see --help)"));
    }
    std::string name = a.substr(2);
    std::optional<std::string> value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const FlagSpec* f = Find(spec, name);
    if (f == nullptr && !value && name.rfind("no-", 0) == 0) {
      // --no-NAME turns a boolean NAME off (for flags that are on by default).
      const FlagSpec* negated = Find(spec, name.substr(3));
      if (negated != nullptr && negated->kind == FlagKind::kBool) {
        out.values_[negated->name] = "false";
        continue;
      }
    }
    if (f == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(spec.name, ": unknown flag --", name, " (see --help)"));
    }
    if (f->kind == FlagKind::kBool) {
      if (value && *value != "true" && *value != "1") {
        if (*value == "false" || *value == "0") {
          out.values_[name] = "false";
          continue;
        }
        return absl::InvalidArgumentError(
            absl::StrCat(spec.name, ": flag --", name, " takes no value (got '", *value, "')"));
      }
      out.values_[name] = "true";
      continue;
    }
    if (!value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(spec.name, ": flag --", name, " needs a value"));
      }
      value = args[++i];
    }
    if (absl::Status s = CheckValue(spec, *f, *value); !s.ok()) return s;
    out.values_[name] = *value;
    if (f->repeated) out.all_[name].push_back(*value);
  }
  return out;
}

std::optional<std::string> Flags::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<std::string> Flags::Required(const std::string& name) const {
  auto v = Get(name);
  if (!v) return absl::InvalidArgumentError(absl::StrCat("missing required flag --", name));
  return *v;
}

std::string Flags::GetOr(const std::string& name, const std::string& fallback) const {
  auto v = Get(name);
  return v ? *v : fallback;
}

bool Flags::GetBool(const std::string& name, bool fallback) const {
  auto v = Get(name);
  return v ? *v == "true" : fallback;
}

int64_t Flags::GetInt(const std::string& name, int64_t fallback) const {
  auto v = Get(name);
  int64_t out = fallback;
  if (v && !absl::SimpleAtoi(*v, &out)) out = fallback;  // unreachable: Parse checked it
  return out;
}

double Flags::GetDouble(const std::string& name, double fallback) const {
  auto v = Get(name);
  double out = fallback;
  if (v && !absl::SimpleAtod(*v, &out)) out = fallback;  // unreachable: Parse checked it
  return out;
}

FlagSpec Repeated(FlagSpec f) {
  f.repeated = true;
  return f;
}

std::vector<std::string> Flags::GetAll(const std::string& name) const {
  auto it = all_.find(name);
  return it == all_.end() ? std::vector<std::string>() : it->second;
}

absl::StatusOr<std::vector<int32_t>> ParseTokenIds(const std::string& flag,
                                                   const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t id;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(
          absl::StripAsciiWhitespace(part).empty()
              ? absl::StrCat("--", flag, ": '", text, "' has an empty entry (ids are 1,2,3)")
              : absl::StrCat("--", flag, ": '", std::string(part), "' is not an integer token id"));
    }
    ids.push_back(id);
  }
  return ids;
}

absl::Status CheckServerAddress(const std::string& flag, const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return absl::OkStatus();
  const std::string port = address.substr(colon + 1);
  if (port.empty() || port.size() > 9 ||
      port.find_first_not_of("0123456789") != std::string::npos) {
    return absl::OkStatus();  // not a port (a unix: path, a bare IPv6 address...)
  }
  const int value = std::stoi(port);
  if (value < 1 || value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": port ", port, " of '", address, "' is outside [1, 65535]"));
  }
  return absl::OkStatus();
}

std::string Usage(const CommandSpec& spec) {
  std::string out = absl::StrCat("usage: ", spec.name, " [flags]\n");
  if (!spec.summary.empty()) absl::StrAppend(&out, spec.summary, "\n");
  absl::StrAppend(&out, "\nflags:\n");
  for (const FlagSpec& f : spec.flags) {
    std::string left = absl::StrCat("--", f.name);
    if (f.kind != FlagKind::kBool) absl::StrAppend(&left, " ", Placeholder(f));
    std::string meaning = f.meaning;
    if (f.kind == FlagKind::kInt || f.kind == FlagKind::kFloat) {
      absl::StrAppend(&meaning, " ", RangeText(f));
    }
    if (f.repeated) absl::StrAppend(&meaning, " (may be repeated)");
    if (left.size() <= 30) {
      absl::StrAppend(&out, absl::StrFormat("  %-30s %s\n", left, meaning));
    } else {
      absl::StrAppend(&out, "  ", left, "\n", std::string(33, ' '), meaning, "\n");
    }
  }
  absl::StrAppend(&out, "  --help, -h                     print this help and exit\n");
  if (!spec.notes.empty()) absl::StrAppend(&out, "\n", spec.notes, "\n");
  return out;
}

absl::Status PrintUsage(const CommandSpec& spec) {
  const std::string text = Usage(spec);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace tpserve
