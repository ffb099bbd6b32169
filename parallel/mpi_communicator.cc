// The MPI communicator on host memory: non-blocking MPI polled with a deadline, device tensors
// staged through host buffers, a rank-ordered (deterministic) f32/bf16 all-reduce.
#include "parallel/mpi_communicator.h"

#include "parallel/bootstrap.h"

#include <climits>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/bf16.h"
#include "common/logging.h"
#include "common/status.h"
#include "kernels/ops.h"
#include "parallel/comm_util.h"

namespace tpserve {
namespace {

constexpr int kSendRecvTag = 7301;
// Largest count of one MPI call (bytes); bigger point-to-point messages go in chunks.
constexpr int64_t kMaxChunkBytes = int64_t{1} << 30;
// MPI makes progress on large (pipelined) transfers only inside MPI calls: poll with yields for
// this long before backing off to sleeps.
constexpr absl::Duration kSpinTime = absl::Milliseconds(20);

std::string SecondsText(absl::Duration d) {
  return absl::StrFormat("%.3gs", absl::ToDoubleSeconds(d));
}

absl::Status WaitImpl(MPI_Request* request, absl::Time deadline, const std::string& what,
                      MPI_Status* status) {
  const absl::Time start = absl::Now();
  // Spin (yielding) for low latency and transfer progress, then back off to sleeps so that a
  // long wait (a peer still computing, or gone) does not burn a core.
  absl::Duration sleep = absl::Microseconds(20);
  MPI_Status local_status;
  MPI_Status* st = status != nullptr ? status : &local_status;
  for (int64_t iter = 0;; ++iter) {
    int done = 0;
    const int rc = MPI_Test(request, &done, st);
    if (rc != MPI_SUCCESS) {
      return absl::UnavailableError(absl::StrCat(what, " failed: ", MpiError(rc)));
    }
    if (done) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, " did not finish within ", SecondsText(deadline - start),
          " (a peer died, stalled or is waiting in a different operation); the communicator "
          "is now unusable and the process should exit"));
    }
    if (now - start < kSpinTime) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(absl::ToChronoMicroseconds(sleep));
      sleep = std::min(sleep * 2, absl::Milliseconds(1));
    }
  }
}

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, Ops* ops, absl::Duration timeout, std::string name)
      : comm_(comm), ops_(ops), timeout_(timeout), name_(std::move(name)) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // World ranks of the members, for error messages: "rank 1 (world rank 3)".
    world_ranks_.resize(size_);
    std::vector<int> ranks(size_);
    for (int i = 0; i < size_; ++i) ranks[i] = world_ranks_[i] = i;
    MPI_Group group, world;
    if (MPI_Comm_group(comm_, &group) == MPI_SUCCESS) {
      if (MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS) {
        MPI_Group_translate_ranks(group, size_, ranks.data(), world, world_ranks_.data());
        MPI_Group_free(&world);
      }
      MPI_Group_free(&group);
    }
  }

  ~MpiCommunicator() override {
    // After a failure MPI may still own the buffers and the communicator: leave both alone
    // (the process is about to exit).
    if (!broken_.ok()) {
      new std::vector<char>(std::move(send_staging_));  // intentionally leaked
      new std::vector<char>(std::move(recv_staging_));  // intentionally leaked
      new std::vector<char>(std::move(gathered_));      // intentionally leaked
      return;
    }
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return absl::StrCat(name_, " (mpi)"); }

  absl::Status AllReduceSum(Tensor t) override {
    TP_RETURN_IF_ERROR(Usable());
    TP_RETURN_IF_ERROR(comm_internal::CheckAllReduceDType(name(), t));
    if (t.numel() == 0 || size_ == 1) return absl::OkStatus();
    const size_t bytes = t.bytes();
    TP_RETURN_IF_ERROR(CheckCount("AllReduceSum", bytes * size_));
    const char* host = ToHost(t);
    gathered_.resize(bytes * size_);
    MPI_Request req;
    TP_RETURN_IF_ERROR(
        Call(MPI_Iallgather(host, static_cast<int>(bytes), MPI_BYTE, gathered_.data(),
                            static_cast<int>(bytes), MPI_BYTE, comm_, &req),
             "AllReduceSum", -1));
    TP_RETURN_IF_ERROR(Wait(&req, "AllReduceSum", -1));
    // Sum in rank order on every rank: identical bits everywhere.
    const int64_t n = t.numel();
    char* result = HostResultBuffer(t);
    if (t.dtype == DType::kF32) {
      float* out = reinterpret_cast<float*>(result);
      const float* in = reinterpret_cast<const float*>(gathered_.data());
      std::memcpy(out, in, bytes);
      for (int r = 1; r < size_; ++r) {
        const float* src = in + r * n;
        for (int64_t i = 0; i < n; ++i) out[i] += src[i];
      }
    } else {  // bf16: f32 accumulation, one rounding at the end
      const uint16_t* in = reinterpret_cast<const uint16_t*>(gathered_.data());
      uint16_t* out = reinterpret_cast<uint16_t*>(result);
      for (int64_t i = 0; i < n; ++i) {
        float acc = Bf16ToF32(in[i]);
        for (int r = 1; r < size_; ++r) acc += Bf16ToF32(in[r * n + i]);
        out[i] = F32ToBf16(acc);
      }
    }
    FromHost(t, result);
    return absl::OkStatus();
  }

  absl::Status AllGather(const Tensor& in, Tensor out) override {
    TP_RETURN_IF_ERROR(Usable());
    TP_RETURN_IF_ERROR(comm_internal::CheckAllGatherShapes(name(), in, out, size_));
    const size_t bytes = in.bytes();
    if (bytes == 0) return absl::OkStatus();
    TP_RETURN_IF_ERROR(CheckCount("AllGather", bytes * size_));
    const char* send = ToHost(in);
    char* recv = HostResultBuffer(out);
    MPI_Request req;
    TP_RETURN_IF_ERROR(Call(MPI_Iallgather(send, static_cast<int>(bytes), MPI_BYTE, recv,
                                           static_cast<int>(bytes), MPI_BYTE, comm_, &req),
                            "AllGather", -1));
    TP_RETURN_IF_ERROR(Wait(&req, "AllGather", -1));
    FromHost(out, recv);
    return absl::OkStatus();
  }

  // Open MPI's eager limit (4 KB shared memory, 64 KB TCP) covers the pipeline's id messages.
  int buffered_small_sends() const override { return kManySends; }  // eager protocol

  absl::Status Send(const Tensor& t, int peer) override {
    TP_RETURN_IF_ERROR(Usable());
    TP_RETURN_IF_ERROR(comm_internal::CheckPeer(name(), "Send", peer, size_));
    if (peer == rank_) return SelfError("Send");
    const char* host = ToHost(t);
    for (int64_t off = 0; off < static_cast<int64_t>(t.bytes()); off += kMaxChunkBytes) {
      const int count = static_cast<int>(std::min<int64_t>(kMaxChunkBytes, t.bytes() - off));
      MPI_Request req;
      TP_RETURN_IF_ERROR(Call(
          MPI_Isend(host + off, count, MPI_BYTE, peer, kSendRecvTag, comm_, &req), "Send", peer));
      TP_RETURN_IF_ERROR(Wait(&req, "Send", peer));
    }
    return absl::OkStatus();
  }

  absl::Status Recv(Tensor t, int peer) override {
    TP_RETURN_IF_ERROR(Usable());
    TP_RETURN_IF_ERROR(comm_internal::CheckPeer(name(), "Recv", peer, size_));
    if (peer == rank_) return SelfError("Recv");
    char* host = HostResultBuffer(t);
    for (int64_t off = 0; off < static_cast<int64_t>(t.bytes()); off += kMaxChunkBytes) {
      const int count = static_cast<int>(std::min<int64_t>(kMaxChunkBytes, t.bytes() - off));
      MPI_Request req;
      TP_RETURN_IF_ERROR(Call(
          MPI_Irecv(host + off, count, MPI_BYTE, peer, kSendRecvTag, comm_, &req), "Recv", peer));
      MPI_Status status;
      TP_RETURN_IF_ERROR(Wait(&req, "Recv", peer, &status));
      int got = 0;
      MPI_Get_count(&status, MPI_BYTE, &got);
      if (got != count) {
        return Fail(absl::InvalidArgumentError(absl::StrCat(
            name(), ": ", SelfText(), " Recv from ", PeerText(peer), " expected ", count,
            " bytes but the message has ", got, " (shapes differ between the ranks?)")));
      }
    }
    FromHost(t, host);
    return absl::OkStatus();
  }

  absl::Status Broadcast(Tensor t, int root) override {
    TP_RETURN_IF_ERROR(Usable());
    TP_RETURN_IF_ERROR(comm_internal::CheckPeer(name(), "Broadcast root", root, size_));
    if (t.bytes() == 0 || size_ == 1) return absl::OkStatus();
    TP_RETURN_IF_ERROR(CheckCount("Broadcast", t.bytes()));
    char* host = rank_ == root ? const_cast<char*>(ToHost(t)) : HostResultBuffer(t);
    MPI_Request req;
    TP_RETURN_IF_ERROR(
        Call(MPI_Ibcast(host, static_cast<int>(t.bytes()), MPI_BYTE, root, comm_, &req),
             "Broadcast", root));
    TP_RETURN_IF_ERROR(Wait(&req, "Broadcast", root));
    if (rank_ != root) FromHost(t, host);
    return absl::OkStatus();
  }

 private:
  bool OnDevice(const Tensor& t) const { return t.device == Device::kCuda; }

  // A host pointer holding t's data: t itself on the host, else the staging buffer.
  const char* ToHost(const Tensor& t) {
    if (!OnDevice(t)) return static_cast<const char*>(t.data);
    TP_CHECK(ops_ != nullptr) << name() << ": a device tensor needs the communicator's Ops";
    send_staging_.resize(t.bytes());
    ops_->CopyToHost(send_staging_.data(), t.data, t.bytes());
    return send_staging_.data();
  }
  // Where a result for t is written on the host: t itself, or a staging buffer.
  char* HostResultBuffer(const Tensor& t) {
    if (!OnDevice(t)) return static_cast<char*>(t.data);
    TP_CHECK(ops_ != nullptr) << name() << ": a device tensor needs the communicator's Ops";
    if (recv_staging_.size() < t.bytes()) recv_staging_.resize(t.bytes());
    return recv_staging_.data();
  }
  void FromHost(const Tensor& t, const char* host) {
    if (OnDevice(t)) ops_->CopyToDevice(t.data, host, t.bytes());
  }

  absl::Status Usable() const {
    if (broken_.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat(name(), ": ", SelfText(),
                     ": communicator unusable after an earlier error: ", broken_.message()));
  }
  absl::Status Fail(absl::Status s) {
    broken_ = s;
    return s;
  }
  absl::Status SelfError(const char* op) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": ", SelfText(), " cannot ", op, " to itself"));
  }
  absl::Status CheckCount(const char* op, size_t bytes) {
    if (bytes <= static_cast<size_t>(INT_MAX)) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": ", op, " of ", bytes, " bytes exceeds one MPI call's limit"));
  }
  // "rank 1", or "rank 1 (world rank 3)" when the group's numbering differs from the world's.
  std::string Numbered(const char* what, int r) const {
    if (r < 0 || r >= size_ || world_ranks_[r] == r || world_ranks_[r] == MPI_UNDEFINED) {
      return absl::StrCat(what, " ", r);
    }
    return absl::StrCat(what, " ", r, " (world rank ", world_ranks_[r], ")");
  }
  std::string SelfText() const { return Numbered("rank", rank_); }
  std::string PeerText(int peer) const {
    return peer < 0 ? std::string("all ranks") : Numbered("peer", peer);
  }
  absl::Status Call(int rc, const char* op, int peer) {
    if (rc == MPI_SUCCESS) return absl::OkStatus();
    return Fail(absl::UnavailableError(absl::StrCat(name(), ": ", SelfText(), " ", op, " with ",
                                                    PeerText(peer), " failed: ", MpiError(rc))));
  }
  absl::Status Wait(MPI_Request* req, const char* op, int peer, MPI_Status* status = nullptr) {
    const absl::Time start = absl::Now();
    absl::Status s =
        WaitImpl(req, start + timeout_,
                 absl::StrCat(name(), ": ", SelfText(), " ", op, " with ", PeerText(peer)), status);
    if (!s.ok()) return Fail(s);
    return s;
  }

  MPI_Comm comm_;
  Ops* ops_;
  absl::Duration timeout_;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> world_ranks_;  // by group rank
  absl::Status broken_;
  std::vector<char> send_staging_;  // device tensors staged for sending
  std::vector<char> recv_staging_;  // results for device tensors before the copy back
  std::vector<char> gathered_;
};

}  // namespace

absl::Status MpiWaitWithDeadline(MPI_Request* request, absl::Time deadline,
                                 const std::string& what) {
  return WaitImpl(request, deadline, what, nullptr);
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeMpiCommunicator(MPI_Comm comm, Ops* ops,
                                                                  absl::Duration timeout,
                                                                  std::string name) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": MPI is not initialized (call InitMpi first)"));
  }
  // Errors come back as return codes (turned into statuses) instead of aborting the job.
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req;
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const int rc = MPI_Comm_idup(comm, &dup, &req);
  if (rc != MPI_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat(name, ": rank ", rank, " MPI_Comm_idup failed: ", MpiError(rc)));
  }
  TP_RETURN_IF_ERROR(MpiWaitWithDeadline(
      &req, absl::Now() + timeout,
      absl::StrCat(name, ": rank ", rank, " creating the communicator (MPI_Comm_idup)")));
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  return std::unique_ptr<Communicator>(new MpiCommunicator(dup, ops, timeout, std::move(name)));
}

}  // namespace tpserve
