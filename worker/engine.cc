// The in-process engine (see engine.h).
#include "worker/engine.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/model_files.h"
#include "common/status.h"
#ifdef TPSERVE_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace tpserve {

std::string ResolveDevice(const std::string& device) {
  if (device != "auto") return device;
#ifdef TPSERVE_HAVE_CUDA
  if (CudaDeviceCount() > 0) return "cuda";
#endif
  return "cpu";
}

std::string ResolveModelDevice(const std::string& device, int head_dim) {
  const std::string resolved = ResolveDevice(device);
  return device == "auto" && resolved == "cuda" && !CudaSupportsHeadDim(head_dim) ? "cpu"
                                                                                  : resolved;
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
  uint64_t id = 0;
  const GenerateRequest* req = nullptr;
  std::vector<int32_t> tokens;
  size_t computed = 0;  // tokens whose K/V are in the cache
  std::vector<int32_t> blocks;
  GenerateResult result;
  bool done = false;
  int pending = 0;  // launched steps sampling its next token whose ids are not applied yet
};

Engine::~Engine() {
  runner_.reset();  // frees device memory through ops_
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
    const std::string device = ResolveModelDevice(options.device, config.head_dim);
    if (device != ResolveDevice(options.device)) {
      TP_LOG(WARNING) << "head_dim " << config.head_dim
                      << " has no CUDA attention kernel: running on the CPU";
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
  engine->options_.comms = comms;
  ShardRunnerOptions shard = options;
  shard.sample_on_every_tp_rank = true;
  TP_ASSIGN_OR_RETURN(engine->runner_,
                      ShardRunner::Create(*engine->files_, engine->plan_, options.rank,
                                          engine->ops_, comms, shard));
  TP_RETURN_IF_ERROR(engine->runner_->WarmUpGraphs());
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
int64_t Engine::kv_capacity_tokens() const { return runner_->capacity_tokens(); }

absl::StatusOr<Tensor> Engine::Forward(const BatchMeta& meta) {
  return runner_->Forward(meta, /*graphs=*/false);
}

absl::StatusOr<std::vector<std::vector<float>>> Engine::ForwardLogits(const BatchMeta& meta) {
  TP_ASSIGN_OR_RETURN(Tensor logits, Forward(meta));
  return runner_->LogitsToHost(logits);
}

absl::StatusOr<std::vector<std::vector<float>>> Engine::PromptLogits(
    const std::vector<int32_t>& prompt) {
  const int bs = runner_->block_size();
  const int n = static_cast<int>(prompt.size());
  BlockPool pool(runner_->num_blocks());
  std::vector<int32_t> blocks;
  if (!pool.Allocate((n + bs - 1) / bs, blocks)) {
    return absl::ResourceExhaustedError("prompt does not fit the KV cache");
  }
  worker::StepPlan plan;
  worker::SeqStep* s = plan.add_seqs();
  s->set_seq_id(next_seq_id_++);
  s->mutable_token_ids()->Assign(prompt.begin(), prompt.end());
  s->mutable_block_table()->Assign(blocks.begin(), blocks.end());
  s->set_sample(true);
  TP_ASSIGN_OR_RETURN(BatchMeta meta, ShardRunner::MakeBatch(plan, bs, runner_->num_blocks()));
  meta.logits_rows.clear();  // every position, not only the last
  for (int i = 0; i < n; ++i) meta.logits_rows.push_back(i);
  return ForwardLogits(meta);
}

absl::StatusOr<std::vector<GenerateResult>> Engine::Generate(
    const std::vector<GenerateRequest>& reqs) {
  const ModelConfig& cfg = config();
  const int bs = runner_->block_size();
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
    TP_RETURN_IF_ERROR(ValidateSampling(r.sampling));
    const int64_t need = static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens;
    if (need > cfg.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt of ", r.prompt.size(), " tokens plus max_new_tokens ", r.max_new_tokens,
          " exceeds the model's context of ", cfg.max_position_embeddings, " tokens"));
    }
    total_blocks += (need + bs - 1) / bs;
    seqs[i].id = next_seq_id_++;
    seqs[i].req = &r;
    seqs[i].tokens = r.prompt;
  }
  if (total_blocks > runner_->num_blocks()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the batch needs ", total_blocks, " KV blocks of ", bs,
                     " tokens but the cache has ", runner_->num_blocks()));
  }
  BlockPool pool(runner_->num_blocks());
  const bool last_stage = runner_->model().shard().last_stage;
  Communicator* pp = options_.comms.pp;

  // Pipeline micro-batches: with pp stages the sequences are dealt round-robin into k groups,
  // and the groups take turns, so that stage s runs group g while stage s + 1 runs group g - 1.
  // The last stage sends each group's sampled ids to every other stage (small buffered sends);
  // a stage receives them just before it schedules that group again. Every rank updates the
  // sequences in the same order, so all agree on the batches without further messages.
  // k is at most b, the small sends the pp communicator buffers per peer (a pair's Send waits
  // for the Recv of the message b before it): a stage receives the ids of step m just before
  // its step m + k, so the last stage's Send of step m's ids waits at most for a Recv that the
  // stage posted before its step m - b + k <= m, never for one behind a later step (NCCL: b = 0,
  // ids and activations would wait for each other on one stream, k = 1; the custom p2p
  // kernels: 2; MPI's eager protocol: many).
  int k = 1;
  if (plan_.pp > 1) {
    k = options_.pp_micro_batches > 0 ? options_.pp_micro_batches : plan_.pp;
    k = std::min(k, std::max(1, pp->buffered_small_sends()));
  }
  k = std::max(1, std::min<int>(k, static_cast<int>(seqs.size())));
  std::vector<std::vector<Seq*>> groups(k);
  for (size_t i = 0; i < seqs.size(); ++i) groups[i % k].push_back(&seqs[i]);

  struct InFlight {
    std::vector<Seq*> sampled;  // sequences whose next token this step produces
    std::vector<int32_t> ids;   // filled on the last stage at once, elsewhere on Finish
    worker::StepResult result;  // last stage: ids and the logprobs of the rows that asked
    std::chrono::steady_clock::time_point start;
    int num_tokens = 0;
  };
  std::vector<std::optional<InFlight>> inflight(k);
  std::vector<uint64_t> finished_ids;  // told to the runner in the next plan
  DeviceBuffer ids_buffer(ops_, sizeof(int32_t) * std::max(1, options_.model.max_batch_seqs));
  // A step's time runs from its launch, or from the end of the step it queued behind (a step
  // launched ahead), whichever is later.
  auto last_finish = std::chrono::steady_clock::now();

  // Applies the sampled ids of group g's step in flight (receiving them if not the last stage).
  auto finish = [&](int g) -> absl::Status {
    InFlight& f = *inflight[g];
    if (!last_stage && !f.sampled.empty()) {
      f.ids.resize(f.sampled.size());
      Tensor t(ids_buffer.get(), {static_cast<int64_t>(f.ids.size())}, DType::kI32, ops_->device());
      TP_RETURN_IF_ERROR(pp->Recv(t, plan_.pp - 1));
      ops_->CopyToHost(f.ids.data(), t.data, f.ids.size() * sizeof(int32_t));
      // A stream-ordered Recv that gave up left garbage: ask before using the ids.
      TP_RETURN_IF_ERROR(pp->Health());
    }
    const auto now = std::chrono::steady_clock::now();
    const double step_ms =
        std::chrono::duration<double, std::milli>(now - std::max(f.start, last_finish)).count();
    last_finish = now;
    int logprob_row = 0;
    for (size_t i = 0; i < f.sampled.size(); ++i) {
      Seq& s = *f.sampled[i];
      const int32_t id = f.ids[i];
      s.pending = std::max(0, s.pending - 1);
      if (s.done) {
        // Ended (a stop token) in the step before, which finished after this one was launched:
        // the token sampled past its end is dropped.
        if (last_stage && s.req->sampling.logprobs >= 0) ++logprob_row;
        continue;
      }
      s.result.step_ms.push_back(step_ms);
      s.result.step_tokens.push_back(f.num_tokens);
      s.tokens.push_back(id);
      s.result.output_ids.push_back(id);
      if (last_stage && s.req->sampling.logprobs >= 0) {
        const worker::SampledLogprobs& lp = f.result.logprobs(logprob_row++);
        TokenLogprobs out;
        out.logprob = lp.logprob();
        for (const worker::TokenLogprob& t : lp.top())
          out.top.push_back({t.token_id(), t.logprob()});
        s.result.logprobs.push_back(std::move(out));
      }
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
      if (s.done) {
        pool.Release(s.blocks);
        finished_ids.push_back(s.id);
      }
    }
    inflight[g].reset();
    return absl::OkStatus();
  };

  // Adds sequence s's next piece of work to `plan` and moves s.computed past it: its next chunk
  // of at most `budget` tokens, or, while a step in flight samples its next token (launching
  // ahead), that token, fed on the device (nothing when that token is its last).
  auto plan_seq = [&](Seq& s, worker::StepPlan& plan, InFlight& f, int& budget) -> absl::Status {
    const bool fed = s.pending > 0;
    if (fed && static_cast<int>(s.result.output_ids.size()) + s.pending >= s.req->max_new_tokens) {
      return absl::OkStatus();  // the token in flight is its last
    }
    // A fed sequence computes the token in flight, at position tokens.size().
    const size_t begin = fed ? s.tokens.size() : s.computed;
    const size_t chunk = fed ? 1 : std::min<size_t>(s.tokens.size() - s.computed, budget);
    const size_t end = begin + chunk;
    const size_t need_blocks = (end + bs - 1) / bs;
    if (need_blocks > s.blocks.size() &&
        !pool.Allocate(static_cast<int>(need_blocks - s.blocks.size()), s.blocks)) {
      return absl::InternalError("KV block pool exhausted despite the admission check");
    }
    worker::SeqStep* step = plan.add_seqs();
    step->set_seq_id(s.id);
    step->set_start_pos(static_cast<int32_t>(begin));
    if (fed) {
      step->add_token_ids(0);
      step->set_feed_last_sampled(true);
    } else {
      step->mutable_token_ids()->Assign(s.tokens.begin() + begin, s.tokens.begin() + end);
    }
    step->mutable_block_table()->Assign(s.blocks.begin(), s.blocks.end());
    budget -= static_cast<int>(chunk);
    f.num_tokens += static_cast<int>(chunk);
    s.computed = end;
    if (fed || end == s.tokens.size()) {
      step->set_sample(true);
      const SamplingParams& p = s.req->sampling;
      worker::Sampling* sp_out = step->mutable_sampling();
      sp_out->set_temperature(p.temperature);
      sp_out->set_top_p(p.top_p);
      sp_out->set_top_k(p.top_k);
      sp_out->set_seed(p.seed);
      sp_out->set_repetition_penalty(p.repetition_penalty);
      if (p.logprobs >= 0) sp_out->set_logprobs(p.logprobs);
      f.sampled.push_back(&s);
    }
    return absl::OkStatus();
  };

  uint64_t step_id = 0;
  if (k == 1 && runner_->launch_ahead()) {
    // One step ahead (pp = 1): the next plan is built and launched while the step before it
    // still runs; a sequence whose last token is not on the host yet continues with
    // feed_last_sampled (its id is fed on the device). A sequence that stops on a token of the
    // step in flight has one more token computed, dropped by finish.
    std::optional<InFlight> cur;
    // Finishes the step in flight: its result from the runner, then finish's bookkeeping.
    auto finish_cur = [&]() -> absl::Status {
      inflight[0] = std::move(*cur);
      cur.reset();
      TP_ASSIGN_OR_RETURN(inflight[0]->result, runner_->Finish());
      if (last_stage) {
        inflight[0]->ids.assign(inflight[0]->result.token_ids().begin(),
                                inflight[0]->result.token_ids().end());
      }
      return finish(0);
    };
    for (;;) {
      worker::StepPlan plan;
      plan.set_step_id(step_id + 1);
      plan.mutable_finished_seq_ids()->Assign(finished_ids.begin(), finished_ids.end());
      InFlight f;
      int budget = options_.model.max_batch_tokens;
      for (Seq& s : seqs) {
        if (s.done || budget == 0) continue;
        if (static_cast<int>(f.sampled.size()) >= options_.model.max_batch_seqs) break;
        TP_RETURN_IF_ERROR(plan_seq(s, plan, f, budget));
      }
      if (cur && (plan.seqs_size() == 0 || !runner_->CanLaunchAhead(plan))) {
        // Nothing to go ahead with, or a step that needs the ids on the host: undo the plan
        // (its blocks stay with their sequences), finish the step in flight and plan again
        // from what it sampled.
        for (const worker::SeqStep& st : plan.seqs()) {
          for (Seq& s : seqs) {
            if (s.id == st.seq_id()) s.computed = static_cast<size_t>(st.start_pos());
          }
        }
        TP_RETURN_IF_ERROR(finish_cur());
        continue;
      }
      if (plan.seqs_size() == 0) break;
      ++step_id;
      finished_ids.clear();
      f.start = std::chrono::steady_clock::now();
      const bool record = std::any_of(f.sampled.begin(), f.sampled.end(),
                                      [](Seq* s) { return s->req->record_logits; });
      std::vector<std::vector<float>> logits;
      TP_RETURN_IF_ERROR(runner_->Launch(plan, record ? &logits : nullptr));
      for (Seq* sp : f.sampled) ++sp->pending;
      for (size_t i = 0; i < f.sampled.size() && record; ++i) {
        if (f.sampled[i]->req->record_logits) {
          f.sampled[i]->result.step_logits.push_back(std::move(logits.at(i)));
        }
      }
      // The step before: its ids while this one waits behind it on the device.
      if (cur) TP_RETURN_IF_ERROR(finish_cur());
      cur = std::move(f);
    }
  }
  for (bool progress = true; progress;) {
    progress = false;
    for (int g = 0; g < k; ++g) {
      if (inflight[g]) TP_RETURN_IF_ERROR(finish(g));
      worker::StepPlan plan;
      plan.set_step_id(++step_id);
      plan.mutable_finished_seq_ids()->Assign(finished_ids.begin(), finished_ids.end());
      InFlight f;
      int budget = options_.model.max_batch_tokens;
      for (Seq* sp : groups[g]) {
        Seq& s = *sp;
        if (s.done || budget == 0) continue;
        if (static_cast<int>(f.sampled.size()) >= options_.model.max_batch_seqs) break;
        TP_RETURN_IF_ERROR(plan_seq(s, plan, f, budget));
      }
      if (plan.seqs_size() == 0) continue;
      progress = true;
      finished_ids.clear();

      f.start = std::chrono::steady_clock::now();
      const bool record = std::any_of(f.sampled.begin(), f.sampled.end(),
                                      [](Seq* s) { return s->req->record_logits; });
      std::vector<std::vector<float>> logits;
      TP_ASSIGN_OR_RETURN(f.result, runner_->Run(plan, record ? &logits : nullptr));
      if (last_stage && !f.sampled.empty()) {
        f.ids.assign(f.result.token_ids().begin(), f.result.token_ids().end());
        for (size_t i = 0; i < f.sampled.size() && record; ++i) {
          if (f.sampled[i]->req->record_logits) {
            f.sampled[i]->result.step_logits.push_back(std::move(logits.at(i)));
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
  runner_->Forget(finished_ids);
  std::vector<GenerateResult> results;
  for (Seq& s : seqs) results.push_back(std::move(s.result));
  return results;
}

}  // namespace tpserve
