// The NCCL communicator: collectives and send/recv on device memory (one GPU per rank),
// enqueued on the compute stream without a host wait, followed by a watchdog that aborts the
// NCCL communicator at a deadline.
// Only built when CUDA is on (TPSERVE_WITH_NCCL).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "parallel/communicator.h"

namespace tpserve {

// A fresh ncclUniqueId as bytes (sizeof(ncclUniqueId)), for relaying to the other ranks.
absl::StatusOr<std::string> NewNcclUniqueIdBytes();
absl::StatusOr<ncclUniqueId> NcclUniqueIdFromBytes(const std::string& bytes);

// Joins the NCCL communicator `id` as `rank` of `size` on the current CUDA device, non-blocking
// (ncclCommInitRankConfig with blocking = 0) so that initialization and every operation can be
// given up after `timeout`.
//
// `compute_stream` is the stream that produces and consumes the tensors (nullptr: the legacy
// default stream). Each operation is enqueued on `compute_stream` and the call returns without
// waiting for it (stream-ordered: a CUDA graph capture on that stream captures it), so its
// results are ready for that stream and for host waits on it, not for other streams. A watchdog
// thread follows every operation enqueued outside a capture (and the work named by
// TrackStreamWork, e.g. graph replays): one not finished `timeout` after it was enqueued, or an
// asynchronous NCCL or CUDA error, aborts the communicator (ncclCommAbort: its queued kernels
// return, so host waits end) and is kept as the reason, naming the group, the rank, the peer and
// the operation. Health() returns it, and every later call fails with it; the process should
// exit. An enqueue that itself does not finish in `timeout` aborts at once.
//
// AllReduceSum: f32 and bf16 (NCCL's native bf16 sum). Tensors must be device tensors.
absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const ncclUniqueId& id, int rank,
                                                                   int size,
                                                                   cudaStream_t compute_stream,
                                                                   absl::Duration timeout,
                                                                   std::string name);

}  // namespace tpserve
