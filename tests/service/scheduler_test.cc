// Unit tests of the scheduler, the KV block manager and request validation, with a fake worker
// group whose "model" is a pure function of each sequence's tokens, so that any batching,
// chunking or preemption must give exactly what a request gets alone.
#include "coordinator/scheduler.h"

#include <chrono>
#include <map>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "coordinator/block_manager.h"
#include "coordinator/inference_service.h"
#include "coordinator/worker_group.h"

namespace tpserve {
namespace {

constexpr int kVocab = 50;

// Next token = hash of the whole context, mod kVocab, and so are the logprobs of sequences that
// ask for them. Checks every plan: tokens continue the sequence, slots are in the sequence's own
// blocks, no block is shared by two live sequences (in one plan or in two plans in flight), a
// sequence the scheduler said finished never comes back, and a feed_last_sampled placeholder
// stands exactly where the token sampled for it in its previous step belongs (which the fake
// substitutes, as the workers do).
class FakeExecutor : public StepExecutor {
 public:
  explicit FakeExecutor(int num_blocks, int block_size)
      : num_blocks_(num_blocks), block_size_(block_size) {}

  absl::Status Submit(const worker::StepPlan& plan) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::map<int32_t, uint64_t>& mine = in_flight_blocks_[plan.step_id()];
      for (const worker::SeqStep& s : plan.seqs()) {
        for (int32_t b : s.block_table()) {
          for (const auto& [id, other] : in_flight_blocks_) {
            auto it = other.find(b);
            EXPECT_TRUE(it == other.end() || it->second == s.seq_id())
                << "block " << b << " of sequence " << s.seq_id() << " (step " << plan.step_id()
                << ") is held by sequence " << it->second << " in step " << id;
          }
          mine[b] = s.seq_id();
        }
      }
      max_in_flight_seen_ =
          std::max(max_in_flight_seen_, static_cast<int>(in_flight_blocks_.size()));
    }
    return StepExecutor::Submit(plan);
  }
  absl::StatusOr<worker::StepResult> Collect(uint64_t step_id) override {
    auto out = StepExecutor::Collect(step_id);
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_blocks_.erase(step_id);
    return out;
  }

  absl::StatusOr<worker::StepResult> Execute(const worker::StepPlan& plan) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_) return absl::UnavailableError("worker rank 1 failed: killed by the test");
    for (uint64_t id : plan.finished_seq_ids()) {
      EXPECT_TRUE(finished_.insert(id).second) << "sequence " << id << " finished twice";
      history_.erase(id);
      last_sampled_.erase(id);
    }
    int tokens = 0;
    worker::StepResult out;
    std::map<int32_t, uint64_t> owner;
    for (const worker::SeqStep& s : plan.seqs()) {
      EXPECT_EQ(finished_.count(s.seq_id()), 0u) << "sequence " << s.seq_id() << " ended";
      std::vector<int32_t>& h = history_[s.seq_id()];
      EXPECT_LE(s.start_pos(), static_cast<int>(h.size()));
      h.resize(s.start_pos());
      if (s.feed_last_sampled()) {
        ++feeds_;
        auto last = last_sampled_.find(s.seq_id());
        if (last == last_sampled_.end()) {
          return absl::InternalError(absl::StrCat("sequence ", s.seq_id(), " feeds a token ",
                                                  "that its previous step did not sample"));
        }
        EXPECT_EQ(s.token_ids_size(), 1);
        EXPECT_EQ(s.token_ids(0), 0) << "the placeholder";
        // The placeholder's position is right after every token the sequence computed.
        EXPECT_EQ(s.start_pos(), static_cast<int>(h.size()));
        h.push_back(last->second);
      } else {
        h.insert(h.end(), s.token_ids().begin(), s.token_ids().end());
      }
      last_sampled_.erase(s.seq_id());
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
        last_sampled_[s.seq_id()] = out.token_ids(out.token_ids_size() - 1);
        ++samples_[s.seq_id()];
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
  std::map<uint64_t, int32_t> last_sampled_;
  std::map<uint64_t, int> samples_;  // tokens sampled per sequence, dropped ones included
  std::set<uint64_t> finished_;
  std::map<uint64_t, std::map<int32_t, uint64_t>> in_flight_blocks_;  // step -> block -> seq
  int max_in_flight_seen_ = 0;
  int feeds_ = 0;
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
    }
    return FakeExecutor::Submit(plan);
  }
  absl::StatusOr<worker::StepResult> Collect(uint64_t step_id) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      EXPECT_EQ(in_flight_.begin()->first, step_id) << "results collected out of order";
    }
    auto ids = FakeExecutor::Collect(step_id);
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

// The serial loop (overlap off) gives the same tokens, and keeps one step in flight.
TEST(SchedulerTest, WithoutOverlapTheSerialLoopMatchesSoloRuns) {
  FakeExecutor ex(40, 4);
  SchedulerOptions o = Options(40, 8, 16);
  o.overlap = false;
  Scheduler s(o, nullptr, &ex);
  ASSERT_NO_FATAL_FAILURE(ExpectSoloResults(s, 24));
  EXPECT_EQ(ex.max_in_flight_seen_, 1);
  EXPECT_EQ(ex.feeds_, 0);
  EXPECT_GT(s.stats().preemptions, 0);
  EXPECT_EQ(s.stats().free_blocks, 40);
}

// Overlap (the default at pp = 1): two steps in flight over the same sequences, decodes fed by
// the workers, with chunking and preemption: the solo results still.
TEST(SchedulerTest, OverlapKeepsTwoStepsInFlightAndMatchesSoloRuns) {
  FakeExecutor ex(40, 4);
  Scheduler s(Options(40, 8, 16), nullptr, &ex);
  ASSERT_NO_FATAL_FAILURE(ExpectSoloResults(s, 24));
  EXPECT_EQ(ex.max_in_flight_seen_, 2);
  EXPECT_GT(ex.feeds_, 100) << "decodes should continue with feed_last_sampled";
  const SchedulerStats st = s.stats();
  EXPECT_GT(st.preemptions, 0);
  EXPECT_EQ(st.free_blocks, 40);
  EXPECT_EQ(st.dropped_tokens, 0) << "lengths are known ahead: no step past max_new_tokens";
  EXPECT_GT(st.cpu_seconds, 0);
  EXPECT_LT(st.cpu_seconds, st.step_seconds * 4) << "the scheduler's CPU time is per step";
}

bool WaitIdleBlocks(Scheduler& s, int total, double seconds) {
  const auto end = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (std::chrono::steady_clock::now() < end) {
    const SchedulerStats st = s.stats();
    if (st.free_blocks == total && st.running == 0 && st.waiting == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

// With overlap the coordinator learns a token one step late: when it is a stop id or EOS, the
// next step has already sampled one more token for the sequence. That token is computed (the
// fake counts it) but never emitted, and the blocks come back exactly once.
TEST(SchedulerTest, TheTokenAfterAStopIsComputedButNeverEmitted) {
  std::vector<int32_t> reference;
  {
    FakeExecutor ex(64, 4);
    Scheduler s(Options(64, 4, 64), nullptr, &ex);
    s.Start();
    auto r = MakeRequest(7, 24, 3);
    ASSERT_TRUE(s.Submit(r).ok());
    ASSERT_TRUE(WaitFinished({r}, 10));
    reference = Output(*r);
    ASSERT_EQ(reference.size(), 24u);
  }
  const int32_t stop = reference[6];
  const size_t first = std::find(reference.begin(), reference.end(), stop) - reference.begin();
  const std::vector<int32_t> expected(reference.begin(), reference.begin() + first + 1);
  for (const bool as_eos : {false, true}) {
    FakeExecutor ex(64, 4);
    SchedulerOptions o = Options(64, 4, 64);
    if (as_eos) o.eos_token_ids = {stop};
    Scheduler s(o, nullptr, &ex);
    s.Start();
    RequestParams p = MakeRequest(7, 24, 3)->params();
    if (as_eos) {
      p.ignore_eos = false;
    } else {
      p.stop_token_ids = {stop};
    }
    auto r = std::make_shared<RequestState>(p);
    ASSERT_TRUE(s.Submit(r).ok());
    ASSERT_TRUE(WaitFinished({r}, 10));
    RequestState::Taken t = r->Take();
    EXPECT_TRUE(t.status.ok()) << t.status;
    EXPECT_EQ(t.info.reason, Finish::kStop);
    EXPECT_EQ(t.ids, expected) << "eos " << as_eos;
    EXPECT_EQ(Output(*r), expected) << "eos " << as_eos << ": a token past the stop was emitted";
    EXPECT_EQ(t.info.output_tokens, static_cast<int>(expected.size()));
    ASSERT_TRUE(WaitIdleBlocks(s, 64, 5));
    EXPECT_EQ(s.stats().dropped_tokens, 1);
    // The next plan tells the workers that the sequence ended.
    auto next = MakeRequest(3, 2, 9);
    ASSERT_TRUE(s.Submit(next).ok());
    ASSERT_TRUE(WaitFinished({next}, 5));
    ASSERT_TRUE(WaitIdleBlocks(s, 64, 5));
    std::lock_guard<std::mutex> lock(ex.mu_);
    EXPECT_EQ(ex.samples_[1], static_cast<int>(expected.size()) + 1)
        << "the step after the stop should have sampled one more token (and it was dropped)";
    EXPECT_EQ(ex.finished_.count(1), 1u) << "the workers were told the sequence ended";
  }
}

// A length limit is known ahead: the scheduler never samples past max_new_tokens.
TEST(SchedulerTest, OverlapNeverSamplesPastTheLengthLimit) {
  FakeExecutor ex(64, 4);
  Scheduler s(Options(64, 4, 64), nullptr, &ex);
  s.Start();
  std::vector<std::shared_ptr<RequestState>> reqs;
  for (int i = 0; i < 4; ++i) {
    reqs.push_back(MakeRequest(3 + i, 1 + i * 5, i));
    ASSERT_TRUE(s.Submit(reqs.back()).ok());
  }
  ASSERT_TRUE(WaitFinished(reqs, 10));
  ASSERT_TRUE(WaitIdleBlocks(s, 64, 5));
  std::lock_guard<std::mutex> lock(ex.mu_);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(Output(*reqs[i]).size(), static_cast<size_t>(1 + i * 5));
    EXPECT_EQ(ex.samples_[i + 1], 1 + i * 5) << "request " << i;
  }
  EXPECT_EQ(s.stats().dropped_tokens, 0);
}

// Cancels at random moments and expired deadlines, with two steps in flight and a pool small
// enough to preempt: every request ends, what it got is a prefix of its solo output, no block
// is held by two sequences in flight, and every block comes back.
TEST(SchedulerTest, CancelsAndDeadlinesInFlightReturnEveryBlock) {
  constexpr int kRequests = 16;
  std::vector<std::vector<int32_t>> solo;
  for (int i = 0; i < kRequests; ++i) {
    FakeExecutor ex(1000, 4);
    Scheduler alone(Options(1000, 1, 1000), nullptr, &ex);
    alone.Start();
    auto r = MakeRequest(5 + i, 60, i);
    ASSERT_TRUE(alone.Submit(r).ok());
    ASSERT_TRUE(WaitFinished({r}, 10));
    solo.push_back(Output(*r));
  }
  for (const bool overlap : {true, false}) {
    FakeExecutor ex(48, 4);
    ex.delay_ms_ = 1;
    SchedulerOptions o = Options(48, 8, 24);
    o.overlap = overlap;
    Scheduler s(o, nullptr, &ex);
    s.Start();
    std::vector<std::shared_ptr<RequestState>> reqs;
    std::mt19937 rng(overlap ? 7 : 8);
    for (int i = 0; i < kRequests; ++i) {
      RequestParams p = MakeRequest(5 + i, 60, i)->params();
      if (i % 4 == 1) {
        p.deadline = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(std::uniform_int_distribution<int>(1, 60)(rng));
      }
      reqs.push_back(std::make_shared<RequestState>(p));
      ASSERT_TRUE(s.Submit(reqs.back()).ok());
    }
    std::vector<int> cancel_at(kRequests);
    for (int& c : cancel_at) c = std::uniform_int_distribution<int>(0, 80)(rng);
    for (int ms = 0; ms <= 80; ++ms) {
      for (int i = 0; i < kRequests; ++i) {
        if (i % 4 == 2 && cancel_at[i] == ms) {
          reqs[i]->Cancel();
          s.Wake();
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(WaitFinished(reqs, 30));
    for (int i = 0; i < kRequests; ++i) {
      RequestState::Taken t = reqs[i]->Take();
      const std::vector<int32_t> got = Output(*reqs[i]);
      ASSERT_LE(got.size(), solo[i].size());
      EXPECT_EQ(got, std::vector<int32_t>(solo[i].begin(), solo[i].begin() + got.size()))
          << "request " << i << " overlap " << overlap;
      if (t.status.ok()) {
        EXPECT_EQ(got, solo[i]) << "request " << i;
      } else {
        EXPECT_TRUE(t.status.code() == absl::StatusCode::kCancelled ||
                    t.status.code() == absl::StatusCode::kDeadlineExceeded)
            << t.status;
      }
    }
    EXPECT_TRUE(WaitIdleBlocks(s, 48, 5)) << "free " << s.stats().free_blocks << " of 48";
    auto after = MakeRequest(4, 3, 5);
    ASSERT_TRUE(s.Submit(after).ok());
    ASSERT_TRUE(WaitFinished({after}, 5));
    EXPECT_TRUE(after->Take().status.ok());
    EXPECT_EQ(Output(*after).size(), 3u);
    EXPECT_TRUE(WaitIdleBlocks(s, 48, 5));
  }
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

// What a sampling worker returns is checked before it reaches the scheduler: a wrong number of
// ids, an id outside the vocabulary or a malformed logprobs entry fails the step.
TEST(StepResultValidationTest, MalformedResultsAreRefused) {
  worker::StepResult good;
  good.set_step_id(7);
  good.add_token_ids(0);
  good.add_token_ids(99);
  worker::SampledLogprobs* lp = good.add_logprobs();
  lp->set_logprob(-0.5f);
  lp->add_top()->set_token_id(3);
  EXPECT_TRUE(ValidateStepResult(good, 2, 1, 100).ok());

  auto refused = [](const worker::StepResult& r, int sampled, int with_logprobs,
                    const std::string& what) {
    const absl::Status st = ValidateStepResult(r, sampled, with_logprobs, 100);
    EXPECT_FALSE(st.ok()) << what;
    EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
  };
  worker::StepResult r = good;
  r.set_token_ids(1, 100);
  refused(r, 2, 1, "token id 100 is outside the vocabulary [0, 100)");
  r = good;
  r.set_token_ids(0, -1);
  refused(r, 2, 1, "token id -1 is outside the vocabulary");
  refused(good, 3, 1, "2 token ids for 3 sampled sequences");
  refused(good, 2, 0, "1 logprobs entries for 0 sequences that asked");
  r = good;
  r.mutable_logprobs(0)->mutable_top(0)->set_token_id(1000);
  refused(r, 2, 1, "token id 1000 is outside the vocabulary");
  r = good;
  for (int i = 0; i < kMaxLogprobs; ++i) r.mutable_logprobs(0)->add_top()->set_token_id(1);
  refused(r, 2, 1, "logprob alternatives (at most 20)");
}

}  // namespace
}  // namespace tpserve
