// The public gRPC service tpserve.v1.Inference (callback API): validates every request field,
// tokenizes, queues the request with the scheduler and answers from the reactor; reactors only
// move bytes, the scheduler thread owns the batch.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/model_config.h"
#include "coordinator/api_keys.h"
#include "coordinator/chat_template/chat_template.h"
#include "coordinator/intake_pool.h"
#include "coordinator/request.h"
#include "coordinator/scheduler.h"
#include "tpserve/v1/inference.grpc.pb.h"

namespace tpserve {

class Tokenizer;

struct ServiceLimits {
  int64_t context_length = 2048;
  int64_t vocab_size = 0;
  int64_t kv_capacity_tokens = 0;  // one sequence can never need more
  int default_max_new_tokens = 256;
  int max_stop_strings = 16;
  int max_stop_string_bytes = 256;
  // Text prompts longer than this are refused before they are tokenized (the server sets it
  // from --max-prompt-tokens and the longest token's bytes, capped by --max-request-bytes).
  int max_prompt_text_bytes = 1 << 22;
  int64_t max_prompt_tokens = 0;  // --max-prompt-tokens; 0: the context length
};

// Renders a conversation with the model's chat template (see coordinator/chat_template/).
using ChatPromptRenderer = std::function<absl::StatusOr<std::string>(
    const std::vector<ChatMessage>& messages, bool add_generation_prompt)>;

// Checks every field of `request` and turns it into scheduler parameters; INVALID_ARGUMENT
// naming the field otherwise. `tokenizer` may be null (then only token-id prompts work);
// `chat` may be empty (then messages prompts are refused).
absl::StatusOr<RequestParams> ValidateGenerateRequest(const v1::GenerateRequest& request,
                                                      const Tokenizer* tokenizer,
                                                      const ServiceLimits& limits,
                                                      const ChatPromptRenderer& chat = {});

// Where a request's prompt is tokenized: texts up to `inline_bytes` on the thread that
// submits it (an RPC or HTTP thread: a few ms), longer ones on the intake pool.
struct IntakeOptions {
  int threads = 0;                  // 0: a quarter of the cores, 1 to 4
  int max_queued = 16;              // long prompts waiting for a thread; more: RESOURCE_EXHAUSTED
  int64_t inline_bytes = 16 << 10;  // about 10 ms of tokenizing
};

class InferenceService final : public v1::Inference::CallbackService {
 public:
  // Until Activate, generation answers UNAVAILABLE (the workers are still loading).
  explicit InferenceService(const Tokenizer* tokenizer, ChatPromptRenderer chat = {},
                            IntakeOptions intake = {});
  ~InferenceService() override;
  // Every call needs one of `keys` in its `authorization: Bearer` metadata (set before the
  // server starts; none: no check).
  void SetApiKeys(ApiKeys keys) { api_keys_ = std::move(keys); }
  // `info` is the static part of GetModelInfo; the KV statistics come from the scheduler.
  void Activate(Scheduler* scheduler, ServiceLimits limits, v1::ModelInfo info);

  // The one path from a request to the scheduler, for the gRPC and the HTTP front ends alike:
  // UNAVAILABLE until Activate, validation (INVALID_ARGUMENT naming the field), a request id
  // when none is given, the queue (RESOURCE_EXHAUSTED when full, UNAVAILABLE when draining).
  // A long text prompt is tokenized on the intake pool (see IntakeOptions): RESOURCE_EXHAUSTED
  // when its queue is full, DEADLINE_EXCEEDED when `deadline` passes while it waits.
  // `done` is called once, with the admitted request or the error, before SubmitAsync returns
  // or later on an intake thread; `request` must stay valid until then. `cancelled` (may be
  // empty) lets a request whose caller left skip its tokenizing.
  using SubmitDone = std::function<void(absl::StatusOr<std::shared_ptr<RequestState>>)>;
  void SubmitAsync(const v1::GenerateRequest& request, Clock::time_point deadline,
                   std::function<bool()> cancelled, SubmitDone done);
  // Tokenizes `text` like Tokenizer::Encode, on the intake pool when it is long (waiting for
  // it): for the HTTP chat endpoint, which renders the conversation itself. RESOURCE_EXHAUSTED
  // when the pool's queue is full, FAILED_PRECONDITION without a tokenizer.
  absl::StatusOr<std::vector<int32_t>> EncodeText(const std::string& text, bool add_special_tokens);
  // SubmitAsync, waiting for the answer.
  absl::StatusOr<std::shared_ptr<RequestState>> Submit(const v1::GenerateRequest& request,
                                                       Clock::time_point deadline);
  // Answers the requests still waiting for the intake pool UNAVAILABLE and stops its threads
  // (after the servers stopped, before the scheduler goes).
  void Shutdown();
  // Null until Activate.
  Scheduler* scheduler() const { return scheduler_.load(std::memory_order_acquire); }
  const Tokenizer* tokenizer() const { return tokenizer_; }
  // Valid once scheduler() is not null.
  const ServiceLimits& limits() const { return limits_; }
  const v1::ModelInfo& static_info() const { return info_; }
  // The worker group's failures and restarts, reported by GetModelInfo (any thread).
  void SetWorkerGroupStatus(const v1::WorkerGroupStatus& status) ABSL_LOCKS_EXCLUDED(group_mu_);

  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext* context,
                                     const v1::GenerateRequest* request,
                                     v1::GenerateResponse* response) override;
  grpc::ServerWriteReactor<v1::GenerateResponse>* GenerateStream(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const v1::DetokenizeRequest* request,
                                       v1::DetokenizeResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* DropPrefixCache(grpc::CallbackServerContext* context,
                                            const v1::DropPrefixCacheRequest* request,
                                            v1::DropPrefixCacheResponse* response) override;

 private:
  // Validates, tokenizes and queues `request` on this thread.
  absl::StatusOr<std::shared_ptr<RequestState>> SubmitNow(const v1::GenerateRequest& request,
                                                          Clock::time_point deadline);

  // UNAUTHENTICATED unless the call carries a valid API key (when keys are set).
  absl::Status Authorize(const grpc::CallbackServerContext* context) const;
  // Authorize, then FAILED_PRECONDITION when the model has no tokenizer (Tokenize, Detokenize).
  absl::Status AuthorizeTokenizerCall(const grpc::CallbackServerContext* context) const;

  const Tokenizer* tokenizer_;
  const ChatPromptRenderer chat_;
  ApiKeys api_keys_;
  std::atomic<Scheduler*> scheduler_{nullptr};
  // Written once by Activate before scheduler_ is published.
  ServiceLimits limits_;
  v1::ModelInfo info_;
  absl::Mutex group_mu_;
  v1::WorkerGroupStatus group_status_ ABSL_GUARDED_BY(group_mu_);
  std::atomic<uint64_t> next_request_{1};
  const IntakeOptions intake_;
  IntakePool pool_;
};

// absl::Status -> grpc::Status (same code and message).
grpc::Status ToGrpc(const absl::Status& status);

}  // namespace tpserve
