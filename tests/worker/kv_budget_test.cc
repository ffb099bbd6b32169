// KV pool sizing (worker/kv_budget.h) on the numbers of a DeepSeek-Coder-6.7B shard on an
// H200, and the shard memory estimate against what a CPU load allocates.
#include "worker/kv_budget.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/model_files.h"
#include "parallel/communicator.h"
#include "parallel/shard_plan.h"
#include "tests/testing/test_models.h"
#include "worker/kv_cache.h"
#include "worker/model.h"
#include "worker/shard_loader.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kTotal = 150'754'820'096;  // an H200's cudaMemGetInfo total
constexpr int64_t kInUse = 716'177'408;      // CUDA context, cuBLAS workspace
constexpr int64_t kWeights = 13'476'298'752;
constexpr int64_t kWorkspace = 1'191'182'336;
constexpr int64_t kBlockBytes = 8'388'608;  // 32 layers x K,V x 16 tokens x 32 heads x 128 x 2

KvBudgetInput DeepSeek67() {
  KvBudgetInput in;
  in.total_bytes = kTotal;
  in.in_use_bytes = kInUse;
  in.weight_bytes = kWeights;
  in.workspace_bytes = kWorkspace;
  in.gpu_memory_utilization = 0.90;
  in.block_bytes = kBlockBytes;
  in.block_size = 16;
  in.max_seq_len = 16384;
  return in;
}

TEST(KvBudgetTest, BudgetIsWhatTheFractionLeavesAfterWeightsAndWorkspace) {
  auto kv = ComputeKvBudget(DeepSeek67());
  ASSERT_TRUE(kv.ok()) << kv.status();
  const int64_t allowed = static_cast<int64_t>(0.90 * kTotal);
  const int64_t blocks = (allowed - kInUse - kWeights - kWorkspace) / kBlockBytes;
  EXPECT_EQ(kv->num_blocks, blocks);
  EXPECT_EQ(kv->kv_bytes, blocks * kBlockBytes);
  EXPECT_EQ(kv->capacity_tokens, blocks * 16);
  EXPECT_THAT(kv->source, HasSubstr("--gpu-memory-utilization 0.9"));
  // Used plus the pool stays within the fraction.
  EXPECT_LE(kInUse + kWeights + kWorkspace + kv->kv_bytes, allowed);
  EXPECT_GT(kInUse + kWeights + kWorkspace + kv->kv_bytes + kBlockBytes, allowed);
}

TEST(KvBudgetTest, WeightsThatDoNotFitNameTheSizesAndTheRemedies) {
  KvBudgetInput in = DeepSeek67();
  in.weight_bytes = 150'000'000'000;  // a 70B bf16 checkpoint on one GPU
  auto kv = ComputeKvBudget(in);
  ASSERT_FALSE(kv.ok());
  EXPECT_EQ(kv.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(kv.status().message());
  EXPECT_THAT(msg, HasSubstr("does not fit on the device"));
  EXPECT_THAT(msg, HasSubstr("150000000000 bytes"));                     // weights
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kWorkspace, " bytes")));       // workspace
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kTotal - kInUse, " bytes")));  // free
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kTotal, " bytes")));           // total
  EXPECT_THAT(msg, HasSubstr("--tp"));
  EXPECT_THAT(msg, HasSubstr("--max-num-batched-tokens"));
}

TEST(KvBudgetTest, WeightsAboveTheFractionLeaveNoRoomForTheCache) {
  KvBudgetInput in = DeepSeek67();
  in.gpu_memory_utilization = 0.05;  // 7.5 GB allowed, 13.5 GB of weights
  auto kv = ComputeKvBudget(in);
  ASSERT_FALSE(kv.ok());
  EXPECT_EQ(kv.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(kv.status().message());
  EXPECT_THAT(msg, HasSubstr("no room for the KV cache"));
  EXPECT_THAT(msg, HasSubstr("--gpu-memory-utilization 0.05"));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(static_cast<int64_t>(0.05 * kTotal), " bytes")));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kWeights, " bytes")));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kWorkspace, " bytes")));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kInUse, " bytes")));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kTotal, " bytes")));
  EXPECT_THAT(msg, HasSubstr("raise --gpu-memory-utilization"));
  EXPECT_THAT(msg, HasSubstr("--tp"));
}

TEST(KvBudgetTest, CacheSmallerThanOneFullContextIsRefused) {
  KvBudgetInput in = DeepSeek67();
  // 0.2 allows 30.15 GB: 30.15 - 0.72 - 13.48 - 1.19 = 14.76 GB = 1759 blocks = 28144 tokens:
  // fits 16384. Make the context longer than that.
  in.gpu_memory_utilization = 0.2;
  in.max_seq_len = 32768;
  auto kv = ComputeKvBudget(in);
  ASSERT_FALSE(kv.ok());
  EXPECT_EQ(kv.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(kv.status().message());
  const int64_t blocks =
      (static_cast<int64_t>(0.2 * kTotal) - kInUse - kWeights - kWorkspace) / kBlockBytes;
  EXPECT_THAT(msg, HasSubstr(absl::StrCat("would hold ", blocks * 16, " tokens")));
  EXPECT_THAT(msg, HasSubstr("32768 tokens"));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kWeights, " bytes")));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kWorkspace, " bytes")));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kTotal, " bytes")));
  EXPECT_THAT(msg, HasSubstr("--gpu-memory-utilization 0.2"));
  EXPECT_THAT(msg, HasSubstr("--kv-cache-mb"));

  in.max_seq_len = 16384;  // the same budget holds the real context
  auto ok = ComputeKvBudget(in);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->num_blocks, blocks);
}

TEST(KvBudgetTest, ExplicitSizesTakePrecedenceOverTheFraction) {
  KvBudgetInput in = DeepSeek67();
  in.gpu_memory_utilization = 0.05;  // would fail (see above)
  in.kv_cache_bytes = int64_t{1} << 30;
  in.num_kv_blocks = 7;  // kv_cache_bytes wins
  auto kv = ComputeKvBudget(in);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->num_blocks, 128);
  EXPECT_EQ(kv->capacity_tokens, 128 * 16);
  EXPECT_THAT(kv->source, HasSubstr("--kv-cache-mb"));

  in.kv_cache_bytes = 0;
  kv = ComputeKvBudget(in);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->num_blocks, 7);  // no full-context minimum for an explicit size
}

TEST(KvBudgetTest, ExplicitSizesMustFitTheFreeMemory) {
  KvBudgetInput in = DeepSeek67();
  in.kv_cache_bytes = 200'000'000'000;
  auto kv = ComputeKvBudget(in);
  ASSERT_FALSE(kv.ok());
  EXPECT_EQ(kv.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(kv.status().message());
  EXPECT_THAT(msg, HasSubstr("200000000000 bytes"));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kTotal - kInUse - kWeights - kWorkspace, " bytes")));
  EXPECT_THAT(msg, HasSubstr("Lower --kv-cache-mb"));

  in.kv_cache_bytes = kBlockBytes - 1;  // less than one block
  kv = ComputeKvBudget(in);
  ASSERT_FALSE(kv.ok());
  EXPECT_THAT(std::string(kv.status().message()), HasSubstr("not even one block"));
  EXPECT_THAT(std::string(kv.status().message()), HasSubstr("8388607 bytes"));
}

TEST(KvBudgetTest, WithoutDeviceMemoryTheDefaultOrTheExplicitSizeIsUsed) {
  KvBudgetInput in;
  in.block_bytes = 4096;
  in.block_size = 16;
  in.max_seq_len = 512;
  in.default_blocks = 128;
  in.weight_bytes = int64_t{1} << 40;  // not checked: no device memory
  auto kv = ComputeKvBudget(in);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->num_blocks, 128);
  EXPECT_EQ(kv->source, "default");
  in.num_kv_blocks = 5;
  kv = ComputeKvBudget(in);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->num_blocks, 5);
}

TEST(KvBudgetTest, BadInputsAreRefused) {
  KvBudgetInput in = DeepSeek67();
  for (double f : {0.0, -0.5, 1.01}) {
    in.gpu_memory_utilization = f;
    auto kv = ComputeKvBudget(in);
    ASSERT_FALSE(kv.ok()) << f;
    EXPECT_EQ(kv.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(kv.status().message()), HasSubstr("(0, 1]"));
  }
  in.gpu_memory_utilization = 1.0;
  EXPECT_TRUE(ComputeKvBudget(in).ok());
}

TEST(KvBudgetTest, BlockCountStaysWithinInt32Slots) {
  KvBudgetInput in = DeepSeek67();
  in.block_bytes = 64;  // a tiny model: the budget would give billions of blocks
  auto kv = ComputeKvBudget(in);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->num_blocks, MaxKvBlocks(16));
  EXPECT_LE(kv->num_blocks * 16, int64_t{INT32_MAX});
}

TEST(KvBudgetTest, BytesStringIsReadableAndExact) {
  EXPECT_EQ(BytesString(13'476'298'752), "13.48 GB (13476298752 bytes)");
  EXPECT_EQ(BytesString(8'388'608), "8.39 MB (8388608 bytes)");
  EXPECT_EQ(BytesString(512), "512 bytes");
}

// The estimate LoadShard checks before loading equals what a load allocates (CPU ops).
TEST(ShardMemoryTest, EstimateMatchesTheLoad) {
  const std::string dir =
      testing_util::WriteTestModel(testing_util::AwkwardConfig(), "kv_budget_awkward");
  auto files = ModelFiles::Open(dir);
  ASSERT_TRUE(files.ok()) << files.status();
  std::unique_ptr<Ops> ops = MakeCpuOps();
  int64_t one_rank_weights = 0;
  for (int tp : {1, 2}) {
    PlanOptions po;
    po.tp = tp;
    auto plan = PlanShards(files->config(), po);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ModelOptions mo;
    mo.max_batch_tokens = 64;
    mo.max_batch_seqs = 4;
    auto estimate = LlamaModel::EstimateMemory(*files, *plan, 0, ops.get(), mo);
    ASSERT_TRUE(estimate.ok()) << estimate.status();
    if (tp > 1) {  // loading rank 0 of 2 needs its communicators: compare the estimates only
      EXPECT_LT(estimate->weight_bytes, one_rank_weights);
      EXPECT_GT(2 * estimate->weight_bytes, one_rank_weights);  // norms are replicated
      continue;
    }
    one_rank_weights = estimate->weight_bytes;
    auto tp_comm = MakeSingleRankCommunicator(ops.get());
    auto pp_comm = MakeSingleRankCommunicator(ops.get());
    ShardLoadOptions lo;
    lo.model = mo;
    lo.num_kv_blocks = 9;
    auto shard = LoadShard(*files, *plan, 0, ops.get(), {tp_comm.get(), pp_comm.get()}, lo);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ(static_cast<int64_t>(shard->model->weight_bytes()), estimate->weight_bytes);
    EXPECT_EQ(static_cast<int64_t>(shard->model->activation_bytes()), estimate->activation_bytes);
    EXPECT_EQ(shard->cache->num_blocks(), 9);
    EXPECT_EQ(shard->cache->bytes(), 9 * KvCache::BlockBytes(3, 16, 2, 8, ops->compute_dtype()));
  }
}

}  // namespace
}  // namespace tpserve
