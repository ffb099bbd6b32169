// The scheduler loop (see scheduler.h).
#include "coordinator/scheduler.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "coordinator/thread_cpu.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace tpserve {

struct Scheduler::Seq {
  std::shared_ptr<RequestState> req;
  uint64_t id = 0;
  std::vector<int32_t> tokens;  // prompt + outputs
  int prompt_len = 0;
  size_t computed = 0;          // tokens whose K/V are in the workers' cache
  std::vector<int32_t> blocks;  // block table
  SentBlockTable sent_table;    // what the workers hold of it (block-table deltas)
  // Prefix cache: the chain hashes of the full blocks of `tokens` (as far as computed so far),
  // how many leading blocks of the table are registered, whether this sequence may use and
  // fill the cache, and whether the next step must tell the workers the skipped prefix.
  std::vector<uint64_t> hashes;
  size_t registered = 0;
  bool cacheable = true;
  bool send_prefix = false;
  bool awaited_prefix = false;  // waited at admission for a running sequence to compute a block
  uint64_t admit_order = 0;
  bool ever_admitted = false;
  int outputs = 0;
  // Null without a tokenizer. A request with stop strings is detokenized here (its stop
  // decisions need the text): `text` and `sent` then track it. Any other is detokenized by the
  // delivery thread, which alone uses the decoder.
  std::shared_ptr<IncrementalDecoder> decoder;
  bool decode_here = false;
  std::string text;  // output text so far (may run ahead of what was sent)
  size_t sent = 0;   // bytes of `text` already emitted
  size_t max_stop_len = 0;
  Clock::time_point first_scheduled, first_token;
  bool ever_scheduled = false, got_token = false;
  bool in_plan = false, preempted = false, done = false;
  // Steps in flight that hold the sequence (the workers may still write its KV blocks), and
  // how many of them sample it (tokens the coordinator does not know yet). With overlap a
  // decoding sequence is in up to two: step n samples token t, step n + 1 feeds t.
  int pending_steps = 0;
  int pending_samples = 0;
  size_t scheduled = 0;   // tokens [0, scheduled) are computed or in a step in flight
  bool released = false;  // done, blocks released, id told to the workers
};

namespace {

// The end of the text that can be sent: the longest suffix that might start a stop string is
// held back.
size_t SafeEnd(const std::string& text, const std::vector<std::string>& stops) {
  size_t end = text.size();
  for (const std::string& s : stops) {
    const size_t max_k = std::min(s.size() - 1, text.size());
    for (size_t k = max_k; k >= 1; --k) {
      if (text.compare(text.size() - k, k, s, 0, k) == 0) {
        end = std::min(end, text.size() - k);
        break;
      }
    }
  }
  return end;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

absl::Status StepExecutor::Submit(const worker::StepPlan& plan) {
  submitted_[plan.step_id()] = plan;
  return absl::OkStatus();
}

absl::StatusOr<worker::StepResult> StepExecutor::Collect(uint64_t step_id) {
  auto it = submitted_.find(step_id);
  if (it == submitted_.end()) {
    return absl::InternalError(absl::StrCat("step ", step_id, " was never submitted"));
  }
  worker::StepPlan plan = std::move(it->second);
  submitted_.erase(it);
  return Execute(plan);
}

Scheduler::Scheduler(const SchedulerOptions& options, const Tokenizer* tokenizer,
                     StepExecutor* executor)
    : options_(options),
      tokenizer_(tokenizer),
      executor_(executor),
      blocks_(options.num_blocks, options.block_size, options.enable_prefix_caching) {}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // The thread (if any) failed what it held; whatever arrived after is failed here.
  FailAll(absl::UnavailableError("the server is shutting down"));
  delivery_.Stop();  // after every request's completion is delivered
  std::deque<DropRequest> drops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drops.swap(drops_);
  }
  for (DropRequest& d : drops) d.done(absl::UnavailableError("the server is shutting down"));
}

void Scheduler::Start() {
  // A pipeline already keeps max_in_flight disjoint steps going; at pp = 1 overlap adds a second
  // step over the same sequences.
  overlap_ = options_.overlap && executor_->max_in_flight() <= 1;
  thread_ = std::thread([this] { Loop(); });
}

absl::Status Scheduler::Submit(std::shared_ptr<RequestState> request) {
  auto seq = std::make_unique<Seq>();
  seq->req = std::move(request);
  const RequestParams& p = seq->req->params();
  seq->tokens = p.prompt;
  seq->prompt_len = static_cast<int>(p.prompt.size());
  if (tokenizer_ != nullptr) {
    seq->decoder = std::make_shared<IncrementalDecoder>(tokenizer_, /*skip_special_tokens=*/true);
    seq->decode_here = !p.stop.empty();
  }
  for (const std::string& s : p.stop) seq->max_stop_len = std::max(seq->max_stop_len, s.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!refuse_.ok()) return refuse_;
    if (!suspend_.ok()) return suspend_;
    if (stop_) return absl::UnavailableError("the server is shutting down");
    if (queued_.load() >= options_.max_queued_requests) {
      return absl::ResourceExhaustedError(absl::StrCat("the request queue is full (",
                                                       options_.max_queued_requests,
                                                       " requests waiting); retry later"));
    }
    queued_.fetch_add(1);
    seq->id = next_seq_id_++;
    incoming_.push_back(std::move(seq));
  }
  cv_.notify_all();
  return absl::OkStatus();
}

void Scheduler::Wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    wake_ = true;
  }
  cv_.notify_all();
}

void Scheduler::StopAccepting(absl::Status reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (refuse_.ok()) refuse_ = std::move(reason);
}

bool Scheduler::Idle() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!incoming_.empty() || stats_.running != 0 || stats_.waiting != 0) return false;
  }
  // Every completion was handed to delivery before the stats said idle.
  return delivery_.Idle();
}

bool Scheduler::WaitIdle(std::chrono::steady_clock::time_point deadline) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!idle_cv_.wait_until(lock, deadline, [&] {
          return incoming_.empty() && stats_.running == 0 && stats_.waiting == 0;
        })) {
      return false;
    }
  }
  return delivery_.WaitIdle(deadline);
}

void Scheduler::Fail(absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_.ok()) fail_ = status;
    if (refuse_.ok()) refuse_ = status;
  }
  cv_.notify_all();
}

void Scheduler::Suspend(absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fail_.ok() || stop_) return;
    suspend_ = std::move(status);
    ++suspend_generation_;
  }
  cv_.notify_all();
}

void Scheduler::Resume(int num_blocks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    suspend_ = absl::OkStatus();
    resume_blocks_ = num_blocks;
  }
  cv_.notify_all();
}

bool Scheduler::Suspending() {
  std::lock_guard<std::mutex> lock(mu_);
  return !suspend_.ok() || suspend_generation_ != handled_generation_;
}

void Scheduler::Requeue(const absl::Status& status) {
  pending_.clear();
  // Sequences that produced output end (their stream cannot be replayed); the rest go back to
  // the queue in admission order, before the ones that never ran, with nothing computed.
  std::deque<std::unique_ptr<Seq>> kept;
  auto keep_or_end = [&](std::unique_ptr<Seq>& s) {
    s->pending_steps = s->pending_samples = 0;
    if (s->done) return;
    if (s->outputs > 0) {
      Finish(*s, status, Finish::kNone);
      return;
    }
    s->blocks.clear();
    s->computed = s->scheduled = s->registered = 0;
    s->send_prefix = s->in_plan = s->preempted = false;
    kept.push_back(std::move(s));
  };
  std::sort(running_.begin(), running_.end(),
            [](const auto& a, const auto& b) { return a->admit_order < b->admit_order; });
  for (auto& s : running_) keep_or_end(s);
  for (auto& s : waiting_) keep_or_end(s);
  running_.clear();
  waiting_ = std::move(kept);
  finished_ids_.clear();  // the new workers know no sequence
  // The KV contents are gone with the workers: every block is free and nothing is cached.
  blocks_ = BlockManager(blocks_.total_blocks(), blocks_.block_size(), blocks_.prefix_caching());
  TP_LOG(WARNING) << "worker group lost: " << waiting_.size()
                  << " requests without output kept for the next group";
  PublishStats();
}

void Scheduler::DropPrefixCache(std::string cache_salt, bool all,
                                std::function<void(absl::StatusOr<int>)> done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      drops_.push_back({std::move(cache_salt), all, std::move(done)});
      done = nullptr;
    }
  }
  if (done) {
    done(absl::UnavailableError("the server is shutting down"));
    return;
  }
  cv_.notify_all();
}

void Scheduler::RunDrops() {
  std::deque<DropRequest> drops;
  auto forget = [&drops](Seq& s) {
    for (const DropRequest& d : drops) {
      if (d.all || s.req->params().cache_salt == d.salt) s.cacheable = false;
    }
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    drops.swap(drops_);
    // Requests already submitted with the salt neither use nor fill the cache any more.
    for (auto& s : incoming_) forget(*s);
  }
  if (drops.empty()) return;
  for (auto& s : waiting_) forget(*s);
  for (auto& s : running_) forget(*s);
  std::vector<int> dropped;
  for (const DropRequest& d : drops) dropped.push_back(blocks_.DropCached(d.salt, d.all));
  PublishStats();
  for (size_t i = 0; i < drops.size(); ++i) drops[i].done(dropped[i]);
}

std::vector<int32_t> Scheduler::BlockTableForTest(uint64_t seq_id) const {
  for (const auto& s : running_) {
    if (s->id == seq_id) return s->blocks;
  }
  return {};
}

SchedulerStats Scheduler::stats() {
  const double delivery_cpu = delivery_.cpu_seconds();
  const double sender_cpu = executor_->sender_cpu_seconds();
  std::lock_guard<std::mutex> lock(mu_);
  SchedulerStats s = stats_;
  s.delivery_cpu_seconds = delivery_cpu;
  s.sender_cpu_seconds = sender_cpu;
  return s;
}

void Scheduler::PublishStats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.total_blocks = blocks_.total_blocks();
  stats_.free_blocks = blocks_.free_blocks();
  stats_.running = static_cast<int>(running_.size());
  stats_.waiting = static_cast<int>(waiting_.size() + incoming_.size());
  stats_.preemptions = preemptions_;
  stats_.steps = steps_;
  stats_.step_seconds = step_seconds_;
  stats_.execute_seconds = execute_seconds_;
  stats_.forward_seconds = forward_seconds_;
  stats_.step_tokens = step_tokens_;
  stats_.prefix_caching = blocks_.prefix_caching();
  stats_.prefix_cache_queries = prefix_queries_;
  stats_.prefix_cache_hits = prefix_hits_;
  stats_.prefix_cache_evictions = blocks_.evictions();
  stats_.prefix_cache_waits = prefix_waits_;
  stats_.prompt_tokens_computed = prompt_tokens_computed_;
  stats_.cached_blocks = blocks_.cached_blocks();
  stats_.evictable_blocks = blocks_.evictable_blocks();
  idle_cv_.notify_all();
  stats_.cpu_seconds = cpu_seconds_;
  stats_.plan_cpu_seconds = plan_cpu_seconds_;
  stats_.send_cpu_seconds = send_cpu_seconds_;
  stats_.apply_cpu_seconds = apply_cpu_seconds_;
  stats_.dropped_tokens = dropped_tokens_;
  stats_.overlap = overlap_;
}

void Scheduler::Finish(Seq& seq, absl::Status status, tpserve::Finish reason) {
  if (seq.done) return;
  seq.done = true;
  if (!seq.ever_admitted) queued_.fetch_sub(1);
  const Clock::time_point now = Clock::now();
  FinalInfo info;
  info.reason = reason;
  info.prompt_tokens = seq.prompt_len;
  info.output_tokens = seq.outputs;
  const Clock::time_point arrival = seq.req->arrival();
  info.queued_s = Seconds((seq.ever_scheduled ? seq.first_scheduled : now) - arrival);
  info.ttft_s = seq.got_token ? Seconds(seq.first_token - arrival) : 0.0;
  info.total_s = Seconds(now - arrival);
  if (options_.on_request_finished) options_.on_request_finished(status, info);
  // The completion follows the request's last token through delivery (in the same item when
  // this token ended it).
  if (status.ok() && !deliveries_.empty() && deliveries_.back().request == seq.req &&
      !deliveries_.back().complete) {
    Delivery& d = deliveries_.back();
    d.complete = true;
    d.info = info;
  } else {
    Delivery& d = deliveries_.emplace_back();
    d.request = seq.req;
    d.complete = true;
    d.status = std::move(status);
    d.info = info;
  }
  ReleaseIfIdle(seq);
}

void Scheduler::ReleaseIfIdle(Seq& seq) {
  if (!seq.done || seq.pending_steps > 0 || seq.released) return;
  seq.released = true;
  if (!seq.preempted) RegisterComputed(seq);  // its computed blocks stay cached for reuse
  blocks_.Release(seq.blocks);
  // The workers drop the sequence's state with the next plan, after every step holding it.
  if (seq.ever_admitted) finished_ids_.push_back(seq.id);
}

void Scheduler::FailAll(const absl::Status& status) {
  std::deque<std::unique_ptr<Seq>> incoming;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incoming.swap(incoming_);
  }
  // The steps in flight are lost with the group: nothing holds a sequence any more.
  pending_.clear();
  for (auto& s : incoming) Finish(*s, status, Finish::kNone);
  for (auto& s : waiting_) Finish(*s, status, Finish::kNone);
  for (auto& s : running_) {
    s->pending_steps = s->pending_samples = 0;
    Finish(*s, status, Finish::kNone);
    ReleaseIfIdle(*s);
  }
  waiting_.clear();
  running_.clear();
  // The workers' KV contents cannot be trusted after a failure (a restarted group starts empty).
  blocks_.DropCached("", /*all=*/true);
  delivery_.Push(deliveries_);
  PublishStats();
}

void Scheduler::Reap(std::vector<uint64_t>& finished_ids) {
  const Clock::time_point now = Clock::now();
  auto check = [&](Seq& s) {
    // A sequence in a step still in flight is answered now; its blocks are released when no
    // step holds it any more (the workers may still be writing them), see ReleaseIfIdle.
    if (s.done) return;
    if (s.req->cancelled()) {
      Finish(s, absl::CancelledError("the request was cancelled"), Finish::kNone);
    } else if (now >= s.req->params().deadline) {
      Finish(s, absl::DeadlineExceededError("the request's deadline expired"), Finish::kNone);
    }
  };
  for (auto& s : running_) check(*s);
  for (auto& s : waiting_) check(*s);
  std::erase_if(running_,
                [](const std::unique_ptr<Seq>& s) { return s->done && s->pending_steps == 0; });
  std::erase_if(waiting_, [](const std::unique_ptr<Seq>& s) { return s->done; });
  delivery_.Push(deliveries_);
}

void Scheduler::Admit() {
  // Blocks that running sequences will compute (their prefill is not done), by chain hash: built
  // at most once per call, when a candidate's next block is not cached.
  std::optional<absl::flat_hash_map<uint64_t, const Seq*>> producing;
  for (auto it = waiting_.begin();
       it != waiting_.end() && static_cast<int>(running_.size()) < options_.max_num_seqs;) {
    Seq& s = **it;
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    // The longest cached run of full blocks, short of the last token (its logits are needed):
    // a fully cached prompt recomputes its last block into a block of its own, so that no step
    // ever writes into a block another sequence reads.
    std::vector<int32_t> matched;
    if (blocks_.prefix_caching() && s.cacheable) {
      const int max_blocks = static_cast<int>((len - 1) / blocks_.block_size());
      ExtendHashes(s, static_cast<size_t>(max_blocks));
      matched = blocks_.Match(s.hashes, s.tokens, s.req->params().cache_salt, max_blocks);
      // The next block is being computed by a running sequence (requests with a shared prefix
      // that arrive together): wait for it instead of computing it again; the others behind
      // this one may go first. The wait ends when the producer has computed it (it is then
      // cached) or stops producing (done, preempted, uncacheable): then this one computes it.
      if (matched.size() < static_cast<size_t>(max_blocks)) {
        if (!producing) producing = ProducingBlocks();
        if (AwaitsProducer(s, matched.size(), *producing)) {
          if (!s.awaited_prefix) {
            s.awaited_prefix = true;
            ++prefix_waits_;
          }
          ++it;
          continue;
        }
      }
    }
    blocks_.Acquire(s.blocks, matched);
    // The whole known sequence gets its blocks now, so prefill chunks never wait for blocks;
    // decode growth takes one block at a time (and may preempt).
    if (!blocks_.GrowTo(s.blocks, blocks_.BlocksFor(len))) {
      blocks_.Release(s.blocks);
      break;
    }
    s.computed = matched.size() * static_cast<size_t>(blocks_.block_size());
    s.registered = matched.size();
    s.send_prefix = s.computed > 0;
    if (blocks_.prefix_caching()) {
      prefix_queries_ += len;
      prefix_hits_ += static_cast<int64_t>(s.computed);
    }
    if (!s.ever_admitted) {
      s.ever_admitted = true;
      queued_.fetch_sub(1);
    }
    s.admit_order = ++admit_counter_;
    // It may produce blocks the next candidates wait for.
    if (producing && s.cacheable) AddProducing(s, *producing);
    running_.push_back(std::move(*it));
    it = waiting_.erase(it);
  }
}

absl::flat_hash_map<uint64_t, const Scheduler::Seq*> Scheduler::ProducingBlocks() {
  absl::flat_hash_map<uint64_t, const Seq*> producing;
  for (auto& p : running_) {
    if (!p->done && !p->preempted && p->cacheable) AddProducing(*p, producing);
  }
  return producing;
}

void Scheduler::AddProducing(Seq& p, absl::flat_hash_map<uint64_t, const Seq*>& producing) {
  // The full blocks of its known tokens that are not computed yet (a block a chunk ended
  // inside included): its prefill computes them, and registers each once computed.
  const size_t bs = static_cast<size_t>(blocks_.block_size());
  const size_t full = p.tokens.size() / bs;
  ExtendHashes(p, full);
  for (size_t i = p.computed / bs; i < full; ++i) producing.emplace(p.hashes[i], &p);
}

bool Scheduler::AwaitsProducer(const Seq& s, size_t block,
                               const absl::flat_hash_map<uint64_t, const Seq*>& producing) const {
  auto found = producing.find(s.hashes[block]);
  if (found == producing.end()) return false;
  const Seq& p = *found->second;
  const size_t end = (block + 1) * static_cast<size_t>(blocks_.block_size());
  // What the wait relies on: the producer still runs, will register the block, has not computed
  // it yet, and holds exactly these tokens under the same salt (a hash collision is no reason
  // to wait).
  return !p.done && !p.preempted && p.cacheable && p.computed < end && p.tokens.size() >= end &&
         p.req->params().cache_salt == s.req->params().cache_salt &&
         std::equal(s.tokens.begin(), s.tokens.begin() + static_cast<ptrdiff_t>(end),
                    p.tokens.begin());
}

void Scheduler::ExtendHashes(Seq& seq, size_t full_blocks) {
  const size_t bs = static_cast<size_t>(blocks_.block_size());
  while (seq.hashes.size() < full_blocks && (seq.hashes.size() + 1) * bs <= seq.tokens.size()) {
    const size_t i = seq.hashes.size();
    const uint64_t parent =
        i == 0 ? BlockManager::RootHash(seq.req->params().cache_salt) : seq.hashes[i - 1];
    seq.hashes.push_back(
        BlockManager::ChainHash(parent, std::span<const int32_t>(seq.tokens).subspan(i * bs, bs)));
  }
}

void Scheduler::RegisterComputed(Seq& seq) {
  // A computed block is never written again (steps in flight write only at or after
  // `computed`), so it is registered as soon as its step is applied, even while a later step
  // holds the sequence (overlap: a decode that continues; its prompt's blocks become shareable
  // at once, not when it ends). Except when the same block is cached already: registering swaps
  // the table's entry for the cached one and frees this copy, which a step in flight still
  // lists; that waits until no step holds the sequence (at the latest when it ends,
  // ReleaseIfIdle), and so do the blocks after it (their parent is not registered).
  if (!blocks_.prefix_caching() || !seq.cacheable) return;
  const size_t bs = static_cast<size_t>(blocks_.block_size());
  const size_t full = seq.computed / bs;
  ExtendHashes(seq, full);
  while (seq.registered < full) {
    const size_t i = seq.registered;
    if (seq.pending_steps > 0 &&
        blocks_.WouldReplace(seq.blocks, static_cast<int>(i), seq.hashes[i])) {
      return;
    }
    if (!blocks_.Register(seq.blocks, static_cast<int>(i), seq.hashes[i],
                          std::span<const int32_t>(seq.tokens).subspan(i * bs, bs),
                          seq.req->params().cache_salt)) {
      seq.cacheable = false;  // a hash collision (or a dropped chain): the rest stays private
      return;
    }
    ++seq.registered;
  }
}

void Scheduler::Preempt(Seq* seq) {
  blocks_.Release(seq->blocks);
  seq->computed = 0;
  seq->registered = 0;
  seq->send_prefix = false;
  seq->scheduled = 0;
  seq->preempted = true;
  ++preemptions_;
  TP_LOG(DEBUG) << "preempted sequence " << seq->id << " (" << seq->tokens.size()
                << " tokens; recomputed later)";
}

bool Scheduler::BuildStep(worker::StepPlan& plan, std::vector<Seq*>& sampled,
                          std::vector<std::pair<Seq*, int>>& chunks) {
  int budget = options_.max_num_batched_tokens;
  // A sequence in flight continues in this step (overlap) when the one step holding it samples
  // its next token after all its known tokens, and that token cannot be its last by length.
  auto continues = [&](const Seq& s) {
    return overlap_ && s.pending_steps == 1 && s.pending_samples == 1 &&
           s.scheduled == s.tokens.size() && s.outputs + 1 < s.req->params().max_new_tokens &&
           static_cast<int64_t>(s.tokens.size()) + 1 < options_.context_length;
  };
  std::vector<Seq*>& order = order_;
  order.clear();
  for (auto& s : running_) {
    s->in_plan = false;
    if (s->done) continue;
    const bool decode = s->pending_steps == 0 ? s->tokens.size() - s->computed == 1 : continues(*s);
    if (decode) order.push_back(s.get());  // decodes first
  }
  for (auto& s : running_) {
    if (!s->done && s->pending_steps == 0 && s->tokens.size() - s->computed != 1) {
      order.push_back(s.get());
    }
  }
  // With k steps in flight (pipeline stages), each step takes about 1/k of the running
  // sequences so that every stage has a micro-batch to work on.
  const int k = std::max(1, executor_->max_in_flight());
  size_t max_seqs = order.size();
  if (k > 1) max_seqs = (running_.size() + k - 1) / k;
  const Clock::time_point now = Clock::now();
  for (Seq* s : order) {
    if (s->preempted || budget <= 0) continue;
    if (static_cast<size_t>(plan.seqs_size()) >= max_seqs) break;
    // A continuation computes the token its step in flight samples, at position tokens.size().
    const bool feed = s->pending_steps > 0;
    const size_t start = feed ? s->tokens.size() : s->computed;
    const int remaining = feed ? 1 : static_cast<int>(s->tokens.size() - s->computed);
    const int chunk = std::min(remaining, budget);
    const int need = blocks_.BlocksFor(static_cast<int64_t>(start) + chunk);
    while (!blocks_.GrowTo(s->blocks, need)) {
      // Out of blocks: preempt the newest sequence not in this step nor in flight (possibly `s`
      // itself; a continuation is in flight, it just waits for its result instead).
      Seq* victim = nullptr;
      for (auto& r : running_) {
        if (!r->in_plan && r->pending_steps == 0 && !r->preempted && !r->done &&
            (!victim || r->admit_order > victim->admit_order)) {
          victim = r.get();
        }
      }
      if (victim == nullptr) break;
      Preempt(victim);
      if (victim == s) break;
    }
    if (s->preempted || static_cast<int>(s->blocks.size()) < need) continue;
    // Steps write only private blocks: the cached (shareable) ones hold computed tokens only.
    TP_CHECK(!blocks_.IsCached(s->blocks[s->computed / blocks_.block_size()]))
        << "sequence " << s->id << " would write into a cached KV block";
    worker::SeqStep* step = plan.add_seqs();
    step->set_seq_id(s->id);
    step->set_start_pos(static_cast<int32_t>(start));
    if (s->send_prefix) {
      // The cached prefix this sequence skips: the sampling worker's token history. (Only on
      // its first step after admission, never a fed one: start == computed then.)
      for (size_t i = 0; i < s->computed; ++i) step->add_prefix_token_ids(s->tokens[i]);
      s->send_prefix = false;
    }
    if (feed) {
      step->add_token_ids(0);  // the workers put the token they sampled for it last step here
      step->set_feed_last_sampled(true);
    } else {
      step->mutable_token_ids()->Add(s->tokens.begin() + s->computed,
                                     s->tokens.begin() + s->computed + chunk);
    }
    EncodeBlockTable(s->blocks, s->sent_table, *step);  // only what changed since its last step
    const bool sample = chunk == remaining;
    step->set_sample(sample);
    const RequestParams& p = s->req->params();
    worker::Sampling* sp = step->mutable_sampling();
    sp->set_temperature(p.temperature);
    sp->set_top_p(p.top_p);
    sp->set_top_k(p.top_k);
    sp->set_seed(p.seed);
    sp->set_repetition_penalty(p.repetition_penalty);
    if (p.logprobs >= 0) sp->set_logprobs(p.logprobs);
    s->in_plan = true;
    s->scheduled = start + chunk;
    if (!s->ever_scheduled) {
      s->ever_scheduled = true;
      s->first_scheduled = now;
    }
    chunks.emplace_back(s, chunk);
    if (sample) sampled.push_back(s);
    budget -= chunk;
  }
  // Preempted sequences go back to the front of the queue (oldest first) and are recomputed.
  std::vector<std::unique_ptr<Seq>> preempted;
  for (auto& s : running_) {
    if (s->preempted) preempted.push_back(std::move(s));
  }
  std::erase_if(running_, [](const std::unique_ptr<Seq>& s) { return s == nullptr; });
  for (auto it = preempted.rbegin(); it != preempted.rend(); ++it) {
    (*it)->preempted = false;
    waiting_.push_front(std::move(*it));
  }
  if (plan.seqs_size() == 0) return false;
  plan.set_step_id(next_step_id_++);
  for (uint64_t id : finished_ids_) plan.add_finished_seq_ids(id);
  finished_ids_.clear();
  return true;
}

void Scheduler::ApplyToken(Seq& seq, int32_t id, std::optional<TokenLogprobs> logprobs) {
  const RequestParams& p = seq.req->params();
  seq.tokens.push_back(id);
  ++seq.outputs;
  if (!seq.got_token) {
    seq.got_token = true;
    seq.first_token = Clock::now();
  }
  tpserve::Finish reason = Finish::kNone;
  const auto& eos = options_.eos_token_ids;
  if ((!p.ignore_eos && std::find(eos.begin(), eos.end(), id) != eos.end()) ||
      std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), id) != p.stop_token_ids.end()) {
    reason = Finish::kStop;
  } else if (seq.outputs >= p.max_new_tokens ||
             static_cast<int64_t>(seq.tokens.size()) >= options_.context_length) {
    reason = Finish::kLength;
  }
  Delivery& d = deliveries_.emplace_back();
  d.request = seq.req;
  d.id = id;
  d.logprobs = std::move(logprobs);
  if (!seq.decode_here) {
    d.decoder = seq.decoder;  // the delivery thread detokenizes (and flushes at the end)
  } else {
    seq.text += seq.decoder->Add(id);
    if (reason != Finish::kNone) seq.text += seq.decoder->Finish();
    size_t cut = std::string::npos;
    for (const std::string& s : p.stop) cut = std::min(cut, seq.text.find(s, seq.sent));
    if (cut != std::string::npos) {
      seq.text.resize(cut);
      reason = Finish::kStop;
    }
    // The longest suffix that might start a stop string is held back until the next token.
    const size_t end = reason != Finish::kNone ? seq.text.size() : SafeEnd(seq.text, p.stop);
    if (end > seq.sent) {
      d.text = seq.text.substr(seq.sent, end - seq.sent);
      seq.sent = end;
    }
  }
  if (reason != Finish::kNone) Finish(seq, absl::OkStatus(), reason);
}

void Scheduler::ApplyResult(const Pending& p, const worker::StepResult& result) {
  ++steps_;
  for (auto& [seq, n] : p.chunks) {
    // A sequence's chunks are applied in order: `computed` is where this one starts.
    const int64_t start = static_cast<int64_t>(seq->computed);
    prompt_tokens_computed_ +=
        std::max<int64_t>(0, std::min<int64_t>(seq->prompt_len, start + n) - start);
    seq->computed += n;
    --seq->pending_steps;
    step_tokens_ += n;
    RegisterComputed(*seq);
  }
  int next_logprobs = 0;
  for (size_t i = 0; i < p.sampled.size(); ++i) {
    Seq& seq = *p.sampled[i];
    --seq.pending_samples;
    const bool wants_logprobs = seq.req->params().logprobs >= 0;
    if (seq.done) {
      // The sequence finished (stop, length, cancel, deadline) after this step was sent: the
      // token is one too many. Never emitted, never appended.
      ++dropped_tokens_;
      next_logprobs += wants_logprobs;
      continue;
    }
    std::optional<TokenLogprobs> lp;
    if (wants_logprobs) {
      const worker::SampledLogprobs& w = result.logprobs(next_logprobs++);
      lp.emplace();
      lp->logprob = w.logprob();
      for (const worker::TokenLogprob& t : w.top()) lp->top.push_back({t.token_id(), t.logprob()});
    }
    ApplyToken(seq, result.token_ids(static_cast<int>(i)), std::move(lp));
  }
  for (auto& [seq, n] : p.chunks) ReleaseIfIdle(*seq);
  std::erase_if(running_,
                [](const std::unique_ptr<Seq>& s) { return s->done && s->pending_steps == 0; });
  delivery_.Push(deliveries_);
}

Clock::time_point Scheduler::LateBuildTime() const {
  if (options_.overlap_lead_seconds <= 0 || pending_.empty()) return Clock::time_point::min();
  // The running step's time: the shortest recent step of at most as many tokens (a step with
  // fewer tokens is not slower, so the estimate errs early: after a run of long prefill steps a
  // decode step is planned at once, never waited for past its end).
  const Pending& running = pending_.front();
  const int tokens = running.Tokens();
  double step = -1;
  for (size_t i = 0; i < recent_steps_count_; ++i) {
    if (recent_steps_[i].tokens <= tokens && (step < 0 || recent_steps_[i].seconds < step)) {
      step = recent_steps_[i].seconds;
    }
  }
  if (step < 0) return Clock::time_point::min();
  // It started when its predecessor's result came back (the worker takes the next plan in its
  // queue), or when it was sent if nothing ran before it.
  const Clock::time_point start = std::max(last_collect_, running.submitted);
  return start + std::chrono::duration_cast<Clock::duration>(
                     std::chrono::duration<double>(step - options_.overlap_lead_seconds));
}

bool Scheduler::HasEvent() const {
  return stop_ || wake_ || !incoming_.empty() || !fail_.ok() || !drops_.empty() ||
         suspend_generation_ != handled_generation_ || (suspended_ && suspend_.ok());
}

bool Scheduler::TakeIncoming() {
  const bool arrived = !incoming_.empty();
  while (!incoming_.empty()) {
    waiting_.push_back(std::move(incoming_.front()));
    incoming_.pop_front();
  }
  return arrived;
}

bool Scheduler::WaitForArrivals(Clock::time_point until) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, until, [&] { return HasEvent(); });
  if (stop_ || !fail_.ok()) return false;  // the loop's next turn handles them
  return TakeIncoming();
}

void Scheduler::Loop() {
  while (true) {
    absl::Status fail;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return HasEvent() || !running_.empty() || !waiting_.empty(); });
      wake_ = false;
      if (stop_) break;
      fail = fail_;
      if (fail.ok()) TakeIncoming();
      if (fail.ok() && suspend_generation_ != handled_generation_) {
        handled_generation_ = suspend_generation_;
        suspended_ = true;
        const absl::Status why =
            suspend_.ok() ? absl::UnavailableError("the worker group failed") : suspend_;
        lock.unlock();
        Requeue(why);
        lock.lock();
      }
      if (fail.ok() && suspended_ && suspend_.ok()) {
        suspended_ = false;
        finished_ids_.clear();
        blocks_ = BlockManager(resume_blocks_, blocks_.block_size(), blocks_.prefix_caching());
        TP_LOG(INFO) << "the worker group is back (" << resume_blocks_
                     << " KV blocks): " << waiting_.size() + running_.size() << " requests to run";
      }
    }
    if (fail.ok() && suspended_) {
      // Waiting for the next group: only cancellations and deadlines move (checked every 100 ms).
      Reap(finished_ids_);
      RunDrops();
      PublishStats();
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(100), [&] {
        return stop_ || !fail_.ok() || suspend_.ok() || suspend_generation_ != handled_generation_;
      });
      continue;
    }
    if (!fail.ok()) {
      FailAll(fail);
      RunDrops();
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !incoming_.empty() || !drops_.empty(); });
      continue;
    }
    RunDrops();
    const Clock::time_point step_start = Clock::now();
    double cpu_start = ThreadCpuSeconds();
    double phase_start = cpu_start;
    // Charges the CPU time since the last call to `phase`.
    auto charge = [&phase_start](double& phase) {
      const double now = ThreadCpuSeconds();
      phase += now - phase_start;
      phase_start = now;
    };
    Reap(finished_ids_);
    Admit();
    // Fill the pipeline: up to max_in_flight steps over disjoint sequences; with overlap (pp = 1)
    // two steps, the second continuing the decodes of the first.
    const int depth = overlap_ ? 2 : std::max(1, executor_->max_in_flight());
    bool failed = false;
    while (static_cast<int>(pending_.size()) < depth) {
      // Late overlap: the step after the running one is planned shortly before that one should
      // end, so that requests arriving meanwhile join it (an arrival ends the wait at once).
      if (overlap_ && pending_.size() == 1) {
        const Clock::time_point at = LateBuildTime();
        // (A wait costs no CPU time: the admission counts as planning.)
        if (Clock::now() < at && WaitForArrivals(at)) Admit();
      }
      Pending p;
      // One message, reused: its repeated fields keep their memory from step to step.
      worker::StepPlan& plan = plan_;
      plan.Clear();
      const bool built = BuildStep(plan, p.sampled, p.chunks);
      charge(plan_cpu_seconds_);
      if (!built) break;
      p.step_id = plan.step_id();
      p.submitted = Clock::now();
      for (auto& [seq, n] : p.chunks) ++seq->pending_steps;
      for (Seq* seq : p.sampled) ++seq->pending_samples;
      absl::Status st = executor_->Submit(plan);
      charge(send_cpu_seconds_);
      if (!st.ok()) {
        TP_LOG(ERROR) << "step " << plan.step_id() << " could not be submitted: " << st;
        pending_.clear();
        if (!Suspending()) Fail(st);
        failed = true;
        break;
      }
      pending_.push_back(std::move(p));
    }
    PublishStats();
    charge(plan_cpu_seconds_);
    cpu_seconds_ += phase_start - cpu_start;
    if (failed) continue;
    if (pending_.empty()) {
      // Nothing runnable (everything waits for blocks): should not happen; avoid spinning.
      std::unique_lock<std::mutex> lock(mu_);
      if (!running_.empty() || !waiting_.empty()) {
        cv_.wait_for(lock, std::chrono::milliseconds(20));
      }
      continue;
    }
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    absl::StatusOr<worker::StepResult> result = executor_->Collect(p.step_id);
    const Clock::time_point exec_end = Clock::now();
    last_collect_ = exec_end;
    if (result.ok() && executor_->last_forward_seconds() > 0) {
      recent_steps_[recent_steps_next_] = {p.Tokens(), executor_->last_forward_seconds()};
      recent_steps_next_ = (recent_steps_next_ + 1) % recent_steps_.size();
      recent_steps_count_ = std::min(recent_steps_count_ + 1, recent_steps_.size());
    }
    cpu_start = ThreadCpuSeconds();
    const int want_logprobs = static_cast<int>(std::count_if(
        p.sampled.begin(), p.sampled.end(), [](Seq* s) { return s->req->params().logprobs >= 0; }));
    if (result.ok() && (result->token_ids_size() != static_cast<int>(p.sampled.size()) ||
                        result->logprobs_size() != want_logprobs)) {
      result = absl::InternalError(absl::StrCat(
          "a step sampled ", result->token_ids_size(), " tokens with ", result->logprobs_size(),
          " logprobs but ", p.sampled.size(), " tokens with ", want_logprobs, " were planned"));
    }
    if (!result.ok()) {
      TP_LOG(ERROR) << "step " << p.step_id << " failed: " << result.status();
      pending_.clear();
      if (!Suspending()) Fail(result.status());
      continue;
    }
    ApplyResult(p, *result);
    execute_seconds_ += Seconds(exec_end - p.submitted);
    forward_seconds_ += executor_->last_forward_seconds();
    const double step_s = Seconds(Clock::now() - step_start);
    step_seconds_ += step_s;
    if (options_.on_step) options_.on_step(step_s);
    PublishStats();
    const double cpu_end = ThreadCpuSeconds();
    apply_cpu_seconds_ += cpu_end - cpu_start;
    cpu_seconds_ += cpu_end - cpu_start;
  }
  FailAll(absl::UnavailableError("the server is shutting down"));
}

}  // namespace tpserve
