// A small metrics registry: counters, gauges and fixed-bucket histograms with labels, rendered in
// the Prometheus text exposition format (version 0.0.4) for GET /metrics.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tpserve {

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

// A monotonic total. Set() mirrors a total kept elsewhere (e.g. the scheduler's preemptions).
class Counter {
 public:
  void Add(double v = 1);
  void Set(double total);
  double value() const;

 private:
  mutable absl::Mutex mu_;
  double value_ ABSL_GUARDED_BY(mu_) = 0;
};

class Gauge {
 public:
  void Set(double v);
  double value() const;

 private:
  mutable absl::Mutex mu_;
  double value_ ABSL_GUARDED_BY(mu_) = 0;
};

// Cumulative buckets by upper bound (+Inf implied), sum and count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // one per bound, then +Inf (== count)
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, not cumulative; +Inf last
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// Owns every metric; pointers it returns stay valid for its lifetime. Thread-safe.
class MetricsRegistry {
 public:
  Counter* GetCounter(const std::string& name, const std::string& help, MetricLabels labels = {});
  Gauge* GetGauge(const std::string& name, const std::string& help, MetricLabels labels = {});
  Histogram* GetHistogram(const std::string& name, const std::string& help,
                          std::vector<double> bounds, MetricLabels labels = {});
  // Runs before each Render (refreshes gauges read from elsewhere, e.g. scheduler stats).
  void AddCollector(std::function<void()> collect);
  // The Prometheus text format, families sorted by name.
  std::string Render();

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    std::string help;
    // Keyed by the rendered label set, e.g. `rank="0"`.
    std::map<std::string, std::unique_ptr<Counter>> counters;
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
  };
  Family& FamilyFor(const std::string& name, const std::string& help, Type type)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> collectors_ ABSL_GUARDED_BY(mu_);
};

// Bucket bounds: `count` values from `start`, each `factor` times the previous.
std::vector<double> ExponentialBuckets(double start, double factor, int count);

}  // namespace tpserve
