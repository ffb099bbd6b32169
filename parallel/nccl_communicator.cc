// The NCCL communicator: a non-blocking NCCL communicator whose operations are enqueued on the
// compute stream without a host wait; a watchdog thread follows them and aborts the
// communicator when one is not done by its deadline.
#include "parallel/nccl_communicator.h"

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/check.h"
#include "common/status.h"
#include "parallel/comm_util.h"

namespace tpserve {
namespace {

std::string Seconds(absl::Duration d) { return absl::StrFormat("%.3gs", absl::ToDoubleSeconds(d)); }

void Backoff(absl::Time start, absl::Duration* sleep) {
  if (absl::Now() - start < absl::Milliseconds(1)) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(absl::ToChronoMicroseconds(*sleep));
    *sleep = std::min(*sleep * 2, absl::Microseconds(500));
  }
}

// Polls a non-blocking communicator until its pending call leaves ncclInProgress.
ncclResult_t PollAsync(ncclComm_t comm, absl::Time deadline, bool* timed_out) {
  const absl::Time start = absl::Now();
  absl::Duration sleep = absl::Microseconds(20);
  *timed_out = false;
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (absl::Now() >= deadline) {
      *timed_out = true;
      return ncclInProgress;
    }
    Backoff(start, &sleep);
  }
}

ncclDataType_t ToNccl(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
    case DType::kF8E4M3:
    case DType::kI8:
    case DType::kI4:
      break;  // KV-cache types: never communicated
  }
  return ncclUint8;
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, cudaStream_t compute_stream,
                   absl::Duration timeout, std::string name)
      : comm_(comm),
        rank_(rank),
        size_(size),
        compute_stream_(compute_stream),
        timeout_(timeout),
        name_(std::move(name)) {
    watchdog_ = std::thread([this] { WatchdogLoop(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    watchdog_.join();
    if (broken_.ok()) {
      // Orderly teardown; a peer that is gone makes finalize time out, then abort.
      bool timed_out = false;
      ncclResult_t r = ncclCommFinalize(comm_);
      if (r == ncclSuccess || r == ncclInProgress) {
        r = PollAsync(comm_, absl::Now() + timeout_, &timed_out);
      }
      if (r == ncclSuccess && !timed_out) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    for (const Pending& p : pending_) cudaEventDestroy(p.event);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return absl::StrCat(name_, " (nccl)"); }
  bool stream_ordered_collectives() const override { return true; }
  // Send and Recv are enqueued on the compute stream like the collectives.
  size_t stream_ordered_p2p_max_bytes() const override { return SIZE_MAX; }

  absl::Status Health() override {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }

  absl::Status AllReduceSum(Tensor t) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckAllReduceDType(name(), t));
    TP_RETURN_IF_ERROR(CheckDevice("AllReduceSum", t));
    return Run("AllReduceSum", -1, [&] {
      return ncclAllReduce(t.data, t.data, t.numel(), ToNccl(t.dtype), ncclSum, comm_,
                           compute_stream_);
    });
  }

  absl::Status AllGather(const Tensor& in, Tensor out) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckAllGatherShapes(name(), in, out, size_));
    TP_RETURN_IF_ERROR(CheckDevice("AllGather", in));
    return Run("AllGather", -1, [&] {
      return ncclAllGather(in.data, out.data, in.bytes(), ncclUint8, comm_, compute_stream_);
    });
  }

  absl::Status Send(const Tensor& t, int peer) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckPeer(name(), "Send", peer, size_));
    TP_RETURN_IF_ERROR(CheckDevice("Send", t));
    return Run("Send", peer, [&] {
      return ncclSend(t.data, t.bytes(), ncclUint8, peer, comm_, compute_stream_);
    });
  }

  absl::Status Recv(Tensor t, int peer) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckPeer(name(), "Recv", peer, size_));
    TP_RETURN_IF_ERROR(CheckDevice("Recv", t));
    return Run("Recv", peer, [&] {
      return ncclRecv(t.data, t.bytes(), ncclUint8, peer, comm_, compute_stream_);
    });
  }

  absl::Status Broadcast(Tensor t, int root) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckPeer(name(), "Broadcast root", root, size_));
    TP_RETURN_IF_ERROR(CheckDevice("Broadcast", t));
    return Run("Broadcast", root, [&] {
      return ncclBroadcast(t.data, t.data, t.bytes(), ncclUint8, root, comm_, compute_stream_);
    });
  }

 private:
  // An operation enqueued on the compute stream and not yet seen finished by the watchdog.
  struct Pending {
    cudaEvent_t event;  // recorded on the compute stream right after the operation
    const char* op;
    int peer;
    absl::Time start;
  };

  absl::Status CheckDevice(const char* op, const Tensor& t) {
    if (t.device == Device::kCuda) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": ", op, " needs a device tensor, got a host tensor ",
                     t.ShapeString(), " (use the MPI communicator for host memory)"));
  }

  std::string What(const char* op, int peer) const {
    return absl::StrCat(name(), ": rank ", rank_, " ", op, " with ",
                        peer < 0 ? std::string("all ranks") : absl::StrCat("peer ", peer));
  }

  // Records `s` as the reason the communicator is unusable and aborts it; NCCL kernels still
  // queued or running return, so a host wait on the stream ends. The first error wins.
  // mu_ must be held.
  absl::Status AbortLocked(absl::Status s) {
    if (broken_.ok()) {
      broken_ = s;
      ncclCommAbort(comm_);
    }
    return broken_;
  }

  // The watchdog's abort: the reason is recorded under mu_ (from then on no call touches comm_),
  // the abort itself runs without it, so that Health() answers at once even while ncclCommAbort
  // waits for the device.
  void WatchdogAbort(std::unique_lock<std::mutex>& lock, absl::Status s) {
    if (!broken_.ok()) return;
    broken_ = std::move(s);
    lock.unlock();
    ncclCommAbort(comm_);
    lock.lock();
  }

  // Enqueues an operation on the compute stream and returns without waiting for it: the
  // results are ready for the compute stream (and for host waits on it). Outside a CUDA graph
  // capture the watchdog then follows it until it finishes; under capture the graph's replays
  // are followed instead (TrackStreamWork).
  template <typename Enqueue>
  absl::Status Run(const char* op, int peer, Enqueue enqueue) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          What(op, peer), ": communicator unusable after an earlier error: ", broken_.message()));
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TP_CUDA_CHECK(cudaStreamIsCapturing(compute_stream_, &capture));
    const absl::Time start = absl::Now();
    ncclResult_t r = enqueue();
    bool timed_out = false;
    if (r == ncclInProgress) r = PollAsync(comm_, start + timeout_, &timed_out);
    if (timed_out) return AbortLocked(TimeoutError(op, peer, start, "enqueueing"));
    if (r != ncclSuccess) return AbortLocked(NcclError(op, peer, r));
    if (capture == cudaStreamCaptureStatusNone) WatchLocked(op, peer, start);
    return absl::OkStatus();
  }

  // mu_ held: records an event after the work queued so far and hands it to the watchdog.
  void WatchLocked(const char* op, int peer, absl::Time start) {
    cudaEvent_t event = nullptr;
    if (!free_events_.empty()) {
      event = free_events_.back();
      free_events_.pop_back();
    } else {
      TP_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    }
    TP_CUDA_CHECK(cudaEventRecord(event, compute_stream_));
    pending_.push_back({event, op, peer, start});
    wake_.notify_all();
  }

 public:
  void TrackStreamWork(const char* what) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(compute_stream_, &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
      return;
    }
    WatchLocked(what, -1, absl::Now());
  }

 private:
  // Follows the pending operations in order: a finished one is dropped; one still running
  // after the timeout, a CUDA error or an asynchronous NCCL error aborts the communicator.
  void WatchdogLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    absl::Duration sleep = absl::Microseconds(20);
    while (!stop_) {
      if (pending_.empty() || !broken_.ok()) {
        wake_.wait(lock, [&] { return stop_ || (!pending_.empty() && broken_.ok()); });
        sleep = absl::Microseconds(20);
        continue;
      }
      const Pending p = pending_.front();
      const cudaError_t e = cudaEventQuery(p.event);
      if (e == cudaSuccess) {
        pending_.pop_front();
        free_events_.push_back(p.event);
        sleep = absl::Microseconds(20);
        continue;
      }
      if (e != cudaErrorNotReady) {
        WatchdogAbort(lock, absl::InternalError(absl::StrCat(What(p.op, p.peer), ": CUDA error ",
                                                             cudaGetErrorName(e), " (",
                                                             cudaGetErrorString(e), ")")));
        continue;
      }
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        WatchdogAbort(lock, NcclError(p.op, p.peer, state));
        continue;
      }
      if (absl::Now() - p.start >= timeout_) {
        WatchdogAbort(lock, TimeoutError(p.op, p.peer, p.start, "waiting for"));
        continue;
      }
      wake_.wait_for(lock, absl::ToChronoMicroseconds(sleep), [&] { return stop_; });
      sleep = std::min(sleep * 2, absl::Microseconds(500));
    }
  }

  absl::Status TimeoutError(const char* op, int peer, absl::Time start, const char* phase) {
    return absl::DeadlineExceededError(absl::StrCat(
        What(op, peer), ": gave up ", phase, " the operation after ", Seconds(absl::Now() - start),
        " (a peer died, stalled or is waiting in a different operation); NCCL communicator "
        "aborted, the process should exit"));
  }
  absl::Status NcclError(const char* op, int peer, ncclResult_t r) {
    return absl::UnavailableError(absl::StrCat(What(op, peer), " failed: NCCL ",
                                               ncclGetErrorString(r), " (", ncclGetLastError(comm_),
                                               ")"));
  }

  ncclComm_t comm_;
  int rank_;
  int size_;
  cudaStream_t compute_stream_;
  absl::Duration timeout_;
  std::string name_;
  // Guards everything below and every call into comm_ (the watchdog aborts it).
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  absl::Status broken_;
  bool stop_ = false;
  std::thread watchdog_;  // last: started once the rest exists
};

}  // namespace

absl::StatusOr<std::string> NewNcclUniqueIdBytes() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    return absl::UnavailableError(absl::StrCat("ncclGetUniqueId failed: ", ncclGetErrorString(r)));
  }
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

absl::StatusOr<ncclUniqueId> NcclUniqueIdFromBytes(const std::string& bytes) {
  ncclUniqueId id;
  if (bytes.size() != sizeof(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL unique id has ", sizeof(id), " bytes, got ", bytes.size()));
  }
  std::memcpy(&id, bytes.data(), sizeof(id));
  return id;
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const ncclUniqueId& id, int rank,
                                                                   int size,
                                                                   cudaStream_t compute_stream,
                                                                   absl::Duration timeout,
                                                                   std::string name) {
  if (rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": rank ", rank, " outside a group of ", size));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const absl::Time start = absl::Now();
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  bool timed_out = false;
  if ((r == ncclSuccess || r == ncclInProgress) && comm != nullptr) {
    r = PollAsync(comm, start + timeout, &timed_out);
  }
  if (timed_out) {
    ncclCommAbort(comm);
    return absl::DeadlineExceededError(absl::StrCat(
        name, " (nccl): rank ", rank, " of ", size, " init did not finish within ",
        Seconds(timeout), " (did every rank of the group start and join with the same id?)"));
  }
  if (r != ncclSuccess) {
    if (comm != nullptr) ncclCommAbort(comm);
    return absl::UnavailableError(absl::StrCat(name, " (nccl): rank ", rank, " of ", size,
                                               " init failed: ", ncclGetErrorString(r)));
  }
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(comm, rank, size, compute_stream, timeout, std::move(name)));
}

}  // namespace tpserve
