// The NCCL communicator: a non-blocking NCCL communicator whose operations run on their own
// stream and are waited for with a deadline; past it the communicator is aborted.
#include "parallel/nccl_communicator.h"

#include <cstring>
#include <thread>

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
    TP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    TP_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    TP_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }

  ~NcclCommunicator() override {
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
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return absl::StrCat(name_, " (nccl)"); }

  absl::Status AllReduceSum(Tensor t) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckAllReduceDType(name(), t));
    TP_RETURN_IF_ERROR(CheckDevice("AllReduceSum", t));
    return Run("AllReduceSum", -1, [&] {
      return ncclAllReduce(t.data, t.data, t.numel(), ToNccl(t.dtype), ncclSum, comm_, stream_);
    });
  }

  absl::Status AllGather(const Tensor& in, Tensor out) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckAllGatherShapes(name(), in, out, size_));
    TP_RETURN_IF_ERROR(CheckDevice("AllGather", in));
    return Run("AllGather", -1, [&] {
      return ncclAllGather(in.data, out.data, in.bytes(), ncclUint8, comm_, stream_);
    });
  }

  absl::Status Send(const Tensor& t, int peer) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckPeer(name(), "Send", peer, size_));
    TP_RETURN_IF_ERROR(CheckDevice("Send", t));
    return Run("Send", peer,
               [&] { return ncclSend(t.data, t.bytes(), ncclUint8, peer, comm_, stream_); });
  }

  absl::Status Recv(Tensor t, int peer) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckPeer(name(), "Recv", peer, size_));
    TP_RETURN_IF_ERROR(CheckDevice("Recv", t));
    return Run("Recv", peer,
               [&] { return ncclRecv(t.data, t.bytes(), ncclUint8, peer, comm_, stream_); });
  }

  absl::Status Broadcast(Tensor t, int root) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckPeer(name(), "Broadcast root", root, size_));
    TP_RETURN_IF_ERROR(CheckDevice("Broadcast", t));
    return Run("Broadcast", root, [&] {
      return ncclBroadcast(t.data, t.data, t.bytes(), ncclUint8, root, comm_, stream_);
    });
  }

 private:
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

  absl::Status Abort(absl::Status s) {
    broken_ = s;
    ncclCommAbort(comm_);
    return s;
  }

  template <typename Enqueue>
  absl::Status Run(const char* op, int peer, Enqueue enqueue) {
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          What(op, peer), ": communicator unusable after an earlier error: ", broken_.message()));
    }
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + timeout_;
    TP_CUDA_CHECK(cudaEventRecord(ready_, compute_stream_));
    TP_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    ncclResult_t r = enqueue();
    bool timed_out = false;
    if (r == ncclInProgress) r = PollAsync(comm_, deadline, &timed_out);
    if (timed_out) return Abort(TimeoutError(op, peer, start, "enqueueing"));
    if (r != ncclSuccess) return Abort(NcclError(op, peer, r));
    TP_CUDA_CHECK(cudaEventRecord(done_, stream_));
    absl::Duration sleep = absl::Microseconds(20);
    while (true) {
      const cudaError_t e = cudaEventQuery(done_);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) {
        return Abort(
            absl::InternalError(absl::StrCat(What(op, peer), ": CUDA error ", cudaGetErrorName(e),
                                             " (", cudaGetErrorString(e), ")")));
      }
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) return Abort(NcclError(op, peer, state));
      if (absl::Now() >= deadline) return Abort(TimeoutError(op, peer, start, "waiting for"));
      Backoff(start, &sleep);
    }
    return absl::OkStatus();
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
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
  absl::Status broken_;
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
