// The public gRPC service (see inference_service.h).
#include "coordinator/inference_service.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/logging.h"
#include "common/sampling.h"
#include "common/status.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace tpserve {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

namespace {

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

absl::Status NoTokenizer() {
  return absl::FailedPreconditionError("the model directory has no tokenizer.json");
}

uint64_t RandomSeed() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  return rng();
}

v1::FinishReason ToProto(Finish reason) {
  switch (reason) {
    case Finish::kLength:
      return v1::FINISH_REASON_LENGTH;
    case Finish::kStop:
      return v1::FINISH_REASON_STOP;
    default:
      return v1::FINISH_REASON_UNSPECIFIED;
  }
}

// The response's logprobs, one per id (ids and logprobs come from the same request state),
// with each token's own text when there is a tokenizer (Decode is always valid UTF-8).
void FillLogprobs(const std::vector<int32_t>& ids, const std::vector<TokenLogprobs>& logprobs,
                  const Tokenizer* tokenizer, v1::GenerateResponse* r) {
  auto text = [tokenizer](int32_t id) {
    return tokenizer != nullptr ? tokenizer->Decode({id}, /*skip_special_tokens=*/false)
                                : std::string();
  };
  for (size_t i = 0; i < logprobs.size() && i < ids.size(); ++i) {
    v1::TokenLogprobs* t = r->add_logprobs();
    t->set_token_id(ids[i]);
    t->set_logprob(logprobs[i].logprob);
    t->set_text(text(ids[i]));
    for (const TokenLogprob& alt : logprobs[i].top) {
      v1::TokenLogprob* a = t->add_top_logprobs();
      a->set_token_id(alt.id);
      a->set_logprob(alt.logprob);
      a->set_text(text(alt.id));
    }
  }
}

// The longest prompt a request could have and be served: --max-prompt-tokens, and room for one
// output token in the context and in the KV cache. Text is tokenized only that far.
struct PromptBound {
  int64_t tokens;
  std::string why;
};
PromptBound MaxPromptTokens(const ServiceLimits& limits) {
  PromptBound b{
      limits.context_length - 1,
      absl::StrCat("at most ", limits.context_length - 1, " fit the model's context length of ",
                   limits.context_length, " tokens with room for one output token")};
  if (limits.kv_capacity_tokens > 0 && limits.kv_capacity_tokens - 1 < b.tokens) {
    b = {limits.kv_capacity_tokens - 1,
         absl::StrCat("at most ", limits.kv_capacity_tokens - 1, " fit the KV cache's capacity of ",
                      limits.kv_capacity_tokens, " tokens with room for one output token")};
  }
  if (limits.max_prompt_tokens > 0 && limits.max_prompt_tokens <= b.tokens) {
    b = {limits.max_prompt_tokens,
         absl::StrCat("at most ", limits.max_prompt_tokens, " are accepted (--max-prompt-tokens)")};
  }
  b.tokens = std::max<int64_t>(b.tokens, 0);
  return b;
}

void FillFinal(const std::string& request_id, const FinalInfo& info, v1::GenerateResponse* r) {
  r->set_request_id(request_id);
  r->set_finished(true);
  r->set_finish_reason(ToProto(info.reason));
  r->set_prompt_tokens(info.prompt_tokens);
  r->set_output_tokens(info.output_tokens);
  r->mutable_timings()->set_queued_seconds(info.queued_s);
  r->mutable_timings()->set_time_to_first_token_seconds(info.ttft_s);
  r->mutable_timings()->set_total_seconds(info.total_s);
}

// What both Generate reactors share. Each is created before its request is admitted (its
// prompt may be tokenized on an intake thread): until Attach, a cancel only marks it, because
// the call's request must live until the intake has read it. Kept alive until gRPC's OnDone.
template <typename Self, typename GrpcReactor>
class AdmittedReactor : public GrpcReactor, public RequestListener {
 public:
  // The admitted request (or why it was not admitted); called once.
  void Attach(absl::StatusOr<std::shared_ptr<RequestState>> state, Scheduler* scheduler) {
    std::unique_lock<std::mutex> lock(mu_);
    attached_ = true;
    if (!state.ok()) {
      finish_called_ = true;
      lock.unlock();
      this->Finish(ToGrpc(state.status()));
      return;
    }
    state_ = *state;
    scheduler_ = scheduler;
    if (cancelled_) {
      finish_called_ = true;
      lock.unlock();
      state_->Cancel();
      scheduler_->Wake();
      FinishCancelled();
      return;
    }
    lock.unlock();
    state_->SetListener(weak_self_);  // not self_: OnDone may be clearing it
    OnRequestUpdate();                // it may already be over
  }

  bool cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }

  void OnCancel() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      if (!attached_ || state_ == nullptr) return;  // Attach answers, or it has answered
    }
    state_->Cancel();
    scheduler_->Wake();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finish_called_ || WriteInFlight()) return;
      finish_called_ = true;
    }
    FinishCancelled();
  }

  void OnDone() override {
    std::shared_ptr<Self> self = std::move(self_);  // may delete this on return
  }

 protected:
  // Takes `r` (just made) and keeps it alive until OnDone.
  static std::shared_ptr<Self> Track(Self* r) {
    std::shared_ptr<Self> p(r);
    p->self_ = p;
    p->weak_self_ = p;
    return p;
  }
  void FinishCancelled() {
    this->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the request was cancelled"));
  }
  // With mu_ held: a write is in flight, and its completion finishes a cancelled call.
  virtual bool WriteInFlight() const { return false; }

  // Set once by Attach (under mu_), read-only afterwards.
  std::shared_ptr<RequestState> state_;
  Scheduler* scheduler_ = nullptr;
  std::mutex mu_;
  bool attached_ = false;
  bool cancelled_ = false;
  bool finish_called_ = false;

 private:
  std::shared_ptr<Self> self_;  // until OnDone
  std::weak_ptr<Self> weak_self_;
};

// Answers a unary Generate once the request finishes (or is cancelled).
class UnaryGenerateReactor final
    : public AdmittedReactor<UnaryGenerateReactor, grpc::ServerUnaryReactor> {
 public:
  static std::shared_ptr<UnaryGenerateReactor> Create(const Tokenizer* tokenizer,
                                                      v1::GenerateResponse* response) {
    return Track(new UnaryGenerateReactor(tokenizer, response));
  }

  void OnRequestUpdate() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (finish_called_) return;
    RequestState::Taken t = state_->Take();
    if (!t.finished) return;
    finish_called_ = true;
    if (t.status.ok()) {
      std::string text;
      std::vector<int32_t> ids;
      std::vector<TokenLogprobs> logprobs;
      state_->Whole(&text, &ids, &logprobs);
      response_->set_text(text);
      response_->mutable_token_ids()->Assign(ids.begin(), ids.end());
      FillLogprobs(ids, logprobs, tokenizer_, response_);
      FillFinal(state_->params().request_id, t.info, response_);
    }
    lock.unlock();
    Finish(ToGrpc(t.status));
  }

 private:
  UnaryGenerateReactor(const Tokenizer* tokenizer, v1::GenerateResponse* response)
      : tokenizer_(tokenizer), response_(response) {}

  const Tokenizer* tokenizer_;
  v1::GenerateResponse* response_;
};

// Streams deltas as the scheduler produces them; one write in flight, deltas coalesce. Like the
// unary reactor, it exists before its request is admitted and answers nothing until Attach.
class StreamGenerateReactor final
    : public AdmittedReactor<StreamGenerateReactor,
                             grpc::ServerWriteReactor<v1::GenerateResponse>> {
 public:
  static std::shared_ptr<StreamGenerateReactor> Create(const Tokenizer* tokenizer) {
    return Track(new StreamGenerateReactor(tokenizer));
  }

  void OnRequestUpdate() override { Pump(); }

  void OnWriteDone(bool ok) override {
    bool finish_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      if (!ok || cancelled_) {
        if (!finish_called_) {
          finish_called_ = true;
          finish_now = true;
        }
      }
    }
    if (finish_now) {
      state_->Cancel();
      scheduler_->Wake();
      FinishCancelled();
      return;
    }
    Pump();
  }

 private:
  explicit StreamGenerateReactor(const Tokenizer* tokenizer) : tokenizer_(tokenizer) {}

  bool WriteInFlight() const override { return writing_; }  // OnWriteDone finishes

  void Pump() {
    std::unique_lock<std::mutex> lock(mu_);
    if (writing_ || finish_called_ || cancelled_) return;
    RequestState::Taken t = state_->Take();
    if (t.finished && !t.status.ok()) {
      finish_called_ = true;
      lock.unlock();
      Finish(ToGrpc(t.status));
      return;
    }
    if (!t.finished && t.text.empty() && t.ids.empty()) return;
    response_.Clear();
    response_.set_request_id(state_->params().request_id);
    response_.set_text(std::move(t.text));
    response_.mutable_token_ids()->Assign(t.ids.begin(), t.ids.end());
    FillLogprobs(t.ids, t.logprobs, tokenizer_, &response_);
    writing_ = true;
    if (t.finished) {
      FillFinal(state_->params().request_id, t.info, &response_);
      finish_called_ = true;
      lock.unlock();
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
    lock.unlock();
    StartWrite(&response_);
  }

  const Tokenizer* tokenizer_;
  v1::GenerateResponse response_;
  bool writing_ = false;
};

}  // namespace

absl::StatusOr<RequestParams> ValidateGenerateRequest(const v1::GenerateRequest& request,
                                                      const Tokenizer* tokenizer,
                                                      const ServiceLimits& limits,
                                                      const ChatPromptRenderer& chat) {
  RequestParams p;
  if (request.request_id().size() > 256) {
    return Invalid(absl::StrCat("request_id is ", request.request_id().size(),
                                " bytes long; at most 256 are allowed"));
  }
  p.request_id = request.request_id();
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText: {
      const std::string& text = request.text();
      if (text.empty()) return Invalid("prompt.text is empty");
      if (static_cast<int64_t>(text.size()) > limits.max_prompt_text_bytes) {
        return Invalid(absl::StrCat("prompt.text is ", text.size(), " bytes; at most ",
                                    limits.max_prompt_text_bytes,
                                    " are accepted (--max-prompt-tokens, --max-request-bytes)"));
      }
      if (tokenizer == nullptr) {
        return Invalid(
            "prompt.text: the model directory has no tokenizer.json; send prompt.token_ids");
      }
      const PromptBound bound = MaxPromptTokens(limits);
      p.prompt = tokenizer->Encode(text, /*add_special_tokens=*/true, bound.tokens);
      if (p.prompt.empty()) return Invalid("prompt.text encodes to no tokens");
      if (static_cast<int64_t>(p.prompt.size()) > bound.tokens) {
        return Invalid(absl::StrCat("prompt.text encodes to more than ", bound.tokens, " tokens; ",
                                    bound.why));
      }
      break;
    }
    case v1::GenerateRequest::kTokenIds: {
      const auto& ids = request.token_ids().ids();
      if (ids.empty()) return Invalid("prompt.token_ids is empty");
      if (limits.max_prompt_tokens > 0 && ids.size() > limits.max_prompt_tokens) {
        return Invalid(absl::StrCat("prompt.token_ids has ", ids.size(), " ids; at most ",
                                    limits.max_prompt_tokens,
                                    " are accepted (--max-prompt-tokens)"));
      }
      for (int i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] >= limits.vocab_size) {
          return Invalid(absl::StrCat("prompt.token_ids[", i, "] = ", ids[i],
                                      " is outside the vocabulary [0, ", limits.vocab_size, ")"));
        }
      }
      p.prompt.assign(ids.begin(), ids.end());
      break;
    }
    case v1::GenerateRequest::kMessages: {
      const auto& messages = request.messages().messages();
      if (messages.empty()) return Invalid("prompt.messages is empty");
      if (!chat) {
        return Invalid(
            "prompt.messages: this model has no chat template (tokenizer_config.json has no "
            "chat_template); send prompt.text or prompt.token_ids");
      }
      if (tokenizer == nullptr) {
        return Invalid("prompt.messages: the model directory has no tokenizer.json");
      }
      std::vector<ChatMessage> m;
      int64_t bytes = 0;
      for (const v1::ChatMessage& x : messages) {
        bytes += static_cast<int64_t>(x.content().size());
        m.push_back({x.role(), x.content()});
      }
      if (bytes > limits.max_prompt_text_bytes) {
        return Invalid(absl::StrCat("prompt.messages hold ", bytes, " bytes; at most ",
                                    limits.max_prompt_text_bytes, " are accepted"));
      }
      absl::StatusOr<std::string> text = chat(m, /*add_generation_prompt=*/true);
      if (!text.ok()) {
        return Invalid(
            absl::StrCat("prompt.messages: the chat template failed: ", text.status().message()));
      }
      // The template writes the BOS and the other special tokens itself.
      const PromptBound bound = MaxPromptTokens(limits);
      p.prompt = tokenizer->Encode(*text, /*add_special_tokens=*/false, bound.tokens);
      if (p.prompt.empty()) return Invalid("prompt.messages render to no tokens");
      if (static_cast<int64_t>(p.prompt.size()) > bound.tokens) {
        return Invalid(absl::StrCat("prompt.messages render to more than ", bound.tokens,
                                    " tokens; ", bound.why));
      }
      break;
    }
    default:
      return Invalid("prompt: set prompt.text, prompt.token_ids or prompt.messages");
  }
  const int64_t prompt_len = static_cast<int64_t>(p.prompt.size());

  const v1::SamplingOptions& s = request.sampling();
  SamplingParams sampling;  // the API's unset fields keep the defaults (greedy, all off)
  if (s.has_temperature()) sampling.temperature = s.temperature();
  if (s.has_top_p()) sampling.top_p = s.top_p();
  if (s.has_top_k()) sampling.top_k = s.top_k();
  if (s.has_repetition_penalty()) sampling.repetition_penalty = s.repetition_penalty();
  if (s.has_logprobs()) {
    // Internally -1 means "none"; a set API field must be in range, -1 included.
    if (s.logprobs() == -1) {
      return Invalid(absl::StrCat("sampling.logprobs must be in [0, ", kMaxLogprobs, "] (got -1)"));
    }
    sampling.logprobs = s.logprobs();
  }
  TP_RETURN_IF_ERROR(ValidateSampling(sampling, "sampling."));
  p.temperature = sampling.temperature;
  p.top_p = sampling.top_p;
  p.top_k = sampling.top_k;
  p.repetition_penalty = sampling.repetition_penalty;
  p.logprobs = sampling.logprobs;
  p.seed = s.has_seed() ? s.seed() : (IsGreedy(p.temperature) ? 0 : RandomSeed());

  const v1::StoppingOptions& st = request.stopping();
  if (prompt_len >= limits.context_length) {
    return Invalid(absl::StrCat("the prompt has ", prompt_len,
                                " tokens but the model's context length is ", limits.context_length,
                                " tokens (room for at least one output "
                                "token is needed)"));
  }
  if (st.has_max_new_tokens()) {
    if (st.max_new_tokens() < 1) {
      return Invalid(
          absl::StrCat("stopping.max_new_tokens must be >= 1 (got ", st.max_new_tokens(), ")"));
    }
    if (prompt_len + st.max_new_tokens() > limits.context_length) {
      return Invalid(
          absl::StrCat("the prompt has ", prompt_len, " tokens and stopping.max_new_tokens is ",
                       st.max_new_tokens(), ": ", prompt_len + st.max_new_tokens(),
                       " tokens exceed the model's context length of ", limits.context_length));
    }
    p.max_new_tokens = st.max_new_tokens();
  } else {
    int64_t room = limits.context_length - prompt_len;
    if (limits.kv_capacity_tokens > 0)
      room = std::min(room, limits.kv_capacity_tokens - prompt_len);
    p.max_new_tokens = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>(limits.default_max_new_tokens, room)));
  }
  if (limits.kv_capacity_tokens > 0 && prompt_len + p.max_new_tokens > limits.kv_capacity_tokens) {
    return Invalid(absl::StrCat("the prompt has ", prompt_len, " tokens and max_new_tokens is ",
                                p.max_new_tokens, ": ", prompt_len + p.max_new_tokens,
                                " tokens exceed the KV cache capacity of ",
                                limits.kv_capacity_tokens, " tokens"));
  }
  if (st.stop_size() > limits.max_stop_strings) {
    return Invalid(absl::StrCat("stopping.stop has ", st.stop_size(), " strings; at most ",
                                limits.max_stop_strings));
  }
  for (int i = 0; i < st.stop_size(); ++i) {
    if (st.stop(i).empty()) return Invalid(absl::StrCat("stopping.stop[", i, "] is empty"));
    if (static_cast<int>(st.stop(i).size()) > limits.max_stop_string_bytes) {
      return Invalid(absl::StrCat("stopping.stop[", i, "] is ", st.stop(i).size(),
                                  " bytes; at most ", limits.max_stop_string_bytes));
    }
    p.stop.push_back(st.stop(i));
  }
  if (!p.stop.empty() && tokenizer == nullptr) {
    return Invalid("stopping.stop needs text, but the model directory has no tokenizer.json");
  }
  for (int i = 0; i < st.stop_token_ids_size(); ++i) {
    const int32_t id = st.stop_token_ids(i);
    if (id < 0 || id >= limits.vocab_size) {
      return Invalid(absl::StrCat("stopping.stop_token_ids[", i, "] = ", id,
                                  " is outside the vocabulary [0, ", limits.vocab_size, ")"));
    }
    p.stop_token_ids.push_back(id);
  }
  p.ignore_eos = st.ignore_eos();
  if (request.cache_salt().size() > 256) {
    return Invalid(absl::StrCat("cache_salt is ", request.cache_salt().size(),
                                " bytes long; at most 256 are allowed"));
  }
  p.cache_salt = request.cache_salt();
  return p;
}

void InferenceService::Activate(Scheduler* scheduler, ServiceLimits limits, v1::ModelInfo info) {
  limits_ = limits;
  info_ = std::move(info);
  scheduler_.store(scheduler, std::memory_order_release);
}

void InferenceService::SetWorkerGroupStatus(const v1::WorkerGroupStatus& status) {
  absl::MutexLock lock(&group_mu_);
  group_status_ = status;
}

namespace {
absl::Status NotReady() {
  return absl::UnavailableError("the server is starting: the workers are loading the model");
}
}  // namespace

namespace {
// The bytes of text that admitting `request` tokenizes (none for token ids).
int64_t PromptTextBytes(const v1::GenerateRequest& request) {
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText:
      return static_cast<int64_t>(request.text().size());
    case v1::GenerateRequest::kMessages: {
      int64_t bytes = 0;
      for (const v1::ChatMessage& m : request.messages().messages()) {
        bytes += static_cast<int64_t>(m.content().size() + m.role().size());
      }
      return bytes;
    }
    default:
      return 0;
  }
}

int DefaultIntakeThreads() {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores / 4, 1, 4);
}
}  // namespace

InferenceService::InferenceService(const Tokenizer* tokenizer, ChatPromptRenderer chat,
                                   IntakeOptions intake)
    : tokenizer_(tokenizer),
      chat_(std::move(chat)),
      intake_(intake),
      pool_(intake.threads > 0 ? intake.threads : DefaultIntakeThreads(), intake.max_queued) {}

InferenceService::~InferenceService() { pool_.Shutdown(); }

void InferenceService::Shutdown() { pool_.Shutdown(); }

absl::StatusOr<std::shared_ptr<RequestState>> InferenceService::SubmitNow(
    const v1::GenerateRequest& request, Clock::time_point deadline) {
  Scheduler* scheduler = scheduler_.load(std::memory_order_acquire);
  if (scheduler == nullptr) return NotReady();
  absl::StatusOr<RequestParams> params =
      ValidateGenerateRequest(request, tokenizer_, limits_, chat_);
  if (!params.ok()) return params.status();
  if (params->request_id.empty()) {
    params->request_id = absl::StrCat("req-", next_request_.fetch_add(1));
  }
  params->deadline = deadline;
  auto state = std::make_shared<RequestState>(std::move(*params));
  absl::Status submitted = scheduler->Submit(state);
  if (!submitted.ok()) return submitted;
  return state;
}

void InferenceService::SubmitAsync(const v1::GenerateRequest& request, Clock::time_point deadline,
                                   std::function<bool()> cancelled, SubmitDone done) {
  if (scheduler_.load(std::memory_order_acquire) == nullptr) return done(NotReady());
  // A short prompt is tokenized here at once (a few ms at most), and one too long to be
  // accepted is refused here by its length alone; a long one waits for an intake thread, so
  // that it holds neither an RPC thread nor the CPU against the short ones.
  const int64_t bytes = PromptTextBytes(request);
  if (bytes <= intake_.inline_bytes || bytes > limits_.max_prompt_text_bytes) {
    return done(SubmitNow(request, deadline));
  }
  auto task = [this, &request, deadline, cancelled = std::move(cancelled),
               done](absl::Status status) {
    if (status.ok() && cancelled && cancelled()) {
      status = absl::CancelledError("the request was cancelled");
    }
    if (!status.ok()) return done(status);
    done(SubmitNow(request, deadline));
  };
  if (absl::Status posted = pool_.Post(deadline, std::move(task)); !posted.ok()) done(posted);
}

absl::StatusOr<std::shared_ptr<RequestState>> InferenceService::Submit(
    const v1::GenerateRequest& request, Clock::time_point deadline) {
  absl::StatusOr<std::shared_ptr<RequestState>> result;
  absl::Notification answered;
  SubmitAsync(request, deadline, nullptr, [&](absl::StatusOr<std::shared_ptr<RequestState>> state) {
    result = std::move(state);
    answered.Notify();
  });
  // Bounded: the intake answers every request it took (one prompt of at most
  // max_prompt_text_bytes each, or UNAVAILABLE when it shuts down).
  answered.WaitForNotification();
  return result;
}

absl::StatusOr<std::vector<int32_t>> InferenceService::EncodeText(const std::string& text,
                                                                  bool add_special_tokens) {
  if (tokenizer_ == nullptr) return NoTokenizer();
  if (static_cast<int64_t>(text.size()) <= intake_.inline_bytes) {
    return tokenizer_->Encode(text, add_special_tokens);
  }
  absl::StatusOr<std::vector<int32_t>> result;
  absl::Notification answered;
  absl::Status posted = pool_.Post(Clock::time_point::max(), [&](absl::Status status) {
    if (status.ok()) {
      result = tokenizer_->Encode(text, add_special_tokens);
    } else {
      result = status;
    }
    answered.Notify();
  });
  if (!posted.ok()) return posted;
  answered.WaitForNotification();  // bounded: one text, or UNAVAILABLE at shutdown
  return result;
}

absl::Status InferenceService::AuthorizeTokenizerCall(
    const grpc::CallbackServerContext* context) const {
  if (absl::Status auth = Authorize(context); !auth.ok()) return auth;
  return tokenizer_ == nullptr ? NoTokenizer() : absl::OkStatus();
}

absl::Status InferenceService::Authorize(const grpc::CallbackServerContext* context) const {
  if (!api_keys_.enabled()) return absl::OkStatus();
  const auto& md = context->client_metadata();
  const auto it = md.find("authorization");
  return api_keys_.Check(it == md.end() ? std::string_view()
                                        : std::string_view(it->second.data(), it->second.size()));
}

namespace {
// The call's gRPC deadline on the scheduler's clock (none: max).
Clock::time_point CallDeadline(const grpc::CallbackServerContext* context) {
  const auto grpc_deadline = context->deadline();
  if (grpc_deadline == std::chrono::system_clock::time_point::max()) {
    return Clock::time_point::max();
  }
  const auto left = grpc_deadline - std::chrono::system_clock::now();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(left);
}

class ErrorWriteReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  explicit ErrorWriteReactor(const absl::Status& status) { Finish(ToGrpc(status)); }
  void OnDone() override { delete this; }
};
}  // namespace

grpc::ServerUnaryReactor* InferenceService::Generate(grpc::CallbackServerContext* context,
                                                     const v1::GenerateRequest* request,
                                                     v1::GenerateResponse* response) {
  if (absl::Status auth = Authorize(context); !auth.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpc(auth));
    return reactor;
  }
  auto reactor = UnaryGenerateReactor::Create(tokenizer_, response);
  SubmitAsync(
      *request, CallDeadline(context), [reactor] { return reactor->cancelled(); },
      [this, reactor](absl::StatusOr<std::shared_ptr<RequestState>> state) {
        reactor->Attach(std::move(state), scheduler_.load(std::memory_order_acquire));
      });
  return reactor.get();
}

grpc::ServerWriteReactor<v1::GenerateResponse>* InferenceService::GenerateStream(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  if (absl::Status auth = Authorize(context); !auth.ok()) return new ErrorWriteReactor(auth);
  auto reactor = StreamGenerateReactor::Create(tokenizer_);
  SubmitAsync(
      *request, CallDeadline(context), [reactor] { return reactor->cancelled(); },
      [this, reactor](absl::StatusOr<std::shared_ptr<RequestState>> state) {
        reactor->Attach(std::move(state), scheduler_.load(std::memory_order_acquire));
      });
  return reactor.get();
}

grpc::ServerUnaryReactor* InferenceService::Tokenize(grpc::CallbackServerContext* context,
                                                     const v1::TokenizeRequest* request,
                                                     v1::TokenizeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status allowed = AuthorizeTokenizerCall(context); !allowed.ok()) {
    reactor->Finish(ToGrpc(allowed));
    return reactor;
  }
  if (static_cast<int64_t>(request->text().size()) > limits_.max_prompt_text_bytes) {
    reactor->Finish(ToGrpc(Invalid(absl::StrCat(
        "text is ", request->text().size(), " bytes; at most ", limits_.max_prompt_text_bytes))));
    return reactor;
  }
  auto encode = [this, reactor, request, response] {
    std::vector<int32_t> ids = tokenizer_->Encode(request->text(), request->add_special_tokens());
    response->mutable_token_ids()->Assign(ids.begin(), ids.end());
    reactor->Finish(grpc::Status::OK);
  };
  if (static_cast<int64_t>(request->text().size()) <= intake_.inline_bytes) {
    encode();
    return reactor;
  }
  // Long text: on an intake thread, like a long prompt (the call, and so `request`, lives
  // until Finish).
  absl::Status posted = pool_.Post(CallDeadline(context), [reactor, encode](absl::Status status) {
    if (!status.ok()) return reactor->Finish(ToGrpc(status));
    encode();
  });
  if (!posted.ok()) reactor->Finish(ToGrpc(posted));
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::Detokenize(grpc::CallbackServerContext* context,
                                                       const v1::DetokenizeRequest* request,
                                                       v1::DetokenizeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status allowed = AuthorizeTokenizerCall(context); !allowed.ok()) {
    reactor->Finish(ToGrpc(allowed));
    return reactor;
  }
  for (int i = 0; i < request->token_ids_size(); ++i) {
    const int32_t id = request->token_ids(i);
    if (id < 0 || id >= limits_.vocab_size) {
      reactor->Finish(ToGrpc(
          Invalid(absl::StrCat("token_ids[", i, "] = ", id, " is outside the vocabulary [0, ",
                               limits_.vocab_size, ")"))));
      return reactor;
    }
  }
  std::vector<int32_t> ids(request->token_ids().begin(), request->token_ids().end());
  response->set_text(tokenizer_->Decode(ids, request->skip_special_tokens()));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::GetModelInfo(grpc::CallbackServerContext* context,
                                                         const v1::GetModelInfoRequest* request,
                                                         v1::ModelInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status auth = Authorize(context); !auth.ok()) {
    reactor->Finish(ToGrpc(auth));
    return reactor;
  }
  Scheduler* scheduler = scheduler_.load(std::memory_order_acquire);
  if (scheduler == nullptr) {
    reactor->Finish(ToGrpc(NotReady()));
    return reactor;
  }
  *response = info_;
  {
    absl::MutexLock lock(&group_mu_);
    *response->mutable_worker_group() = group_status_;
  }
  const SchedulerStats s = scheduler->stats();
  v1::KvCacheStats* kv = response->mutable_kv();
  kv->set_block_size(scheduler->options().block_size);
  kv->set_total_blocks(s.total_blocks);
  kv->set_free_blocks(s.free_blocks);
  kv->set_running_sequences(s.running);
  kv->set_waiting_requests(s.waiting);
  kv->set_preemptions(s.preemptions);
  v1::StepStats* steps = response->mutable_steps();
  steps->set_steps(s.steps);
  steps->set_tokens(s.step_tokens);
  steps->set_step_seconds(s.step_seconds);
  steps->set_round_trip_seconds(s.execute_seconds);
  steps->set_forward_seconds(s.forward_seconds);
  v1::PrefixCacheStats* pc = response->mutable_prefix_cache();
  pc->set_enabled(s.prefix_caching);
  pc->set_queries(s.prefix_cache_queries);
  pc->set_hits(s.prefix_cache_hits);
  pc->set_hit_rate(s.prefix_cache_queries > 0 ? static_cast<double>(s.prefix_cache_hits) /
                                                    static_cast<double>(s.prefix_cache_queries)
                                              : 0.0);
  pc->set_cached_blocks(s.cached_blocks);
  pc->set_evictable_blocks(s.evictable_blocks);
  pc->set_evictions(s.prefix_cache_evictions);
  pc->set_computed_prompt_tokens(s.prompt_tokens_computed);
  steps->set_scheduler_cpu_seconds(s.cpu_seconds);
  steps->set_scheduler_plan_cpu_seconds(s.plan_cpu_seconds);
  steps->set_scheduler_send_cpu_seconds(s.send_cpu_seconds);
  steps->set_scheduler_apply_cpu_seconds(s.apply_cpu_seconds);
  steps->set_delivery_cpu_seconds(s.delivery_cpu_seconds);
  steps->set_sender_cpu_seconds(s.sender_cpu_seconds);
  steps->set_dropped_tokens(s.dropped_tokens);
  steps->set_overlap_scheduling(s.overlap);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::DropPrefixCache(
    grpc::CallbackServerContext* context, const v1::DropPrefixCacheRequest* request,
    v1::DropPrefixCacheResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status auth = Authorize(context); !auth.ok()) {
    reactor->Finish(ToGrpc(auth));
    return reactor;
  }
  Scheduler* scheduler = scheduler_.load(std::memory_order_acquire);
  if (scheduler == nullptr) {
    reactor->Finish(ToGrpc(NotReady()));
    return reactor;
  }
  if (request->cache_salt().size() > 256) {
    reactor->Finish(ToGrpc(Invalid(absl::StrCat("cache_salt is ", request->cache_salt().size(),
                                                " bytes long; at most 256 are allowed"))));
    return reactor;
  }
  if (request->all() && !request->cache_salt().empty()) {
    reactor->Finish(ToGrpc(Invalid("give cache_salt or all, not both")));
    return reactor;
  }
  // Answered from the scheduler thread once the blocks are forgotten.
  scheduler->DropPrefixCache(request->cache_salt(), request->all(),
                             [reactor, response](absl::StatusOr<int> dropped) {
                               if (dropped.ok()) response->set_dropped_blocks(*dropped);
                               reactor->Finish(ToGrpc(dropped.status()));
                             });
  return reactor;
}

}  // namespace tpserve
