// The worker's step runner (see step_runner.h).
#include "worker/step_runner.h"

#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
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

StepRunner::~StepRunner() {
  graphs_.reset();  // before the cache and the model it replays
  cache_.reset();
  model_.reset();
}

absl::StatusOr<std::unique_ptr<StepRunner>> StepRunner::Create(const ModelFiles& files,
                                                               const ShardPlan& plan, int rank,
                                                               Ops* ops, ParallelContext comms,
                                                               const StepRunnerOptions& options) {
  std::unique_ptr<StepRunner> r(new StepRunner());
  r->ops_ = ops;
  r->options_ = options;
  ShardLoadOptions load;
  load.model = options.model;
  load.block_size = options.block_size;
  load.kv_cache_bytes = options.kv_cache_bytes;
  load.gpu_memory_utilization = options.gpu_memory_utilization;
#ifdef TPSERVE_HAVE_CUDA
  // As in Engine::Create: the batch buffers are sized once, before the KV budget is measured,
  // so that nothing moves after warm-up and decode steps can replay as CUDA graphs.
  CudaReserve reserve;
  auto* cuda =
      options.cuda_graphs && plan.tp == 1 && plan.pp == 1 ? dynamic_cast<CudaOps*>(ops) : nullptr;
  if (cuda != nullptr) {
    const ModelConfig& config = files.config();
    load.before_kv = [&](LlamaModel& model) {
      reserve = CudaGraphRunner::ReserveFor(
          config, model.shard(), options.model, options.block_size,
          (config.max_position_embeddings + options.block_size - 1) / options.block_size);
      cuda->Reserve(reserve);
    };
  }
#endif
  TP_ASSIGN_OR_RETURN(LoadedShard loaded, LoadShard(files, plan, rank, ops, comms, load));
  r->model_ = std::move(loaded.model);
  r->cache_ = std::move(loaded.cache);
#ifdef TPSERVE_HAVE_CUDA
  if (cuda != nullptr) {
    r->graphs_ =
        std::make_unique<CudaGraphRunner>(cuda, r->model_.get(), r->cache_.get(), reserve.max_seqs);
  }
#endif
  const RankShard& shard = r->model_->shard();
  r->sampler_ = shard.last_stage && shard.tp_rank == 0;
  return r;
}

absl::StatusOr<BatchMeta> StepRunner::MakeBatch(const worker::StepPlan& plan, int block_size,
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

absl::Status StepRunner::ApplyRepetitionPenalty(const Tensor& logits, int row, float penalty,
                                                const std::vector<int32_t>& history, int64_t vocab,
                                                std::vector<float>* raw) {
  const int64_t width = logits.dim(1);
  const size_t elem = DTypeSize(logits.dtype);
  char* base = static_cast<char*>(logits.data) + static_cast<size_t>(row) * width * elem;
  std::vector<char> host(width * elem);
  ops_->CopyToHost(host.data(), base, host.size());
  if (raw != nullptr) {
    raw->resize(std::min(vocab, width));
    for (size_t i = 0; i < raw->size(); ++i) {
      if (logits.dtype == DType::kF32) {
        (*raw)[i] = reinterpret_cast<const float*>(host.data())[i];
      } else if (logits.dtype == DType::kBF16) {
        (*raw)[i] = Bf16ToF32(reinterpret_cast<const uint16_t*>(host.data())[i]);
      }
    }
  }
  std::unordered_set<int32_t> seen(history.begin(), history.end());
  for (int32_t id : seen) {
    if (id < 0 || id >= width) continue;
    float x;
    if (logits.dtype == DType::kF32) {
      x = reinterpret_cast<float*>(host.data())[id];
    } else if (logits.dtype == DType::kBF16) {
      x = Bf16ToF32(reinterpret_cast<uint16_t*>(host.data())[id]);
    } else {
      return absl::UnimplementedError("repetition penalty: logits dtype not supported");
    }
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

absl::StatusOr<worker::StepResult> StepRunner::Run(const worker::StepPlan& plan) {
  TP_ASSIGN_OR_RETURN(BatchMeta meta, MakeBatch(plan, cache_->block_size(), cache_->num_blocks()));
  if (meta.num_tokens > options_.model.max_batch_tokens ||
      static_cast<int>(meta.logits_rows.size()) > options_.model.max_batch_seqs) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", plan.step_id(), " has ", meta.num_tokens, " tokens and ",
                     meta.logits_rows.size(), " sampled rows; this worker was sized for ",
                     options_.model.max_batch_tokens, " and ", options_.model.max_batch_seqs));
  }
  if (sampler_) {
    for (uint64_t id : plan.finished_seq_ids()) history_.erase(id);
    for (const worker::SeqStep& s : plan.seqs()) {
      std::vector<int32_t>& h = history_[s.seq_id()];
      // A cached prefix (prefix caching): this worker never computed those tokens.
      if (s.prefix_token_ids_size() > 0)
        h.assign(s.prefix_token_ids().begin(), s.prefix_token_ids().end());
      if (static_cast<int>(h.size()) < s.start_pos()) {
        return absl::InternalError(absl::StrCat("sequence ", s.seq_id(), " resumes at ",
                                                s.start_pos(), " but this worker saw only ",
                                                h.size(), " of its tokens"));
      }
      h.resize(s.start_pos());
      h.insert(h.end(), s.token_ids().begin(), s.token_ids().end());
    }
  }
  Tensor logits;
#ifdef TPSERVE_HAVE_CUDA
  if (graphs_ != nullptr && meta.all_decode()) {
    TP_ASSIGN_OR_RETURN(logits, graphs_->RunDecode(meta));
  } else {
    TP_ASSIGN_OR_RETURN(logits, model_->Forward(meta, *cache_));
  }
#else
  TP_ASSIGN_OR_RETURN(logits, model_->Forward(meta, *cache_));
#endif
  worker::StepResult result;
  if (!sampler_ || meta.logits_rows.empty()) return result;
  const int64_t vocab = model_->config().vocab_size;
  std::vector<SamplingParams> params;
  // Rows with a repetition penalty that want logprobs: their logits before the penalty, whose
  // log-probabilities are computed here (the raw distribution, as for every other row).
  std::map<int, std::vector<float>> raw_rows;
  bool any_logprobs = false;
  int row = 0;
  for (const worker::SeqStep& s : plan.seqs()) {
    if (!s.sample()) continue;
    const worker::Sampling& sp = s.sampling();
    SamplingParams p;
    p.temperature = sp.temperature();
    p.top_k = sp.top_k();
    p.top_p = sp.top_p() > 0 ? sp.top_p() : 1.0f;
    p.seed = sp.seed();
    p.position = s.start_pos() + s.token_ids_size();
    if (sp.has_logprobs()) {
      if (sp.logprobs() < 0 || sp.logprobs() > kMaxLogprobs) {
        return absl::InvalidArgumentError(
            absl::StrCat("step ", plan.step_id(), ": sequence ", s.seq_id(), " asks for ",
                         sp.logprobs(), " logprobs; the range is [0, ", kMaxLogprobs, "]"));
      }
      p.logprobs = sp.logprobs();
      any_logprobs = true;
    }
    if (sp.repetition_penalty() > 0 && sp.repetition_penalty() != 1.0f) {
      std::vector<float>* raw = p.logprobs >= 0 ? &raw_rows[row] : nullptr;
      TP_RETURN_IF_ERROR(ApplyRepetitionPenalty(logits, row, sp.repetition_penalty(),
                                                history_[s.seq_id()], vocab, raw));
      if (raw != nullptr) p.logprobs = -1;  // computed below from the raw row
    }
    params.push_back(p);
    ++row;
  }
  std::vector<std::optional<TokenLogprobs>> logprobs;
  const std::vector<int32_t> ids =
      ops_->Sample(logits, vocab, params, any_logprobs ? &logprobs : nullptr);
  result.mutable_token_ids()->Assign(ids.begin(), ids.end());
  if (!any_logprobs) return result;
  row = 0;
  for (const worker::SeqStep& s : plan.seqs()) {
    if (!s.sample()) continue;
    const int r = row++;
    if (!s.sampling().has_logprobs()) continue;
    auto raw = raw_rows.find(r);
    const TokenLogprobs lp =
        raw != raw_rows.end()
            ? ReferenceLogprobs(raw->second.data(), static_cast<int64_t>(raw->second.size()),
                                ids[r], s.sampling().logprobs())
            : *logprobs[r];
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

}  // namespace tpserve
