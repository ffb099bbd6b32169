// Checks deterministic mode (--deterministic) at the shard runner: one target request is run
// alone and among other requests of random lengths, at a random position of every step, with
// chunked prefill, a prefix-cache hit or a preemption, through hand-made step plans (as the
// coordinator's scheduler makes them); its tokens, logprobs and logits are compared bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "worker/shard_runner.h"

namespace tpserve::testing_util {

struct DetScenario {
  std::string name;
  int others = 0;       // other requests running beside the target at every step
  int chunk = 1 << 20;  // prefill tokens per sequence and step
  int max_step_tokens = 1 << 20;
  int other_max_prompt = 40;  // others' prompts: 1..this tokens; then 1..8 decode steps
  // The target's full prompt blocks come from the last run that kept them (KeepPrefix).
  bool prefix_hit = false;
  // After this many generated tokens the target loses its blocks and is recomputed (prompt and
  // generated tokens, in chunks, among the others) before it goes on; -1: never.
  int preempt_after = -1;
  uint64_t seed = 1;
};

struct DetOutcome {
  std::vector<int32_t> tokens;
  std::vector<float> logprob;                               // of each sampled token
  std::vector<std::vector<std::pair<int32_t, float>>> top;  // its top alternatives
  std::vector<std::vector<float>> logits;                   // the target's row, each sample
};

// Every token, logprob and logits value identical (bit for bit: floats compared as bytes).
inline void ExpectSameBits(const DetOutcome& got, const DetOutcome& want, const std::string& what) {
  EXPECT_EQ(got.tokens, want.tokens) << what;
  ASSERT_EQ(got.logprob.size(), want.logprob.size()) << what;
  ASSERT_EQ(got.logits.size(), want.logits.size()) << what;
  for (size_t i = 0; i < want.logprob.size(); ++i) {
    EXPECT_EQ(std::memcmp(&got.logprob[i], &want.logprob[i], sizeof(float)), 0)
        << what << ": logprob of token " << i << ": " << got.logprob[i] << " vs "
        << want.logprob[i];
    EXPECT_EQ(got.top[i], want.top[i]) << what << ": top logprobs of token " << i;
    ASSERT_EQ(got.logits[i].size(), want.logits[i].size()) << what;
    size_t differ = 0, first = 0;
    for (size_t v = 0; v < want.logits[i].size(); ++v) {
      if (std::memcmp(&got.logits[i][v], &want.logits[i][v], sizeof(float)) != 0) {
        if (differ++ == 0) first = v;
      }
    }
    EXPECT_EQ(differ, 0u) << what << ": token " << i << ": " << differ
                          << " logits differ, the first at " << first << " ("
                          << got.logits[i][first] << " vs " << want.logits[i][first] << ")";
  }
}

class DetHarness {
 public:
  // Uses KV blocks [1, runner->num_blocks()) (block 0 is the graph warm-up's scratch).
  explicit DetHarness(ShardRunner* runner) : runner_(runner) {
    for (int b = runner->num_blocks() - 1; b >= 1; --b) free_.push_back(b);
  }

  // Runs `prompt` for `new_tokens` sampled tokens (temperature 0.7, top-p 0.9, seed 42, 5
  // logprobs) under `sc`. With keep_prefix the target's full prompt blocks stay allocated for a
  // later prefix_hit scenario.
  absl::StatusOr<DetOutcome> Run(const std::vector<int32_t>& prompt, int new_tokens,
                                 const DetScenario& sc, bool keep_prefix = false) {
    std::mt19937_64 rng(sc.seed);
    const int bs = runner_->block_size();
    Seq target;
    target.id = next_id_++;
    target.tokens = prompt;
    target.sample = true;
    if (sc.prefix_hit && keep_prefix) {
      return absl::InvalidArgumentError("a prefix_hit run cannot keep its prefix");
    }
    if (sc.prefix_hit) {
      if (prefix_prompt_ != prompt || prefix_blocks_.empty()) {
        return absl::FailedPreconditionError("prefix_hit without a kept prefix of this prompt");
      }
      target.shared = static_cast<int>(prefix_blocks_.size());
      target.blocks = prefix_blocks_;
      target.computed = target.shared * bs;
    }
    std::vector<Seq> others;
    for (int i = 0; i < sc.others; ++i) others.push_back(NewOther(rng, sc));
    DetOutcome out;
    bool preempted = false;
    uint64_t step_id = 0;
    while (static_cast<int>(out.tokens.size()) < new_tokens) {
      if (!preempted && sc.preempt_after >= 0 &&
          static_cast<int>(out.tokens.size()) == sc.preempt_after) {
        preempted = true;
        Release(target);
        target.computed = 0;
        target.admitted = true;
      }
      worker::StepPlan plan;
      plan.set_step_id(++step_id);
      int budget = sc.max_step_tokens;
      std::vector<worker::SeqStep> steps;
      int target_n = 0;
      {
        auto s = Schedule(target, sc.chunk, &budget, /*is_target=*/true);
        if (!s.ok()) return s.status();
        target_n = static_cast<int>(s->token_ids_size());
        steps.push_back(*std::move(s));
      }
      for (Seq& o : others) {
        if (budget <= 0) break;
        auto s = Schedule(o, sc.chunk, &budget, /*is_target=*/false);
        if (!s.ok()) return s.status();
        steps.push_back(*std::move(s));
      }
      // The target at a random place of the step.
      std::shuffle(steps.begin(), steps.end(), rng);
      int target_sample_index = -1, samples = 0;
      for (const worker::SeqStep& s : steps) {
        if (s.seq_id() == target.id && s.sample()) target_sample_index = samples;
        samples += s.sample() ? 1 : 0;
        *plan.add_seqs() = s;
      }
      for (uint64_t id : finished_) plan.add_finished_seq_ids(id);
      finished_.clear();
      std::vector<std::vector<float>> logits;
      absl::StatusOr<worker::StepResult> r = runner_->Run(plan, &logits);
      if (!r.ok()) return r.status();
      if (r->token_ids_size() != samples || static_cast<int>(logits.size()) != samples) {
        return absl::InternalError(absl::StrCat("step ", step_id, ": ", r->token_ids_size(),
                                                " ids for ", samples, " sampled sequences"));
      }
      target.computed += target_n;
      if (target_sample_index >= 0) {
        // Only the target asks for logprobs: the first entry is its.
        if (r->logprobs_size() != 1) return absl::InternalError("expected one logprobs entry");
        const int32_t id = r->token_ids(target_sample_index);
        out.tokens.push_back(id);
        out.logprob.push_back(r->logprobs(0).logprob());
        std::vector<std::pair<int32_t, float>> top;
        for (const auto& t : r->logprobs(0).top()) top.emplace_back(t.token_id(), t.logprob());
        out.top.push_back(std::move(top));
        out.logits.push_back(std::move(logits[target_sample_index]));
        target.tokens.push_back(id);
      }
      for (Seq& o : others) {
        if (o.computed < static_cast<int>(o.tokens.size())) continue;
        // Fully computed: it decodes a random token next, or ends and a new request arrives.
        if (static_cast<int>(o.tokens.size()) >= o.total) {
          Release(o);
          finished_.push_back(o.id);
          o = NewOther(rng, sc);
        } else {
          o.tokens.push_back(static_cast<int32_t>(rng() % vocab_hint_));
        }
      }
    }
    if (keep_prefix) {
      // The full blocks of the prompt stay for a later prefix_hit run (the last prompt token
      // is always computed, as the coordinator does).
      for (int b : prefix_blocks_) free_.push_back(b);
      const int full = (static_cast<int>(prompt.size()) - 1) / bs;
      prefix_blocks_.assign(target.blocks.begin(), target.blocks.begin() + full);
      prefix_prompt_ = prompt;
      target.blocks.erase(target.blocks.begin(), target.blocks.begin() + full);
    }
    Release(target);
    for (Seq& o : others) {
      Release(o);
      finished_.push_back(o.id);
    }
    finished_.push_back(target.id);
    return out;
  }

  // Token ids of the others' random prompts are below this.
  void set_vocab_hint(int v) { vocab_hint_ = v; }

 private:
  struct Seq {
    uint64_t id = 0;
    std::vector<int32_t> tokens;
    int computed = 0;  // tokens whose KV is in the cache
    int total = 0;     // others: length at which they end
    std::vector<int32_t> blocks;
    int shared = 0;  // leading blocks borrowed from the kept prefix (never freed here)
    bool sample = true;
    bool admitted = true;  // its next step is its first since (re)admission
  };

  Seq NewOther(std::mt19937_64& rng, const DetScenario& sc) {
    Seq o;
    o.id = next_id_++;
    const int len = 1 + static_cast<int>(rng() % sc.other_max_prompt);
    for (int i = 0; i < len; ++i) o.tokens.push_back(static_cast<int32_t>(rng() % vocab_hint_));
    o.total = len + 1 + static_cast<int>(rng() % 8);
    o.sample = rng() % 4 != 0;
    return o;
  }

  void Release(Seq& s) {
    for (size_t i = s.shared; i < s.blocks.size(); ++i) free_.push_back(s.blocks[i]);
    s.blocks.clear();  // a preempted sequence starts again in fresh blocks
    s.shared = 0;
  }

  // The sequence's next step: up to `chunk` uncomputed tokens within the budget. Others count
  // their tokens as computed at once; the target's are counted when the step has run.
  absl::StatusOr<worker::SeqStep> Schedule(Seq& s, int chunk, int* budget, bool is_target) {
    const int bs = runner_->block_size();
    const int n = std::min({chunk, static_cast<int>(s.tokens.size()) - s.computed, *budget});
    if (n <= 0) return absl::InternalError("nothing to schedule");
    *budget -= n;
    while (static_cast<int>(s.blocks.size()) * bs < s.computed + n) {
      if (free_.empty()) return absl::ResourceExhaustedError("the test ran out of KV blocks");
      s.blocks.push_back(free_.back());
      free_.pop_back();
    }
    worker::SeqStep step;
    step.set_seq_id(s.id);
    step.set_start_pos(s.computed);
    for (int i = 0; i < n; ++i) step.add_token_ids(s.tokens[s.computed + i]);
    for (int32_t b : s.blocks) step.add_block_table(b);
    if (s.admitted && s.computed > 0) {
      // Admitted with a cached prefix: the tokens this runner did not compute (as the
      // coordinator sends them).
      for (int i = 0; i < s.computed; ++i) step.add_prefix_token_ids(s.tokens[i]);
    }
    s.admitted = false;
    step.set_sample(s.computed + n == static_cast<int>(s.tokens.size()) && s.sample);
    worker::Sampling* sp = step.mutable_sampling();
    sp->set_temperature(0.7f);
    sp->set_top_p(0.9f);
    sp->set_seed(42);
    sp->set_repetition_penalty(1.0f);
    if (is_target) {
      sp->set_logprobs(5);
    } else {
      s.computed += n;
    }
    return step;
  }

  ShardRunner* runner_;
  std::vector<int> free_;
  std::vector<int32_t> prefix_blocks_;
  std::vector<int32_t> prefix_prompt_;
  std::vector<uint64_t> finished_;
  uint64_t next_id_ = 1;
  int vocab_hint_ = 256;
};

}  // namespace tpserve::testing_util
