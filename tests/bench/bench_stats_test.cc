// Statistics of the load generator: percentiles, summaries and the report of known records.
#include <gtest/gtest.h>

#include "tools/bench/load_gen.h"
#include "tools/bench/stats.h"

namespace tpserve::bench {
namespace {

TEST(PercentileTest, MatchesNumpyLinearInterpolation) {
  const std::vector<double> v = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  // numpy.percentile([1..10], q): 50 -> 5.5, 90 -> 9.1, 99 -> 9.91, 0 -> 1, 100 -> 10.
  EXPECT_DOUBLE_EQ(PercentileOfSorted(v, 50), 5.5);
  EXPECT_DOUBLE_EQ(PercentileOfSorted(v, 90), 9.1);
  EXPECT_NEAR(PercentileOfSorted(v, 99), 9.91, 1e-12);
  EXPECT_DOUBLE_EQ(PercentileOfSorted(v, 0), 1);
  EXPECT_DOUBLE_EQ(PercentileOfSorted(v, 100), 10);
  EXPECT_DOUBLE_EQ(PercentileOfSorted(v, 25), 3.25);
}

TEST(PercentileTest, SingleValueAndEmpty) {
  EXPECT_DOUBLE_EQ(PercentileOfSorted({42}, 0), 42);
  EXPECT_DOUBLE_EQ(PercentileOfSorted({42}, 99), 42);
  EXPECT_DOUBLE_EQ(PercentileOfSorted({}, 50), 0);
}

TEST(SummarizeTest, UnsortedInput) {
  // 1..100 shuffled: mean 50.5, median 50.5, p90 90.1, p99 99.01.
  std::vector<double> v;
  for (int i = 0; i < 100; ++i) v.push_back((i * 37) % 100 + 1);
  const Summary s = Summarize(v);
  EXPECT_EQ(s.count, 100);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
  EXPECT_DOUBLE_EQ(s.median, 50.5);
  EXPECT_NEAR(s.p90, 90.1, 1e-9);
  EXPECT_NEAR(s.p99, 99.01, 1e-9);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 100);
}

TEST(SummarizeTest, EvenCountMedianAndSkew) {
  const Summary s = Summarize({10, 1, 1000, 2});
  EXPECT_DOUBLE_EQ(s.mean, 253.25);
  EXPECT_DOUBLE_EQ(s.median, 6);  // between 2 and 10
  EXPECT_EQ(Summarize({}).count, 0);
}

RequestRecord Ok(double ttft, double e2e, int64_t out, std::vector<double> itl) {
  RequestRecord r;
  r.ok = true;
  r.ttft_s = ttft;
  r.e2e_s = e2e;
  r.prompt_tokens = 10;
  r.output_tokens = out;
  r.max_new_tokens = out;
  r.itl_s = std::move(itl);
  return r;
}

TEST(ComputeReportTest, KnownRecords) {
  std::vector<RequestRecord> records;
  // TPOT = (e2e - ttft) / (out - 1): (1.05 - 0.05) / 10 = 100 ms, (0.5 - 0.1) / 4 = 100 ms.
  records.push_back(Ok(0.05, 1.05, 11, {0.1, 0.1}));
  records.push_back(Ok(0.1, 0.5, 5, {0.2}));
  records.push_back(Ok(0.2, 0.2, 1, {}));  // one token: no TPOT
  RequestRecord failed;
  failed.error_code = "RESOURCE_EXHAUSTED";
  records.push_back(failed);
  failed.error_code = "UNAVAILABLE";
  records.push_back(failed);
  failed.error_code = "RESOURCE_EXHAUSTED";
  records.push_back(failed);
  RequestRecord short_output = Ok(0.1, 0.2, 2, {0.1});
  short_output.max_new_tokens = 4;
  records.push_back(short_output);

  const Report r = ComputeReport(records, /*duration_s=*/2.0);
  EXPECT_EQ(r.num_requests, 7);
  EXPECT_EQ(r.completed, 4);
  EXPECT_EQ(r.failed, 3);
  EXPECT_EQ(r.errors.at("RESOURCE_EXHAUSTED"), 2);
  EXPECT_EQ(r.errors.at("UNAVAILABLE"), 1);
  EXPECT_EQ(r.output_length_mismatches, 1);
  EXPECT_EQ(r.input_tokens, 40);
  EXPECT_EQ(r.output_tokens, 19);
  EXPECT_DOUBLE_EQ(r.request_throughput, 2.0);
  EXPECT_DOUBLE_EQ(r.output_throughput, 9.5);
  EXPECT_DOUBLE_EQ(r.total_token_throughput, 29.5);
  EXPECT_EQ(r.ttft_ms.count, 4);
  EXPECT_NEAR(r.ttft_ms.mean, (50 + 100 + 200 + 100) / 4.0, 1e-9);
  EXPECT_EQ(r.tpot_ms.count, 3);  // the one-token request has none
  EXPECT_NEAR(r.tpot_ms.median, 100, 1e-9);
  EXPECT_EQ(r.itl_ms.count, 4);
  EXPECT_NEAR(r.itl_ms.mean, 125, 1e-9);
  EXPECT_EQ(r.e2e_ms.count, 4);
  EXPECT_NEAR(r.e2e_ms.max, 1050, 1e-9);
}

TEST(ComputeReportTest, UnaryRecordsHaveNoTtft) {
  RequestRecord r = Ok(-1, 0.3, 4, {});
  const Report rep = ComputeReport({r}, 1.0);
  EXPECT_EQ(rep.completed, 1);
  EXPECT_EQ(rep.ttft_ms.count, 0);
  EXPECT_EQ(rep.tpot_ms.count, 0);
  EXPECT_EQ(rep.e2e_ms.count, 1);
}

}  // namespace
}  // namespace tpserve::bench
