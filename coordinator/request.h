// One generation request as the scheduler sees it (validated parameters) and the state it
// shares with the RPC reactor that answers it: output deltas, the final status, cancellation.
// The scheduler thread writes; the reactor reads and is told through a Listener.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/logprobs.h"

namespace tpserve {

using Clock = std::chrono::steady_clock;

struct RequestParams {
  std::string request_id;
  std::vector<int32_t> prompt;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  float repetition_penalty = 1.0f;
  int32_t logprobs = -1;  // -1: none; N: each token's logprob and the top N alternatives
  int max_new_tokens = 16;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  Clock::time_point deadline = Clock::time_point::max();
  // Prefix caching: only requests with the same salt share cached KV blocks.
  std::string cache_salt;
};

enum class Finish { kNone, kLength, kStop };

// What the reactor needs at the end.
struct FinalInfo {
  Finish reason = Finish::kNone;
  int prompt_tokens = 0;
  int output_tokens = 0;
  double queued_s = 0, ttft_s = 0, total_s = 0;
};

class RequestListener {
 public:
  virtual ~RequestListener() = default;
  // Called (from the scheduler thread, or the thread that cancels) when there is new output or
  // the request finished. Must not block.
  virtual void OnRequestUpdate() = 0;
};

class RequestState {
 public:
  explicit RequestState(RequestParams params)
      : params_(std::move(params)), arrival_(Clock::now()) {}

  const RequestParams& params() const { return params_; }
  Clock::time_point arrival() const { return arrival_; }

  void SetListener(std::weak_ptr<RequestListener> listener) {
    std::lock_guard<std::mutex> lock(mu_);
    listener_ = std::move(listener);
  }

  // Scheduler side. `logprobs` (the token's, when the request asked) goes with `id`.
  void Emit(const std::string& text, int32_t id, const TokenLogprobs* logprobs = nullptr) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_text_ += text;
      full_text_ += text;
      if (id >= 0) {
        pending_ids_.push_back(id);
        all_ids_.push_back(id);
        if (logprobs != nullptr) {
          pending_logprobs_.push_back(*logprobs);
          all_logprobs_.push_back(*logprobs);
        }
      }
    }
    Notify();
  }
  void Complete(absl::Status status, const FinalInfo& info) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
      status_ = std::move(status);
      final_ = info;
    }
    finished_cv_.notify_all();
    Notify();
  }

  // Reactor side. Takes the output not yet taken; true when there is something to send.
  struct Taken {
    std::string text;
    std::vector<int32_t> ids;
    std::vector<TokenLogprobs> logprobs;  // aligned with ids when the request asked
    bool finished = false;
    absl::Status status;
    FinalInfo info;
  };
  Taken Take() {
    std::lock_guard<std::mutex> lock(mu_);
    Taken t;
    t.text.swap(pending_text_);
    t.ids.swap(pending_ids_);
    t.logprobs.swap(pending_logprobs_);
    t.finished = finished_;
    t.status = status_;
    t.info = final_;
    return t;
  }
  // The whole output so far (unary answers). `logprobs` may be null.
  void Whole(std::string* text, std::vector<int32_t>* ids,
             std::vector<TokenLogprobs>* logprobs = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    *text = full_text_;
    *ids = all_ids_;
    if (logprobs != nullptr) *logprobs = all_logprobs_;
  }
  bool finished() const {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_;
  }
  // Waits until Complete or `deadline`; true when finished (the coordinator's warm-up).
  bool WaitFinished(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return finished_cv_.wait_until(lock, deadline, [&] { return finished_; });
  }

  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  void Notify() {
    std::shared_ptr<RequestListener> l;
    {
      std::lock_guard<std::mutex> lock(mu_);
      l = listener_.lock();
    }
    if (l) l->OnRequestUpdate();
  }

  const RequestParams params_;
  const Clock::time_point arrival_;
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mu_;
  std::condition_variable finished_cv_;
  std::weak_ptr<RequestListener> listener_;
  std::string pending_text_, full_text_;
  std::vector<int32_t> pending_ids_, all_ids_;
  std::vector<TokenLogprobs> pending_logprobs_, all_logprobs_;
  bool finished_ = false;
  absl::Status status_;
  FinalInfo final_;
};

}  // namespace tpserve
