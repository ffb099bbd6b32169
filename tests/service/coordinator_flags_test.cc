// The coordinator's flags that size the workers: --gpu-memory-utilization (forwarded to every
// worker in its Assignment) and --kv-cache-mb; --enable-prefix-caching.
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

TEST(CoordinatorFlagsTest, PrefixCachingIsOnByDefaultAndCanBeTurnedOff) {
  auto o = ParseCoordinatorFlags({"--model", "m"}, true);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->enable_prefix_caching);
  for (const std::vector<std::string>& on :
       {std::vector<std::string>{"--enable-prefix-caching"},
        std::vector<std::string>{"--enable-prefix-caching=true"},
        std::vector<std::string>{"--enable-prefix-caching=1"}}) {
    std::vector<std::string> args = {"--model", "m"};
    args.insert(args.end(), on.begin(), on.end());
    o = ParseCoordinatorFlags(args, true);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_TRUE(o->enable_prefix_caching) << on[0];
  }
  for (const char* off : {"--no-enable-prefix-caching", "--enable-prefix-caching=false",
                          "--enable-prefix-caching=0"}) {
    o = ParseCoordinatorFlags({"--model", "m", off}, false);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_FALSE(o->enable_prefix_caching) << off;
  }
  o = ParseCoordinatorFlags({"--model", "m", "--enable-prefix-caching=maybe"}, true);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(kCoordinatorUsage), HasSubstr("--enable-prefix-caching"));
}

}  // namespace
}  // namespace tpserve
