// Unit tests of the scheduler, the KV block manager and request validation, with a fake worker
// group whose "model" is a pure function of each sequence's tokens, so that any batching,
// chunking or preemption must give exactly what a request gets alone.
#include "coordinator/scheduler.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <random>
#include <set>
#include <span>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/block_manager.h"
#include "coordinator/inference_service.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "coordinator/worker_group.h"
#include "proto/block_tables.h"

namespace tpserve {
namespace {

constexpr int kVocab = 50;

// A worker with a simulated KV cache: every computed token is written to its slot (block table
// x block size), and the next token is a hash of the context READ BACK from the cache through the
// block table (so a wrong or stale shared block changes the output), mod kVocab; so are the
// logprobs of sequences that ask for them. Checks every plan: tokens continue the sequence (the
// cached prefix included: prefix_token_ids), the cache holds exactly the sequence's tokens, no
// step writes into a block another sequence reads (in its plan or in another step in flight), a
// sequence the scheduler said finished never comes back, and a feed_last_sampled placeholder
// stands exactly where the token sampled for it in its previous step belongs (which the fake
// substitutes, as the workers do).
class FakeExecutor : public StepExecutor {
 public:
  explicit FakeExecutor(int num_blocks, int block_size)
      : num_blocks_(num_blocks),
        block_size_(block_size),
        kv_(static_cast<size_t>(num_blocks) * block_size, -1) {}

  // The plan as the workers see it: block-table deltas resolved against the plans before (as
  // every worker does), each table equal to the coordinator's. Steps in flight (overlap,
  // pipelines): no block a plan writes may be held by another sequence in another step in
  // flight (shared cached blocks are only read).
  absl::Status Submit(const worker::StepPlan& sent) override {
    worker::StepPlan plan = sent;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const worker::SeqStep& s : sent.seqs()) deltas_ += s.has_kept_blocks();
      const absl::Status resolved = tables_.Resolve(plan);
      EXPECT_TRUE(resolved.ok()) << resolved;
      if (!resolved.ok()) return resolved;
      for (const worker::SeqStep& s : plan.seqs()) {
        if (scheduler_ == nullptr) break;
        ++tables_checked_;
        EXPECT_EQ(std::vector<int32_t>(s.block_table().begin(), s.block_table().end()),
                  scheduler_->BlockTableForTest(s.seq_id()))
            << "step " << plan.step_id() << ": the workers' table of sequence " << s.seq_id()
            << " differs from the coordinator's";
      }
    }
    OnResolved(plan);
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::map<int32_t, uint64_t>& mine = in_flight_blocks_[plan.step_id()];
      for (const worker::SeqStep& s : plan.seqs()) {
        for (int32_t b : s.block_table()) mine.emplace(b, s.seq_id());
        for (int i = 0; i < s.token_ids_size(); ++i) {
          const int pos = s.start_pos() + i;
          if (pos / block_size_ >= s.block_table_size()) break;
          const int32_t b = s.block_table(pos / block_size_);
          for (const auto& [id, other] : in_flight_blocks_) {
            if (id == plan.step_id()) continue;
            auto it = other.find(b);
            EXPECT_TRUE(it == other.end() || it->second == s.seq_id())
                << "step " << plan.step_id() << " writes block " << b << " of sequence "
                << s.seq_id() << ", held by sequence " << it->second << " in step " << id;
          }
        }
      }
      max_in_flight_seen_ =
          std::max(max_in_flight_seen_, static_cast<int>(in_flight_blocks_.size()));
    }
    return StepExecutor::Submit(plan);
  }
  // Called with each resolved plan before it is run (pipelines check it).
  virtual void OnResolved(const worker::StepPlan& plan) {}
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
    std::map<int32_t, std::set<uint64_t>> readers;  // block -> sequences of this plan using it
    for (const worker::SeqStep& s : plan.seqs()) {
      for (int32_t b : s.block_table()) readers[b].insert(s.seq_id());
    }
    for (const worker::SeqStep& s : plan.seqs()) {
      EXPECT_EQ(finished_.count(s.seq_id()), 0u) << "sequence " << s.seq_id() << " ended";
      std::vector<int32_t>& h = history_[s.seq_id()];
      // Started again (from scratch or from a cached prefix) before it ever sampled: it was
      // preempted in its prefill.
      if (!h.empty() && samples_[s.seq_id()] == 0 &&
          (s.prefix_token_ids_size() > 0 || s.start_pos() < static_cast<int>(h.size()))) {
        restarted_in_prefill_.insert(s.seq_id());
      }
      if (s.prefix_token_ids_size() > 0) {
        EXPECT_EQ(s.prefix_token_ids_size(), s.start_pos());
        h.assign(s.prefix_token_ids().begin(), s.prefix_token_ids().end());
      }
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
      if (s.block_table_size() < need) continue;
      for (int b = 0; b < need; ++b) {
        const int32_t block = s.block_table(b);
        EXPECT_TRUE(block >= 0 && block < num_blocks_);
        if (block < 0 || block >= num_blocks_) return absl::InternalError("bad block");
      }
      for (int pos = s.start_pos(); pos < static_cast<int>(h.size()); ++pos) {
        const int32_t block = s.block_table(pos / block_size_);
        EXPECT_EQ(readers[block].size(), 1u)
            << "step " << plan.step_id() << " writes into block " << block << " shared by "
            << readers[block].size() << " sequences";
        written_blocks_.insert(block);
        kv_[static_cast<size_t>(block) * block_size_ + pos % block_size_] = h[pos];
      }
      std::vector<int32_t> context;
      for (int pos = 0; pos < static_cast<int>(h.size()); ++pos) {
        const int32_t block = s.block_table(pos / block_size_);
        context.push_back(kv_[static_cast<size_t>(block) * block_size_ + pos % block_size_]);
      }
      EXPECT_EQ(context, h) << "sequence " << s.seq_id()
                            << ": the KV cache does not hold its tokens";
      if (s.sample()) {
        uint64_t x = 1469598103934665603ull;
        for (int32_t t : context) x = (x ^ static_cast<uint64_t>(t)) * 1099511628211ull;
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
    computed_tokens_ += tokens;
    max_tokens_ = std::max(max_tokens_, tokens);
    max_seqs_ = std::max(max_seqs_, plan.seqs_size());
    ++steps_;
    if (after_step_) after_step_(steps_);
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    return out;
  }

  std::mutex mu_;
  int num_blocks_, block_size_;
  std::vector<int32_t> kv_;  // token id at each slot; -1: never written
  std::map<uint64_t, std::vector<int32_t>> history_;
  std::set<int32_t> written_blocks_;
  int64_t computed_tokens_ = 0;
  std::map<uint64_t, int32_t> last_sampled_;
  std::map<uint64_t, int> samples_;  // tokens sampled per sequence, dropped ones included
  std::set<uint64_t> restarted_in_prefill_;
  std::set<uint64_t> finished_;
  std::map<uint64_t, std::map<int32_t, uint64_t>> in_flight_blocks_;  // step -> block -> seq
  int max_in_flight_seen_ = 0;
  int feeds_ = 0;
  int max_tokens_ = 0, max_seqs_ = 0, steps_ = 0;
  int delay_ms_ = 0;
  bool fail_ = false;
  BlockTables tables_;                    // the workers' tables (deltas resolved)
  const Scheduler* scheduler_ = nullptr;  // set: every resolved table is checked against it
  int64_t tables_checked_ = 0;
  int64_t deltas_ = 0;  // sequence steps sent as a block-table delta
  // Called after each step (its number, from 1) is computed, with mu_ held: a test disrupts a
  // request at a known point of the run.
  std::function<void(int)> after_step_;
};

// A worker that takes time: a step runs for step_time(its tokens) from when the step before it
// ends (or from when it is sent, if the worker is idle then), Collect returns when it ends, and
// the step time is reported as the workers' (last_forward_seconds), as the real group reports
// it. Records each step's span, how long the worker sat idle before it, and the first step of
// every sequence.
class TimedExecutor : public FakeExecutor {
 public:
  using Clock = std::chrono::steady_clock;
  struct Span {
    Clock::time_point start, end;
    Clock::duration idle{};  // the worker waited this long for the plan
  };
  using StepTime = std::function<std::chrono::milliseconds(int tokens)>;
  TimedExecutor(int num_blocks, int block_size, StepTime step_time)
      : FakeExecutor(num_blocks, block_size), step_time_(std::move(step_time)) {}
  absl::Status Submit(const worker::StepPlan& plan) override {
    const Clock::time_point now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(timing_mu_);
      Span span;
      const bool ran_before = last_end_ != Clock::time_point{};
      int tokens = 0;
      for (const worker::SeqStep& s : plan.seqs()) tokens += s.token_ids_size();
      span.start = std::max(now, last_end_);
      span.end = span.start + step_time_(tokens);
      if (ran_before && now > last_end_) span.idle = now - last_end_;
      last_end_ = span.end;
      spans_[plan.step_id()] = span;
      for (const worker::SeqStep& s : plan.seqs()) first_step_.emplace(s.seq_id(), plan.step_id());
    }
    return FakeExecutor::Submit(plan);
  }
  absl::StatusOr<worker::StepResult> Collect(uint64_t step_id) override {
    Span span;
    {
      std::lock_guard<std::mutex> lock(timing_mu_);
      span = spans_.at(step_id);
    }
    std::this_thread::sleep_until(span.end);
    last_forward_ = std::chrono::duration<double>(span.end - span.start).count();
    return FakeExecutor::Collect(step_id);
  }
  double last_forward_seconds() const override { return last_forward_; }
  // Steps after the first whose worker waited longer than `over` for the plan.
  int IdleSteps(std::chrono::milliseconds over = std::chrono::milliseconds(2)) {
    std::lock_guard<std::mutex> lock(timing_mu_);
    int idle = 0;
    for (const auto& [id, span] : spans_) {
      if (id > 1 && span.idle > over) ++idle;
    }
    return idle;
  }
  // "step: idle ms" of every step that waited, for failure messages.
  std::string Idles() {
    std::lock_guard<std::mutex> lock(timing_mu_);
    std::string out;
    for (const auto& [id, span] : spans_) {
      if (span.idle > Clock::duration::zero()) {
        absl::StrAppendFormat(&out, "%d: %.2f ms; ", id,
                              std::chrono::duration<double, std::milli>(span.idle).count());
      }
    }
    return out;
  }

  std::mutex timing_mu_;
  std::map<uint64_t, Span> spans_;
  std::map<uint64_t, uint64_t> first_step_;  // sequence id -> the first step holding it
  Clock::time_point last_end_{};
  double last_forward_ = 0;  // read by the scheduler thread right after its Collect
  const StepTime step_time_;
};

// A pipeline of `depth` stages: up to `depth` plans in flight, collected in order. Checks that
// no sequence is in two plans in flight at once, and that no block a plan writes is in another
// plan in flight (cached blocks that are only read may be).
class PipelinedFakeExecutor : public FakeExecutor {
 public:
  PipelinedFakeExecutor(int num_blocks, int block_size, int depth)
      : FakeExecutor(num_blocks, block_size), depth_(depth) {}
  int max_in_flight() const override { return depth_; }
  void OnResolved(const worker::StepPlan& plan) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& mine = in_flight_[plan.step_id()];
      for (const worker::SeqStep& s : plan.seqs()) {
        mine.seqs.insert(s.seq_id());
        mine.blocks.insert(s.block_table().begin(), s.block_table().end());
        for (int i = 0; i < s.token_ids_size(); ++i) {
          mine.written.insert(s.block_table((s.start_pos() + i) / block_size_));
        }
      }
      for (const auto& [id, other] : in_flight_) {
        if (id == plan.step_id()) continue;
        for (uint64_t seq : mine.seqs) {
          EXPECT_EQ(other.seqs.count(seq), 0u)
              << "sequence " << seq << " in steps " << id << " and " << plan.step_id();
        }
        for (int32_t b : mine.written) {
          EXPECT_EQ(other.blocks.count(b), 0u) << "block " << b << " written while in flight";
        }
        for (int32_t b : other.written) {
          EXPECT_EQ(mine.blocks.count(b), 0u) << "block " << b << " written while in flight";
        }
      }
    }
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
    std::set<int32_t> blocks, written;
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
    SchedulerOptions o = Options(1000, 1, 1000);
    o.enable_prefix_caching = false;
    Scheduler alone(o, nullptr, &ex);
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
  ex.scheduler_ = &s;
  ASSERT_NO_FATAL_FAILURE(ExpectSoloResults(s, kRequests));
  EXPECT_LE(ex.max_tokens_, 16);
  EXPECT_LE(ex.max_seqs_, 8);
  const SchedulerStats st = s.stats();
  EXPECT_GT(st.preemptions, 0) << "the test should exercise preemption";
  EXPECT_EQ(st.free_blocks, 40);
  EXPECT_GT(ex.tables_checked_, 0);
  EXPECT_GT(ex.deltas_, 0) << "block tables should travel as deltas";
}

// Pipeline parallelism: three steps in flight over disjoint sequences (and blocks), with
// chunking and preemption, still give exactly the solo results.
TEST(SchedulerTest, StepsInFlightThroughAPipelineMatchSoloRuns) {
  constexpr int kRequests = 16;
  PipelinedFakeExecutor ex(48, 4, 3);
  Scheduler s(Options(48, 9, 24), nullptr, &ex);
  ex.scheduler_ = &s;
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
  ex.scheduler_ = &s;
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
  ex.scheduler_ = &s;
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

// Late overlap: with a lead, the step after the running one is planned shortly before that one
// ends, so a request arriving early in step k joins step k + 1; without one (the step after is
// planned as soon as the running one is sent) it joins step k + 2. Either way the worker never
// waits for a plan while a request decodes. Steps of 100 ms and an arrival 15-30 ms into one:
// without a lead the scheduler must have planned step k + 1 within 15 ms of step k's start (a
// 3 ms margin with 40 ms steps failed once in a clean-clone CI run, under the load of the test
// beside it); with a 40 ms lead it plans it 60 ms in.
TEST(SchedulerTest, LateOverlapLetsAnArrivalJoinTheNextStep) {
  using Clock = TimedExecutor::Clock;
  for (const double lead_ms : {40.0, 0.0}) {
    SCOPED_TRACE(::testing::Message() << "lead " << lead_ms << " ms");
    TimedExecutor ex(200, 4, [](int) { return std::chrono::milliseconds(100); });
    SchedulerOptions o = Options(200, 8, 64);
    o.overlap_lead_seconds = lead_ms / 1000;
    Scheduler s(o, nullptr, &ex);
    s.Start();
    auto a = MakeRequest(8, 24, 1);  // sequence 1: decodes for about 2.4 s
    ASSERT_TRUE(s.Submit(a).ok());
    // A step (the fourth or later: step times are known by then) that started 15-30 ms ago.
    uint64_t k = 0;
    const Clock::time_point give_up = Clock::now() + std::chrono::seconds(10);
    while (k == 0 && Clock::now() < give_up) {
      {
        std::lock_guard<std::mutex> lock(ex.timing_mu_);
        const Clock::time_point now = Clock::now();
        for (const auto& [id, span] : ex.spans_) {
          if (id >= 4 && span.start + std::chrono::milliseconds(15) <= now &&
              now <= span.start + std::chrono::milliseconds(30)) {
            k = id;
          }
        }
      }
      if (k == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    ASSERT_NE(k, 0u) << "no step was seen 15-30 ms after its start";
    auto b = MakeRequest(8, 4, 2);  // sequence 2
    ASSERT_TRUE(s.Submit(b).ok());
    ASSERT_TRUE(WaitFinished({a, b}, 10));
    EXPECT_LE(ex.IdleSteps(), 1) << "the worker waited for plans while a request decoded";
    std::lock_guard<std::mutex> lock(ex.timing_mu_);
    EXPECT_EQ(ex.first_step_.at(2), lead_ms > 0 ? k + 1 : k + 2)
        << "the request arrived 15-30 ms into step " << k << " of 100 ms";
    EXPECT_GE(ex.spans_.size(), 24u);
  }
}

// Late overlap never leaves the worker waiting when steps change length: after a run of long
// prefill steps (160 ms) the short decode steps (20 ms) that follow are planned from the times of
// steps as short as they are, not from the long ones (which would plan each ~130 ms too late).
// The lead (10 ms) is larger than the few ms a loaded 2-core CI machine's thread scheduling adds
// to a plan's time: with 10 ms steps and a 3 ms lead, a clean-clone CI run saw 6 steps wait
// 2-5 ms, and 4 busy loops beside the test reproduced it (waits of 1-5 ms).
TEST(SchedulerTest, LateOverlapDoesNotWaitPastAShortStep) {
  TimedExecutor ex(400, 4,
                   [](int tokens) { return std::chrono::milliseconds(tokens >= 32 ? 160 : 20); });
  SchedulerOptions o = Options(400, 8, 64);
  o.overlap_lead_seconds = 0.010;
  Scheduler s(o, nullptr, &ex);
  s.Start();
  std::vector<std::shared_ptr<RequestState>> reqs;
  for (int i = 0; i < 6; ++i) {
    reqs.push_back(MakeRequest(200, 30, i));  // 1,200 prompt tokens: ~19 steps of 64
    ASSERT_TRUE(s.Submit(reqs.back()).ok());
  }
  ASSERT_TRUE(WaitFinished(reqs, 30));
  // Planned from the long steps' time, the first short step would wait ~130 ms for its plan.
  EXPECT_EQ(ex.IdleSteps(std::chrono::milliseconds(40)), 0) << "the worker waited for a plan";
  EXPECT_LE(ex.IdleSteps(), 1) << "the worker waited for plans: " << ex.Idles();
  std::lock_guard<std::mutex> lock(ex.timing_mu_);
  int long_steps = 0, short_steps = 0;
  for (const auto& [id, span] : ex.spans_) {
    ++(span.end - span.start == std::chrono::milliseconds(160) ? long_steps : short_steps);
  }
  EXPECT_GE(long_steps, 16) << "the test needs a run of long steps";
  EXPECT_GE(short_steps, 20) << "and short ones after it";
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
    ex.scheduler_ = &s;
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
    ex.scheduler_ = &s;
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
  ex.scheduler_ = &s;
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
    ex.scheduler_ = &s;
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
  ex.scheduler_ = &s;
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
  ex.scheduler_ = &s;
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

std::shared_ptr<RequestState> RequestFor(const std::vector<int32_t>& prompt, int max_new,
                                         const std::string& cache_salt = "", int logprobs = -1) {
  RequestParams p;
  p.prompt = prompt;
  p.max_new_tokens = max_new;
  p.ignore_eos = true;
  p.logprobs = logprobs;
  p.cache_salt = cache_salt;
  return std::make_shared<RequestState>(p);
}

std::vector<int32_t> Tokens(int n, int seed) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(3 + (i * 13 + seed * 29 + (i * i) % 7) % (kVocab - 3));
  return t;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Runs `prompts` (together) to the end; their outputs and logprobs, flattened.
std::vector<std::vector<float>> RunBatch(Scheduler& s, const std::vector<std::vector<int32_t>>& ps,
                                         int max_new, const std::string& salt = "") {
  std::vector<std::shared_ptr<RequestState>> reqs;
  for (size_t i = 0; i < ps.size(); ++i) {
    reqs.push_back(RequestFor(ps[i], max_new, salt, i % 2 ? 2 : -1));
    EXPECT_TRUE(s.Submit(reqs.back()).ok());
  }
  EXPECT_TRUE(WaitFinished(reqs, 10));
  std::vector<std::vector<float>> out;
  for (auto& r : reqs) {
    EXPECT_TRUE(r->Take().status.ok());
    std::vector<float> v;
    for (int32_t id : Output(*r)) v.push_back(static_cast<float>(id));
    for (float f : OutputLogprobs(*r)) v.push_back(f);
    out.push_back(std::move(v));
  }
  return out;
}

// Waits until the scheduler holds no sequence (its stats are published after each step).
bool WaitIdle(Scheduler& s, double seconds) {
  const auto end = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (std::chrono::steady_clock::now() < end) {
    const SchedulerStats st = s.stats();
    if (s.Idle() && st.free_blocks == st.total_blocks) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// The group fails and is replaced (Suspend, then Resume with a fresh KV cache): the request that
// produced output ends UNAVAILABLE naming the rank; the one still queued is kept and, after
// Resume, gives the same output as on a scheduler that never failed; new requests are refused
// meanwhile; nothing is cached or held across the failure (the fake's KV cache is wiped like a
// new worker's, so a block reused from before would not hold the sequence's tokens).
TEST(SchedulerTest, SuspendKeepsRequestsWithoutOutputAndResumeStartsFresh) {
  std::vector<int32_t> expected;
  {
    FakeExecutor ex(64, 4);
    Scheduler clean(Options(64, 1, 64), nullptr, &ex);
    clean.Start();
    auto r = MakeRequest(9, 6, 2);
    ASSERT_TRUE(clean.Submit(r).ok());
    ASSERT_TRUE(WaitFinished({r}, 5));
    expected = Output(*r);
  }
  FakeExecutor ex(64, 4);
  ex.delay_ms_ = 1;
  Scheduler s(Options(64, 1, 64), nullptr, &ex);  // one sequence at a time: the second waits
  s.Start();
  auto running = MakeRequest(10, 400, 1);
  auto queued = MakeRequest(9, 6, 2);
  ASSERT_TRUE(s.Submit(running).ok());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (Output(*running).empty() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_FALSE(Output(*running).empty());
  ASSERT_TRUE(s.Submit(queued).ok());
  // As the worker group does: the failure callback (Suspend) runs before the step fails.
  const absl::Status failure = absl::UnavailableError("worker rank 1 failed: killed by the test");
  s.Suspend(failure);
  {
    std::lock_guard<std::mutex> lock(ex.mu_);
    ex.fail_ = true;
  }
  ASSERT_TRUE(WaitFinished({running}, 5));
  EXPECT_EQ(running->Take().status, failure);
  EXPECT_EQ(s.Submit(MakeRequest(3, 3, 3)).code(), absl::StatusCode::kUnavailable);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(queued->finished()) << "a request without output waits for the next group";
  SchedulerStats st = s.stats();
  EXPECT_EQ(st.running, 0);
  EXPECT_EQ(st.waiting, 1);
  EXPECT_EQ(st.free_blocks, st.total_blocks);
  EXPECT_EQ(st.cached_blocks, 0);
  {
    // A new group: empty KV cache, no sequence known.
    std::lock_guard<std::mutex> lock(ex.mu_);
    ex.fail_ = false;
    std::fill(ex.kv_.begin(), ex.kv_.end(), -1);
    ex.history_.clear();
    ex.last_sampled_.clear();
    ex.in_flight_blocks_.clear();  // the failed group's steps were never collected
  }
  s.Resume(48);
  ASSERT_TRUE(WaitFinished({queued}, 5));
  EXPECT_TRUE(queued->Take().status.ok());
  EXPECT_EQ(Output(*queued), expected);
  // The prompt of the failed request again: the cache from before the failure is gone, so it is
  // computed in full (the fake checks that every block holds the sequence's tokens).
  auto again = MakeRequest(10, 4, 1);
  ASSERT_TRUE(s.Submit(again).ok());
  ASSERT_TRUE(WaitFinished({again}, 5));
  EXPECT_TRUE(again->Take().status.ok());
  ASSERT_TRUE(WaitIdle(s, 5));
  st = s.stats();
  EXPECT_EQ(st.total_blocks, 48) << "the new group's KV capacity";
  EXPECT_EQ(st.free_blocks, 48);
}

TEST(BlockManagerTest, ChainedHashesMatchTheLongestCachedPrefix) {
  constexpr int kBs = 4;
  BlockManager m(16, kBs, /*enable_prefix_caching=*/true);
  const std::vector<int32_t> a = Tokens(14, 1);  // 3 full blocks + 2 tokens
  auto hashes = [&](const std::vector<int32_t>& t, const std::string& salt) {
    std::vector<uint64_t> h;
    uint64_t parent = BlockManager::RootHash(salt);
    for (size_t i = 0; (i + 1) * kBs <= t.size(); ++i) {
      parent = BlockManager::ChainHash(parent, std::span<const int32_t>(t).subspan(i * kBs, kBs));
      h.push_back(parent);
    }
    return h;
  };
  std::vector<int32_t> ta;
  ASSERT_TRUE(m.GrowTo(ta, 4));
  const std::vector<uint64_t> ha = hashes(a, "");
  ASSERT_EQ(ha.size(), 3u);
  EXPECT_FALSE(m.Register(ta, 1, ha[1], std::span<const int32_t>(a).subspan(4, 4), ""))
      << "a block whose parent is not cached cannot be cached";
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(m.Register(ta, i, ha[i], std::span<const int32_t>(a).subspan(i * kBs, kBs), ""));
  }
  EXPECT_EQ(m.cached_blocks(), 3);
  EXPECT_EQ(m.free_blocks(), 12);
  // The same tokens: all three; a prompt differing in block 1: only block 0; in block 0: none.
  EXPECT_EQ(m.Match(ha, a, "", 3), std::vector<int32_t>(ta.begin(), ta.begin() + 3));
  EXPECT_EQ(m.Match(ha, a, "", 2).size(), 2u);
  std::vector<int32_t> b = a;
  b[5] = b[5] == 3 ? 4 : 3;
  EXPECT_EQ(m.Match(hashes(b, ""), b, "", 3), std::vector<int32_t>{ta[0]});
  std::vector<int32_t> c = a;
  c[0] = c[0] == 3 ? 4 : 3;
  EXPECT_TRUE(m.Match(hashes(c, ""), c, "", 3).empty());
  // Another salt shares nothing, although the tokens are the same.
  EXPECT_TRUE(m.Match(hashes(a, "tenant-b"), a, "tenant-b", 3).empty());
  // A colliding hash (the test passes block 1's hash for other tokens) is a miss, never a
  // wrong block: the tokens are compared.
  std::vector<int32_t> td;
  ASSERT_TRUE(m.GrowTo(td, 2));
  std::vector<int32_t> d = a;
  d[6] = d[6] == 3 ? 4 : 3;
  std::vector<int32_t> td2;
  m.Acquire(td2, m.Match(ha, d, "", 1));
  ASSERT_EQ(td2.size(), 1u);
  ASSERT_TRUE(m.GrowTo(td2, 2));
  EXPECT_FALSE(m.Register(td2, 1, ha[1], std::span<const int32_t>(d).subspan(4, 4), ""));
  std::vector<uint64_t> forged = {ha[0], ha[1]};
  EXPECT_EQ(m.Match(forged, d, "", 2).size(), 1u);
  m.Release(ta);
  m.Release(td);
  m.Release(td2);
  EXPECT_EQ(m.free_blocks(), 16);
  EXPECT_EQ(m.cached_blocks(), 3) << "released cached blocks stay cached (evictable)";
  EXPECT_EQ(m.evictable_blocks(), 3);
}

TEST(BlockManagerTest, RefcountsLruEvictionAndDuplicates) {
  constexpr int kBs = 2;
  BlockManager m(6, kBs, true);
  auto chain = [&](std::vector<int32_t>& table, const std::vector<int32_t>& t,
                   const std::string& salt) {
    uint64_t parent = BlockManager::RootHash(salt);
    for (size_t i = 0; i < table.size(); ++i) {
      auto span = std::span<const int32_t>(t).subspan(i * kBs, kBs);
      parent = BlockManager::ChainHash(parent, span);
      ASSERT_TRUE(m.Register(table, static_cast<int>(i), parent, span, salt));
    }
  };
  auto hashes = [&](const std::vector<int32_t>& t, const std::string& salt) {
    std::vector<uint64_t> h;
    uint64_t parent = BlockManager::RootHash(salt);
    for (size_t i = 0; (i + 1) * kBs <= t.size(); ++i) {
      parent = BlockManager::ChainHash(parent, std::span<const int32_t>(t).subspan(i * kBs, kBs));
      h.push_back(parent);
    }
    return h;
  };
  const std::vector<int32_t> x = {5, 6, 7, 8}, y = {9, 10, 11, 12};
  std::vector<int32_t> tx, tx2, ty;
  ASSERT_TRUE(m.GrowTo(tx, 2));
  chain(tx, x, "");
  // A second sequence shares x's blocks: they stay in use until both release them.
  tx2.clear();
  m.Acquire(tx2, m.Match(hashes(x, ""), x, "", 2));
  EXPECT_EQ(tx2, tx);
  EXPECT_EQ(m.free_blocks(), 4);
  m.Release(tx);
  EXPECT_EQ(m.free_blocks(), 4) << "still used by the second sequence";
  EXPECT_EQ(m.evictable_blocks(), 0);
  m.Release(tx2);
  EXPECT_EQ(m.free_blocks(), 6);
  EXPECT_EQ(m.evictable_blocks(), 2);
  // y: cached too (x's blocks are older, so they are evicted first).
  ASSERT_TRUE(m.GrowTo(ty, 2));
  chain(ty, y, "");
  m.Release(ty);
  EXPECT_EQ(m.cached_blocks(), 4);
  // A recomputed duplicate of y's first block becomes y's cached block; its own is freed.
  std::vector<int32_t> dup;
  ASSERT_TRUE(m.GrowTo(dup, 1));
  const int32_t own = dup[0];
  chain(dup, {9, 10}, "");
  EXPECT_NE(dup[0], own);
  EXPECT_TRUE(m.IsCached(dup[0]));
  m.Release(dup);
  EXPECT_EQ(m.free_blocks(), 6);
  // Taking fresh blocks: the 2 truly free ones, then the least recently used cached blocks,
  // x's, its last block first (the prefix it extends stays matchable longer).
  std::vector<int32_t> fresh;
  ASSERT_TRUE(m.GrowTo(fresh, 3));
  EXPECT_EQ(m.evictions(), 1);
  EXPECT_EQ(m.Match(hashes(x, ""), x, "", 2).size(), 1u);
  ASSERT_TRUE(m.GrowTo(fresh, 4));
  EXPECT_EQ(m.evictions(), 2);
  EXPECT_TRUE(m.Match(hashes(x, ""), x, "", 2).empty());
  EXPECT_EQ(m.Match(hashes(y, ""), y, "", 2).size(), 2u);
  EXPECT_EQ(m.free_blocks(), 2);
  EXPECT_FALSE(m.GrowTo(fresh, 7));
  EXPECT_EQ(fresh.size(), 4u) << "a refused GrowTo changes nothing";
  m.Release(fresh);
  EXPECT_EQ(m.free_blocks(), 6);
  // Dropping by salt: another salt's blocks stay.
  std::vector<int32_t> ts;
  ASSERT_TRUE(m.GrowTo(ts, 1));
  chain(ts, {1, 2}, "s");
  m.Release(ts);
  EXPECT_EQ(m.DropCached("s", false), 1);
  EXPECT_EQ(m.Match(hashes(y, ""), y, "", 2).size(), 2u);
  EXPECT_EQ(m.DropCached("", true), 2);
  EXPECT_EQ(m.cached_blocks(), 0);
  EXPECT_EQ(m.free_blocks(), 6);
}

// Multi-turn conversations, a shared system prompt, prompts that are exact prefixes of cached
// ones (block-aligned: the last block is recomputed), one token longer, and repeated prompts:
// with prefix caching the tokens and logprobs are those of the uncached scheduler, with fewer
// tokens computed.
TEST(PrefixCacheTest, CachedRunsGiveTheUncachedTokens) {
  auto run = [](bool caching, int64_t* computed, SchedulerStats* stats) {
    FakeExecutor ex(200, 4);
    SchedulerOptions o = Options(200, 8, 32);
    o.enable_prefix_caching = caching;
    Scheduler s(o, nullptr, &ex);
    ex.scheduler_ = &s;
    s.Start();
    std::vector<std::vector<float>> out;
    auto add = [&](const std::vector<std::vector<float>>& r) {
      out.insert(out.end(), r.begin(), r.end());
    };
    // A conversation of 4 turns: each resends the history and the output.
    std::vector<int32_t> history = Tokens(10, 1);
    for (int t = 0; t < 4; ++t) {
      auto r = RequestFor(history, 6);
      EXPECT_TRUE(s.Submit(r).ok());
      EXPECT_TRUE(WaitFinished({r}, 10));
      std::vector<float> v;
      for (int32_t id : Output(*r)) v.push_back(static_cast<float>(id));
      out.push_back(v);
      history = Concat(Concat(history, Output(*r)), Tokens(5, 10 + t));
    }
    // A shared 16-token system prompt: one request first, then five together.
    const std::vector<int32_t> sys = Tokens(16, 2);
    add(RunBatch(s, {Concat(sys, Tokens(3, 20))}, 5));
    std::vector<std::vector<int32_t>> batch;
    for (int i = 0; i < 5; ++i) batch.push_back(Concat(sys, Tokens(2 + i, 21 + i)));
    add(RunBatch(s, batch, 7));
    // Exact prefixes of the cached prompt (block-aligned and not), one token longer, the
    // whole system prompt, and the same prompt twice at once.
    for (int n : {12, 13, 16, 17, 8, 4, 3}) {
      add(RunBatch(s, {std::vector<int32_t>(sys.begin(), sys.begin() + std::min(n, 16))}, 5));
    }
    add(RunBatch(s, {Concat(sys, {7})}, 5));
    add(RunBatch(s, {Concat(sys, Tokens(3, 20)), Concat(sys, Tokens(3, 20))}, 6));
    EXPECT_TRUE(WaitIdle(s, 5));
    *stats = s.stats();
    std::lock_guard<std::mutex> lock(ex.mu_);
    *computed = ex.computed_tokens_;
    return out;
  };
  int64_t computed_off = 0, computed_on = 0;
  SchedulerStats off_stats, on_stats;
  const auto off = run(false, &computed_off, &off_stats);
  const auto on = run(true, &computed_on, &on_stats);
  ASSERT_EQ(on.size(), off.size());
  for (size_t i = 0; i < on.size(); ++i) EXPECT_EQ(on[i], off[i]) << "request " << i;
  EXPECT_FALSE(off_stats.prefix_caching);
  EXPECT_EQ(off_stats.prefix_cache_hits, 0);
  EXPECT_EQ(off_stats.cached_blocks, 0);
  EXPECT_TRUE(on_stats.prefix_caching);
  EXPECT_GT(on_stats.prefix_cache_queries, 0);
  EXPECT_GT(on_stats.prefix_cache_hits, on_stats.prefix_cache_queries / 3);
  EXPECT_EQ(computed_off - computed_on, on_stats.prefix_cache_hits)
      << "every token found in the cache is one the workers did not compute";
  EXPECT_EQ(on_stats.free_blocks, on_stats.total_blocks);
  EXPECT_GT(on_stats.cached_blocks, 0);
  EXPECT_EQ(on_stats.evictable_blocks, on_stats.cached_blocks) << "idle: every cached block "
                                                                  "is evictable";
}

// Many short conversations (some with a shared prefix, two salts) under a small KV pool with
// preemption, cancellations and deadlines: every request that completes gets the uncached
// tokens, and the pool returns to idle.
void RandomizedWorkload(FakeExecutor& ex, int depth_label) {
  constexpr int kConversations = 24, kTurns = 3;
  std::mt19937 rng(1234 + depth_label);
  struct Conv {
    std::vector<std::vector<int32_t>> prompts;  // turn t's prompt (uncached history)
    std::vector<std::vector<int32_t>> outputs;  // the uncached outputs
    std::vector<int> max_new;
    std::string salt;
  };
  std::vector<Conv> convs(kConversations);
  const std::vector<int32_t> shared = Tokens(9, 77);
  {
    // The reference: no caching, a pool that never preempts.
    FakeExecutor ref_ex(2000, 4);
    SchedulerOptions o = Options(2000, 64, 512);
    o.enable_prefix_caching = false;
    Scheduler ref(o, nullptr, &ref_ex);
    ref.Start();
    for (int c = 0; c < kConversations; ++c) {
      Conv& v = convs[c];
      v.salt = c % 3 == 0 ? "tenant-b" : "";
      std::vector<int32_t> history = Tokens(3 + static_cast<int>(rng() % 6), c);
      if (c % 2 == 0) history = Concat(shared, history);
      for (int t = 0; t < kTurns; ++t) {
        v.prompts.push_back(history);
        v.max_new.push_back(8 + static_cast<int>(rng() % 17));
        auto r = RequestFor(history, v.max_new.back(), v.salt);
        ASSERT_TRUE(ref.Submit(r).ok());
        ASSERT_TRUE(WaitFinished({r}, 10));
        v.outputs.push_back(Output(*r));
        history = Concat(Concat(history, v.outputs.back()),
                         Tokens(2 + static_cast<int>(rng() % 4), 100 + c * 7 + t));
      }
    }
  }
  // Disruptions drawn up front (the RNG is not thread-safe).
  std::vector<std::vector<int>> disruption(kConversations, std::vector<int>(kTurns));
  for (auto& d : disruption)
    for (int& x : d) x = static_cast<int>(rng() % 12);  // 0: cancel, 1: deadline, else none
  SchedulerOptions o = Options(28, 8, 16);  // 28 blocks of 4 tokens for 8 running sequences
  Scheduler s(o, nullptr, &ex);
  ex.scheduler_ = &s;
  s.Start();
  std::atomic<int> completed{0}, disrupted{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kConversations; ++c) {
    threads.emplace_back([&, c] {
      const Conv& v = convs[c];
      for (int t = 0; t < kTurns; ++t) {
        RequestParams p;
        p.prompt = v.prompts[t];
        p.max_new_tokens = v.max_new[t];
        p.ignore_eos = true;
        p.cache_salt = v.salt;
        // Every other disruption is certain (cancelled before it is submitted, a deadline
        // already past); the others land wherever the run is (waiting, prefill, decode).
        const bool certain = c % 2 == 0;
        if (disruption[c][t] == 1) {
          p.deadline = certain ? Clock::now() : Clock::now() + std::chrono::milliseconds(1 + t);
        }
        auto r = std::make_shared<RequestState>(p);
        if (disruption[c][t] == 0 && certain) r->Cancel();
        ASSERT_TRUE(s.Submit(r).ok());
        if (disruption[c][t] == 0 && !certain) {
          std::this_thread::sleep_for(std::chrono::microseconds(200 * (c % 5)));
          r->Cancel();
          s.Wake();
        }
        ASSERT_TRUE(WaitFinished({r}, 20));
        const RequestState::Taken taken = r->Take();
        if (taken.status.ok()) {
          EXPECT_EQ(Output(*r), v.outputs[t]) << "conversation " << c << " turn " << t;
          ++completed;
        } else {
          EXPECT_TRUE(taken.status.code() == absl::StatusCode::kCancelled ||
                      taken.status.code() == absl::StatusCode::kDeadlineExceeded)
              << taken.status;
          ++disrupted;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(WaitIdle(s, 5)) << "the KV pool did not return to idle";
  const SchedulerStats st = s.stats();
  EXPECT_EQ(st.free_blocks, 28);
  EXPECT_EQ(st.evictable_blocks, st.cached_blocks);
  EXPECT_GT(st.preemptions, 0) << "the test should exercise preemption";
  EXPECT_GT(st.prefix_cache_hits, 0);
  EXPECT_GT(st.prefix_cache_evictions, 0) << "the test should exercise eviction";
  EXPECT_GT(completed.load(), kConversations * kTurns / 2);
  EXPECT_GT(disrupted.load(), 0) << "the test should exercise cancels and deadlines";
  std::lock_guard<std::mutex> lock(ex.mu_);
  EXPECT_GT(ex.tables_checked_, 0) << "the workers' tables were checked against the scheduler's";
  EXPECT_GT(ex.deltas_, 0) << "block tables should travel as deltas";
}

TEST(PrefixCacheTest, RandomizedConversationsUnderPressureMatchUncached) {
  FakeExecutor ex(28, 4);
  ASSERT_NO_FATAL_FAILURE(RandomizedWorkload(ex, 1));
}

TEST(PrefixCacheTest, RandomizedConversationsThroughAPipelineMatchUncached) {
  PipelinedFakeExecutor ex(28, 4, 3);
  ASSERT_NO_FATAL_FAILURE(RandomizedWorkload(ex, 3));
  EXPECT_GE(ex.max_in_flight_seen_, 2);
}

// Requests that share a prefix, all queued before the scheduler starts (so that they arrive in
// one admission): the results, the stats, and the prompt tokens the fake computed.
struct SharedRun {
  std::vector<std::vector<float>> out;
  std::vector<absl::Status> status;
  SchedulerStats stats;
  int64_t fake_computed = 0;
  std::set<uint64_t> restarted_in_prefill;  // sequence ids (in submission order, from 1)
};

SharedRun RunTogether(FakeExecutor& ex, const SchedulerOptions& o,
                      const std::vector<std::shared_ptr<RequestState>>& reqs) {
  SharedRun run;
  Scheduler s(o, nullptr, &ex);
  for (auto& r : reqs) EXPECT_TRUE(s.Submit(r).ok());
  s.Start();
  EXPECT_TRUE(WaitFinished(reqs, 20)) << "a request hangs";
  for (auto& r : reqs) {
    run.status.push_back(r->Take().status);
    std::vector<float> v;
    for (int32_t id : Output(*r)) v.push_back(static_cast<float>(id));
    for (float f : OutputLogprobs(*r)) v.push_back(f);
    run.out.push_back(std::move(v));
  }
  EXPECT_TRUE(WaitIdle(s, 5)) << "the KV pool did not return to idle";
  run.stats = s.stats();
  EXPECT_EQ(run.stats.free_blocks, run.stats.total_blocks);
  EXPECT_EQ(run.stats.evictable_blocks, run.stats.cached_blocks) << "idle: all evictable";
  std::lock_guard<std::mutex> lock(ex.mu_);
  run.fake_computed = ex.computed_tokens_;
  run.restarted_in_prefill = ex.restarted_in_prefill_;
  return run;
}

// A 32-token shared prefix (8 blocks of 4) + 1..6 unique tokens, 6 requests at once: the prefix
// is computed once (the first request computes it, the others wait for its blocks and find them
// cached), the tokens and logprobs are the uncached ones. Chunked (8 tokens a step: the
// producer's prompt takes 5 steps), in one step (64: the producer's blocks must become
// shareable while it decodes on with overlap), without overlap, and through a 3-stage pipeline.
TEST(PrefixCacheTest, APrefixSharedByRequestsArrivingTogetherIsComputedOnce) {
  const std::vector<int32_t> shared = Tokens(32, 40);
  struct Layout {
    std::string name;
    int budget;
    bool overlap;
    int depth;  // pipeline stages (0: the plain fake)
  };
  for (const Layout& l : {Layout{"chunked", 8, true, 0}, Layout{"one step", 64, true, 0},
                          Layout{"no overlap", 8, false, 0}, Layout{"pipeline", 8, true, 3}}) {
    SCOPED_TRACE(l.name);
    int unique_total = 0;
    auto requests = [&] {
      std::vector<std::shared_ptr<RequestState>> reqs;
      unique_total = 0;
      for (int i = 0; i < 6; ++i) {
        reqs.push_back(RequestFor(Concat(shared, Tokens(1 + i, 50 + i)), 6, "", i % 2 ? 2 : -1));
        unique_total += 1 + i;
      }
      return reqs;
    };
    auto run = [&](bool caching) {
      std::unique_ptr<FakeExecutor> ex =
          l.depth > 0 ? std::make_unique<PipelinedFakeExecutor>(100, 4, l.depth)
                      : std::make_unique<FakeExecutor>(100, 4);
      SchedulerOptions o = Options(100, 8, l.budget);
      o.enable_prefix_caching = caching;
      o.overlap = l.overlap;
      return RunTogether(*ex, o, requests());
    };
    const SharedRun off = run(false);
    const SharedRun on = run(true);
    ASSERT_EQ(on.out.size(), off.out.size());
    for (size_t i = 0; i < on.out.size(); ++i) {
      EXPECT_TRUE(on.status[i].ok()) << on.status[i];
      EXPECT_EQ(on.out[i], off.out[i]) << "request " << i;
    }
    EXPECT_EQ(off.stats.prompt_tokens_computed, 6 * 32 + unique_total);
    EXPECT_EQ(on.stats.prompt_tokens_computed, 32 + unique_total) << "the prefix, once";
    EXPECT_EQ(on.stats.prefix_cache_hits, 5 * 32);
    EXPECT_EQ(on.stats.prefix_cache_waits, 5);
    EXPECT_EQ(off.stats.prefix_cache_waits, 0);
    EXPECT_EQ(off.fake_computed - on.fake_computed, 5 * 32) << "the workers' count agrees";
  }
}

// The producer of a shared prefix is disrupted in the middle of its prefill (cancelled, its
// deadline expires, or it is preempted for a decoding request's block): the requests waiting for
// its blocks do not hang, take over what it had not computed yet (computed once still), and get
// the uncached tokens; the pool returns to idle.
TEST(PrefixCacheTest, WaitersTakeOverWhenTheProducerIsDisruptedMidPrefill) {
  const std::vector<int32_t> shared = Tokens(48, 41);  // 12 blocks of 4
  auto waiters = [&] {
    std::vector<std::shared_ptr<RequestState>> w;
    for (int i = 0; i < 4; ++i) w.push_back(RequestFor(Concat(shared, Tokens(2, 60 + i)), 5));
    return w;
  };
  const int waiters_unique = 4 * 2;
  // The reference: no caching.
  SharedRun ref;
  {
    FakeExecutor ex(200, 4);
    SchedulerOptions o = Options(200, 8, 4);
    o.enable_prefix_caching = false;
    ref = RunTogether(ex, o, waiters());
  }
  for (const std::string what : {"cancel", "deadline"}) {
    for (bool overlap : {true, false}) {
      SCOPED_TRACE(what + (overlap ? " with overlap" : " without overlap"));
      FakeExecutor ex(200, 4);
      SchedulerOptions o = Options(200, 8, 4);  // 4 tokens a step: the prefix takes 12 steps
      o.overlap = overlap;
      RequestParams p;
      p.prompt = Concat(shared, Tokens(3, 70));
      p.max_new_tokens = 5;
      p.ignore_eos = true;
      if (what == "deadline") p.deadline = Clock::now() + std::chrono::milliseconds(50);
      auto producer = std::make_shared<RequestState>(p);
      std::vector<std::shared_ptr<RequestState>> reqs = {producer};
      for (auto& w : waiters()) reqs.push_back(w);
      // After its third step the producer has computed 2 or 3 of the 12 shared blocks.
      ex.after_step_ = [&](int step) {
        if (step != 3) return;
        if (what == "cancel") {
          producer->Cancel();
        } else {
          std::this_thread::sleep_until(p.deadline + std::chrono::milliseconds(1));
        }
      };
      const SharedRun on = RunTogether(ex, o, reqs);
      EXPECT_EQ(on.status[0].code(), what == "cancel" ? absl::StatusCode::kCancelled
                                                      : absl::StatusCode::kDeadlineExceeded);
      for (size_t i = 1; i < reqs.size(); ++i) {
        EXPECT_TRUE(on.status[i].ok()) << on.status[i];
        EXPECT_EQ(on.out[i], ref.out[i - 1]) << "waiter " << i;
      }
      // The producer's blocks are reused by the waiter that takes over; its other tokens and
      // the rest of the prefix are computed once.
      EXPECT_EQ(on.stats.prompt_tokens_computed, 48 + waiters_unique);
      EXPECT_GT(on.stats.prefix_cache_hits, 3 * 48) << "the producer computed part of it";
      EXPECT_GE(on.stats.prefix_cache_waits, 4);
    }
  }
  // Preemption: a decoding request (admitted first) needs blocks while the producer is in its
  // prefill; the producer is the newest sequence, so it is the one preempted (the waiters hold
  // no blocks). 17 blocks: 1 + 13 at admission, the decoder grows to 11.
  for (bool overlap : {true, false}) {
    SCOPED_TRACE(overlap ? "preempt with overlap" : "preempt without overlap");
    std::vector<std::shared_ptr<RequestState>> reqs = {RequestFor(Tokens(3, 80), 40),
                                                       RequestFor(Concat(shared, {7}), 5)};
    for (auto& w : waiters()) reqs.push_back(w);
    auto run = [&](bool caching, bool big) {
      FakeExecutor ex(big ? 200 : 17, 4);
      SchedulerOptions o = Options(big ? 200 : 17, 8, 4);
      o.enable_prefix_caching = caching;
      o.overlap = overlap;
      std::vector<std::shared_ptr<RequestState>> fresh;
      for (auto& r : reqs) fresh.push_back(std::make_shared<RequestState>(r->params()));
      return RunTogether(ex, o, fresh);
    };
    const SharedRun expected = run(false, true);
    const SharedRun on = run(true, false);
    EXPECT_EQ(expected.stats.preemptions, 0);
    EXPECT_EQ(on.restarted_in_prefill.count(2), 1u) << "the producer is preempted in its prefill";
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_TRUE(on.status[i].ok()) << on.status[i];
      EXPECT_EQ(on.out[i], expected.out[i]) << "request " << i;
    }
    EXPECT_LT(on.stats.prompt_tokens_computed, expected.stats.prompt_tokens_computed - 3 * 48)
        << "the waiters still share the prefix";
    EXPECT_GE(on.stats.prefix_cache_hits, 4 * 48) << "each waiter finds the whole prefix";
    EXPECT_EQ(on.stats.prefix_cache_waits, 4);
  }
}

// Two salts never share a block; the same salt does; DropPrefixCache forgets one salt's blocks
// (and only those), or all of them.
TEST(PrefixCacheTest, SaltsIsolateAndDropForgets) {
  FakeExecutor ex(100, 4);
  Scheduler s(Options(100, 8, 64), nullptr, &ex);
  ex.scheduler_ = &s;
  s.Start();
  const std::vector<int32_t> prompt = Tokens(13, 5);
  auto run = [&](const std::string& salt) {
    const int64_t before = s.stats().prefix_cache_hits;
    auto r = RequestFor(prompt, 4, salt);
    EXPECT_TRUE(s.Submit(r).ok());
    EXPECT_TRUE(WaitFinished({r}, 10));
    EXPECT_TRUE(WaitIdle(s, 5));
    return s.stats().prefix_cache_hits - before;
  };
  EXPECT_EQ(run("tenant-a"), 0);
  EXPECT_EQ(run("tenant-b"), 0) << "another salt must not see tenant-a's blocks";
  EXPECT_EQ(run(""), 0);
  EXPECT_EQ(run("tenant-a"), 12);
  EXPECT_EQ(run("tenant-b"), 12);
  EXPECT_EQ(run(""), 12);
  auto drop = [&](const std::string& salt, bool all) {
    std::promise<absl::StatusOr<int>> done;
    auto f = done.get_future();
    s.DropPrefixCache(salt, all, [&done](absl::StatusOr<int> n) { done.set_value(n); });
    EXPECT_EQ(f.wait_for(std::chrono::seconds(5)), std::future_status::ready);
    absl::StatusOr<int> n = f.get();
    EXPECT_TRUE(n.ok()) << n.status();
    return n.ok() ? *n : -1;
  };
  const int cached = s.stats().cached_blocks;
  EXPECT_EQ(cached % 3, 0);
  EXPECT_EQ(drop("tenant-a", false), cached / 3);
  EXPECT_EQ(run("tenant-a"), 0) << "dropped";
  EXPECT_EQ(run("tenant-b"), 12) << "another salt's blocks stay";
  EXPECT_GT(drop("", true), 0);
  EXPECT_EQ(s.stats().cached_blocks, 0);
  EXPECT_EQ(s.stats().free_blocks, 100);
  EXPECT_EQ(run(""), 0);
}

// The coordinator's drain and warm-up wait on notifications: WaitIdle returns when the last
// request is done (or at its deadline), RequestState::WaitFinished when the request completes.
TEST(SchedulerTest, WaitIdleAndWaitFinishedReturnOnCompletionOrDeadline) {
  FakeExecutor ex(64, 4);
  ex.delay_ms_ = 2;
  Scheduler s(Options(64, 4, 64), nullptr, &ex);
  ex.scheduler_ = &s;
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

// Records a request's stream as a reactor sees it: every update takes the new output; nothing
// may arrive after the update that said finished.
class StreamRecorder final : public RequestListener {
 public:
  explicit StreamRecorder(std::shared_ptr<RequestState> state) : state_(std::move(state)) {}
  void OnRequestUpdate() override {
    std::lock_guard<std::mutex> lock(mu_);
    RequestState::Taken t = state_->Take();
    if (finished_ && (!t.text.empty() || !t.ids.empty())) ++after_finish_;
    text_ += t.text;
    ids_.insert(ids_.end(), t.ids.begin(), t.ids.end());
    if (t.finished) finished_ = true;
  }
  std::mutex mu_;
  std::shared_ptr<RequestState> state_;
  std::string text_;
  std::vector<int32_t> ids_;
  bool finished_ = false;
  int after_finish_ = 0;
};

// Tokens reach each stream through the delivery thread in order, text detokenized on either
// side (the scheduler for requests with stop strings, delivery for the others); nothing follows
// a stop id or a stop string, and what a stream received is the request's whole output.
TEST(SchedulerTest, DeliveryKeepsStreamsInOrderAndNothingFollowsAStop) {
  auto tokenizer = Tokenizer::Load(
      std::string(std::getenv("TPSERVE_SOURCE_DIR") ? std::getenv("TPSERVE_SOURCE_DIR") : ".") +
      "/models/tiny-coder");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  constexpr int kRequests = 12;
  auto run = [&](const std::vector<RequestParams>& params) {
    FakeExecutor ex(256, 4);
    Scheduler s(Options(256, 8, 64), tokenizer->get(), &ex);
    ex.scheduler_ = &s;
    s.Start();
    std::vector<std::shared_ptr<RequestState>> reqs;
    std::vector<std::shared_ptr<StreamRecorder>> recs;
    for (const RequestParams& p : params) {
      reqs.push_back(std::make_shared<RequestState>(p));
      recs.push_back(std::make_shared<StreamRecorder>(reqs.back()));
      reqs.back()->SetListener(recs.back());
      EXPECT_TRUE(s.Submit(reqs.back()).ok());
    }
    EXPECT_TRUE(WaitFinished(reqs, 20));
    EXPECT_TRUE(s.WaitIdle(Clock::now() + std::chrono::seconds(5)));
    EXPECT_TRUE(WaitIdleBlocks(s, 256, 5));
    return recs;
  };
  std::vector<RequestParams> plain;
  for (int i = 0; i < kRequests; ++i) plain.push_back(MakeRequest(5 + i, 30, i)->params());
  const auto reference = run(plain);
  std::vector<RequestParams> stopping = plain;
  std::vector<std::string> expected_text(kRequests);
  std::vector<size_t> max_ids(kRequests);
  int with_stop_strings = 0;
  for (int i = 0; i < kRequests; ++i) {
    const StreamRecorder& ref = *reference[i];
    ASSERT_EQ(ref.ids_.size(), 30u);
    ASSERT_EQ(ref.text_, (*tokenizer)->Decode(ref.ids_, /*skip_special_tokens=*/true))
        << "request " << i << ": the streamed text is the ids' text";
    expected_text[i] = ref.text_;
    max_ids[i] = ref.ids_.size();
    if (i % 3 == 1) {
      const int32_t stop = ref.ids_[10];
      stopping[i].stop_token_ids = {stop};
      const size_t n = std::find(ref.ids_.begin(), ref.ids_.end(), stop) - ref.ids_.begin() + 1;
      max_ids[i] = n;
      expected_text[i] =
          (*tokenizer)->Decode(std::vector<int32_t>(ref.ids_.begin(), ref.ids_.begin() + n), true);
    } else if (i % 3 == 2 && ref.text_.size() > 8) {
      const std::string stop = ref.text_.substr(ref.text_.size() / 2, 2);
      stopping[i].stop = {stop};
      ++with_stop_strings;
      expected_text[i] = ref.text_.substr(0, ref.text_.find(stop));
    }
  }
  EXPECT_EQ(with_stop_strings, kRequests / 3) << "the plain outputs are too short to cut";
  const auto got = run(stopping);
  for (int i = 0; i < kRequests; ++i) {
    StreamRecorder& r = *got[i];
    std::lock_guard<std::mutex> lock(r.mu_);
    std::string whole_text;
    std::vector<int32_t> whole_ids;
    r.state_->Whole(&whole_text, &whole_ids);
    EXPECT_TRUE(r.finished_) << "request " << i;
    EXPECT_EQ(r.after_finish_, 0) << "request " << i << ": output after the end of the stream";
    EXPECT_EQ(r.ids_, whole_ids) << "request " << i;
    EXPECT_EQ(r.text_, whole_text) << "request " << i;
    EXPECT_EQ(r.text_, expected_text[i]) << "request " << i;
    EXPECT_LE(r.ids_.size(), max_ids[i]) << "request " << i;
    EXPECT_EQ(r.ids_, std::vector<int32_t>(reference[i]->ids_.begin(),
                                           reference[i]->ids_.begin() + r.ids_.size()))
        << "request " << i << ": the streamed ids are a prefix of the plain run's";
    if (i % 3 == 1) {
      EXPECT_EQ(r.ids_.size(), max_ids[i]) << "request " << i << " ends at its stop id";
    }
  }
}

// Random table histories (growth, a block swapped by the prefix cache, truncation, a table
// rebuilt after preemption, sequences ending) encoded by the coordinator and resolved by a
// worker after a trip through the wire give the coordinator's tables; most steps travel as
// deltas, and a delta the worker cannot apply is an error naming the sequence.
TEST(BlockTableDeltaTest, RandomHistoriesResolveToTheCoordinatorsTables) {
  std::mt19937 rng(5);
  std::map<uint64_t, std::pair<std::vector<int32_t>, SentBlockTable>> seqs;
  BlockTables worker_tables;
  uint64_t next_id = 1;
  int64_t deltas = 0, seq_steps = 0, sent_entries = 0, table_entries = 0;
  for (int step = 1; step <= 2000; ++step) {
    worker::StepPlan plan;
    plan.set_step_id(step);
    std::vector<uint64_t> ended;
    for (const auto& [id, st] : seqs) {
      if (rng() % 60 == 0) ended.push_back(id);
    }
    for (uint64_t id : ended) {
      seqs.erase(id);
      plan.add_finished_seq_ids(id);
    }
    while (seqs.size() < 8) seqs[next_id++];
    for (auto& [id, st] : seqs) {
      auto& [table, sent] = st;
      switch (rng() % 10) {
        case 0:  // preempted and readmitted: a new table
          table.clear();
          for (int k = static_cast<int>(rng() % 6); k > 0; --k) table.push_back(rng() % 1000);
          break;
        case 1:  // the prefix cache swapped a block for an identical cached one
          if (!table.empty()) table[rng() % table.size()] = static_cast<int32_t>(rng() % 1000);
          break;
        case 2:
          table.resize(table.size() * 3 / 4);
          break;
        default:  // decode growth
          table.push_back(static_cast<int32_t>(rng() % 1000));
          break;
      }
      if (rng() % 3 == 0) continue;  // not in this step
      worker::SeqStep* s = plan.add_seqs();
      s->set_seq_id(id);
      EncodeBlockTable(table, sent, *s);
      deltas += s->has_kept_blocks();
      sent_entries += s->block_table_size();
      table_entries += static_cast<int64_t>(table.size());
      ++seq_steps;
    }
    worker::StepPlan received;
    ASSERT_TRUE(received.ParseFromString(plan.SerializeAsString()));
    const absl::Status resolved = worker_tables.Resolve(received);
    ASSERT_TRUE(resolved.ok()) << resolved;
    for (const worker::SeqStep& s : received.seqs()) {
      EXPECT_FALSE(s.has_kept_blocks());
      ASSERT_EQ(std::vector<int32_t>(s.block_table().begin(), s.block_table().end()),
                seqs[s.seq_id()].first)
          << "step " << step << ", sequence " << s.seq_id();
    }
  }
  EXPECT_LE(worker_tables.size(), seqs.size()) << "ended sequences are forgotten";
  EXPECT_GT(deltas, seq_steps * 9 / 10);
  // Even with this many swaps and rebuilds, deltas carry a fraction of the tables.
  EXPECT_LT(sent_entries * 2, table_entries);
  // Decode growth: an unchanged table sends nothing, a new block sends only that block.
  SentBlockTable sent;
  std::vector<int32_t> table = {4, 8, 15};
  worker::SeqStep first, same, grown;
  EncodeBlockTable(table, sent, first);
  EXPECT_FALSE(first.has_kept_blocks());
  EXPECT_EQ(first.block_table_size(), 3);
  EncodeBlockTable(table, sent, same);
  EXPECT_EQ(same.kept_blocks(), 3);
  EXPECT_EQ(same.block_table_size(), 0);
  table.push_back(16);
  EncodeBlockTable(table, sent, grown);
  EXPECT_EQ(grown.kept_blocks(), 3);
  ASSERT_EQ(grown.block_table_size(), 1);
  EXPECT_EQ(grown.block_table(0), 16);
  worker::StepPlan bad;
  bad.set_step_id(7);
  worker::SeqStep* s = bad.add_seqs();
  s->set_seq_id(123456);
  s->set_kept_blocks(3);
  const absl::Status st = worker_tables.Resolve(bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_NE(st.message().find("sequence 123456 keeps 3 blocks"), std::string::npos) << st;
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
