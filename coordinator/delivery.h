// Delivery: the thread that turns the scheduler's sampled tokens into output, off the scheduler
// thread: it detokenizes (the requests whose stop decisions need no text), appends to each
// RequestState, wakes its listener (the gRPC reactor's write, the HTTP waiter) and completes
// requests, in exactly the order the scheduler handed the work over.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/logprobs.h"
#include "coordinator/request.h"

namespace tpserve {

class IncrementalDecoder;

// One piece of a request's output, in the scheduler's order.
struct Delivery {
  std::shared_ptr<RequestState> request;
  // Set when the delivery thread detokenizes this request (its decoder is used by that thread
  // only): `id`'s text is decoder->Add(id), and decoder->Finish() follows when `complete`.
  // Null: `text` is the text to send (the scheduler decoded it for its stop strings).
  std::shared_ptr<IncrementalDecoder> decoder;
  std::string text;
  int32_t id = -1;  // -1: no token (a completion alone)
  std::optional<TokenLogprobs> logprobs;
  bool complete = false;  // the request ends after this token with `status` and `info`
  absl::Status status;
  FinalInfo info;
};

class DeliveryQueue {
 public:
  DeliveryQueue();
  ~DeliveryQueue();  // Stop()

  // Hands over one step's deliveries (one lock, one wake-up); `batch` is left empty, its
  // memory kept for the next step.
  void Push(std::vector<Delivery>& batch);
  // True when everything pushed has been delivered.
  bool Idle();
  // Waits until Idle() or `deadline`; true when idle.
  bool WaitIdle(Clock::time_point deadline);
  // Delivers what is queued, then ends the thread. Later pushes are delivered at once on the
  // pushing thread.
  void Stop();
  // CPU time of the delivery thread so far.
  double cpu_seconds();

 private:
  void Loop();
  static void Deliver(Delivery& d);

  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::vector<Delivery> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // the thread is delivering a batch it took
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  double cpu_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace tpserve
