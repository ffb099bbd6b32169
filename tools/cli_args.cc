// Implementation of CliArgs.
#include "tools/cli_args.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tpserve {

absl::StatusOr<CliArgs> CliArgs::Parse(const std::vector<std::string>& args,
                                       const std::set<std::string>& value_flags,
                                       const std::set<std::string>& bool_flags) {
  CliArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0 || a == "--") {
      out.positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2);
    std::optional<std::string> value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (bool_flags.count(name)) {
      if (value && *value != "true" && *value != "1") {
        if (*value == "false" || *value == "0") continue;
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " takes no value"));
      }
      out.values_[name] = "true";
    } else if (value_flags.count(name)) {
      if (!value) {
        if (i + 1 >= args.size()) {
          return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
        }
        value = args[++i];
      }
      out.values_[name] = *value;
    } else {
      std::vector<std::string> known;
      for (const auto& f : value_flags) known.push_back("--" + f);
      for (const auto& f : bool_flags) known.push_back("--" + f);
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, " (known: ", absl::StrJoin(known, " "), ")"));
    }
  }
  return out;
}

std::optional<std::string> CliArgs::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<std::string> CliArgs::Required(const std::string& name) const {
  auto v = Get(name);
  if (!v) return absl::InvalidArgumentError(absl::StrCat("missing required flag --", name));
  return *v;
}

std::string CliArgs::GetOr(const std::string& name, const std::string& fallback) const {
  auto v = Get(name);
  return v ? *v : fallback;
}

absl::StatusOr<int64_t> CliArgs::GetInt(const std::string& name, int64_t fallback) const {
  auto v = Get(name);
  if (!v) return fallback;
  int64_t out;
  if (!absl::SimpleAtoi(*v, &out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --", name, " expects an integer, got '", *v, "'"));
  }
  return out;
}

absl::StatusOr<double> CliArgs::GetDouble(const std::string& name, double fallback) const {
  auto v = Get(name);
  if (!v) return fallback;
  double out;
  if (!absl::SimpleAtod(*v, &out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --", name, " expects a number, got '", *v, "'"));
  }
  return out;
}

}  // namespace tpserve
