// Unit tests of the scheduler, the KV block manager and request validation, with a fake worker
// group whose "model" is a pure function of each sequence's tokens, so that any batching,
// chunking or preemption must give exactly what a request gets alone.
#include "coordinator/scheduler.h"

#include <chrono>
#include <map>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "coordinator/block_manager.h"
#include "coordinator/inference_service.h"

namespace tpserve {
namespace {

constexpr int kVocab = 50;

// Next token = hash of the whole context, mod kVocab, and so are the logprobs of sequences that
// ask for them. Checks every plan: tokens continue the sequence, slots are in the sequence's own
// blocks, no block is shared by two live sequences.
class FakeExecutor : public StepExecutor {
 public:
  explicit FakeExecutor(int num_blocks, int block_size)
      : num_blocks_(num_blocks), block_size_(block_size) {}

  absl::StatusOr<worker::StepResult> Execute(const worker::StepPlan& plan) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_) return absl::UnavailableError("worker rank 1 failed: killed by the test");
    for (uint64_t id : plan.finished_seq_ids()) {
      history_.erase(id);
      owner_blocks_.erase(id);
    }
    int tokens = 0;
    worker::StepResult out;
    std::map<int32_t, uint64_t> owner;
    for (const worker::SeqStep& s : plan.seqs()) {
      std::vector<int32_t>& h = history_[s.seq_id()];
      EXPECT_LE(s.start_pos(), static_cast<int>(h.size()));
      h.resize(s.start_pos());
      h.insert(h.end(), s.token_ids().begin(), s.token_ids().end());
      tokens += s.token_ids_size();
      const int need = (static_cast<int>(h.size()) + block_size_ - 1) / block_size_;
      EXPECT_GE(s.block_table_size(), need);
      for (int b = 0; b < need; ++b) {
        const int32_t block = s.block_table(b);
        EXPECT_TRUE(block >= 0 && block < num_blocks_);
        EXPECT_TRUE(owner.emplace(block, s.seq_id()).second) << "block " << block << " shared";
      }
      if (s.sample()) {
        uint64_t x = 1469598103934665603ull;
        for (int32_t t : h) x = (x ^ static_cast<uint64_t>(t)) * 1099511628211ull;
        out.add_token_ids(static_cast<int32_t>(3 + x % (kVocab - 3)));
        if (s.sampling().has_logprobs()) {
          worker::SampledLogprobs* lp = out.add_logprobs();
          lp->set_logprob(-static_cast<float>(x % 1000) / 100.0f);
          for (int k = 0; k < s.sampling().logprobs(); ++k) {
            worker::TokenLogprob* alt = lp->add_top();
            alt->set_token_id(static_cast<int32_t>((x >> 10) % kVocab + k) % kVocab);
            alt->set_logprob(-static_cast<float>(k) - static_cast<float>(x % 7) / 8.0f);
          }
        }
      }
    }
    max_tokens_ = std::max(max_tokens_, tokens);
    max_seqs_ = std::max(max_seqs_, plan.seqs_size());
    ++steps_;
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    return out;
  }

  std::mutex mu_;
  int num_blocks_, block_size_;
  std::map<uint64_t, std::vector<int32_t>> history_;
  std::map<uint64_t, std::vector<int32_t>> owner_blocks_;
  int max_tokens_ = 0, max_seqs_ = 0, steps_ = 0;
  int delay_ms_ = 0;
  bool fail_ = false;
};

// A pipeline of `depth` stages: up to `depth` plans in flight, collected in order. Checks that
// no sequence and no KV block is in two plans in flight at once.
class PipelinedFakeExecutor : public FakeExecutor {
 public:
  PipelinedFakeExecutor(int num_blocks, int block_size, int depth)
      : FakeExecutor(num_blocks, block_size), depth_(depth) {}
  int max_in_flight() const override { return depth_; }
  absl::Status Submit(const worker::StepPlan& plan) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& mine = in_flight_[plan.step_id()];
      for (const worker::SeqStep& s : plan.seqs()) {
        for (const auto& [id, other] : in_flight_) {
          if (id == plan.step_id()) continue;
          EXPECT_EQ(other.seqs.count(s.seq_id()), 0u)
              << "sequence " << s.seq_id() << " in steps " << id << " and " << plan.step_id();
          for (int32_t b : s.block_table()) {
            EXPECT_EQ(other.blocks.count(b), 0u) << "block " << b << " in two steps in flight";
          }
        }
        mine.seqs.insert(s.seq_id());
        mine.blocks.insert(s.block_table().begin(), s.block_table().end());
      }
      max_in_flight_seen_ = std::max(max_in_flight_seen_, static_cast<int>(in_flight_.size()));
    }
    return StepExecutor::Submit(plan);
  }
  absl::StatusOr<worker::StepResult> Collect(uint64_t step_id) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      EXPECT_EQ(in_flight_.begin()->first, step_id) << "results collected out of order";
    }
    auto ids = StepExecutor::Collect(step_id);
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.erase(step_id);
    return ids;
  }

  struct Step {
    std::set<uint64_t> seqs;
    std::set<int32_t> blocks;
  };
  const int depth_;
  std::map<uint64_t, Step> in_flight_;
  int max_in_flight_seen_ = 0;
};

std::shared_ptr<RequestState> MakeRequest(int prompt_len, int max_new, int salt,
                                          int logprobs = -1) {
  RequestParams p;
  p.logprobs = logprobs;
  for (int i = 0; i < prompt_len; ++i) p.prompt.push_back(3 + (i * 7 + salt) % (kVocab - 3));
  p.max_new_tokens = max_new;
  p.ignore_eos = true;
  return std::make_shared<RequestState>(p);
}

bool WaitFinished(const std::vector<std::shared_ptr<RequestState>>& reqs, double seconds) {
  const auto end = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (std::chrono::steady_clock::now() < end) {
    bool all = true;
    for (auto& r : reqs) all = all && r->finished();
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

std::vector<int32_t> Output(RequestState& r) {
  std::string text;
  std::vector<int32_t> ids;
  r.Whole(&text, &ids);
  return ids;
}

// The logprobs of the whole output, flattened: per token its logprob, then (id, logprob) pairs.
std::vector<float> OutputLogprobs(RequestState& r) {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<TokenLogprobs> logprobs;
  r.Whole(&text, &ids, &logprobs);
  std::vector<float> flat;
  for (const TokenLogprobs& t : logprobs) {
    flat.push_back(t.logprob);
    for (const TokenLogprob& a : t.top) {
      flat.push_back(static_cast<float>(a.id));
      flat.push_back(a.logprob);
    }
  }
  EXPECT_EQ(logprobs.size(), r.params().logprobs >= 0 ? ids.size() : 0u)
      << "one logprobs entry per output token";
  for (const TokenLogprobs& t : logprobs) {
    EXPECT_EQ(static_cast<int>(t.top.size()), r.params().logprobs);
  }
  return flat;
}

SchedulerOptions Options(int blocks, int seqs, int tokens) {
  SchedulerOptions o;
  o.num_blocks = blocks;
  o.block_size = 4;
  o.max_num_seqs = seqs;
  o.max_num_batched_tokens = tokens;
  o.max_queued_requests = 1000;
  o.context_length = 512;
  o.eos_token_ids = {2};
  return o;
}

TEST(BlockManagerTest, GrowsReleasesAndRefusesWithoutPartialChange) {
  BlockManager m(5, 16);
  std::vector<int32_t> a, b;
  EXPECT_EQ(m.BlocksFor(33), 3);
  EXPECT_TRUE(m.GrowTo(a, 3));
  EXPECT_FALSE(m.GrowTo(b, 3));
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(m.free_blocks(), 2);
  m.Release(a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(m.free_blocks(), 5);
}

// Request i of the batching tests: prompt and output lengths vary with i; two in three ask for
// logprobs (0 to 3 alternatives).
std::shared_ptr<RequestState> BatchTestRequest(int i) {
  return MakeRequest(5 + i * 3, 10 + i % 7, i, i % 3 == 0 ? -1 : i % 4);
}

// Runs requests 0..n-1 together on `s` (not yet started) and expects each to end by length with
// exactly the tokens (and logprobs, neither lost nor duplicated by preemption) it gets alone on
// an unconstrained scheduler.
void ExpectSoloResults(Scheduler& s, int n) {
  std::vector<std::vector<int32_t>> solo;
  std::vector<std::vector<float>> solo_logprobs;
  for (int i = 0; i < n; ++i) {
    FakeExecutor ex(1000, 4);
    Scheduler alone(Options(1000, 1, 1000), nullptr, &ex);
    alone.Start();
    auto r = BatchTestRequest(i);
    ASSERT_TRUE(alone.Submit(r).ok());
    ASSERT_TRUE(WaitFinished({r}, 10));
    solo.push_back(Output(*r));
    solo_logprobs.push_back(OutputLogprobs(*r));
    ASSERT_EQ(static_cast<int>(solo.back().size()), 10 + i % 7);
  }
  s.Start();
  std::vector<std::shared_ptr<RequestState>> reqs;
  for (int i = 0; i < n; ++i) {
    reqs.push_back(BatchTestRequest(i));
    ASSERT_TRUE(s.Submit(reqs.back()).ok());
  }
  ASSERT_TRUE(WaitFinished(reqs, 30));
  for (int i = 0; i < n; ++i) {
    RequestState::Taken t = reqs[i]->Take();
    EXPECT_TRUE(t.status.ok()) << t.status;
    EXPECT_EQ(Output(*reqs[i]), solo[i]) << "request " << i;
    EXPECT_EQ(OutputLogprobs(*reqs[i]), solo_logprobs[i]) << "request " << i;
    EXPECT_EQ(t.logprobs.size(), reqs[i]->params().logprobs >= 0 ? t.ids.size() : 0u)
        << "request " << i;
    EXPECT_EQ(t.info.reason, Finish::kLength) << "request " << i;
  }
}

// Batched, chunked and preempted runs give exactly the solo results.
TEST(SchedulerTest, ContinuousBatchingWithPreemptionMatchesSoloRuns) {
  constexpr int kRequests = 24;
  // 40 blocks of 4 tokens: far less than the 24 requests need together -> preemption.
  FakeExecutor ex(40, 4);
  Scheduler s(Options(40, 8, 16), nullptr, &ex);
  ASSERT_NO_FATAL_FAILURE(ExpectSoloResults(s, kRequests));
  EXPECT_LE(ex.max_tokens_, 16);
  EXPECT_LE(ex.max_seqs_, 8);
  const SchedulerStats st = s.stats();
  EXPECT_GT(st.preemptions, 0) << "the test should exercise preemption";
  EXPECT_EQ(st.free_blocks, 40);
}

// Pipeline parallelism: three steps in flight over disjoint sequences (and blocks), with
// chunking and preemption, still give exactly the solo results.
TEST(SchedulerTest, StepsInFlightThroughAPipelineMatchSoloRuns) {
  constexpr int kRequests = 16;
  PipelinedFakeExecutor ex(48, 4, 3);
  Scheduler s(Options(48, 9, 24), nullptr, &ex);
  ASSERT_NO_FATAL_FAILURE(ExpectSoloResults(s, kRequests));
  EXPECT_EQ(ex.max_in_flight_seen_, 3) << "the pipeline never held three steps";
  EXPECT_LE(ex.max_seqs_, 3) << "a step took more than a third of the 9 running sequences";
  const SchedulerStats st = s.stats();
  EXPECT_GT(st.preemptions, 0) << "the test should exercise preemption";
  EXPECT_EQ(st.free_blocks, 48);
}

TEST(SchedulerTest, CancelFreesBlocksAndQueueOverflowIsResourceExhausted) {
  FakeExecutor ex(64, 4);
  ex.delay_ms_ = 2;
  SchedulerOptions o = Options(64, 2, 64);
  o.max_queued_requests = 2;
  Scheduler s(o, nullptr, &ex);
  s.Start();
  std::vector<std::shared_ptr<RequestState>> reqs;
  for (int i = 0; i < 2; ++i) {
    reqs.push_back(MakeRequest(10, 400, i));
    ASSERT_TRUE(s.Submit(reqs.back()).ok());
  }
  // Wait until both run, then fill the queue.
  for (int i = 0; i < 500 && s.stats().running < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_EQ(s.stats().running, 2);
  for (int i = 0; i < 2; ++i) {
    reqs.push_back(MakeRequest(10, 400, 10 + i));
    ASSERT_TRUE(s.Submit(reqs.back()).ok());
  }
  absl::Status full = s.Submit(MakeRequest(10, 5, 99));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_LT(s.stats().free_blocks, 64);
  for (auto& r : reqs) r->Cancel();
  s.Wake();
  ASSERT_TRUE(WaitFinished(reqs, 5));
  for (auto& r : reqs) EXPECT_EQ(r->Take().status.code(), absl::StatusCode::kCancelled);
  for (int i = 0; i < 200 && s.stats().free_blocks != 64; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(s.stats().free_blocks, 64);
  auto after = MakeRequest(4, 3, 5);
  EXPECT_TRUE(s.Submit(after).ok());
  EXPECT_TRUE(WaitFinished({after}, 5));
}

TEST(SchedulerTest, WorkerFailureEndsEverythingUnavailable) {
  FakeExecutor ex(64, 4);
  ex.delay_ms_ = 1;
  Scheduler s(Options(64, 4, 64), nullptr, &ex);
  s.Start();
  auto r = MakeRequest(10, 400, 1);
  ASSERT_TRUE(s.Submit(r).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  {
    std::lock_guard<std::mutex> lock(ex.mu_);
    ex.fail_ = true;
  }
  ASSERT_TRUE(WaitFinished({r}, 5));
  const absl::Status st = r->Take().status;
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("rank 1"), absl::string_view::npos);
  EXPECT_EQ(s.Submit(MakeRequest(3, 3, 3)).code(), absl::StatusCode::kUnavailable);
}

// The coordinator's drain and warm-up wait on notifications: WaitIdle returns when the last
// request is done (or at its deadline), RequestState::WaitFinished when the request completes.
TEST(SchedulerTest, WaitIdleAndWaitFinishedReturnOnCompletionOrDeadline) {
  FakeExecutor ex(64, 4);
  ex.delay_ms_ = 2;
  Scheduler s(Options(64, 4, 64), nullptr, &ex);
  s.Start();
  EXPECT_TRUE(s.WaitIdle(Clock::now()));  // nothing submitted yet
  auto r = MakeRequest(4, 20, 1);
  ASSERT_TRUE(s.Submit(r).ok());
  // 20 steps of at least 2 ms each: neither is done within 5 ms.
  EXPECT_FALSE(s.WaitIdle(Clock::now() + std::chrono::milliseconds(5)));
  EXPECT_FALSE(r->WaitFinished(Clock::now() + std::chrono::milliseconds(5)));
  ASSERT_TRUE(r->WaitFinished(Clock::now() + std::chrono::seconds(10)));
  EXPECT_TRUE(r->Take().status.ok());
  EXPECT_TRUE(s.WaitIdle(Clock::now() + std::chrono::seconds(10)));
  EXPECT_TRUE(s.Idle());
}

TEST(ValidateTest, DefaultsAndLimits) {
  ServiceLimits limits;
  limits.context_length = 100;
  limits.vocab_size = 50;
  limits.kv_capacity_tokens = 80;
  limits.default_max_new_tokens = 30;
  v1::GenerateRequest req;
  for (int i = 0; i < 60; ++i) req.mutable_token_ids()->add_ids(5);
  auto p = ValidateGenerateRequest(req, nullptr, limits);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->max_new_tokens, 20);  // the default (30) capped by the KV capacity (80 - 60)
  EXPECT_EQ(p->temperature, 0.0f);
  EXPECT_EQ(p->repetition_penalty, 1.0f);
  req.mutable_stopping()->set_max_new_tokens(25);  // 85 > the KV capacity of 80
  auto q = ValidateGenerateRequest(req, nullptr, limits);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(q.status().message().find("80"), absl::string_view::npos) << q.status();
  // sampling.logprobs: [0, 20]; out of range names the field and the limit.
  for (int n : {0, 7, kMaxLogprobs}) {
    req.mutable_sampling()->set_logprobs(n);
    req.mutable_stopping()->set_max_new_tokens(5);
    auto ok = ValidateGenerateRequest(req, nullptr, limits);
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(ok->logprobs, n);
  }
  for (int n : {-1, kMaxLogprobs + 1, 1000}) {
    req.mutable_sampling()->set_logprobs(n);
    auto bad = ValidateGenerateRequest(req, nullptr, limits);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << n;
    EXPECT_NE(bad.status().message().find("sampling.logprobs"), absl::string_view::npos);
    EXPECT_NE(bad.status().message().find("20"), absl::string_view::npos) << bad.status();
  }
  req.mutable_sampling()->clear_logprobs();
  EXPECT_EQ(ValidateGenerateRequest(req, nullptr, limits)->logprobs, -1);
  v1::GenerateRequest text;
  text.set_text("hello");
  auto t = ValidateGenerateRequest(text, nullptr, limits);
  EXPECT_NE(t.status().message().find("tokenizer"), absl::string_view::npos) << t.status();
}

}  // namespace
}  // namespace tpserve
