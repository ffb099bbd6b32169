// Unit tests of the shard planner: balanced and manual device maps, per-rank slices, and every
// invalid case with a message that says what would work.
#include "parallel/shard_plan.h"

#include <algorithm>
#include <functional>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tpserve {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;

// A Llama-2-7B-shaped config.
ModelConfig Llama7B() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.hidden_size = 4096;
  c.intermediate_size = 11008;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 32;
  c.head_dim = 128;
  c.vocab_size = 32000;
  c.max_position_embeddings = 4096;
  return c;
}

// Small model whose embedding weighs about as much as two layers.
ModelConfig HeavyEmbedding(int layers) {
  ModelConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_layers = layers;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.head_dim = 16;
  // One layer: 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64 = 41088 elements; vocab 1284 * 64 = 82176.
  c.vocab_size = 1284;
  c.max_position_embeddings = 1;  // negligible KV
  return c;
}

int64_t MaxStageBytes(const ShardPlan& p) {
  return *std::max_element(p.stage_bytes.begin(), p.stage_bytes.end());
}

// Brute force over all compositions of `layers` into `pp` positive parts: the smallest max stage
// load, using the plan's own per-stage costs (derived from a reference plan's stage_bytes).
int64_t BruteForceBest(const ModelConfig& c, int pp) {
  // Per-layer and end costs from single-stage plans of the same model.
  PlanOptions o;
  o.pp = pp;
  int64_t best = std::numeric_limits<int64_t>::max();
  std::vector<int> counts(pp, 1);
  std::function<void(int, int)> rec = [&](int stage, int left) {
    if (stage == pp - 1) {
      counts[stage] = left;
      std::string map;
      int begin = 0;
      for (int s = 0; s < pp; ++s) {
        if (s) map += ",";
        map += std::to_string(begin) + "-" + std::to_string(begin + counts[s] - 1) + ":" +
               std::to_string(s);
        begin += counts[s];
      }
      o.device_map = map;
      absl::StatusOr<ShardPlan> p = PlanShards(c, o);
      EXPECT_TRUE(p.ok()) << p.status();
      best = std::min(best, MaxStageBytes(*p));
      return;
    }
    for (int n = 1; n <= left - (pp - 1 - stage); ++n) {
      counts[stage] = n;
      rec(stage + 1, left - n);
    }
  };
  rec(0, static_cast<int>(c.num_layers));
  return best;
}

TEST(ShardPlanTest, SingleRankOwnsEverything) {
  ModelConfig c = Llama7B();
  absl::StatusOr<ShardPlan> p = PlanShards(c, PlanOptions{});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->DeviceMapString(), "0-31:0");
  RankShard s = p->ForRank(c, 0);
  EXPECT_EQ(s.layer_begin, 0);
  EXPECT_EQ(s.layer_end, 32);
  EXPECT_TRUE(s.first_stage());
  EXPECT_TRUE(s.last_stage);
  EXPECT_EQ(s.num_q_heads, 32);
  EXPECT_EQ(s.num_kv_heads, 32);
  EXPECT_EQ(s.intermediate_size, 11008);
  EXPECT_EQ(s.vocab_shard, 32000);
  EXPECT_TRUE(p->notes.empty());
  // Stage bytes: weights + KV for max_position_embeddings tokens, embedding and lm_head (bf16).
  const int64_t layer = c.LayerWeightElems() * 2 + c.KvElemsPerTokenPerLayer() * 4096 * 2;
  EXPECT_EQ(p->stage_bytes[0], 32 * layer + 2 * c.EmbeddingElems() * 2 + c.hidden_size * 2);
}

TEST(ShardPlanTest, BalancedEvenModelSplitsEvenly) {
  ModelConfig c = Llama7B();
  PlanOptions o;
  o.pp = 2;
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->DeviceMapString(), "0-15:0,16-31:1");
  o.pp = 4;
  p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->DeviceMapString(), "0-7:0,8-15:1,16-23:2,24-31:3");
}

TEST(ShardPlanTest, BalancedGivesEndStagesFewerLayersWhenEmbeddingIsHeavy) {
  ModelConfig c = HeavyEmbedding(8);
  PlanOptions o;
  o.pp = 3;
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  // Embedding ~2 layers on stage 0, lm_head ~2 layers on stage 2: 8 layers + 4 -> 4 per stage.
  EXPECT_EQ(p->DeviceMapString(), "0-1:0,2-5:1,6-7:2");
  EXPECT_EQ(MaxStageBytes(*p), BruteForceBest(c, 3));
}

TEST(ShardPlanTest, BalancedMatchesBruteForce) {
  for (int layers : {3, 5, 7, 10}) {
    for (int pp = 1; pp <= std::min(layers, 4); ++pp) {
      ModelConfig c = HeavyEmbedding(layers);
      PlanOptions o;
      o.pp = pp;
      absl::StatusOr<ShardPlan> p = PlanShards(c, o);
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_EQ(p->stage_layer_begin.size(), pp + 1u);
      EXPECT_EQ(p->stage_layer_begin.front(), 0);
      EXPECT_EQ(p->stage_layer_begin.back(), layers);
      for (int s = 0; s < pp; ++s) EXPECT_GE(p->num_layers(s), 1);
      EXPECT_EQ(MaxStageBytes(*p), BruteForceBest(c, pp)) << "layers " << layers << " pp " << pp;
    }
  }
}

TEST(ShardPlanTest, KvBytesCountInTheBalance) {
  // With a long context the per-layer KV dominates the embedding: end stages no longer shrink.
  ModelConfig c = HeavyEmbedding(8);
  PlanOptions o;
  o.pp = 3;
  o.context_tokens = 100000;
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  // Layers are now nearly uniform; the stage with the heaviest extra (lm_head) gets the fewest.
  EXPECT_EQ(p->DeviceMapString(), "0-2:0,3-5:1,6-7:2");
  const int64_t layer_kv = 2 * c.num_kv_heads * c.head_dim * 100000 * 2;
  EXPECT_GE(p->stage_bytes[1], 3 * layer_kv);
}

TEST(ShardPlanTest, BalancesByFreeMemory) {
  ModelConfig c = Llama7B();
  PlanOptions o;
  o.pp = 2;
  o.context_tokens = 1024;
  // Stage 0's GPU has twice the free memory of stage 1's.
  o.stage_free_bytes = {int64_t{16} << 30, int64_t{8} << 30};
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  // Loads relative to free memory: 22 layers + embedding on 16 GiB (0.555), 10 + lm_head on
  // 8 GiB (0.521); 21/11 would put 0.570 on stage 1.
  EXPECT_EQ(p->num_layers(0), 22);
  EXPECT_EQ(p->num_layers(1), 10);
  for (int s = 0; s < 2; ++s) EXPECT_LE(p->stage_bytes[s], o.stage_free_bytes[s]);
}

TEST(ShardPlanTest, RefusesWhenAStageCannotFitAndSaysWhatWould) {
  ModelConfig c = Llama7B();
  PlanOptions o;
  o.pp = 2;
  o.context_tokens = 4096;
  // ~14.5 GiB needed in total (12.6 GiB of weights): 7 GiB per stage is not enough.
  o.stage_free_bytes = {int64_t{7} << 30, int64_t{7} << 30};
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("does not fit with tp=1, pp=2"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("per GPU"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("7.00 GiB free"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("it would fit with pp=3 (tp=1)"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("tp=2 (pp=2)"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("a context budget of at most"));
}

TEST(ShardPlanTest, ManualMapFitCheckNamesTheStage) {
  ModelConfig c = Llama7B();
  PlanOptions o;
  o.pp = 2;
  o.context_tokens = 16;
  o.device_map = "0-27:0,28-31:1";
  o.stage_free_bytes = {int64_t{8} << 30, int64_t{8} << 30};
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("stage 0 (layers 0-27) needs"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("8.00 GiB free"));
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("it would fit with the balanced device map 0-15:0,16-31:1"));
  o.device_map = "0-15:0,16-31:1";
  EXPECT_TRUE(PlanShards(c, o).ok());
}

constexpr int64_t kGiB = int64_t{1} << 30;

// What the service does with its workers' Register messages: the memory each stage can use
// (utilization fraction kept back, a shared device split, the smallest rank of a stage) ...
TEST(ShardPlanTest, StageFreeBytesFromWhatTheRanksReport) {
  // tp = 2, pp = 2 on four GPUs of two hosts; host b's GPU 1 has less free memory.
  std::vector<RankMemory> ranks = {
      {"a", true, 0, 70 * kGiB, 80 * kGiB},
      {"a", true, 1, 70 * kGiB, 80 * kGiB},
      {"b", true, 0, 30 * kGiB, 40 * kGiB},
      {"b", true, 1, 20 * kGiB, 40 * kGiB},
  };
  std::vector<int64_t> s = StageFreeBytes(ranks, 2, 2, 0.9);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0], 70 * kGiB - 8 * kGiB);
  EXPECT_EQ(s[1], 20 * kGiB - 4 * kGiB);
  // Two ranks on one GPU (as on a one-GPU machine) share what it can give.
  ranks[3].gpu_index = 0;
  ranks[3].free_bytes = 30 * kGiB;
  s = StageFreeBytes(ranks, 2, 2, 0.9);
  EXPECT_EQ(s[1], (30 * kGiB - 4 * kGiB) / 2);
  // CPU ranks of one host share its available memory; no utilization fraction applies.
  const std::vector<RankMemory> cpu = {{"h", false, -1, 12 * kGiB, 0},
                                       {"h", false, -1, 12 * kGiB, 0}};
  EXPECT_EQ(StageFreeBytes(cpu, 1, 2, 0.9), (std::vector<int64_t>{6 * kGiB, 6 * kGiB}));
  // Unknown memory on any rank: no balance by memory, no fit check.
  ranks[2].free_bytes = 0;
  EXPECT_TRUE(StageFreeBytes(ranks, 2, 2, 0.9).empty());
  // A layout that does not match the ranks.
  EXPECT_TRUE(StageFreeBytes(cpu, 2, 2, 0.9).empty());
}

// ... balances a pipeline towards the larger GPUs and refuses one that cannot fit with the
// numbers.
TEST(ShardPlanTest, UnequalReportedMemoryMovesLayersAndRefusesWhatCannotFit) {
  ModelConfig c = Llama7B();
  PlanOptions o;
  o.pp = 2;
  o.context_tokens = 4096;
  const std::vector<RankMemory> equal = {{"a", true, 0, 40 * kGiB, 40 * kGiB},
                                         {"a", true, 1, 40 * kGiB, 40 * kGiB}};
  o.stage_free_bytes = StageFreeBytes(equal, 1, 2, 0.9);
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->num_layers(0), 16);
  // GPU 1 has another process on it: 12 GiB free of 40.
  const std::vector<RankMemory> unequal = {{"a", true, 0, 40 * kGiB, 40 * kGiB},
                                           {"a", true, 1, 12 * kGiB, 40 * kGiB}};
  o.stage_free_bytes = StageFreeBytes(unequal, 1, 2, 0.9);
  p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GT(p->num_layers(0), 20);
  for (int s = 0; s < 2; ++s) EXPECT_LE(p->stage_bytes[s], o.stage_free_bytes[s]);
  // Both GPUs nearly full: refused, naming the stage, the bytes and what would fit.
  const std::vector<RankMemory> full = {{"a", true, 0, 10 * kGiB, 40 * kGiB},
                                        {"a", true, 1, 10 * kGiB, 40 * kGiB}};
  o.stage_free_bytes = StageFreeBytes(full, 1, 2, 0.9);
  p = PlanShards(c, o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("6.00 GiB free"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("it would fit with pp=3"));
}

TEST(ShardPlanTest, ManualMap) {
  ModelConfig c = Llama7B();
  PlanOptions o;
  o.pp = 2;
  o.device_map = "0-9:0, 10-31:1";
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->stage_layer_begin, (std::vector<int>{0, 10, 32}));
  EXPECT_EQ(p->DeviceMapString(), "0-9:0,10-31:1");
  // Several entries per stage and single layers.
  absl::StatusOr<std::vector<int>> b = ParseDeviceMap("0:0,1-2:0,3:1,4-7:2", 8, 3);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, (std::vector<int>{0, 3, 4, 8}));
  // Round trip of a balanced plan's map.
  o.device_map.clear();
  o.pp = 4;
  p = PlanShards(c, o);
  ASSERT_TRUE(p.ok());
  b = ParseDeviceMap(p->DeviceMapString(), 32, 4);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, p->stage_layer_begin);
}

void ExpectMapError(const std::string& map, int layers, int pp, const std::string& needle) {
  absl::StatusOr<std::vector<int>> b = ParseDeviceMap(map, layers, pp);
  ASSERT_FALSE(b.ok()) << map;
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr(needle)) << map;
  EXPECT_THAT(std::string(b.status().message()), HasSubstr(map)) << "names the map";
}

TEST(ShardPlanTest, ManualMapErrors) {
  ExpectMapError("0-15:0,10-31:1", 32, 2, "layer 10 is assigned twice (to stage 0 and to stage 1)");
  ExpectMapError("0-11:0,16-31:1", 32, 2, "layers 12-15 are not assigned to any stage");
  ExpectMapError("0-3:0,4-7:1,8-11:0", 12, 2,
                 "stage 0 owns layers 0-3 and 8-11, which are not contiguous");
  ExpectMapError("0-15:1,16-31:0", 32, 2, "stage 1 owns layers 0-15 but stage 0 owns 16-31");
  ExpectMapError("0-15:0,16-31:2", 32, 2, "names stage 2 but pp=2");
  ExpectMapError("0-15:0,16-31:1", 32, 3, "stage 2 has no layers");
  ExpectMapError("0-15:0,16-32:1", 32, 2, "names layer 32 but the model has 32 layers");
  ExpectMapError("0-15", 32, 1, "needs exactly one ':'");
  ExpectMapError("a-b:0", 32, 1, "has no valid layer range");
  ExpectMapError("0-31:x", 32, 1, "has no valid stage number");
  ExpectMapError("5-3:0", 32, 1, "empty or negative layer range");
  ExpectMapError("", 4, 1, "entry 1");
  // Through PlanShards too.
  ModelConfig c = Llama7B();
  PlanOptions o;
  o.pp = 2;
  o.device_map = "0-15:0";
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("layers 16-31 are not assigned"));
}

TEST(ShardPlanTest, HeadsNotDivisibleListsWorkingTp) {
  ModelConfig c = Llama7B();
  PlanOptions o;
  o.tp = 3;
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("tp=3 does not divide the 32 attention heads"));
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("tp values that work for this model: 1, 2, 4, 8, 16, 32"));
}

TEST(ShardPlanTest, IntermediateNotDivisible) {
  ModelConfig c = Llama7B();
  c.intermediate_size = 11010;  // 2 * 3 * 5 * 367
  PlanOptions o;
  o.tp = 4;
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("does not divide the MLP intermediate_size 11010"));
  EXPECT_THAT(std::string(p.status().message()),
              EndsWith("tp values that work for this model: 1, 2"));
}

TEST(ShardPlanTest, KvHeadsFewerThanTpAreReplicated) {
  ModelConfig c = Llama7B();
  c.num_kv_heads = 4;  // GQA, groups of 8 q heads
  PlanOptions o;
  o.tp = 8;
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->kv_replicated);
  ASSERT_EQ(p->notes.size(), 1u);
  EXPECT_THAT(p->notes[0], HasSubstr("replicated on 2 TP ranks"));
  for (int r = 0; r < 8; ++r) {
    RankShard s = p->ForRank(c, r);
    EXPECT_EQ(s.num_q_heads, 4);
    EXPECT_EQ(s.q_head_begin, 4 * r);
    EXPECT_EQ(s.num_kv_heads, 1);
    EXPECT_EQ(s.kv_head_begin, r / 2) << "rank " << r;
    // Every q head of the rank maps onto its KV head (GQA group of 8).
    EXPECT_EQ(s.q_head_begin / 8, s.kv_head_begin);
    EXPECT_EQ((s.q_head_begin + s.num_q_heads - 1) / 8, s.kv_head_begin);
  }
  // tp = kv heads: no replication.
  o.tp = 4;
  p = PlanShards(c, o);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->kv_replicated);
  EXPECT_EQ(p->ForRank(c, 3).kv_head_begin, 3);
}

TEST(ShardPlanTest, KvHeadsNeitherDividedNorReplicable) {
  ModelConfig c;
  c.hidden_size = 24 * 16;
  c.intermediate_size = 1536;
  c.num_layers = 2;
  c.num_heads = 24;
  c.num_kv_heads = 8;
  c.head_dim = 16;
  c.vocab_size = 100;
  PlanOptions o;
  o.tp = 12;
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("neither divides the 8 KV heads"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("work for this model: 1, 2, 4, 8, 24"));
}

TEST(ShardPlanTest, VocabIsPadded) {
  ModelConfig c = Llama7B();
  c.vocab_size = 32001;
  PlanOptions o;
  o.tp = 2;
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->vocab_padded, 32002);
  ASSERT_EQ(p->notes.size(), 1u);
  EXPECT_THAT(p->notes[0], HasSubstr("vocab 32001 padded to 32002"));
  EXPECT_EQ(p->ForRank(c, 0).vocab_begin, 0);
  EXPECT_EQ(p->ForRank(c, 1).vocab_begin, 16001);
  EXPECT_EQ(p->ForRank(c, 1).vocab_shard, 16001);
}

TEST(ShardPlanTest, MoreStagesThanLayers) {
  ModelConfig c = HeavyEmbedding(4);
  PlanOptions o;
  o.pp = 5;
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("pp=5 stages but the model has only 4 layers"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("use pp between 1 and 4"));
  o.pp = 4;
  p = PlanShards(c, o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->DeviceMapString(), "0-0:0,1-1:1,2-2:2,3-3:3");
}

TEST(ShardPlanTest, BadOptions) {
  ModelConfig c = Llama7B();
  PlanOptions o;
  o.tp = 0;
  EXPECT_THAT(std::string(PlanShards(c, o).status().message()), HasSubstr("at least 1"));
  o.tp = 1;
  o.pp = 2;
  o.stage_free_bytes = {1 << 30};
  EXPECT_THAT(std::string(PlanShards(c, o).status().message()),
              HasSubstr("stage_free_bytes has 1 entries but pp=2"));
  o.stage_free_bytes = {1 << 30, 0};
  EXPECT_THAT(std::string(PlanShards(c, o).status().message()),
              HasSubstr("stage 1 reports no free GPU memory"));
}

TEST(ShardPlanTest, RankSlicesCoverTheModel) {
  ModelConfig c = Llama7B();
  c.num_kv_heads = 8;
  PlanOptions o;
  o.tp = 4;
  o.pp = 2;
  absl::StatusOr<ShardPlan> p = PlanShards(c, o);
  ASSERT_TRUE(p.ok()) << p.status();
  for (int r = 0; r < 8; ++r) {
    RankShard s = p->ForRank(c, r);
    EXPECT_EQ(s.tp_rank, r % 4);
    EXPECT_EQ(s.stage, r / 4);
    EXPECT_EQ(s.layer_begin, s.stage == 0 ? 0 : 16);
    EXPECT_EQ(s.layer_end, s.stage == 0 ? 16 : 32);
    EXPECT_EQ(s.last_stage, s.stage == 1);
    EXPECT_EQ(s.q_head_begin, 8 * s.tp_rank);
    EXPECT_EQ(s.kv_head_begin, 2 * s.tp_rank);
    EXPECT_EQ(s.num_kv_heads, 2);
    EXPECT_EQ(s.intermediate_begin, 2752 * s.tp_rank);
    EXPECT_EQ(s.vocab_begin, 8000 * s.tp_rank);
  }
}

}  // namespace
}  // namespace tpserve
