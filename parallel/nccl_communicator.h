// The NCCL communicator: collectives and send/recv on device memory (one GPU per rank), run on
// the communicator's own stream, with a deadline that aborts the NCCL communicator.
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
// default stream). Each operation makes the communicator's own stream wait for the work queued
// on `compute_stream`, runs the NCCL call there, and returns once it has finished (host wait
// polled with a deadline), so results are ready for any stream. A call that does not finish in
// `timeout` (or an asynchronous NCCL error) aborts the communicator (ncclCommAbort) and returns
// DeadlineExceeded / Unavailable naming the group, the rank, the peer and the operation; the
// communicator is unusable afterwards and the process should exit.
//
// AllReduceSum: f32 and bf16 (NCCL's native bf16 sum). Tensors must be device tensors.
absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const ncclUniqueId& id, int rank,
                                                                   int size,
                                                                   cudaStream_t compute_stream,
                                                                   absl::Duration timeout,
                                                                   std::string name);

}  // namespace tpserve
