// The pinned, double-buffered (ring of N) host-to-device uploader (see uploader.h).
#include "kernels/cuda/uploader.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "common/check.h"
#include "common/env.h"

namespace tpserve::cuda {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct CopyJob {
  char* dst;
  const char* src;
  size_t bytes;
};

// A fixed team of threads that run one list of memcpy jobs at a time; the caller works too.
class CopyTeam {
 public:
  explicit CopyTeam(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Loop(); });
  }
  ~CopyTeam() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    start_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Returns when every job is copied. `jobs` must outlive the call only.
  void Run(const std::vector<CopyJob>& jobs) {
    if (jobs.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_ = &jobs;
      next_.store(0);
      done_.store(0);
      ++generation_;
    }
    start_.notify_all();
    Work(jobs);
    std::unique_lock<std::mutex> lock(mu_);
    // A worker that picked up this list may still be inside Work: wait for it too, so that it
    // never touches the next list with this one's counters.
    finished_.wait(lock, [&] { return done_.load() == jobs.size() && active_ == 0; });
    jobs_ = nullptr;
  }

 private:
  void Loop() {
    uint64_t seen = 0;
    while (true) {
      const std::vector<CopyJob>* jobs = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        jobs = jobs_;
        if (jobs == nullptr) continue;
        ++active_;
      }
      Work(*jobs);
      {
        std::lock_guard<std::mutex> lock(mu_);
        --active_;
      }
      finished_.notify_all();
    }
  }

  void Work(const std::vector<CopyJob>& jobs) {
    for (size_t i = next_.fetch_add(1); i < jobs.size(); i = next_.fetch_add(1)) {
      std::memcpy(jobs[i].dst, jobs[i].src, jobs[i].bytes);
      if (done_.fetch_add(1) + 1 == jobs.size()) {
        std::lock_guard<std::mutex> lock(mu_);  // pairs with the wait in Run
        finished_.notify_all();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_, finished_;
  const std::vector<CopyJob>* jobs_ = nullptr;
  uint64_t generation_ = 0;
  int active_ = 0;
  bool stop_ = false;
  std::atomic<size_t> next_{0}, done_{0};
};

int DefaultThreads() {
  const int64_t n = EnvInt(env::kLoadThreads);
  if (n >= 1) return static_cast<int>(std::min<int64_t>(n, 64));
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(8, hw));
}

class PinnedUploader final : public DeviceUploader {
 public:
  PinnedUploader(int device, const UploaderOptions& o)
      : cap_(o.buffer_bytes),
        buffers_(std::max(2, o.num_buffers)),
        team_(o.threads > 0 ? o.threads : DefaultThreads()) {
    TP_CHECK(cap_ >= (size_t{1} << 20)) << "staging buffers of " << cap_ << " bytes";
    TP_CUDA_CHECK(cudaSetDevice(device));
    TP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    stats_.threads = team_.size();
  }

  ~PinnedUploader() override {
    cudaStreamSynchronize(stream_);
    for (Buffer& b : buffers_) {
      if (b.host != nullptr) cudaFreeHost(b.host);
      if (b.done != nullptr) cudaEventDestroy(b.done);
    }
    cudaStreamDestroy(stream_);
  }

  void Upload(void* dst, const void* src, size_t bytes) override {
    UploadRows(dst, src, 1, bytes, bytes);
  }

  void UploadRows(void* dst, const void* src, size_t rows, size_t row_bytes,
                  size_t src_pitch) override {
    if (row_bytes == src_pitch) {  // contiguous: one long row
      row_bytes *= rows;
      rows = 1;
    }
    char* d = static_cast<char*>(dst);
    for (size_t r = 0; r < rows; ++r) {
      const char* s = static_cast<const char*>(src) + r * src_pitch;
      size_t left = row_bytes;
      while (left > 0) {
        Acquire();
        const size_t n = std::min(left, cap_ - used_);
        Add(d, s, n);
        d += n;
        s += n;
        left -= n;
        if (used_ == cap_) Submit();
      }
    }
  }

  void Flush() override {
    Submit();
    const auto t = Clock::now();
    TP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    stats_.wait_s += SecondsSince(t);
    for (Buffer& b : buffers_) b.in_flight = false;
  }

  Stats stats() const override { return stats_; }

 private:
  struct Buffer {
    char* host = nullptr;
    cudaEvent_t done = nullptr;
    bool in_flight = false;  // its last DMA may not have finished
  };
  struct Segment {  // one DMA: staging [offset, offset + bytes) -> dst
    char* dst;
    size_t offset;
    size_t bytes;
  };

  // Makes the current buffer ready to fill (allocating it on first use, or waiting for its
  // previous DMA).
  void Acquire() {
    if (filling_) return;
    Buffer& b = buffers_[current_];
    if (b.host == nullptr) {
      TP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&b.host), cap_, cudaHostAllocDefault));
      TP_CUDA_CHECK(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
    } else if (b.in_flight) {
      const auto t = Clock::now();
      TP_CUDA_CHECK(cudaEventSynchronize(b.done));
      stats_.wait_s += SecondsSince(t);
      b.in_flight = false;
    }
    filling_ = true;
    used_ = 0;
  }

  void Add(char* dst, const char* src, size_t n) {
    jobs_.push_back({buffers_[current_].host + used_, src, n});
    if (!segments_.empty() && segments_.back().dst + segments_.back().bytes == dst &&
        segments_.back().offset + segments_.back().bytes == used_) {
      segments_.back().bytes += n;  // consecutive rows of a column slice: one DMA
    } else {
      segments_.push_back({dst, used_, n});
    }
    used_ += n;
    stats_.bytes += static_cast<int64_t>(n);
  }

  // Copies the queued sources into the current buffer (in parallel) and starts its DMAs.
  void Submit() {
    if (!filling_) return;
    Buffer& b = buffers_[current_];
    // Pieces of at most 2 MiB, so that the team shares a buffer evenly.
    constexpr size_t kPiece = size_t{2} << 20;
    pieces_.clear();
    for (const CopyJob& j : jobs_) {
      for (size_t off = 0; off < j.bytes; off += kPiece) {
        pieces_.push_back({j.dst + off, j.src + off, std::min(kPiece, j.bytes - off)});
      }
    }
    const auto t = Clock::now();
    team_.Run(pieces_);
    stats_.host_copy_s += SecondsSince(t);
    for (const Segment& s : segments_) {
      TP_CUDA_CHECK(
          cudaMemcpyAsync(s.dst, b.host + s.offset, s.bytes, cudaMemcpyHostToDevice, stream_));
    }
    TP_CUDA_CHECK(cudaEventRecord(b.done, stream_));
    b.in_flight = true;
    jobs_.clear();
    segments_.clear();
    filling_ = false;
    current_ = (current_ + 1) % static_cast<int>(buffers_.size());
  }

  const size_t cap_;
  std::vector<Buffer> buffers_;
  CopyTeam team_;
  cudaStream_t stream_ = nullptr;
  int current_ = 0;
  bool filling_ = false;
  size_t used_ = 0;
  std::vector<CopyJob> jobs_, pieces_;
  std::vector<Segment> segments_;
  Stats stats_;
};

}  // namespace

std::unique_ptr<DeviceUploader> MakePinnedUploader(int device, const UploaderOptions& options) {
  return std::make_unique<PinnedUploader>(device, options);
}

}  // namespace tpserve::cuda
