// The in-process engine (see engine.h).
#include "worker/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/bf16.h"
#include "common/logging.h"
#include "common/model_files.h"
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

std::string ResolveDevice(const std::string& device) {
  if (device != "auto") return device;
#ifdef TPSERVE_HAVE_CUDA
  if (CudaDeviceCount() > 0) return "cuda";
#endif
  return "cpu";
}

absl::StatusOr<std::unique_ptr<Ops>> MakeOps(const std::string& device, int gpu_index) {
  const std::string resolved = ResolveDevice(device);
  if (resolved == "cpu") return MakeCpuOps();
  if (resolved == "cuda") {
#ifdef TPSERVE_HAVE_CUDA
    const int count = CudaDeviceCount();
    if (count == 0) return absl::FailedPreconditionError("--device cuda: no CUDA device found");
    if (gpu_index >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPU ", gpu_index, " requested but only ", count, " visible"));
    }
    return MakeCudaOps(gpu_index);
#else
    return absl::FailedPreconditionError("--device cuda: this build has no CUDA support");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", device, "' (expected cpu, cuda or auto)"));
}

namespace {

class BlockPool {
 public:
  explicit BlockPool(int n) {
    for (int i = n - 1; i >= 0; --i) free_.push_back(i);
  }
  bool Allocate(int count, std::vector<int32_t>& out) {
    if (static_cast<int>(free_.size()) < count) return false;
    for (int i = 0; i < count; ++i) {
      out.push_back(free_.back());
      free_.pop_back();
    }
    return true;
  }
  void Release(std::vector<int32_t>& blocks) {
    for (int32_t b : blocks) free_.push_back(b);
    blocks.clear();
  }

 private:
  std::vector<int32_t> free_;
};

}  // namespace

struct Engine::Seq {
  const GenerateRequest* req = nullptr;
  std::vector<int32_t> tokens;
  size_t computed = 0;  // tokens whose K/V are in the cache
  std::vector<int32_t> blocks;
  GenerateResult result;
  bool done = false;
};

Engine::~Engine() {
  // The model and the cache free device memory through ops_: release them first.
  graphs_.reset();
  cache_.reset();
  model_.reset();
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const std::string& model_dir,
                                                       const EngineOptions& options) {
  // Phases of Create are logged at info level so that the load time can be attributed.
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  const auto t_start = Clock::now();
  std::unique_ptr<Engine> engine(new Engine());
  engine->options_ = options;
  TP_ASSIGN_OR_RETURN(ModelFiles files, ModelFiles::Open(model_dir));
  engine->files_ = std::make_unique<ModelFiles>(std::move(files));
  TP_RETURN_IF_ERROR(engine->files_->ValidateWeights());
  const ModelConfig& config = engine->files_->config();
  const auto t_opened = Clock::now();

  if (options.ops != nullptr) {
    engine->ops_ = options.ops;
  } else {
    std::string device = ResolveDevice(options.device);
    if (options.device == "auto" && device == "cuda" && config.head_dim != 32 &&
        config.head_dim != 64 && config.head_dim != 128) {
      TP_LOG(WARNING) << "head_dim " << config.head_dim
                      << " has no CUDA attention kernel: running on the CPU";
      device = "cpu";
    }
    TP_ASSIGN_OR_RETURN(engine->owned_ops_, MakeOps(device));
    engine->ops_ = engine->owned_ops_.get();
  }
  const auto t_ops = Clock::now();
  PlanOptions plan_options;
  plan_options.tp = options.tp;
  plan_options.pp = options.pp;
  plan_options.device_map = options.device_map;
  TP_ASSIGN_OR_RETURN(engine->plan_, PlanShards(config, plan_options));

  ParallelContext comms = options.comms;
  if (comms.tp == nullptr) {
    engine->single_tp_ = MakeSingleRankCommunicator(engine->ops_);
    comms.tp = engine->single_tp_.get();
  }
  if (comms.pp == nullptr) {
    engine->single_pp_ = MakeSingleRankCommunicator(engine->ops_);
    comms.pp = engine->single_pp_.get();
  }
  ShardLoadOptions load;
  load.model = options.model;
  load.block_size = options.block_size;
  load.kv_cache_bytes = options.kv_cache_bytes;
  load.num_kv_blocks = options.num_kv_blocks;
  load.gpu_memory_utilization = options.gpu_memory_utilization;
  const int64_t blocks_per_seq =
      (config.max_position_embeddings + options.block_size - 1) / options.block_size;
#ifdef TPSERVE_HAVE_CUDA
  CudaReserve reserve;
  auto* cuda = dynamic_cast<CudaOps*>(engine->ops_);
  if (cuda != nullptr) {
    // Size the batch buffers once, before the KV budget is measured, so that nothing moves
    // after warm-up and the budget counts them.
    load.before_kv = [&](LlamaModel& model) {
      const int64_t table_blocks = options.num_kv_blocks > 0
                                       ? std::min<int64_t>(blocks_per_seq, options.num_kv_blocks)
                                       : blocks_per_seq;
      reserve = CudaGraphRunner::ReserveFor(config, model.shard(), options.model,
                                            options.block_size, table_blocks);
      cuda->Reserve(reserve);
    };
  }
#else
  (void)blocks_per_seq;
#endif
  TP_ASSIGN_OR_RETURN(LoadedShard shard, LoadShard(*engine->files_, engine->plan_, options.rank,
                                                   engine->ops_, comms, load));
  engine->model_ = std::move(shard.model);
  engine->cache_ = std::move(shard.cache);
#ifdef TPSERVE_HAVE_CUDA
  if (cuda != nullptr && options.cuda_graphs && options.tp == 1 && options.pp == 1) {
    // Decode graphs are captured lazily, on the first decode step of each batch bucket.
    engine->graphs_ = std::make_unique<CudaGraphRunner>(cuda, engine->model_.get(),
                                                        engine->cache_.get(), reserve.max_seqs);
  }
#endif
  const auto t_end = Clock::now();
  TP_LOG(INFO) << absl::StrFormat(
      "Engine::Create %.3f s: open and validate %.3f s, device init %.3f s, shard load "
      "(weights, workspace, KV pool) %.3f s",
      seconds(t_start, t_end), seconds(t_start, t_opened), seconds(t_opened, t_ops),
      seconds(t_ops, t_end));
  return engine;
}

const ModelConfig& Engine::config() const { return files_->config(); }
const GenerationConfig& Engine::generation_config() const { return files_->generation_config(); }
int64_t Engine::kv_capacity_tokens() const { return cache_->capacity_tokens(); }

absl::StatusOr<Tensor> Engine::Forward(const BatchMeta& meta) {
  return model_->Forward(meta, *cache_);
}

absl::StatusOr<std::vector<std::vector<float>>> Engine::LogitsToHost(const Tensor& logits) {
  std::vector<std::vector<float>> out;
  if (logits.data == nullptr) return out;
  const int64_t rows = logits.dim(0), width = logits.dim(1);
  const int64_t vocab = config().vocab_size;
  std::vector<char> host(logits.bytes());
  ops_->CopyToHost(host.data(), logits.data, logits.bytes());
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> row(vocab);
    for (int64_t c = 0; c < vocab; ++c) {
      const int64_t i = r * width + c;
      if (logits.dtype == DType::kF32) {
        row[c] = reinterpret_cast<const float*>(host.data())[i];
      } else {
        row[c] = Bf16ToF32(reinterpret_cast<const uint16_t*>(host.data())[i]);
      }
    }
    out.push_back(std::move(row));
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<float>>> Engine::ForwardLogits(const BatchMeta& meta) {
  TP_ASSIGN_OR_RETURN(Tensor logits, Forward(meta));
  return LogitsToHost(logits);
}

absl::StatusOr<std::vector<std::vector<float>>> Engine::PromptLogits(
    const std::vector<int32_t>& prompt) {
  const int bs = options_.block_size;
  const int n = static_cast<int>(prompt.size());
  BlockPool pool(cache_->num_blocks());
  std::vector<int32_t> blocks;
  if (!pool.Allocate((n + bs - 1) / bs, blocks)) {
    return absl::ResourceExhaustedError("prompt does not fit the KV cache");
  }
  BatchMeta meta;
  meta.num_seqs = 1;
  meta.num_tokens = n;
  meta.block_size = bs;
  meta.token_ids = prompt;
  meta.query_start = {0, n};
  meta.context_lens = {n};
  meta.block_tables = blocks;
  meta.max_blocks_per_seq = static_cast<int>(blocks.size());
  for (int i = 0; i < n; ++i) {
    meta.positions.push_back(i);
    meta.slot_mapping.push_back(blocks[i / bs] * bs + i % bs);
    meta.logits_rows.push_back(i);
  }
  return ForwardLogits(meta);
}

absl::StatusOr<std::vector<GenerateResult>> Engine::Generate(
    const std::vector<GenerateRequest>& reqs) {
  const ModelConfig& cfg = config();
  const int bs = options_.block_size;
  std::vector<int32_t> eos = generation_config().eos_token_ids;
  if (eos.empty()) eos = cfg.eos_token_ids;

  std::vector<Seq> seqs(reqs.size());
  int64_t total_blocks = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const GenerateRequest& r = reqs[i];
    if (r.prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
    for (int32_t id : r.prompt) {
      if (id < 0 || id >= cfg.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "prompt token id ", id, " outside the vocabulary [0, ", cfg.vocab_size, ")"));
      }
    }
    if (r.max_new_tokens < 1) return absl::InvalidArgumentError("max_new_tokens must be >= 1");
    if (r.sampling.logprobs < -1 || r.sampling.logprobs > kMaxLogprobs) {
      return absl::InvalidArgumentError(absl::StrCat("logprobs must be in [0, ", kMaxLogprobs,
                                                     "] (or -1: none); got ", r.sampling.logprobs));
    }
    const int64_t need = static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens;
    if (need > cfg.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt of ", r.prompt.size(), " tokens plus max_new_tokens ", r.max_new_tokens,
          " exceeds the model's context of ", cfg.max_position_embeddings, " tokens"));
    }
    total_blocks += (need + bs - 1) / bs;
    seqs[i].req = &r;
    seqs[i].tokens = r.prompt;
  }
  if (total_blocks > cache_->num_blocks()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the batch needs ", total_blocks, " KV blocks of ", bs,
                     " tokens but the cache has ", cache_->num_blocks()));
  }
  BlockPool pool(cache_->num_blocks());
  const bool last_stage = model_->shard().last_stage;
  Communicator* pp = options_.comms.pp;

  // Pipeline micro-batches: with pp stages the sequences are dealt round-robin into k groups,
  // and the groups take turns, so that stage s runs group g while stage s + 1 runs group g - 1.
  // The last stage sends each group's sampled ids to every other stage (small eager sends);
  // a stage receives them just before it schedules that group again. Every rank updates the
  // sequences in the same order, so all agree on the batches without further messages.
  int k = 1;
  if (plan_.pp > 1) {
    k = options_.pp_micro_batches > 0 ? options_.pp_micro_batches : plan_.pp;
    if (!pp->buffers_small_sends()) k = 1;  // e.g. NCCL: ids and activations on one stream
  }
  k = std::max(1, std::min<int>(k, static_cast<int>(seqs.size())));
  std::vector<std::vector<Seq*>> groups(k);
  for (size_t i = 0; i < seqs.size(); ++i) groups[i % k].push_back(&seqs[i]);

  struct InFlight {
    std::vector<Seq*> sampled;  // sequences whose next token this step produces
    std::vector<int32_t> ids;   // filled on the last stage at once, elsewhere on Finish
    std::vector<std::optional<TokenLogprobs>> logprobs;  // last stage: rows that asked
    std::chrono::steady_clock::time_point start;
    int num_tokens = 0;
  };
  std::vector<std::optional<InFlight>> inflight(k);
  DeviceBuffer ids_buffer(ops_, sizeof(int32_t) * std::max(1, options_.model.max_batch_seqs));

  // Applies the sampled ids of group g's step in flight (receiving them if not the last stage).
  auto finish = [&](int g) -> absl::Status {
    InFlight& f = *inflight[g];
    if (!last_stage && !f.sampled.empty()) {
      f.ids.resize(f.sampled.size());
      Tensor t(ids_buffer.get(), {static_cast<int64_t>(f.ids.size())}, DType::kI32, ops_->device());
      TP_RETURN_IF_ERROR(pp->Recv(t, plan_.pp - 1));
      ops_->CopyToHost(f.ids.data(), t.data, f.ids.size() * sizeof(int32_t));
    }
    const double step_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - f.start)
            .count();
    for (size_t i = 0; i < f.sampled.size(); ++i) {
      Seq& s = *f.sampled[i];
      const int32_t id = f.ids[i];
      s.result.step_ms.push_back(step_ms);
      s.result.step_tokens.push_back(f.num_tokens);
      s.tokens.push_back(id);
      s.result.output_ids.push_back(id);
      if (i < f.logprobs.size() && f.logprobs[i]) s.result.logprobs.push_back(*f.logprobs[i]);
      const bool is_eos = !s.req->ignore_eos && std::find(eos.begin(), eos.end(), id) != eos.end();
      const bool is_stop = std::find(s.req->stop_token_ids.begin(), s.req->stop_token_ids.end(),
                                     id) != s.req->stop_token_ids.end();
      if (is_eos || is_stop) {
        s.result.finish_reason = "stop";
        s.done = true;
      } else if (static_cast<int>(s.result.output_ids.size()) >= s.req->max_new_tokens) {
        s.result.finish_reason = "length";
        s.done = true;
      }
      if (s.done) pool.Release(s.blocks);
    }
    inflight[g].reset();
    return absl::OkStatus();
  };

  for (bool progress = true; progress;) {
    progress = false;
    for (int g = 0; g < k; ++g) {
      if (inflight[g]) TP_RETURN_IF_ERROR(finish(g));
      BatchMeta meta;
      meta.block_size = bs;
      std::vector<Seq*> batch;  // sequences in this step, in batch order
      InFlight f;
      int budget = options_.model.max_batch_tokens;
      for (Seq* sp : groups[g]) {
        Seq& s = *sp;
        if (s.done || budget == 0) continue;
        if (static_cast<int>(f.sampled.size()) >= options_.model.max_batch_seqs) break;
        const size_t chunk = std::min<size_t>(s.tokens.size() - s.computed, budget);
        const size_t end = s.computed + chunk;
        const size_t need_blocks = (end + bs - 1) / bs;
        if (need_blocks > s.blocks.size() &&
            !pool.Allocate(static_cast<int>(need_blocks - s.blocks.size()), s.blocks)) {
          return absl::InternalError("KV block pool exhausted despite the admission check");
        }
        batch.push_back(&s);
        meta.num_seqs++;
        meta.query_start.push_back(meta.num_tokens);
        for (size_t p = s.computed; p < end; ++p) {
          meta.token_ids.push_back(s.tokens[p]);
          meta.positions.push_back(static_cast<int32_t>(p));
          meta.slot_mapping.push_back(s.blocks[p / bs] * bs + static_cast<int32_t>(p % bs));
        }
        meta.num_tokens += static_cast<int>(chunk);
        meta.context_lens.push_back(static_cast<int32_t>(end));
        budget -= static_cast<int>(chunk);
        s.computed = end;
        if (end == s.tokens.size()) {
          meta.logits_rows.push_back(meta.num_tokens - 1);
          f.sampled.push_back(&s);
        }
      }
      if (batch.empty()) continue;
      progress = true;
      meta.query_start.push_back(meta.num_tokens);
      for (Seq* s : batch) {
        meta.max_blocks_per_seq =
            std::max(meta.max_blocks_per_seq, static_cast<int>(s->blocks.size()));
      }
      for (Seq* s : batch) {
        for (int b = 0; b < meta.max_blocks_per_seq; ++b) {
          meta.block_tables.push_back(b < static_cast<int>(s->blocks.size()) ? s->blocks[b] : -1);
        }
      }

      f.start = std::chrono::steady_clock::now();
      f.num_tokens = meta.num_tokens;
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
      if (last_stage && !f.sampled.empty()) {
        std::vector<SamplingParams> params;
        bool any_logprobs = false;
        for (Seq* s : f.sampled) {
          SamplingParams p = s->req->sampling;
          p.position = static_cast<int64_t>(s->tokens.size());
          any_logprobs |= p.logprobs >= 0;
          params.push_back(p);
        }
        f.ids = ops_->Sample(logits, cfg.vocab_size, params, any_logprobs ? &f.logprobs : nullptr);
        if (std::any_of(f.sampled.begin(), f.sampled.end(),
                        [](Seq* s) { return s->req->record_logits; })) {
          TP_ASSIGN_OR_RETURN(auto host, LogitsToHost(logits));
          for (size_t i = 0; i < f.sampled.size(); ++i) {
            if (f.sampled[i]->req->record_logits) {
              f.sampled[i]->result.step_logits.push_back(std::move(host[i]));
            }
          }
        }
        if (plan_.pp > 1) {
          // The ids go upstream to every other stage of this rank's pipeline chain.
          Tensor t(ids_buffer.get(), {static_cast<int64_t>(f.ids.size())}, DType::kI32,
                   ops_->device());
          ops_->CopyToDevice(t.data, f.ids.data(), f.ids.size() * sizeof(int32_t));
          for (int peer = 0; peer < plan_.pp - 1; ++peer) TP_RETURN_IF_ERROR(pp->Send(t, peer));
        }
      }
      inflight[g] = std::move(f);
      // One micro-batch (k = 1): finish at once, as a plain step loop.
      if (k == 1) TP_RETURN_IF_ERROR(finish(g));
    }
  }
  std::vector<GenerateResult> results;
  for (Seq& s : seqs) results.push_back(std::move(s.result));
  return results;
}

}  // namespace tpserve
