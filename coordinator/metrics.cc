// The metrics registry and its Prometheus text rendering (see metrics.h).
#include "coordinator/metrics.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"

namespace tpserve {

void Counter::Add(double v) {
  absl::MutexLock lock(&mu_);
  value_ += v;
}
void Counter::Set(double total) {
  absl::MutexLock lock(&mu_);
  value_ = total;
}
double Counter::value() const {
  absl::MutexLock lock(&mu_);
  return value_;
}

void Gauge::Set(double v) {
  absl::MutexLock lock(&mu_);
  value_ = v;
}
double Gauge::value() const {
  absl::MutexLock lock(&mu_);
  return value_;
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::Observe(double v) {
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += v;
  ++count_;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  absl::MutexLock lock(&mu_);
  uint64_t running = 0;
  for (uint64_t c : counts_) {
    running += c;
    s.cumulative.push_back(running);
  }
  s.sum = sum_;
  s.count = count_;
  return s;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> b;
  for (int i = 0; i < count; ++i, start *= factor) b.push_back(start);
  return b;
}

namespace {

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string LabelKey(const MetricLabels& labels) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : labels)
    parts.push_back(absl::StrCat(k, "=\"", EscapeLabelValue(v), "\""));
  return absl::StrJoin(parts, ",");
}

// `name{labels}` or `name`, with `extra` appended to the label set (the histogram's le).
std::string Series(const std::string& name, const std::string& key, const std::string& extra = "") {
  const std::string all = key.empty() ? extra : extra.empty() ? key : absl::StrCat(key, ",", extra);
  return all.empty() ? name : absl::StrCat(name, "{", all, "}");
}

std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrCat(static_cast<int64_t>(v));
  return absl::StrCat(v);
}

}  // namespace

MetricsRegistry::Family& MetricsRegistry::FamilyFor(const std::string& name,
                                                    const std::string& help, Type type) {
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second.type = type;
    it->second.help = help;
  }
  TP_CHECK(it->second.type == type) << "metric " << name << " registered with two types";
  return it->second;
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help,
                                     MetricLabels labels) {
  absl::MutexLock lock(&mu_);
  auto& slot = FamilyFor(name, help, Type::kCounter).counters[LabelKey(labels)];
  if (!slot) slot = std::make_unique<Counter>();
  return slot.get();
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help,
                                 MetricLabels labels) {
  absl::MutexLock lock(&mu_);
  auto& slot = FamilyFor(name, help, Type::kGauge).gauges[LabelKey(labels)];
  if (!slot) slot = std::make_unique<Gauge>();
  return slot.get();
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help,
                                         std::vector<double> bounds, MetricLabels labels) {
  absl::MutexLock lock(&mu_);
  auto& slot = FamilyFor(name, help, Type::kHistogram).histograms[LabelKey(labels)];
  if (!slot) slot = std::make_unique<Histogram>(std::move(bounds));
  return slot.get();
}

void MetricsRegistry::AddCollector(std::function<void()> collect) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collect));
}

std::string MetricsRegistry::Render() {
  std::vector<std::function<void()>> collectors;
  {
    absl::MutexLock lock(&mu_);
    collectors = collectors_;
  }
  for (auto& c : collectors) c();  // outside mu_: they call GetGauge / Set
  absl::MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    const char* type = f.type == Type::kCounter ? "counter"
                       : f.type == Type::kGauge ? "gauge"
                                                : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", f.help, "\n# TYPE ", name, " ", type, "\n");
    for (const auto& [key, c] : f.counters) {
      absl::StrAppend(&out, Series(name, key), " ", Number(c->value()), "\n");
    }
    for (const auto& [key, g] : f.gauges) {
      absl::StrAppend(&out, Series(name, key), " ", Number(g->value()), "\n");
    }
    for (const auto& [key, h] : f.histograms) {
      const Histogram::Snapshot s = h->snapshot();
      for (size_t i = 0; i < s.cumulative.size(); ++i) {
        const std::string le = i < s.bounds.size() ? Number(s.bounds[i]) : std::string("+Inf");
        absl::StrAppend(&out, Series(name + "_bucket", key, absl::StrCat("le=\"", le, "\"")), " ",
                        s.cumulative[i], "\n");
      }
      absl::StrAppend(&out, Series(name + "_sum", key), " ", Number(s.sum), "\n");
      absl::StrAppend(&out, Series(name + "_count", key), " ", s.count, "\n");
    }
  }
  return out;
}

}  // namespace tpserve
