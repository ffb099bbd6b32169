// The "custom" communicator: AllReduceSum and AllGather of device tensors by kernels over CUDA
// IPC peer memory (parallel/custom_all_reduce.h), and Send / Recv of device tensors too when it
// has p2p slots (a PP chain's); everything else by an inner communicator (NCCL or MPI).
// Works between processes on GPUs with peer access and between processes that share one GPU
// (time-sliced, or co-resident under MPS). Only built when CUDA is on (TPSERVE_WITH_NCCL).
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "parallel/communicator.h"
#include "parallel/process_groups.h"  // AllReduceImpl

namespace tpserve {

namespace car {
struct LaunchArgs;  // custom_all_reduce.h
}  // namespace car

// Every rank's `mine`, in rank order: a collective byte exchange over the group's ranks.
using BytesAllGather =
    std::function<absl::StatusOr<std::vector<std::string>>(const std::string& mine)>;
// Over an MPI communicator (non-blocking, waited for until `timeout`).
BytesAllGather MpiBytesAllGather(MPI_Comm comm, absl::Duration timeout, std::string what);
// Through a communicator's AllGather of device memory (e.g. NCCL groups without MPI).
BytesAllGather DeviceBytesAllGather(Communicator* comm);

// Collective over `exchange`'s ranks, each on its current CUDA device: "" when no two ranks of
// one machine use the same GPU, else which ranks share which GPU (NCCL refuses such a group).
absl::StatusOr<std::string> RanksSharingAGpu(const BytesAllGather& exchange);

// Under MPS, with more than this many processes on one GPU, the custom kernels were seen to lose
// flag stores (a peer's raised flag never seen by the waiting rank; kernels/cuda/NOTES.md): the
// process groups then keep the backend for every group of the job (CustomKernelsUnreliable).
inline constexpr int kMaxProcessesPerGpuUnderMps = 2;

// Collective over `exchange`'s ranks (a whole job): "" when the custom kernels may be used, else
// why not (more than kMaxProcessesPerGpuUnderMps ranks sharing one GPU through MPS).
absl::StatusOr<std::string> CustomKernelsUnreliable(const BytesAllGather& exchange);

struct CustomAllReduceOptions {
  // The stream that produces and consumes the tensors (the ops' stream); the kernel runs on it
  // and nothing waits on the host, so a call can be captured into a CUDA graph.
  cudaStream_t stream = nullptr;
  // A kernel whose peers do not arrive within `timeout` gives up; the next call of any operation
  // (or Synchronize) returns DeadlineExceeded naming the rank, the peer and the phase.
  absl::Duration timeout = absl::Seconds(60);
  // Largest all-reduce in bytes done by the kernel (larger ones go to the inner communicator).
  // The IPC buffer holds twice this (two halves, alternated by call).
  size_t max_bytes = size_t{64} << 20;
  // One-shot (every rank sums everything) up to this many bytes, two-shot (reduce-scatter +
  // all-gather) above.
  size_t one_shot_max_bytes = size_t{256} << 10;
  // Largest Send / Recv done by the p2p kernels (a multiple of 256); 0: none, Send and Recv go to
  // the inner communicator. The IPC buffer holds two slots of this for each peer.
  size_t p2p_max_bytes = 0;
  AllReduceImpl impl = AllReduceImpl::kCustom;  // kAuto: return the inner one when impossible
  // AllReduceAddRmsNorm by one fused kernel (TPSERVE_FUSED_ALL_REDUCE_NORM in the workers).
  bool fuse_add_rms_norm = true;
};

// One stream: the calls of a communicator must stay ordered on options.stream (a kernel's
// buffers are reused two calls later). Destruction is collective, like creation: every rank
// closes its mappings of the peers' buffers, then a barrier over the inner communicator (bounded
// by its timeout), then each frees its own (CUDA IPC forbids freeing a buffer still mapped).
class CustomAllReduceCommunicator : public Communicator {
 public:
  ~CustomAllReduceCommunicator() override;
  int rank() const override;
  int size() const override;
  // bf16 and f32 device tensors of up to max_bytes: the IPC kernel, enqueued on the stream
  // without a host wait. Everything else: the inner communicator.
  absl::Status AllReduceSum(Tensor t) override;
  // The one-shot kernel fused with the residual add and RMSNorm (bit-equal to AllReduceSum then
  // Ops::AddRmsNorm) for bf16 device tensors up to one_shot_max_bytes, when
  // options.fuse_add_rms_norm; else false.
  absl::StatusOr<bool> AllReduceAddRmsNorm(Tensor x, Tensor residual, const Tensor& weight,
                                           float eps, Tensor normed) override;
  // Device tensors whose `in` has up to max_bytes: the IPC kernel (bit copies, any dtype),
  // enqueued on the stream without a host wait. Everything else: the inner communicator.
  absl::Status AllGather(const Tensor& in, Tensor out) override;
  // With p2p slots, device tensors of up to p2p_max_bytes to / from another rank: the p2p
  // kernels, enqueued on the stream without a host wait (a Send returns before the peer
  // receives; on the device it waits only for the Recv of the pair's message two before it).
  // Everything else: the inner communicator.
  absl::Status Send(const Tensor& t, int peer) override;
  absl::Status Recv(Tensor t, int peer) override;
  absl::Status Broadcast(Tensor t, int root) override;
  std::string name() const override;
  int buffered_small_sends() const override;
  size_t stream_ordered_p2p_max_bytes() const override;
  // The collectives a decode step uses (AllReduceSum, AllGather of device tensors up to
  // max_bytes) are stream-ordered kernels: a CUDA graph may capture them.
  bool stream_ordered_collectives() const override { return true; }
  absl::Status Health() override;
  void TrackStreamWork(const char* what) override { inner_->TrackStreamWork(what); }

  // Waits (host, with the timeout) for the work queued on the stream and returns the error of
  // any kernel that gave up. For tests and benchmarks.
  absl::Status Synchronize();

  struct State;  // buffers, mapped peers, the error record (custom_communicator.cc)

 private:
  friend absl::StatusOr<std::unique_ptr<Communicator>> MakeCustomAllReduceCommunicator(
      std::unique_ptr<Communicator>, const BytesAllGather&, const CustomAllReduceOptions&);
  CustomAllReduceCommunicator(std::unique_ptr<Communicator> inner, std::unique_ptr<State> state);
  absl::Status CheckHealthy(const char* op);
  // Whether a Send / Recv of `t` with `peer` is the p2p kernel's.
  bool ByKernel(const Tensor& t, int peer) const;
  // The status of a kernel launch (an error makes the communicator unusable).
  absl::Status Launched(const char* kernel, cudaError_t e);
  // Launches the Send or Recv kernel `launch` for `t` with `peer` (a message of t's bytes).
  absl::Status LaunchP2p(const char* kernel, const Tensor& t, int peer,
                         cudaError_t (*launch)(const car::LaunchArgs&, cudaStream_t));

  std::unique_ptr<Communicator> inner_;
  std::unique_ptr<State> state_;
  absl::Status broken_;
};

// Wraps `inner` (its rank and size are the group's): every rank allocates its IPC buffer on the
// current CUDA device, the handles are exchanged with `exchange`, every rank maps its peers'.
// Collective: every rank of the group calls it with the same options. When a rank cannot map a
// peer (another host, a GPU without peer access, at most kMaxRanks = 8 ranks), kCustom fails on
// every rank with the reason and kAuto returns `inner` unchanged on every rank.
absl::StatusOr<std::unique_ptr<Communicator>> MakeCustomAllReduceCommunicator(
    std::unique_ptr<Communicator> inner, const BytesAllGather& exchange,
    const CustomAllReduceOptions& options);

}  // namespace tpserve
