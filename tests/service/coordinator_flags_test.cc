// The coordinator's flag table: the options it fills, its ranges and errors, --help, the flags
// that size the workers (--gpu-memory-utilization, --kv-cache-mb), --enable-prefix-caching and
// the HTTP front end's --http-port and --api-key.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/coordinator_flags.h"

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
  EXPECT_THAT(Usage(CoordinatorFlagSpec(false)), HasSubstr("--gpu-memory-utilization F"));
}

TEST(CoordinatorFlagsTest, RangesUnknownFlagsAndPositionalArgumentsAreErrors) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--model", "m", "--port", "70000"}, "--port expects an integer in [0, 65535], got '70000'"},
      {{"--model", "m", "--workers", "0"}, "--workers expects an integer in [1, 4096]"},
      {{"--model", "m", "--max-num-seqs", "many"}, "--max-num-seqs expects an integer"},
      {{"--model", "m", "--heartbeat-timeout", "0.1"}, "[0.5, 86400]"},
      {{"--model", "m", "--overlap-lead-ms", "-1"}, "--overlap-lead-ms"},
      {{"--model", "m", "--drain-timeout", "-1"}, "--drain-timeout"},
      {{"--model", "m", "--kv-cache-mb", "-5"}, "--kv-cache-mb"},
      {{"--model", "m", "--no-such-flag"}, "unknown flag --no-such-flag"},
      {{"--model", "m", "stray"}, "unexpected argument 'stray'"},
      {{"--model", "m", "--tp", "2", "--workers", "3"}, "--workers 3 but --tp 2"},
      {{"--model", "m", "--pp", "2"}, "--pp needs --tp"},
      {{"--model", "m", "--http-port", "65536"}, "--http-port expects an integer in [0, 65535]"},
  };
  // Without --model the coordinator refuses; `tpserve serve` looks for the bundled model
  // (not beside this test binary, so it refuses too, saying where it looked).
  auto no_model = ParseCoordinatorFlags({"--port", "1"}, false);
  EXPECT_THAT(std::string(no_model.status().message()), HasSubstr("missing required flag --model"));
  no_model = ParseCoordinatorFlags({"--port", "1"}, true);
  EXPECT_THAT(std::string(no_model.status().message()), HasSubstr("no bundled model found"));
  for (const auto& [args, message] : cases) {
    for (bool serve : {false, true}) {
      auto o = ParseCoordinatorFlags(args, serve);
      ASSERT_FALSE(o.ok()) << message;
      EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(o.status().message()), HasSubstr(message));
    }
  }
}

TEST(CoordinatorFlagsTest, EveryFlagIsParsedIntoTheOptions) {
  auto o = ParseCoordinatorFlags({"--model",
                                  "m",
                                  "--host",
                                  "127.0.0.1",
                                  "--port",
                                  "0",
                                  "--tp",
                                  "2",
                                  "--pp",
                                  "2",
                                  "--device-map",
                                  "0-1:0,2-3:1",
                                  "--device",
                                  "cpu",
                                  "--worker-binary",
                                  "w",
                                  "--kv-cache-mb",
                                  "64",
                                  "--block-size",
                                  "32",
                                  "--max-num-seqs",
                                  "8",
                                  "--max-num-batched-tokens",
                                  "256",
                                  "--max-queued-requests",
                                  "1",
                                  "--default-max-new-tokens",
                                  "7",
                                  "--register-timeout",
                                  "5",
                                  "--load-timeout",
                                  "6",
                                  "--drain-timeout",
                                  "0",
                                  "--heartbeat-timeout",
                                  "1.5",
                                  "--overlap-lead-ms",
                                  "2.5",
                                  "--step-timeout",
                                  "9",
                                  "--ready-file",
                                  "r",
                                  "--spawn-workers"},
                                 false);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->model_dir, "m");
  EXPECT_EQ(o->host, "127.0.0.1");
  EXPECT_EQ(o->port, 0);
  EXPECT_EQ(o->tp, 2);
  EXPECT_EQ(o->pp, 2);
  EXPECT_EQ(o->world_size, 4);
  EXPECT_EQ(o->device_map, "0-1:0,2-3:1");
  EXPECT_EQ(o->device, "cpu");
  EXPECT_EQ(o->worker_binary, "w");
  EXPECT_EQ(o->kv_cache_mb, 64);
  EXPECT_EQ(o->block_size, 32);
  EXPECT_EQ(o->max_num_seqs, 8);
  EXPECT_EQ(o->max_num_batched_tokens, 256);
  EXPECT_EQ(o->max_queued_requests, 1);
  EXPECT_EQ(o->default_max_new_tokens, 7);
  EXPECT_EQ(o->register_timeout_s, 5);
  EXPECT_EQ(o->load_timeout_s, 6);
  EXPECT_EQ(o->overlap_lead_ms, 2.5);
  EXPECT_EQ(o->drain_timeout_s, 0);
  EXPECT_DOUBLE_EQ(o->heartbeat_timeout_s, 1.5);
  EXPECT_EQ(o->step_timeout_s, 9);
  EXPECT_EQ(o->ready_file, "r");
  EXPECT_TRUE(o->spawn_workers);
  EXPECT_FALSE(o->help);
}

TEST(CoordinatorFlagsTest, HelpNeedsNoModelAndTheUsageListsEveryFlag) {
  for (bool serve : {false, true}) {
    auto o = ParseCoordinatorFlags({"--help"}, serve);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_TRUE(o->help);
    const std::string usage = Usage(CoordinatorFlagSpec(serve));
    for (const FlagSpec& f : CoordinatorFlagSpec(serve).flags) {
      EXPECT_THAT(usage, HasSubstr("--" + f.name + " ")) << usage;
    }
  }
  // The four flags the hand-written usage once missed.
  const std::string usage = Usage(CoordinatorFlagSpec(false));
  for (const char* f :
       {"--block-size", "--default-max-new-tokens", "--load-timeout", "--step-timeout"}) {
    EXPECT_THAT(usage, HasSubstr(f));
  }
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
  EXPECT_THAT(Usage(CoordinatorFlagSpec(true)), HasSubstr("--enable-prefix-caching"));
}

TEST(CoordinatorFlagsTest, DeterministicIsOffByDefaultAndParses) {
  auto o = ParseCoordinatorFlags({"--model", "m"}, true);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->deterministic);
  for (bool serve : {true, false}) {
    o = ParseCoordinatorFlags({"--model", "m", "--deterministic"}, serve);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_TRUE(o->deterministic);
  }
  o = ParseCoordinatorFlags({"--model", "m", "--deterministic=false"}, true);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->deterministic);
  o = ParseCoordinatorFlags({"--model", "m", "--deterministic=sometimes"}, true);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Usage(CoordinatorFlagSpec(false)), HasSubstr("--deterministic"));
}

TEST(CoordinatorFlagsTest, KvCacheDTypeDefaultsToAutoAndIsChecked) {
  auto o = ParseCoordinatorFlags({"--model", "m"}, true);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->kv_cache_dtype, "auto");
  for (const char* t : {"auto", "bf16", "fp8", "int8", "int4"}) {
    o = ParseCoordinatorFlags({"--model", "m", "--kv-cache-dtype", t}, true);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->kv_cache_dtype, t);
  }
  o = ParseCoordinatorFlags({"--model", "m", "--kv-cache-dtype", "fp4"}, false);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(o.status().message()),
              HasSubstr("--kv-cache-dtype: unknown KV-cache dtype 'fp4' (expected auto, bf16"));
  EXPECT_THAT(Usage(CoordinatorFlagSpec(true)), HasSubstr("--kv-cache-dtype"));
}

// Empty: each worker keeps its own --all-reduce / TPSERVE_ALL_REDUCE.
TEST(CoordinatorFlagsTest, AllReduceIsEmptyByDefaultAndChecked) {
  auto o = ParseCoordinatorFlags({"--model", "m"}, true);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->all_reduce, "");
  for (const char* v : {"auto", "nccl", "custom"}) {
    o = ParseCoordinatorFlags({"--model", "m", "--all-reduce", v}, false);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->all_reduce, v);
  }
  o = ParseCoordinatorFlags({"--model", "m", "--all-reduce", "ipc"}, true);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(o.status().message()),
              HasSubstr("--all-reduce must be auto, nccl or custom, got \"ipc\""));
  EXPECT_THAT(Usage(CoordinatorFlagSpec(true)), HasSubstr("--all-reduce"));
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
