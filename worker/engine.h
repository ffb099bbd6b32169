// The in-process engine: one process runs the whole model (one rank, or this rank of a
// multi-process group whose other ranks run the same Engine calls in lockstep) with a simple
// batch loop: chunked prefill, then decode of every running sequence together. Each step is a
// worker::StepPlan run by the ShardRunner, exactly as a worker process runs the coordinator's
// plans. `tpserve run`, the engine benchmark and the end-to-end tests use it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/shard_plan.h"
#include "worker/model.h"
#include "worker/shard_runner.h"

namespace tpserve {

class ModelFiles;

// The shard's options (block size, KV cache size, batch limits, CUDA graphs) and the layout.
struct EngineOptions : ShardRunnerOptions {
  std::string device = "cpu";  // "cpu", "cuda" or "auto" (cuda when a GPU is present)
  // Parallel layout; the defaults are one rank. For several ranks the caller passes the
  // communicators of this rank (see ParallelContext) and every rank calls the same methods.
  int tp = 1;
  int pp = 1;
  int rank = 0;
  std::string device_map;
  ParallelContext comms;
  Ops* ops = nullptr;  // optional: use these ops instead of creating them from `device`
  // Micro-batches in flight through the pipeline stages (pp > 1): 0 means pp. At most as many
  // as the pp communicator buffers small sends (Communicator::buffered_small_sends: MPI many,
  // the custom p2p kernels 2, NCCL none: the stages take turns).
  int pp_micro_batches = 0;
};

struct GenerateRequest {
  std::vector<int32_t> prompt;
  int max_new_tokens = 16;
  // Validated with ValidateSampling; position is filled in per token; logprobs >= 0 asks for
  // them; repetition_penalty applies over the prompt and the output so far.
  SamplingParams sampling;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's EOS ids
  bool record_logits = false;           // keep the logits of every sampled step (tests)
};

struct GenerateResult {
  std::vector<int32_t> output_ids;
  std::string finish_reason;  // "length" or "stop"
  // With sampling.logprobs >= 0 (on the last stage's ranks): one per output id, the token's
  // log-probability under the raw distribution and the top sampling.logprobs alternatives.
  std::vector<TokenLogprobs> logprobs;
  std::vector<std::vector<float>> step_logits;  // [steps][vocab] when record_logits
  // Wall time (ms) of each engine step that sampled a token of this sequence, sampling
  // included; the first is the prefill (time to first token when alone).
  std::vector<double> step_ms;
  // Tokens in the forward pass of each of those steps (all sequences of the batch): a step of
  // a decode-only batch of B sequences has B; prefill chunks make it larger.
  std::vector<int> step_tokens;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const std::string& model_dir,
                                                        const EngineOptions& options);
  ~Engine();

  const ModelConfig& config() const;
  const GenerationConfig& generation_config() const;
  Ops* ops() const { return ops_; }
  const LlamaModel& model() const { return runner_->model(); }
  ShardRunner& runner() { return *runner_; }
  int64_t kv_capacity_tokens() const;

  // Runs all requests together (continuous batch of prefill then decode) to completion.
  // Only the last stage's ranks return results; other ranks return empty results.
  absl::StatusOr<std::vector<GenerateResult>> Generate(const std::vector<GenerateRequest>& reqs);

  // Logits [prompt.size()][vocab] of every prompt position after one prefill (tests).
  absl::StatusOr<std::vector<std::vector<float>>> PromptLogits(const std::vector<int32_t>& prompt);

  // One eager forward (no CUDA graph) over `meta` with block tables already filled; returns
  // host f32 logits [logits_rows][vocab] on the last stage (empty elsewhere). For tests and
  // benchmarks (the op profile times these).
  absl::StatusOr<std::vector<std::vector<float>>> ForwardLogits(const BatchMeta& meta);
  absl::StatusOr<Tensor> Forward(const BatchMeta& meta);

 private:
  Engine() = default;
  struct Seq;

  std::unique_ptr<ModelFiles> files_;
  std::unique_ptr<Ops> owned_ops_;
  Ops* ops_ = nullptr;
  std::unique_ptr<Communicator> single_tp_, single_pp_;
  ShardPlan plan_;
  EngineOptions options_;
  std::unique_ptr<ShardRunner> runner_;
  uint64_t next_seq_id_ = 1;
};

// The device `options.device` names, resolved: "auto" becomes "cuda" when a GPU is present.
std::string ResolveDevice(const std::string& device);
// The device an engine for a model of head dimension `head_dim` runs on: ResolveDevice(device),
// except that "auto" stays on the CPU when the CUDA attention kernels lack that head size.
std::string ResolveModelDevice(const std::string& device, int head_dim);
// Creates ops for "cpu" or "cuda" (error when CUDA is not built in or no GPU is present).
absl::StatusOr<std::unique_ptr<Ops>> MakeOps(const std::string& device, int gpu_index = 0);

}  // namespace tpserve
