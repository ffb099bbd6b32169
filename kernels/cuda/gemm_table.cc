// The cuBLASLt algorithm table (see gemm_table.h).
#include "kernels/cuda/gemm_table.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/env.h"
#include "common/logging.h"
#include "nlohmann/json.hpp"

namespace tpserve::cuda {
namespace {

using Json = nlohmann::json;

// The value of `key` in entry `e` as an integer in [lo, hi].
absl::StatusOr<int64_t> IntField(const Json& e, const char* key, int64_t lo, int64_t hi,
                                 const std::string& where) {
  auto it = e.find(key);
  if (it == e.end()) return absl::InvalidArgumentError(absl::StrCat(where, ": no \"", key, "\""));
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"", key, "\" is ", it->dump(), ", not an integer"));
  }
  const int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"", key, "\" = ", v, " is outside [", lo, ", ", hi, "]"));
  }
  return v;
}

absl::StatusOr<std::string> StringField(const Json& e, const char* key, const std::string& where) {
  auto it = e.find(key);
  if (it == e.end()) return absl::InvalidArgumentError(absl::StrCat(where, ": no \"", key, "\""));
  if (!it->is_string() || it->get<std::string>().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"", key, "\" is ", it->dump(), ", not a non-empty string"));
  }
  return it->get<std::string>();
}

}  // namespace

absl::StatusOr<LtTable> LtTable::Parse(const std::string& json, const std::string& source) {
  Json doc = Json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat("cuBLASLt table ", source, ": not valid JSON"));
  }
  if (!doc.is_object() || !doc.contains("entries") || !doc["entries"].is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuBLASLt table ", source, ": expected an object with an \"entries\" array"));
  }
  LtTable table;
  table.source_ = source;
  std::set<std::tuple<std::string, int, int, int64_t, int64_t, int64_t, bool, int>> seen;
  constexpr int64_t kMaxDim = int64_t{1} << 31;
  const Json& entries = doc["entries"];
  for (size_t i = 0; i < entries.size(); ++i) {
    const Json& e = entries[i];
    const std::string where = absl::StrCat("cuBLASLt table ", source, ", entry ", i);
    if (!e.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
    LtTableEntry t;
    absl::StatusOr<std::string> device = StringField(e, "device", where);
    if (!device.ok()) return device.status();
    t.device = *device;
    absl::StatusOr<std::string> config = StringField(e, "config", where);
    if (!config.ok()) return config.status();
    t.config = *config;
    auto bias = e.find("bias");
    if (bias == e.end() || !bias->is_boolean()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"bias\" must be true or false"));
    }
    t.bias = bias->get<bool>();
    struct IntKey {
      const char* key;
      int64_t lo, hi;
      int64_t* out;
    };
    int64_t sms = 0, cublaslt = 0, alignment = 0, candidate = 0;
    for (const IntKey& f : {IntKey{"sms", 1, 100000, &sms},
                            IntKey{"cublaslt", 1, std::numeric_limits<int>::max(), &cublaslt},
                            IntKey{"m", 1, kMaxDim, &t.m}, IntKey{"n", 1, kMaxDim, &t.n},
                            IntKey{"k", 1, kMaxDim, &t.k}, IntKey{"alignment", 2, 256, &alignment},
                            IntKey{"candidate", 0, 1023, &candidate}}) {
      absl::StatusOr<int64_t> v = IntField(e, f.key, f.lo, f.hi, where);
      if (!v.ok()) return v.status();
      *f.out = *v;
    }
    t.sms = static_cast<int>(sms);
    t.cublaslt = static_cast<int>(cublaslt);
    t.alignment = static_cast<int>(alignment);
    t.candidate = static_cast<int>(candidate);
    if ((t.alignment & (t.alignment - 1)) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": \"alignment\" = ", t.alignment, " is not a power of two"));
    }
    if (!seen.emplace(t.device, t.sms, t.cublaslt, t.m, t.n, t.k, t.bias, t.alignment).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a second entry for ", t.device,
                                                     " M=", t.m, " N=", t.n, " K=", t.k));
    }
    table.entries_.push_back(std::move(t));
  }
  return table;
}

absl::StatusOr<std::string> LtTable::Agreement(const std::string& a, const std::string& b,
                                               const std::string& about) {
  for (const auto& [text, name] : {std::pair{&a, "first"}, std::pair{&b, "second"}}) {
    absl::StatusOr<LtTable> t = Parse(*text, name);
    if (!t.ok()) return t.status();
  }
  const Json ja = Json::parse(a), jb = Json::parse(b);
  Json entries = Json::array();
  for (const Json& ea : ja["entries"]) {
    for (const Json& eb : jb["entries"]) {
      bool same = true;
      for (const char* key : {"device", "sms", "cublaslt", "m", "n", "k", "bias", "alignment",
                              "candidate", "config"}) {
        same = same && ea[key] == eb[key];
      }
      if (!same) continue;
      Json e = ea;
      for (const char* key : {"first_us", "best_us"}) {
        if (ea.contains(key) && eb.contains(key) && ea[key].is_number() && eb[key].is_number()) {
          e[key] = std::round((ea[key].get<double>() + eb[key].get<double>()) * 5) / 10;
        }
      }
      e["sweeps"] = 2;
      entries.push_back(e);
      break;
    }
  }
  Json out;
  out["about"] = about;
  out["entries"] = entries;
  return out.dump(2) + "\n";
}

const LtTable& LtTable::Process() {
  static const LtTable* table = [] {
    const std::string setting = EnvString(env::kCublasLtTable);
    if (setting == "off") return new LtTable();
    std::string text = BuiltinJson(), source = "built-in (kernels/cuda/cublaslt_table.json)";
    if (setting != "builtin") {
      std::ifstream in(setting);
      TP_CHECK(in.good()) << "TPSERVE_CUBLASLT_TABLE=" << setting
                          << ": cannot read the file (set it to a cuBLASLt table written by "
                             "`tpserve-cuda-bench --lt-sweep`, \"builtin\" or \"off\")";
      std::ostringstream ss;
      ss << in.rdbuf();
      text = ss.str();
      source = setting;
    }
    absl::StatusOr<LtTable> parsed = Parse(text, source);
    TP_CHECK(parsed.ok()) << parsed.status().message();
    return new LtTable(std::move(*parsed));
  }();
  return *table;
}

const LtTableEntry* LtTable::Find(const std::string& device, int sms, int cublaslt, int64_t m,
                                  int64_t n, int64_t k, bool bias, int alignment) const {
  for (const LtTableEntry& e : entries_) {
    if (e.m == m && e.n == n && e.k == k && e.bias == bias && e.alignment == alignment &&
        e.sms == sms && e.cublaslt == cublaslt && e.device == device) {
      return &e;
    }
  }
  return nullptr;
}

int LtTable::CountFor(const std::string& device, int sms, int cublaslt) const {
  int count = 0;
  for (const LtTableEntry& e : entries_) {
    count += e.device == device && e.sms == sms && e.cublaslt == cublaslt;
  }
  return count;
}

}  // namespace tpserve::cuda
