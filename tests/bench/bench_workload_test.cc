// Workloads of the load generator: the seeded RNG, length distributions, Poisson arrivals, the
// presets and request plans.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "tools/bench/workload.h"

namespace tpserve::bench {
namespace {

TEST(RngTest, DeterministicAndUniform) {
  Rng a(7), b(7), c(8);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    const uint64_t x = a.Next();
    EXPECT_EQ(x, b.Next());
    differs |= x != c.Next();
  }
  EXPECT_TRUE(differs);
  Rng r(1);
  double sum = 0;
  int64_t lo_hits = 0, hi_hits = 0;
  constexpr int kN = 200000;
  for (int i = 0; i < kN; ++i) {
    const double u = r.Uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    const int64_t k = r.UniformInt(3, 5);
    ASSERT_GE(k, 3);
    ASSERT_LE(k, 5);
    lo_hits += k == 3;
    hi_hits += k == 5;
  }
  // Standard error of the mean of U(0,1) over 2e5 draws: 0.00065; 5 sigma.
  EXPECT_NEAR(sum / kN, 0.5, 0.0033);
  EXPECT_NEAR(static_cast<double>(lo_hits) / kN, 1.0 / 3, 0.006);
  EXPECT_NEAR(static_cast<double>(hi_hits) / kN, 1.0 / 3, 0.006);
}

TEST(RngTest, NormalMoments) {
  Rng r(3);
  double sum = 0, sq = 0;
  constexpr int kN = 200000;
  for (int i = 0; i < kN; ++i) {
    const double x = r.Normal(100, 15);
    sum += x;
    sq += x * x;
  }
  const double mean = sum / kN;
  const double stddev = std::sqrt(sq / kN - mean * mean);
  EXPECT_NEAR(mean, 100, 0.2);  // SE 0.034
  EXPECT_NEAR(stddev, 15, 0.2);
}

TEST(PoissonArrivalsTest, DeterministicWithSeed) {
  EXPECT_EQ(PoissonArrivals(100, 5, 42), PoissonArrivals(100, 5, 42));
  EXPECT_NE(PoissonArrivals(100, 5, 42), PoissonArrivals(100, 5, 43));
  const auto t = PoissonArrivals(100, 5, 42);
  EXPECT_EQ(t.size(), 100u);
  EXPECT_EQ(t[0], 0.0);
  for (size_t i = 1; i < t.size(); ++i) EXPECT_GT(t[i], t[i - 1]);
}

TEST(PoissonArrivalsTest, MeanRateAndExponentialGaps) {
  constexpr int kN = 100001;
  constexpr double kRate = 8.0;
  const auto t = PoissonArrivals(kN, kRate, 1);
  // kN - 1 gaps of mean 1/rate: the observed rate has relative SE 1/sqrt(1e5) = 0.32%; 5 sigma.
  const double rate = (kN - 1) / t.back();
  EXPECT_NEAR(rate, kRate, kRate * 0.016);
  // Exponential gaps: P(gap > mean) = e^-1 = 0.3679; the coefficient of variation is 1.
  int64_t above = 0;
  double sq = 0;
  const double mean_gap = t.back() / (kN - 1);
  for (int i = 1; i < kN; ++i) {
    const double g = t[i] - t[i - 1];
    above += g > 1.0 / kRate;
    sq += (g - mean_gap) * (g - mean_gap);
  }
  EXPECT_NEAR(static_cast<double>(above) / (kN - 1), std::exp(-1.0), 0.0075);
  EXPECT_NEAR(std::sqrt(sq / (kN - 1)) / mean_gap, 1.0, 0.02);
}

TEST(PoissonArrivalsTest, NoRateMeansAllAtOnce) {
  for (double rate : {0.0, -1.0, static_cast<double>(INFINITY)}) {
    for (double x : PoissonArrivals(10, rate, 1)) EXPECT_EQ(x, 0.0);
  }
}

TEST(LengthDistTest, Parse) {
  auto fixed = LengthDist::Parse("prompt-len", "512");
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  Rng r(1);
  EXPECT_EQ(fixed->Draw(r), 512);
  EXPECT_EQ(fixed->ToString(), "512");

  auto uni = LengthDist::Parse("prompt-len-dist", "uniform:128:1024");
  ASSERT_TRUE(uni.ok()) << uni.status();
  EXPECT_EQ(uni->Max(), 1024);
  std::set<int64_t> seen;
  for (int i = 0; i < 5000; ++i) {
    const int64_t v = uni->Draw(r);
    ASSERT_GE(v, 128);
    ASSERT_LE(v, 1024);
    seen.insert(v);
  }
  EXPECT_GT(seen.size(), 800u);
  EXPECT_EQ(uni->ToString(), "uniform:128:1024");

  auto normal = LengthDist::Parse("output-len-dist", "normal:200:50:100:300");
  ASSERT_TRUE(normal.ok()) << normal.status();
  double sum = 0;
  for (int i = 0; i < 20000; ++i) {
    const int64_t v = normal->Draw(r);
    ASSERT_GE(v, 100);
    ASSERT_LE(v, 300);
    sum += static_cast<double>(v);
  }
  EXPECT_NEAR(sum / 20000, 200, 2);  // symmetric clipping keeps the mean
  auto normal_default = LengthDist::Parse("x", "normal:100:10");
  ASSERT_TRUE(normal_default.ok());
  EXPECT_EQ(normal_default->min, 1);
  EXPECT_EQ(normal_default->max, 140);
}

TEST(LengthDistTest, BadInputNamesTheFlag) {
  for (const char* bad : {"0", "-3", "1.5", "abc", "uniform:10", "uniform:10:5", "normal:1",
                          "normal:10:-1", "zipf:1:2", "uniform:0:5", "normal:10:1:5:2"}) {
    auto d = LengthDist::Parse("prompt-len-dist", bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find("--prompt-len-dist"), std::string::npos) << d.status();
  }
}

TEST(PresetsTest, TheGuideScenarios) {
  auto latency = FindPreset("latency");
  ASSERT_TRUE(latency.ok());
  EXPECT_EQ(latency->prompt_len, 512);
  EXPECT_EQ(latency->output_len, 512);
  EXPECT_EQ(latency->concurrency, 1);
  EXPECT_EQ(latency->turns, 0);
  for (int n : {32, 64, 128}) {
    auto p = FindPreset("batch" + std::to_string(n));
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->concurrency, n);
    EXPECT_EQ(p->prompt_len, 512);
    EXPECT_EQ(p->output_len, 512);
    EXPECT_GE(p->num_requests, 2 * n);  // at least two waves: the batch stays full
  }
  auto chat = FindPreset("chat");
  ASSERT_TRUE(chat.ok());
  EXPECT_GT(chat->turns, 1);
  EXPECT_GT(chat->conversations, chat->concurrency);
  EXPECT_GT(chat->user_turn_len, 0);
  auto shared = FindPreset("shared-prefix");
  ASSERT_TRUE(shared.ok());
  EXPECT_EQ(shared->concurrency, 64);
  EXPECT_EQ(shared->shared_prefix_len, 1024);
  EXPECT_EQ(shared->prompt_len, 128);
  EXPECT_EQ(shared->output_len, 128);
  EXPECT_GE(shared->num_requests, 2 * shared->concurrency);
  EXPECT_EQ(shared->turns, 0);
  auto bad = FindPreset("nope");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("latency"), std::string::npos);
  EXPECT_EQ(Presets().size(), 6u);
}

WorkloadSpec Spec() {
  WorkloadSpec s;
  s.num_requests = 50;
  s.prompt_len = *LengthDist::Parse("p", "uniform:5:40");
  s.output_len = *LengthDist::Parse("o", "uniform:1:8");
  s.vocab_size = 100;
  s.context_length = 64;
  s.request_rate = 10;
  s.seed = 5;
  return s;
}

TEST(PlanRequestsTest, DeterministicValidAndSeedSensitive) {
  auto a = PlanRequests(Spec());
  auto b = PlanRequests(Spec());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->size(), 50u);
  for (size_t i = 0; i < a->size(); ++i) {
    const PlannedRequest& p = (*a)[i];
    EXPECT_EQ(p.prompt, (*b)[i].prompt);
    EXPECT_EQ(p.max_new_tokens, (*b)[i].max_new_tokens);
    EXPECT_EQ(p.arrival_s, (*b)[i].arrival_s);
    EXPECT_GE(p.prompt.size(), 5u);
    EXPECT_LE(p.prompt.size(), 40u);
    for (int32_t id : p.prompt) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, 100);
    }
  }
  EXPECT_EQ(a->front().arrival_s, 0.0);
  EXPECT_EQ((*a)[7].arrival_s, PoissonArrivals(50, 10, 5)[7]);
  WorkloadSpec other = Spec();
  other.seed = 6;
  EXPECT_NE(PlanRequests(other)->front().prompt, a->front().prompt);
  // Changing the rate changes only the arrivals, not the prompts.
  WorkloadSpec faster = Spec();
  faster.request_rate = 100;
  EXPECT_EQ(PlanRequests(faster)->back().prompt, a->back().prompt);
}

TEST(PlanRequestsTest, ContextLengthIsChecked) {
  WorkloadSpec s = Spec();
  s.prompt_len = LengthDist::Fixed(60);
  s.output_len = LengthDist::Fixed(5);
  auto plan = PlanRequests(s);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("context length 64"), std::string::npos) << plan.status();
}

TEST(PlanRequestsTest, ChatTurns) {
  WorkloadSpec s;
  s.vocab_size = 100;
  s.turns = 3;
  s.conversations = 4;
  s.prompt_len = LengthDist::Fixed(20);
  s.user_turn_len = LengthDist::Fixed(5);
  s.output_len = LengthDist::Fixed(4);
  s.context_length = 64;
  auto plan = PlanRequests(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->size(), 12u);
  for (size_t i = 0; i < plan->size(); ++i) {
    const PlannedRequest& p = (*plan)[i];
    EXPECT_EQ(p.index, static_cast<int64_t>(i));
    EXPECT_EQ(p.conversation, static_cast<int64_t>(i / 3));
    EXPECT_EQ(p.turn, static_cast<int64_t>(i % 3));
    EXPECT_EQ(p.prompt.size(), p.turn == 0 ? 20u : 5u);
  }
  // The third turn sends 20 + 4 + 5 + 4 + 5 = 38 tokens and asks for 4: 42 <= 64. With 6
  // turns the last one needs 20 + 5 * 9 + 4 = 69 > 64.
  s.turns = 6;
  auto too_long = PlanRequests(s);
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.status().message().find("turn 5"), std::string::npos) << too_long.status();
}

TEST(PlanRequestsTest, SharedPrefixIsTheSameInFrontOfEveryPrompt) {
  WorkloadSpec s = Spec();
  s.prompt_len = LengthDist::Fixed(10);
  s.output_len = LengthDist::Fixed(4);
  s.shared_prefix_len = 30;
  auto plan = PlanRequests(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  WorkloadSpec plain = s;
  plain.shared_prefix_len = 0;
  auto unique = PlanRequests(plain);
  ASSERT_TRUE(unique.ok());
  const std::vector<int32_t> prefix(plan->front().prompt.begin(),
                                    plan->front().prompt.begin() + 30);
  std::set<std::vector<int32_t>> tails;
  for (size_t i = 0; i < plan->size(); ++i) {
    const std::vector<int32_t>& p = (*plan)[i].prompt;
    ASSERT_EQ(p.size(), 40u);
    EXPECT_EQ(std::vector<int32_t>(p.begin(), p.begin() + 30), prefix) << i;
    // The unique part is what the plan without a shared prefix draws.
    EXPECT_EQ(std::vector<int32_t>(p.begin() + 30, p.end()), (*unique)[i].prompt) << i;
    tails.insert(std::vector<int32_t>(p.begin() + 30, p.end()));
  }
  EXPECT_GT(tails.size(), 40u);
  // The context check counts the shared prefix: 30 + 10 + 4 = 44 fits 64; 30 + 10 + 30 not.
  s.output_len = LengthDist::Fixed(30);
  auto too_long = PlanRequests(s);
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.status().message().find("prompt of 40 tokens"), std::string::npos)
      << too_long.status();
  // A chat's first turn carries it too.
  WorkloadSpec chat;
  chat.vocab_size = 100;
  chat.turns = 2;
  chat.conversations = 3;
  chat.prompt_len = LengthDist::Fixed(5);
  chat.user_turn_len = LengthDist::Fixed(3);
  chat.output_len = LengthDist::Fixed(2);
  chat.shared_prefix_len = 8;
  auto c = PlanRequests(chat);
  ASSERT_TRUE(c.ok()) << c.status();
  for (const PlannedRequest& r : *c) {
    EXPECT_EQ(r.prompt.size(), r.turn == 0 ? 13u : 3u);
    if (r.turn == 0) {
      EXPECT_EQ(std::vector<int32_t>(r.prompt.begin(), r.prompt.begin() + 8),
                std::vector<int32_t>(c->front().prompt.begin(), c->front().prompt.begin() + 8));
    }
  }
}

}  // namespace
}  // namespace tpserve::bench
