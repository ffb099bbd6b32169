// The Communicator: collectives and point-to-point transfers inside one process group (a TP
// group or the PP chain). Implementations: single rank, MPI on host memory (staging device
// tensors through the host), NCCL on device memory (stream-ordered, followed by a watchdog), and
// the custom communicator over CUDA IPC in front of either (a TP group's all-reduce and
// all-gather, a PP chain's Send / Recv). Every call returns a status: a peer
// that dies or a transfer that misses its deadline becomes an error naming the rank and the
// operation, never a hang (for stream-ordered work: through Health() and the next call).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace tpserve {

class Ops;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: t = sum over ranks of t.
  virtual absl::Status AllReduceSum(Tensor t) = 0;
  // out = concatenation of every rank's `in` in rank order (out.numel() == size * in.numel()).
  virtual absl::Status AllGather(const Tensor& in, Tensor out) = 0;
  virtual absl::Status Send(const Tensor& t, int peer) = 0;
  virtual absl::Status Recv(Tensor t, int peer) = 0;
  virtual absl::Status Broadcast(Tensor t, int root) = 0;
  virtual std::string name() const = 0;  // e.g. "tp group 1 (mpi)", used in error messages
  // How many Sends of a few KB to one peer complete before the peer posts the matching Recvs: 0
  // when a Send waits for its Recv (NCCL), kManySends for MPI's eager protocol, 2 for the custom
  // p2p kernels (two slots per pair). A pipeline with k micro-batches in flight returns the
  // sampled ids upstream while the stages still exchange activations downstream; it is safe
  // with k up to this (Engine::Generate).
  static constexpr int kManySends = 1 << 20;
  virtual int buffered_small_sends() const { return 0; }
  bool buffers_small_sends() const { return buffered_small_sends() > 0; }
  // True when AllReduceSum and AllGather of device tensors (the collectives of a TP decode step)
  // are enqueued on the ops' stream without any host wait, so that a CUDA graph can capture
  // them. Their errors then surface later: through Health(), and through the next call.
  virtual bool stream_ordered_collectives() const { return false; }
  // The largest device tensor whose Send and Recv are enqueued on the ops' stream without any
  // host wait (so that a CUDA graph can capture a pipeline stage's boundary); 0 when none are
  // (host-staged MPI). Errors then surface as for the stream-ordered collectives.
  virtual size_t stream_ordered_p2p_max_bytes() const { return 0; }
  bool stream_ordered_p2p() const { return stream_ordered_p2p_max_bytes() > 0; }
  // The error that made the communicator unusable (a peer that missed its deadline, a failed
  // kernel), OK while it works. Call after waiting for stream-ordered work (e.g. the sampled
  // ids of a step): that work's results are garbage when this is not OK.
  virtual absl::Status Health() { return absl::OkStatus(); }
  // residual += the sum over ranks of x; normed = RMSNorm(residual) * weight (bf16 [rows, hidden]
  // tensors, weight [hidden]): the all-reduce of a row-parallel projection fused with the
  // residual add and the next norm, where the communicator can (true; x is then unspecified),
  // with the same bits as AllReduceSum(x) followed by Ops::AddRmsNorm. False: nothing was done,
  // the caller does those two steps.
  virtual absl::StatusOr<bool> AllReduceAddRmsNorm(Tensor x, Tensor residual, const Tensor& weight,
                                                   float eps, Tensor normed) {
    (void)x, (void)residual, (void)weight, (void)eps, (void)normed;
    return false;
  }
  // Asks the communicator's watchdog (if it has one) to follow the work queued so far on the
  // ops' stream, named `what` in a timeout error: e.g. a CUDA graph replay whose captured
  // collectives it cannot see one by one. A no-op for communicators that wait on the host.
  virtual void TrackStreamWork(const char* what) { (void)what; }
};

// A group of one: collectives are identities (AllGather copies through `ops`).
std::unique_ptr<Communicator> MakeSingleRankCommunicator(Ops* ops);

}  // namespace tpserve
