// One shard's runtime (see shard_runner.h).
#include "worker/shard_runner.h"

#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/sampling.h"
#include "common/status.h"
#include "worker/shard_loader.h"
#ifdef TPSERVE_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#include "worker/cuda_graph_runner.h"
#else
namespace tpserve {
class CudaGraphRunner {};  // graphs need CUDA
}  // namespace tpserve
#endif

namespace tpserve {

namespace {

float LogitAt(const char* row, DType dtype, int64_t i) {
  return dtype == DType::kF32 ? reinterpret_cast<const float*>(row)[i]
                              : Bf16ToF32(reinterpret_cast<const uint16_t*>(row)[i]);
}

// The SamplingParams a plan's sequence carries (worker::Sampling), for the token at `position`.
SamplingParams FromPlan(const worker::Sampling& sp, int64_t position) {
  SamplingParams p;
  p.temperature = sp.temperature();
  p.top_k = sp.top_k();
  p.top_p = sp.top_p() > 0 ? sp.top_p() : 1.0f;
  p.seed = sp.seed();
  p.position = position;
  if (sp.has_logprobs()) p.logprobs = sp.logprobs();
  if (sp.repetition_penalty() != 0) p.repetition_penalty = sp.repetition_penalty();  // 0: unset
  return p;
}

}  // namespace

ShardRunner::~ShardRunner() {
  graphs_.reset();  // before the cache and the model it replays
  cache_.reset();
  model_.reset();
}

absl::StatusOr<std::unique_ptr<ShardRunner>> ShardRunner::Create(
    const ModelFiles& files, const ShardPlan& plan, int rank, Ops* ops, ParallelContext comms,
    const ShardRunnerOptions& options) {
  std::unique_ptr<ShardRunner> r(new ShardRunner());
  r->ops_ = ops;
  // Before the batch buffers and the workspace are reserved: the mode sizes them.
  ops->SetDeterministic(options.deterministic);
  r->options_ = options;
  ShardLoadOptions load;
  load.model = options.model;
  load.block_size = options.block_size;
  load.kv_cache_bytes = options.kv_cache_bytes;
  load.num_kv_blocks = options.num_kv_blocks;
  load.gpu_memory_utilization = options.gpu_memory_utilization;
  load.kv_cache_dtype = options.kv_cache_dtype;
#ifdef TPSERVE_HAVE_CUDA
  CudaReserve reserve;
  auto* cuda = dynamic_cast<CudaOps*>(ops);
  if (cuda != nullptr) {
    // The batch buffers are sized once, before the KV budget is measured, so that nothing
    // moves after warm-up and the budget counts them.
    const ModelConfig& config = files.config();
    const int64_t blocks_per_seq =
        (config.max_position_embeddings + options.block_size - 1) / options.block_size;
    const int64_t table_blocks = options.num_kv_blocks > 0
                                     ? std::min<int64_t>(blocks_per_seq, options.num_kv_blocks)
                                     : blocks_per_seq;
    load.before_kv = [&](LlamaModel& model) {
      reserve = CudaGraphRunner::ReserveFor(config, model.shard(), options.model,
                                            options.block_size, table_blocks);
      cuda->Reserve(reserve);
      if (options.kv_cache_dtype.has_value()) {
        // Prefill over an fp8 / int8 cache: a bf16 scratch for a full batch of prompt tokens
        // (and the partial last pages of 64 sequences); other dtypes and devices: none.
        const int64_t pages =
            (int64_t{reserve.max_tokens} + options.block_size - 1) / options.block_size + 64;
        cuda->ReservePrefillScratch(*options.kv_cache_dtype, pages, options.block_size,
                                    model.shard().num_kv_heads, reserve.head_dim);
      }
    };
  }
#endif
  TP_ASSIGN_OR_RETURN(LoadedShard loaded, LoadShard(files, plan, rank, ops, comms, load));
  r->model_ = std::move(loaded.model);
  r->cache_ = std::move(loaded.cache);
#ifdef TPSERVE_HAVE_CUDA
  // Graphs need every transfer of a decode step to be stream-ordered: at tp > 1 the TP group's
  // all-reduce and all-gather (the custom IPC kernels or NCCL), at pp > 1 the stage boundary's
  // Send / Recv of the residual stream (the custom p2p kernels or NCCL), not the host-staged MPI
  // ones. Stages need not decide alike: a replayed, a captured and an eager step send and
  // receive the same messages (CudaGraphRunner::RunDecode runs one forward per call).
  const bool capturable_tp = plan.tp == 1 || comms.tp->stream_ordered_collectives();
  bool capturable_pp = plan.pp == 1;
  r->graph_max_seqs_ = reserve.max_seqs;
  if (plan.pp > 1 && comms.pp->stream_ordered_p2p()) {
    // The largest decode batch a graph replays: its residual must fit the stream-ordered p2p.
    const size_t residual = static_cast<size_t>(r->GraphSeqLimit()) * files.config().hidden_size *
                            DTypeSize(ops->compute_dtype());
    capturable_pp = residual <= comms.pp->stream_ordered_p2p_max_bytes();
    if (!capturable_pp) {
      TP_LOG(WARNING) << "decode steps run eagerly: a graph's residual of " << residual
                      << " bytes exceeds the stream-ordered sends of " << comms.pp->name();
    }
  }
  if (cuda != nullptr && options.cuda_graphs && capturable_tp && capturable_pp) {
    // Decode graphs are captured by WarmUpGraphs (else on the first use of each bucket).
    r->graphs_ =
        std::make_unique<CudaGraphRunner>(cuda, r->model_.get(), r->cache_.get(), reserve.max_seqs);
    r->graph_max_blocks_ = reserve.max_blocks_per_seq;
  } else {
    r->graph_max_seqs_ = 0;
  }
#endif
  const RankShard& shard = r->model_->shard();
  r->sampler_ = shard.last_stage && (shard.tp_rank == 0 || options.sample_on_every_tp_rank);
  // With graphs at tp > 1 every rank of the group samples the same all-gathered logits, so the
  // fed ids need no host-staged broadcast between the graph replays.
  r->every_tp_rank_samples_ =
      options.sample_on_every_tp_rank || (plan.tp > 1 && r->graphs_ != nullptr);
  r->samples_ = shard.last_stage && (shard.tp_rank == 0 || r->every_tp_rank_samples_);
  r->tp_ = plan.tp;
  r->pp_ = plan.pp;
  r->comms_ = comms;
  // Launching ahead needs the fed ids where the next forward reads them without the host: one
  // pipeline stage (a later stage would need them from the last one) and, at tp > 1, every rank
  // sampling for itself (not the host-staged broadcast).
  const std::string ahead =
      options.launch_ahead.empty() ? EnvString(env::kLaunchAhead) : options.launch_ahead;
  if (ahead != "auto" && ahead != "1" && ahead != "0") {
    return absl::InvalidArgumentError(
        absl::StrCat("launch_ahead must be auto, 1 or 0, not '", ahead, "'"));
  }
  // auto: where it was measured (H200, tp = 1); 1 also at tp > 1 and with synchronous sampling.
  r->launch_ahead_ = ahead != "0" && plan.pp == 1 && (plan.tp == 1 || r->every_tp_rank_samples_) &&
                     (ahead == "1" || (ops->AsyncSampling() && plan.tp == 1));
  if (plan.tp > 1) {
    // Allocated with the rest, before serving: the ids of feed_last_sampled sequences.
    r->feed_ids_ = std::make_unique<DeviceBuffer>(
        ops, sizeof(int32_t) * std::max(1, options.model.max_batch_seqs));
  }
  return r;
}

absl::StatusOr<BatchMeta> ShardRunner::MakeBatch(const worker::StepPlan& plan, int block_size,
                                                 int num_blocks) {
  BatchMeta meta;
  meta.block_size = block_size;
  for (const worker::SeqStep& s : plan.seqs()) {
    meta.max_blocks_per_seq = std::max(meta.max_blocks_per_seq, s.block_table_size());
  }
  for (const worker::SeqStep& s : plan.seqs()) {
    if (s.token_ids_size() == 0 || s.start_pos() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("step ", plan.step_id(), ": sequence ",
                                                     s.seq_id(), " has no tokens to compute"));
    }
    meta.query_start.push_back(meta.num_tokens);
    for (int i = 0; i < s.token_ids_size(); ++i) {
      const int pos = s.start_pos() + i;
      const int b = pos / block_size;
      if (b >= s.block_table_size() || s.block_table(b) < 0 || s.block_table(b) >= num_blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("step ", plan.step_id(), ": sequence ", s.seq_id(), " position ", pos,
                         " has no valid KV block (table of ", s.block_table_size(),
                         " blocks, pool of ", num_blocks, ")"));
      }
      meta.token_ids.push_back(s.token_ids(i));
      meta.positions.push_back(pos);
      meta.slot_mapping.push_back(s.block_table(b) * block_size + pos % block_size);
    }
    meta.num_tokens += s.token_ids_size();
    meta.num_seqs++;
    meta.context_lens.push_back(s.start_pos() + s.token_ids_size());
    for (int b = 0; b < meta.max_blocks_per_seq; ++b) {
      meta.block_tables.push_back(b < s.block_table_size() ? s.block_table(b) : -1);
    }
    if (s.sample()) meta.logits_rows.push_back(meta.num_tokens - 1);
  }
  meta.query_start.push_back(meta.num_tokens);
  return meta;
}

int ShardRunner::GraphSeqLimit() const {
  // The largest power of two within the graphs' buffers and the model's batch limits: a
  // decode batch is padded up to a power of two, which must still fit (a limit of 40 takes
  // batches of up to 32 as graphs; 33 to 40 run eagerly).
  const int limit =
      std::min({graph_max_seqs_, options_.model.max_batch_seqs, options_.model.max_batch_tokens});
  int p = 1;
  while (p * 2 <= limit) p *= 2;
  return limit >= 1 ? p : 0;
}

bool ShardRunner::UsesGraphs(const BatchMeta& meta) const {
  // Decode-only and every sequence sampled: a one-token prompt chunk that does not end its
  // prompt (no logits row) runs eagerly, as CudaGraphRunner::RunDecode requires.
  if (graphs_ == nullptr || !meta.all_decode() ||
      static_cast<int>(meta.logits_rows.size()) != meta.num_seqs) {
    return false;
  }
  int bucket = 1;
  while (bucket < meta.num_seqs) bucket *= 2;
  return bucket <= GraphSeqLimit();
}

int ShardRunner::num_graphs() const {
#ifdef TPSERVE_HAVE_CUDA
  return graphs_ != nullptr ? graphs_->num_graphs() : 0;
#else
  return 0;
#endif
}

absl::Status ShardRunner::WarmUpGraphs() {
#ifdef TPSERVE_HAVE_CUDA
  if (graphs_ == nullptr) return absl::OkStatus();
  // The buckets CudaGraphRunner::RunDecode picks: batch sizes in powers of two up to
  // graph_max_seqs_, block tables of max(16, a power of two) blocks up to graph_max_blocks_.
  // Each warm-up sequence decodes one token at position 0 of KV block 0 (scratch: whatever it
  // writes there is overwritten by the first sequence that owns block 0).
  // Only the buckets UsesGraphs takes: a padded bucket must fit the model's batch limits.
  const int max_seqs = GraphSeqLimit();
  for (int seqs = 1; seqs <= max_seqs; seqs *= 2) {
    for (int blocks = 16;; blocks = std::min(blocks * 2, graph_max_blocks_)) {
      worker::StepPlan plan;
      for (int i = 0; i < seqs; ++i) {
        worker::SeqStep* s = plan.add_seqs();
        s->set_seq_id(i + 1);
        s->add_token_ids(0);
        for (int b = 0; b < blocks; ++b) s->add_block_table(0);
        s->set_sample(true);
      }
      TP_ASSIGN_OR_RETURN(BatchMeta meta,
                          MakeBatch(plan, cache_->block_size(), cache_->num_blocks()));
      TP_RETURN_IF_ERROR(graphs_->RunDecode(meta).status());
      if (blocks >= graph_max_blocks_) break;
    }
  }
  ops_->Synchronize();
#endif
  return absl::OkStatus();
}

absl::StatusOr<Tensor> ShardRunner::Forward(const BatchMeta& meta, bool graphs) {
#ifdef TPSERVE_HAVE_CUDA
  if (graphs && UsesGraphs(meta)) {
    absl::StatusOr<Tensor> logits = graphs_->RunDecode(meta);
    // The replay's transfers are not visible to a watchdog one by one: it follows the replay.
    if (logits.ok() && tp_ > 1) comms_.tp->TrackStreamWork("a decode graph replay");
    if (logits.ok() && pp_ > 1) comms_.pp->TrackStreamWork("a decode graph replay");
    return logits;
  }
#else
  (void)graphs;
#endif
  return model_->Forward(meta, *cache_);
}

std::vector<std::vector<float>> ShardRunner::LogitsToHost(const Tensor& logits) const {
  std::vector<std::vector<float>> out;
  if (logits.data == nullptr) return out;
  const int64_t rows = logits.dim(0), width = logits.dim(1);
  const int64_t vocab = model_->config().vocab_size;
  const size_t row_bytes = static_cast<size_t>(width) * DTypeSize(logits.dtype);
  std::vector<char> host(logits.bytes());
  ops_->CopyToHost(host.data(), logits.data, logits.bytes());
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> row(vocab);
    for (int64_t c = 0; c < vocab; ++c) {
      row[c] = LogitAt(host.data() + r * row_bytes, logits.dtype, c);
    }
    out.push_back(std::move(row));
  }
  return out;
}

void ShardRunner::Forget(const std::vector<uint64_t>& seq_ids) {
  for (uint64_t id : seq_ids) {
    history_.erase(id);
    last_sampled_.erase(id);
  }
}

absl::Status ShardRunner::ResolveFeeds(const worker::StepPlan& plan, BatchMeta& meta,
                                       InFlight* ahead_of) {
  std::vector<int> rows;  // the feeding sequences' indices in the plan
  for (int i = 0; i < plan.seqs_size(); ++i) {
    const worker::SeqStep& s = plan.seqs(i);
    if (!s.feed_last_sampled()) continue;
    if (s.token_ids_size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", plan.step_id(), ": sequence ", s.seq_id(), " feeds its last ",
                       "sampled token but carries ", s.token_ids_size(), " tokens (expected 1)"));
    }
    rows.push_back(i);
  }
  if (rows.empty()) return absl::OkStatus();
  if (pp_ > 1) {
    // The first stage embeds but the last one samples: the coordinator keeps disjoint
    // sequences in flight through a pipeline and sends every token itself.
    return absl::InvalidArgumentError(
        absl::StrCat("step ", plan.step_id(), ": feed_last_sampled needs pp = 1 (this layout has ",
                     pp_, " pipeline stages)"));
  }
  std::vector<int32_t> ids(rows.size(), -1);
  if (samples_) {
    for (size_t k = 0; k < rows.size(); ++k) {
      const uint64_t id = plan.seqs(rows[k]).seq_id();
      if (ahead_of != nullptr && ahead_of->sampled) {
        // The step in flight sampled it: its id is only on the device yet.
        auto it = std::find(ahead_of->seq_ids.begin(), ahead_of->seq_ids.end(), id);
        if (it != ahead_of->seq_ids.end()) {
          ids[k] = 0;  // a valid placeholder; the fed token replaces it
          meta.fed_tokens.push_back(meta.query_start[rows[k]]);
          meta.fed_rows.push_back(static_cast<int>(it - ahead_of->seq_ids.begin()));
          continue;
        }
      }
      auto it = last_sampled_.find(id);
      if (it != last_sampled_.end()) ids[k] = it->second;
    }
  }
  if (tp_ > 1 && !every_tp_rank_samples_) {
    if (ahead_of != nullptr) {
      return absl::InternalError("a step was launched ahead where the fed ids are broadcast");
    }
    // Every rank of the group embeds the same token: tp rank 0 (the sampler) sends its ids.
    // A missing id travels as -1, so that all ranks fail the step alike.
    const size_t bytes = ids.size() * sizeof(int32_t);
    if (feed_ids_ == nullptr || feed_ids_->bytes() < bytes) {
      feed_ids_ = std::make_unique<DeviceBuffer>(
          ops_, std::max(bytes, sizeof(int32_t) * std::max(1, options_.model.max_batch_seqs)));
    }
    Tensor t(feed_ids_->get(), {static_cast<int64_t>(ids.size())}, DType::kI32, ops_->device());
    if (samples_) ops_->CopyToDevice(t.data, ids.data(), bytes);
    TP_RETURN_IF_ERROR(comms_.tp->Broadcast(t, 0));
    ops_->CopyToHost(ids.data(), t.data, bytes);
    TP_RETURN_IF_ERROR(comms_.tp->Health());
  }
  for (size_t k = 0; k < rows.size(); ++k) {
    if (ids[k] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", plan.step_id(), ": sequence ", plan.seqs(rows[k]).seq_id(),
          " feeds its last sampled token but the previous step holding it did not sample it"));
    }
    meta.token_ids[meta.query_start[rows[k]]] = ids[k];
  }
  return absl::OkStatus();
}

absl::Status ShardRunner::ApplyRepetitionPenalty(const Tensor& logits, int row, float penalty,
                                                 const std::vector<int32_t>& history) {
  if (logits.dtype != DType::kF32 && logits.dtype != DType::kBF16) {
    return absl::UnimplementedError("repetition penalty: logits dtype not supported");
  }
  const int64_t width = logits.dim(1);
  const size_t elem = DTypeSize(logits.dtype);
  char* base = static_cast<char*>(logits.data) + static_cast<size_t>(row) * width * elem;
  std::vector<char> host(width * elem);
  ops_->CopyToHost(host.data(), base, host.size());
  std::unordered_set<int32_t> seen(history.begin(), history.end());
  for (int32_t id : seen) {
    if (id < 0 || id >= width) continue;
    float x = LogitAt(host.data(), logits.dtype, id);
    x = x > 0 ? x / penalty : x * penalty;  // the Hugging Face rule
    if (logits.dtype == DType::kF32) {
      reinterpret_cast<float*>(host.data())[id] = x;
    } else {
      reinterpret_cast<uint16_t*>(host.data())[id] = F32ToBf16(x);
    }
  }
  ops_->CopyToDevice(base, host.data(), host.size());
  return absl::OkStatus();
}

absl::StatusOr<worker::StepResult> ShardRunner::Run(const worker::StepPlan& plan,
                                                    std::vector<std::vector<float>>* logits_out) {
  if (!in_flight_.empty()) {
    return absl::InternalError(absl::StrCat("step ", plan.step_id(), " run while ",
                                            in_flight_.size(), " launched steps are in flight"));
  }
  TP_RETURN_IF_ERROR(Launch(plan, logits_out));
  return Finish();
}

bool ShardRunner::CanLaunchAhead(const worker::StepPlan& plan) const {
  if (!launch_ahead_ || in_flight_.size() != 1) return false;
  for (const worker::SeqStep& s : plan.seqs()) {
    const float penalty = s.sampling().repetition_penalty();
    if (s.sample() && penalty != 0 && penalty != 1) return false;
  }
  return true;
}

bool ShardRunner::OldestReady() {
  return in_flight_.empty() || !in_flight_.front().sampled || ops_->SampleReady();
}

absl::Status ShardRunner::Launch(const worker::StepPlan& plan,
                                 std::vector<std::vector<float>>* logits_out) {
  // Stream-ordered collectives report a failure of an earlier step here (or in Finish, after
  // the host waits for the sampled ids).
  TP_RETURN_IF_ERROR(CommsHealth());
  if (in_flight_.size() >= static_cast<size_t>(Ops::kMaxAsyncSamples)) {
    return absl::InternalError(absl::StrCat("step ", plan.step_id(), " launched while ",
                                            in_flight_.size(), " steps are in flight"));
  }
  if (!in_flight_.empty() && !CanLaunchAhead(plan)) {
    return absl::InternalError(absl::StrCat("step ", plan.step_id(),
                                            " launched ahead of a step in flight, which it may "
                                            "not be (CanLaunchAhead)"));
  }
  InFlight* ahead_of = in_flight_.empty() ? nullptr : &in_flight_.back();
  steps_ahead_ += ahead_of != nullptr;
  TP_ASSIGN_OR_RETURN(BatchMeta meta, MakeBatch(plan, cache_->block_size(), cache_->num_blocks()));
  if (samples_) {
    for (uint64_t id : plan.finished_seq_ids()) ForgetLastSampled(id);
  }
  TP_RETURN_IF_ERROR(ResolveFeeds(plan, meta, ahead_of));
  if (meta.num_tokens > options_.model.max_batch_tokens ||
      static_cast<int>(meta.logits_rows.size()) > options_.model.max_batch_seqs) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", plan.step_id(), " has ", meta.num_tokens, " tokens and ",
                     meta.logits_rows.size(), " sampled rows; this shard was sized for ",
                     options_.model.max_batch_tokens, " and ", options_.model.max_batch_seqs));
  }
  if (samples_) {
    // Validate before the forward: a bad plan must not leave a half-run step behind.
    for (const worker::SeqStep& s : plan.seqs()) {
      if (!s.sample()) continue;
      const absl::Status valid = ValidateSampling(FromPlan(s.sampling(), 0), "sampling.");
      if (!valid.ok()) {
        return Annotate(valid, absl::StrCat("step ", plan.step_id(), ", sequence ", s.seq_id()));
      }
    }
    for (uint64_t id : plan.finished_seq_ids()) history_.erase(id);
    size_t fed = 0;  // meta.fed_tokens are in plan order
    for (int i = 0; i < plan.seqs_size(); ++i) {
      const worker::SeqStep& s = plan.seqs(i);
      std::vector<int32_t>& h = history_[s.seq_id()];
      // A cached prefix (prefix caching): this worker never computed those tokens.
      if (s.prefix_token_ids_size() > 0)
        h.assign(s.prefix_token_ids().begin(), s.prefix_token_ids().end());
      if (static_cast<int>(h.size()) < s.start_pos()) {
        return absl::InternalError(absl::StrCat("sequence ", s.seq_id(), " resumes at ",
                                                s.start_pos(), " but this shard saw only ",
                                                h.size(), " of its tokens"));
      }
      h.resize(s.start_pos());
      if (s.feed_last_sampled()) {
        h.push_back(meta.token_ids[meta.query_start[i]]);
        if (fed < meta.fed_tokens.size() && meta.fed_tokens[fed] == meta.query_start[i]) {
          // Known once the step in flight finishes.
          ahead_of->history_fixups.emplace_back(s.seq_id(), h.size() - 1, meta.fed_rows[fed]);
          ++fed;
        }
      } else {
        h.insert(h.end(), s.token_ids().begin(), s.token_ids().end());
      }
      // A later feed of this sequence refers to this step: valid only if it samples.
      ForgetLastSampled(s.seq_id());
    }
  }
  TP_ASSIGN_OR_RETURN(Tensor logits, Forward(meta));
  InFlight f;
  if (samples_ && !meta.logits_rows.empty()) {
    TP_RETURN_IF_ERROR(LaunchSampling(plan, logits, logits_out, f));
  }
  in_flight_.push_back(std::move(f));
  return absl::OkStatus();
}

void ShardRunner::ForgetLastSampled(uint64_t seq_id) {
  last_sampled_.erase(seq_id);
  for (InFlight& f : in_flight_) {
    for (size_t r = 0; r < f.seq_ids.size(); ++r) {
      if (f.seq_ids[r] == seq_id) f.record[r] = false;
    }
  }
}

absl::StatusOr<worker::StepResult> ShardRunner::Finish() {
  if (in_flight_.empty()) return absl::InternalError("Finish without a launched step");
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  if (!f.sampled) return worker::StepResult();
  std::vector<std::optional<TokenLogprobs>> logprobs;
  const std::vector<int32_t> ids = ops_->SampleWait(f.logprobs ? &logprobs : nullptr);
  // The ids are on the host: the collectives behind them finished, or a watchdog aborted them
  // and the ids are garbage.
  TP_RETURN_IF_ERROR(CommsHealth());
  if (ids.size() != f.seq_ids.size()) {
    return absl::InternalError(
        absl::StrCat("sampled ", ids.size(), " ids for ", f.seq_ids.size(), " sequences"));
  }
  for (size_t r = 0; r < ids.size(); ++r) {
    if (f.record[r]) last_sampled_[f.seq_ids[r]] = ids[r];
  }
  for (const auto& [seq, index, row] : f.history_fixups) {
    auto it = history_.find(seq);
    if (it != history_.end() && index < it->second.size()) it->second[index] = ids[row];
  }
  if (!sampler_) return worker::StepResult();  // sampled only to feed its own next step
  worker::StepResult result;
  result.mutable_token_ids()->Assign(ids.begin(), ids.end());
  for (size_t r = 0; r < ids.size(); ++r) {
    if (f.logprobs_n[r] < 0) continue;
    auto raw = f.raw_rows.find(static_cast<int>(r));
    const TokenLogprobs lp =
        raw != f.raw_rows.end()
            ? ReferenceLogprobs(raw->second.data(), static_cast<int64_t>(raw->second.size()),
                                ids[r], f.logprobs_n[r])
            : *logprobs.at(r);
    worker::SampledLogprobs* out = result.add_logprobs();
    out->set_logprob(lp.logprob);
    for (const TokenLogprob& t : lp.top) {
      worker::TokenLogprob* e = out->add_top();
      e->set_token_id(t.id);
      e->set_logprob(t.logprob);
    }
  }
  return result;
}

absl::Status ShardRunner::CommsHealth() {
  if (comms_.tp != nullptr) TP_RETURN_IF_ERROR(comms_.tp->Health());
  if (comms_.pp != nullptr) TP_RETURN_IF_ERROR(comms_.pp->Health());
  return absl::OkStatus();
}

absl::Status ShardRunner::LaunchSampling(const worker::StepPlan& plan, const Tensor& logits,
                                         std::vector<std::vector<float>>* host_logits,
                                         InFlight& f) {
  const int64_t vocab = model_->config().vocab_size;
  if (host_logits != nullptr) *host_logits = LogitsToHost(logits);
  std::vector<SamplingParams> params;
  int row = 0;
  for (const worker::SeqStep& s : plan.seqs()) {
    if (!s.sample()) continue;
    SamplingParams p = FromPlan(s.sampling(), s.start_pos() + s.token_ids_size());
    f.seq_ids.push_back(s.seq_id());
    f.logprobs_n.push_back(s.sampling().has_logprobs() ? s.sampling().logprobs() : -1);
    f.record.push_back(true);
    if (p.repetition_penalty != 1.0f) {
      if (p.logprobs >= 0) {
        // Rows with a repetition penalty that want logprobs: their logits before the penalty,
        // whose log-probabilities Finish computes (the raw distribution, as for every other row).
        std::vector<std::vector<float>> raw = LogitsToHost(logits.rows(row, 1));
        f.raw_rows[row] = std::move(raw.at(0));
        p.logprobs = -1;
      }
      TP_RETURN_IF_ERROR(
          ApplyRepetitionPenalty(logits, row, p.repetition_penalty, history_[s.seq_id()]));
    }
    params.push_back(p);
    ++row;
  }
  // Rows whose logprobs come from the raw logits ask the ops for none.
  bool ops_logprobs = false;
  for (const SamplingParams& p : params) ops_logprobs |= p.logprobs >= 0;
  f.logprobs = ops_logprobs;
  ops_->SampleAsync(logits, vocab, params, ops_logprobs);
  f.sampled = true;
  return absl::OkStatus();
}

}  // namespace tpserve
