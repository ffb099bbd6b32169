// The metrics registry's Prometheus text exposition: types, labels, histogram buckets.
#include "coordinator/metrics.h"

#include <gtest/gtest.h>

#include "coordinator/serving_metrics.h"

namespace tpserve {
namespace {

bool Has(const std::string& text, const std::string& line) {
  return text.find(line + "\n") != std::string::npos;
}

TEST(MetricsTest, RendersCountersGaugesAndLabelledSeries) {
  MetricsRegistry r;
  r.GetCounter("tpserve:things_total", "Things.")->Add(3);
  r.GetGauge("tpserve:level", "Level.", {{"rank", "1"}})->Set(0.25);
  r.GetGauge("tpserve:level", "Level.", {{"rank", "0"}})->Set(7);
  r.GetGauge("tpserve:quoted", "Quoted.", {{"v", "a\"b\\c"}})->Set(1);
  const std::string t = r.Render();
  EXPECT_TRUE(Has(t, "# TYPE tpserve:things_total counter")) << t;
  EXPECT_TRUE(Has(t, "tpserve:things_total 3")) << t;
  EXPECT_TRUE(Has(t, "# TYPE tpserve:level gauge")) << t;
  EXPECT_TRUE(Has(t, "tpserve:level{rank=\"0\"} 7")) << t;
  EXPECT_TRUE(Has(t, "tpserve:level{rank=\"1\"} 0.25")) << t;
  EXPECT_TRUE(Has(t, "tpserve:quoted{v=\"a\\\"b\\\\c\"} 1")) << t;
  // The same name and labels give the same series.
  r.GetCounter("tpserve:things_total", "Things.")->Add(1);
  EXPECT_TRUE(Has(r.Render(), "tpserve:things_total 4"));
}

TEST(MetricsTest, HistogramBucketsAreCumulativeWithInfSumAndCount) {
  MetricsRegistry r;
  Histogram* h = r.GetHistogram("tpserve:lat_seconds", "Latency.", {0.1, 1.0});
  h->Observe(0.05);
  h->Observe(0.1);  // le is inclusive
  h->Observe(0.5);
  h->Observe(3.0);
  const std::string t = r.Render();
  EXPECT_TRUE(Has(t, "# TYPE tpserve:lat_seconds histogram")) << t;
  EXPECT_TRUE(Has(t, "tpserve:lat_seconds_bucket{le=\"0.1\"} 2")) << t;
  EXPECT_TRUE(Has(t, "tpserve:lat_seconds_bucket{le=\"1\"} 3")) << t;
  EXPECT_TRUE(Has(t, "tpserve:lat_seconds_bucket{le=\"+Inf\"} 4")) << t;
  EXPECT_TRUE(Has(t, "tpserve:lat_seconds_sum 3.65")) << t;
  EXPECT_TRUE(Has(t, "tpserve:lat_seconds_count 4")) << t;
}

TEST(MetricsTest, ServingMetricsRecordFinishedRequestsByReason) {
  MetricsRegistry r;
  ServingMetrics m(&r);
  FinalInfo info;
  info.reason = Finish::kLength;
  info.prompt_tokens = 5;
  info.output_tokens = 3;
  info.queued_s = 0.01;
  info.ttft_s = 0.2;
  info.total_s = 0.6;
  m.OnRequestFinished(absl::OkStatus(), info);
  m.OnRequestFinished(absl::CancelledError("gone"), FinalInfo{});
  m.OnStep(0.003);
  m.SetWorkerMemory(1, 100, 1000);
  const std::string t = r.Render();
  EXPECT_TRUE(Has(t, "tpserve:request_success_total{finished_reason=\"length\"} 1")) << t;
  EXPECT_TRUE(Has(t, "tpserve:request_success_total{finished_reason=\"abort\"} 1")) << t;
  EXPECT_TRUE(Has(t, "tpserve:request_success_total{finished_reason=\"stop\"} 0")) << t;
  EXPECT_TRUE(Has(t, "tpserve:prompt_tokens_total 5")) << t;
  EXPECT_TRUE(Has(t, "tpserve:generation_tokens_total 3")) << t;
  EXPECT_TRUE(Has(t, "tpserve:time_to_first_token_seconds_count 1")) << t;
  EXPECT_TRUE(Has(t, "tpserve:time_per_output_token_seconds_sum 0.2")) << t;  // (0.6-0.2)/2
  EXPECT_TRUE(Has(t, "tpserve:step_duration_seconds_count 1")) << t;
  EXPECT_TRUE(Has(t, "tpserve:worker_device_memory_total_bytes{rank=\"1\"} 1000")) << t;
  EXPECT_TRUE(Has(t, "tpserve:num_requests_running 0")) << t;  // no scheduler yet
}

}  // namespace
}  // namespace tpserve
