// The coordinator's flags that size the workers: --gpu-memory-utilization (forwarded to every
// worker in its Assignment) and --kv-cache-mb; the HTTP front end's --http-port and --api-key.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/server.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;

TEST(CoordinatorFlagsTest, GpuMemoryUtilizationDefaultsToNinetyPercent) {
  auto o = ParseCoordinatorFlags({"--model", "m"}, /*serve_command=*/true);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_DOUBLE_EQ(o->gpu_memory_utilization, 0.90);
  EXPECT_EQ(o->kv_cache_mb, 0);
}

TEST(CoordinatorFlagsTest, GpuMemoryUtilizationIsParsedAndRangeChecked) {
  auto o = ParseCoordinatorFlags({"--model", "m", "--gpu-memory-utilization", "0.5"}, true);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_DOUBLE_EQ(o->gpu_memory_utilization, 0.5);
  o = ParseCoordinatorFlags({"--model", "m", "--gpu-memory-utilization=1"}, false);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_DOUBLE_EQ(o->gpu_memory_utilization, 1.0);
  for (const char* bad : {"0", "1.5", "-0.1"}) {
    o = ParseCoordinatorFlags({"--model", "m", "--gpu-memory-utilization", bad}, true);
    ASSERT_FALSE(o.ok()) << bad;
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(o.status().message()), HasSubstr("(0, 1]"));
  }
  o = ParseCoordinatorFlags({"--model", "m", "--gpu-memory-utilization", "most"}, true);
  EXPECT_FALSE(o.ok());
  EXPECT_THAT(std::string(kCoordinatorUsage), HasSubstr("--gpu-memory-utilization F"));
}

TEST(CoordinatorFlagsTest, HttpPortDefaultsTo8000AndZeroTurnsItOff) {
  auto o = ParseCoordinatorFlags({"--model", "m"}, true);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->http_port, 8000);
  EXPECT_TRUE(o->api_key.empty());
  o = ParseCoordinatorFlags({"--model", "m", "--http-port", "0", "--api-key", "k"}, false);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->http_port, 0);
  EXPECT_EQ(o->api_key, "k");
  o = ParseCoordinatorFlags({"--model", "m", "--http-port", "70000"}, true);
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("--http-port"), std::string::npos) << o.status();
}

}  // namespace
}  // namespace tpserve
