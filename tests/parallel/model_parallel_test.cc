// Tensor and pipeline parallelism of the CPU engine (fp32) under mpirun: for each tp x pp layout
// of the world size, every rank runs its shard through Engine with MPI communicators in
// lockstep, and the prompt logits, the logits of every sampled step and the tokens (greedy and
// seeded sampling; a batch of different lengths with chunked prefill) equal one rank's, on
// tiny-coder and on random models with awkward shapes: odd vocab (padding), fewer KV heads than
// tp (replication), layers not divisible by pp, a manual device map, tied embeddings, biases.
// Requested logprobs (sampled on the gathered vocab shards) come back on the last stage and
// equal one rank's within what the logits' tolerance allows.
// Rank 0 computes the single-rank reference once per model and broadcasts it.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model_config.h"
#include "kernels/ops.h"
#include "tests/testing/model_test_util.h"
#include "tests/testing/mp_test_util.h"
#include "tests/testing/test_models.h"
#include "tools/random_model.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

using mp_test::Reference;
using mp_test::RelL2;
using mp_test::RelMax;
using mp_test::WorldRank;
using mp_test::WorldSize;

// fp32 everywhere; only the order of the TP partial sums differs from one rank.
constexpr double kMaxRelErr = 1e-5;
constexpr absl::Duration kCommTimeout = absl::Seconds(60);

// GQA 8/2 with an odd vocabulary (301: padded to 302 / 304), 3 layers (PP=2 splits 2+1 or 1+2),
// linear RoPE scaling. TP=4 replicates each KV head on two ranks.
ModelConfig AwkwardA() { return testing_util::AwkwardConfig(); }

// One KV head (replicated at every tp > 1), a prime vocabulary (307), 5 layers (PP=2: 3+2,
// PP=4: one stage with two layers), tied embeddings (the last stage reads embed_tokens as its
// lm_head), q/k/v and o_proj biases (the row-parallel o bias is added once).
ModelConfig AwkwardB() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.model_type = "llama";
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_layers = 5;
  c.num_heads = 4;
  c.num_kv_heads = 1;
  c.head_dim = 16;
  c.vocab_size = 307;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-5;
  c.rope.theta = 10000;
  c.tie_word_embeddings = true;
  c.attention_bias = true;
  c.o_proj_bias = true;
  c.bos_token_ids = {1};
  c.eos_token_ids = {2};
  return c;
}

struct Layout {
  int tp = 1;
  int pp = 1;
  std::string device_map;  // empty: balanced
  std::string name;
};

struct Case {
  std::string model;  // "tiny_coder", "awkward_a", "awkward_b"
  Layout layout;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.model << " " << c.layout.name; }

std::vector<Case> AllCases() {
  const Layout tp2{2, 1, "", "tp2"}, pp2{1, 2, "", "pp2"}, tp4{4, 1, "", "tp4"},
      pp4{1, 4, "", "pp4"}, tp2pp2{2, 2, "", "tp2pp2"};
  std::vector<Case> cases;
  for (const char* model : {"tiny_coder", "awkward_a", "awkward_b"}) {
    for (const Layout& l : {tp2, pp2, tp4, pp4, tp2pp2}) {
      if (std::string(model) == "awkward_a" && l.pp > 3) continue;  // 3 layers
      cases.push_back({model, l});
    }
  }
  // A manual device map with uneven stages (1 layer, then 4).
  cases.push_back({"awkward_b", {1, 2, "0:0,1-4:1", "pp2_map_1_4"}});
  cases.push_back({"awkward_b", {2, 2, "0-3:0,4:1", "tp2pp2_map_4_1"}});
  return cases;
}

struct Workload {
  std::vector<int32_t> prompt;  // for PromptLogits
  std::vector<GenerateRequest> requests;
  // A second Generate: one prompt longer than a step's token budget, so that the first steps
  // sample nothing (no broadcast of ids) and the cache is reused after the first batch.
  std::vector<GenerateRequest> long_requests;
};

std::vector<int32_t> Prompt(int len, int salt, int64_t vocab) {
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back(static_cast<int32_t>((i * 37 + salt * 11 + 3) % vocab));
  p.back() = static_cast<int32_t>(vocab - 1);  // a row of the last vocab shard
  return p;
}

Workload MakeWorkload(const std::string& model, int64_t vocab) {
  // 32 greedy steps on tiny-coder; fewer on the random models (same code paths).
  const int steps = model == "tiny_coder" ? 32 : 10;
  Workload w;
  w.prompt = Prompt(37, 0, vocab);
  auto greedy = [&](int len, int salt) {
    GenerateRequest r;
    r.prompt = Prompt(len, salt, vocab);
    r.max_new_tokens = steps;
    r.ignore_eos = true;
    r.record_logits = true;
    return r;
  };
  w.requests = {greedy(5, 1), greedy(17, 2), greedy(33, 3)};
  w.requests[1].sampling.logprobs = 5;
  GenerateRequest sampled = greedy(12, 4);
  sampled.sampling.temperature = 1.0f;
  sampled.sampling.top_p = 0.95f;
  sampled.sampling.seed = 1234;
  sampled.sampling.logprobs = 3;
  w.requests.push_back(sampled);
  GenerateRequest top_k = greedy(9, 5);
  top_k.sampling.temperature = 0.7f;
  top_k.sampling.top_k = 20;
  top_k.sampling.seed = 99;
  top_k.max_new_tokens = steps / 2;  // finishes before the others
  top_k.sampling.logprobs = 0;
  w.requests.push_back(top_k);
  // Sampled until a stop token (any of the lowest sixth of the vocabulary): this sequence ends
  // early with "stop" on every rank while the others go on.
  GenerateRequest stop = greedy(7, 7);
  stop.sampling.temperature = 1.0f;
  stop.sampling.seed = 77;
  for (int32_t id = 0; id < vocab / 6; ++id) stop.stop_token_ids.push_back(id);
  w.requests.push_back(stop);
  GenerateRequest long_prompt = greedy(90, 6);
  long_prompt.max_new_tokens = 6;
  long_prompt.sampling.logprobs = kMaxLogprobs;
  w.long_requests.push_back(long_prompt);
  return w;
}

// Options shared by the reference and the parallel engines: 40 tokens per step, so that the
// batch's prompts (76 tokens) are prefilled in chunks, partly together with decodes.
EngineOptions BaseOptions() {
  EngineOptions o;
  o.device = "cpu";
  o.block_size = 16;
  o.num_kv_blocks = 64;
  o.model.max_batch_tokens = 40;
  o.model.max_batch_seqs = 40;  // PromptLogits returns a row per prompt token
  o.cuda_graphs = false;
  return o;
}

// Job-wide state: the world communicator, the model directories (random models written by rank
// 0 into a directory of this job) and the references (computed on first use, collectively).
class World : public ::testing::Environment {
 public:
  void SetUp() override {
    world_ = mp_test::MakeWorld(absl::Seconds(300));
    int32_t pid = static_cast<int32_t>(getpid());
    ASSERT_TRUE(world_->Broadcast(Tensor(&pid, {1}, DType::kI32), 0).ok());
    job_dir_ =
        (std::filesystem::path(::testing::TempDir()) / absl::StrCat("tpserve_mp_", pid)).string();
    const char* src = std::getenv("TPSERVE_SOURCE_DIR");
    dirs_["tiny_coder"] = absl::StrCat(src != nullptr ? src : ".", "/models/tiny-coder");
    dirs_["awkward_a"] = job_dir_ + "/awkward_a";
    dirs_["awkward_b"] = job_dir_ + "/awkward_b";
    int32_t ok = 1;
    if (WorldRank() == 0) {
      ok = mp_test::WriteModelDir(AwkwardA(), dirs_["awkward_a"], 7) &&
           mp_test::WriteModelDir(AwkwardB(), dirs_["awkward_b"], 11);
    }
    ASSERT_TRUE(world_->Broadcast(Tensor(&ok, {1}, DType::kI32), 0).ok());
    ASSERT_EQ(ok, 1) << "rank 0 could not write the random models";
  }
  void TearDown() override {
    int32_t done = 1;
    (void)world_->Broadcast(Tensor(&done, {1}, DType::kI32), 0);  // everyone is done reading
    if (WorldRank() == 0) std::filesystem::remove_all(job_dir_);
    world_.reset();
  }

  const std::string& ModelDir(const std::string& model) { return dirs_.at(model); }

  // Collective: every rank calls it with the same model, in the same order.
  const Reference* GetReference(const std::string& model, int64_t vocab) {
    return mp_test::SharedReference(*world_, refs_, model, vocab,
                                    [&] { return ComputeReference(model, vocab); });
  }

 private:
  absl::StatusOr<Reference> ComputeReference(const std::string& model, int64_t vocab) {
    TP_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                        Engine::Create(dirs_.at(model), BaseOptions()));
    const Workload w = MakeWorkload(model, vocab);
    Reference ref;
    TP_ASSIGN_OR_RETURN(ref.prompt_logits, engine->PromptLogits(w.prompt));
    TP_ASSIGN_OR_RETURN(ref.results, engine->Generate(w.requests));
    TP_ASSIGN_OR_RETURN(std::vector<GenerateResult> more, engine->Generate(w.long_requests));
    std::string ids;
    for (GenerateResult& r : more) ref.results.push_back(std::move(r));
    for (const GenerateResult& r : ref.results) {
      absl::StrAppend(
          &ids, " [",
          absl::StrJoin(r.output_ids.begin(),
                        r.output_ids.begin() + std::min<size_t>(8, r.output_ids.size()), " "),
          " ...]");
    }
    printf("reference %s tokens:%s\n", model.c_str(), ids.c_str());
    return ref;
  }

  std::unique_ptr<Communicator> world_;
  std::string job_dir_;
  std::map<std::string, std::string> dirs_;
  std::map<std::string, Reference> refs_;
};

World* g_world = nullptr;

int64_t VocabOf(const std::string& model) {
  if (model == "awkward_a") return AwkwardA().vocab_size;
  if (model == "awkward_b") return AwkwardB().vocab_size;
  absl::StatusOr<ModelConfig> c = LoadModelConfig(g_world->ModelDir(model) + "/config.json");
  TP_CHECK(c.ok()) << c.status();
  return c->vocab_size;
}

class ModelParallelTest : public ::testing::TestWithParam<Case> {};

TEST_P(ModelParallelTest, MatchesOneRank) {
  const Case& c = GetParam();
  const Layout& layout = c.layout;
  if (layout.tp * layout.pp != WorldSize()) {
    GTEST_SKIP() << "needs " << layout.tp * layout.pp << " ranks";
  }
  const int64_t vocab = VocabOf(c.model);
  const Reference* ref = g_world->GetReference(c.model, vocab);
  ASSERT_NE(ref, nullptr);
  const Workload w = MakeWorkload(c.model, vocab);

  std::unique_ptr<Ops> ops = MakeCpuOps();
  GroupOptions group_options;
  group_options.tp = layout.tp;
  group_options.pp = layout.pp;
  group_options.timeout = kCommTimeout;
  absl::StatusOr<ProcessGroups> groups =
      MakeProcessGroupsFromMpi(MPI_COMM_WORLD, group_options, ops.get());
  ASSERT_TRUE(groups.ok()) << groups.status();
  EngineOptions options = BaseOptions();
  options.ops = ops.get();
  options.tp = layout.tp;
  options.pp = layout.pp;
  options.rank = groups->rank;
  options.device_map = layout.device_map;
  options.comms = {groups->tp_comm.get(), groups->pp_comm.get()};
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(g_world->ModelDir(c.model), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const Engine& e = **engine;
  const RankShard& shard = e.model().shard();
  const bool last_stage = shard.last_stage;
  // The shapes this layout is meant to exercise.
  EXPECT_EQ(e.model().vocab_padded() % layout.tp, 0);
  EXPECT_GE(e.model().vocab_padded(), vocab);
  EXPECT_EQ(shard.num_q_heads * layout.tp, e.config().num_heads);
  if (e.config().num_kv_heads < layout.tp) {
    EXPECT_EQ(shard.num_kv_heads, 1);
  }
  if (!layout.device_map.empty()) {
    absl::StatusOr<std::vector<int>> begin =
        ParseDeviceMap(layout.device_map, e.config().num_layers, layout.pp);
    ASSERT_TRUE(begin.ok()) << begin.status();
    EXPECT_EQ(shard.layer_begin, (*begin)[groups->stage]);
    EXPECT_EQ(shard.layer_end, (*begin)[groups->stage + 1]);
  }

  absl::StatusOr<std::vector<std::vector<float>>> prompt_logits = (*engine)->PromptLogits(w.prompt);
  ASSERT_TRUE(prompt_logits.ok()) << prompt_logits.status();
  absl::StatusOr<std::vector<GenerateResult>> results = (*engine)->Generate(w.requests);
  ASSERT_TRUE(results.ok()) << results.status();
  absl::StatusOr<std::vector<GenerateResult>> more = (*engine)->Generate(w.long_requests);
  ASSERT_TRUE(more.ok()) << more.status();
  for (GenerateResult& r : *more) results->push_back(std::move(r));

  double worst_prompt = 0, worst_step = 0;
  int logprob_requests = 0;
  if (last_stage) {
    ASSERT_EQ(prompt_logits->size(), ref->prompt_logits.size());
    for (size_t i = 0; i < ref->prompt_logits.size(); ++i) {
      ASSERT_EQ((*prompt_logits)[i].size(), static_cast<size_t>(vocab));
      const double l2 = RelL2((*prompt_logits)[i], ref->prompt_logits[i]);
      const double mx = RelMax((*prompt_logits)[i], ref->prompt_logits[i]);
      worst_prompt = std::max({worst_prompt, l2, mx});
      EXPECT_LE(l2, kMaxRelErr) << "prompt row " << i;
      EXPECT_LE(mx, kMaxRelErr) << "prompt row " << i;
    }
  } else {
    EXPECT_TRUE(prompt_logits->empty()) << "only the last stage returns logits";
  }
  ASSERT_EQ(results->size(), ref->results.size());
  EXPECT_EQ(ref->results[5].finish_reason, "stop") << "the stop request should end early";
  for (size_t r = 0; r < ref->results.size(); ++r) {
    const GenerateResult& got = (*results)[r];
    const GenerateResult& want = ref->results[r];
    // Every rank holds the tokens: the last stage samples them, the others receive them.
    EXPECT_EQ(got.output_ids, want.output_ids) << "request " << r;
    EXPECT_EQ(got.finish_reason, want.finish_reason) << "request " << r;
    if (!last_stage) {
      EXPECT_TRUE(got.step_logits.empty());
      EXPECT_TRUE(got.logprobs.empty()) << "only the last stage returns logprobs";
      continue;
    }
    ASSERT_EQ(got.step_logits.size(), want.step_logits.size()) << "request " << r;
    for (size_t s = 0; s < want.step_logits.size(); ++s) {
      const double l2 = RelL2(got.step_logits[s], want.step_logits[s]);
      const double mx = RelMax(got.step_logits[s], want.step_logits[s]);
      worst_step = std::max({worst_step, l2, mx});
      EXPECT_LE(l2, kMaxRelErr) << "request " << r << " step " << s;
      EXPECT_LE(mx, kMaxRelErr) << "request " << r << " step " << s;
    }
    ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << "request " << r;
    if (!want.logprobs.empty()) {
      ASSERT_EQ(want.logprobs.size(), want.output_ids.size()) << "request " << r;
      ++logprob_requests;
    }
    for (size_t s = 0; s < want.logprobs.size(); ++s) {
      // A logprob moves by at most the logits' error twice (the logit and the logsumexp):
      // 2 * kMaxRelErr * max|logit|.
      double max_logit = 0;
      for (float x : want.step_logits[s]) max_logit = std::max(max_logit, std::fabs(double(x)));
      const double tol = 2 * kMaxRelErr * max_logit + 1e-6;
      const TokenLogprobs& g = got.logprobs[s];
      const TokenLogprobs& e = want.logprobs[s];
      EXPECT_NEAR(g.logprob, e.logprob, tol) << "request " << r << " step " << s;
      ASSERT_EQ(g.top.size(), e.top.size()) << "request " << r << " step " << s;
      for (size_t k = 0; k < e.top.size(); ++k) {
        EXPECT_NEAR(g.top[k].logprob, e.top[k].logprob, tol) << "request " << r << " rank " << k;
        // Ids may swap only between alternatives closer than the tolerance.
        if (g.top[k].id != e.top[k].id) {
          EXPECT_TRUE((k > 0 && std::fabs(e.top[k].logprob - e.top[k - 1].logprob) <= 2 * tol) ||
                      (k + 1 < e.top.size() &&
                       std::fabs(e.top[k].logprob - e.top[k + 1].logprob) <= 2 * tol))
              << "request " << r << " step " << s << " rank " << k << ": id " << g.top[k].id
              << " instead of " << e.top[k].id << " without a near tie";
        }
      }
    }
  }
  if (last_stage) {
    EXPECT_EQ(logprob_requests, 4) << "the workload's requests with logprobs";
  }
  if (last_stage && shard.tp_rank == 0) {
    printf(
        "[rank %d] %s %s: vocab %lld padded %lld, kv heads/rank %d, layers [%d, %d); "
        "worst rel err prompt %.2e, steps %.2e\n",
        groups->rank, c.model.c_str(), layout.name.c_str(), static_cast<long long>(vocab),
        static_cast<long long>(e.model().vocab_padded()), shard.num_kv_heads, shard.layer_begin,
        shard.layer_end, worst_prompt, worst_step);
    fflush(stdout);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ModelParallelTest, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.model + "_" + info.param.layout.name;
                         });

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) {
  tpserve::g_world = new tpserve::World();
  ::testing::AddGlobalTestEnvironment(tpserve::g_world);
  return tpserve::mp_test::RunMpiTests(&argc, argv);
}
