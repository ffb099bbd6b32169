// IntakePool (see intake_pool.h).
#include "coordinator/intake_pool.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"

namespace tpserve {

IntakePool::IntakePool(int threads, int max_queued) : max_queued_(std::max(0, max_queued)) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Loop(); });
}

IntakePool::~IntakePool() { Shutdown(); }

absl::Status IntakePool::Post(Clock::time_point deadline, Task task) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (static_cast<int>(queue_.size()) >= max_queued_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("too many long prompts are waiting to be tokenized (", queue_.size(),
                     " of at most ", max_queued_, "); retry later"));
  }
  queue_.push_back(Item{deadline, std::move(task)});
  return absl::OkStatus();
}

void IntakePool::Shutdown() {
  std::deque<Item> left;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
    left.swap(queue_);
  }
  for (Item& item : left) {
    std::move(item.task)(absl::UnavailableError("the server is shutting down"));
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  absl::MutexLock lock(&mu_);
  threads_.clear();
}

void IntakePool::Loop() {
  // Below the RPC threads and the scheduler: a short request's intake and the running batch
  // come first; long prompts use the CPU that is left. (Raising one's own nice value needs no
  // privilege; failing to is harmless.)
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);
  while (true) {
    Item item;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](IntakePool* p)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->stopping_ || !p->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping, nothing left
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    if (Clock::now() >= item.deadline) {
      std::move(item.task)(
          absl::DeadlineExceededError("the deadline passed while the prompt waited to be "
                                      "tokenized"));
    } else {
      std::move(item.task)(absl::OkStatus());
    }
  }
}

}  // namespace tpserve
