// The delivery thread (see delivery.h).
#include "coordinator/delivery.h"

#include "coordinator/thread_cpu.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace tpserve {

DeliveryQueue::DeliveryQueue() : thread_([this] { Loop(); }) {}

DeliveryQueue::~DeliveryQueue() { Stop(); }

void DeliveryQueue::Push(std::vector<Delivery>& batch) {
  if (batch.empty()) return;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!stop_) {
      if (queue_.empty()) {
        queue_.swap(batch);
      } else {
        for (Delivery& d : batch) queue_.push_back(std::move(d));
        batch.clear();
      }
      lock.unlock();
      cv_.notify_one();
      return;
    }
  }
  // Stopped (the scheduler's destructor fails what is left): deliver here.
  for (Delivery& d : batch) Deliver(d);
  batch.clear();
}

bool DeliveryQueue::Idle() {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.empty() && !busy_;
}

bool DeliveryQueue::WaitIdle(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_cv_.wait_until(lock, deadline, [&] { return queue_.empty() && !busy_; });
}

void DeliveryQueue::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

double DeliveryQueue::cpu_seconds() {
  std::lock_guard<std::mutex> lock(mu_);
  return cpu_seconds_;
}

void DeliveryQueue::Deliver(Delivery& d) {
  std::string text = std::move(d.text);
  if (d.decoder != nullptr) {
    if (d.id >= 0) text += d.decoder->Add(d.id);
    if (d.complete) text += d.decoder->Finish();
  }
  if (d.id >= 0 || !text.empty()) {
    d.request->Emit(text, d.id, d.logprobs ? &*d.logprobs : nullptr);
  }
  if (d.complete) d.request->Complete(std::move(d.status), d.info);
}

void DeliveryQueue::Loop() {
  std::vector<Delivery> batch;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      busy_ = false;
      if (queue_.empty()) idle_cv_.notify_all();
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped with nothing left
      batch.swap(queue_);
      busy_ = true;
    }
    const double start = ThreadCpuSeconds();
    for (Delivery& d : batch) Deliver(d);
    // Drop the references (requests, decoders) here, not under the lock.
    batch.clear();
    const double spent = ThreadCpuSeconds() - start;
    std::lock_guard<std::mutex> lock(mu_);
    cpu_seconds_ += spent;
  }
}

}  // namespace tpserve
