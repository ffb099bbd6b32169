// Summary statistics of the load generator: percentiles (linear interpolation between closest
// ranks, as numpy's default) and mean / median / p90 / p99 of a sample.
#pragma once

#include <cstdint>
#include <vector>

namespace tpserve::bench {

struct Summary {
  int64_t count = 0;
  double mean = 0;
  double median = 0;
  double p90 = 0;
  double p99 = 0;
  double min = 0;
  double max = 0;
};

// The q-th percentile (0 <= q <= 100) of `sorted` (ascending, non-empty): the value at rank
// q / 100 * (n - 1), interpolated linearly between the two closest ranks.
double PercentileOfSorted(const std::vector<double>& sorted, double q);

// Summary of `values` (any order). An empty sample gives count 0 and zeros.
Summary Summarize(std::vector<double> values);

}  // namespace tpserve::bench
