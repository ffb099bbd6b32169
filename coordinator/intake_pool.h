// IntakePool: a few low-priority threads that do the CPU-heavy part of a request's intake
// (tokenizing a long prompt) off the RPC threads, behind a bounded queue, so that a burst of
// long prompts neither blocks the RPC threads nor holds the CPU against short requests.
#pragma once

#include <chrono>
#include <deque>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace tpserve {

class IntakePool {
 public:
  using Clock = std::chrono::steady_clock;
  // A task runs exactly once: with OK on a pool thread, or with DEADLINE_EXCEEDED (its deadline
  // passed while it waited) or UNAVAILABLE (the pool is shutting down), then it must only
  // answer its caller without doing the work.
  using Task = absl::AnyInvocable<void(absl::Status) &&>;

  // `threads` >= 1 run at a lower CPU priority (nice + 10) than the RPC and scheduler threads;
  // at most `max_queued` tasks wait for one.
  IntakePool(int threads, int max_queued);
  // Shutdown().
  ~IntakePool();

  // Queues `task`; RESOURCE_EXHAUSTED (and `task` is dropped unrun) when `max_queued` tasks
  // wait already, UNAVAILABLE after Shutdown.
  absl::Status Post(Clock::time_point deadline, Task task);

  // Runs every task still queued with UNAVAILABLE, waits for the running ones, joins the
  // threads. Idempotent.
  void Shutdown();

  int threads() const { return static_cast<int>(threads_.size()); }
  int max_queued() const { return max_queued_; }

 private:
  struct Item {
    Clock::time_point deadline;
    Task task;
  };
  void Loop();

  const int max_queued_;
  absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace tpserve
