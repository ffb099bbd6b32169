// The MPI communicator: collectives and send/recv on host memory over an MPI communicator.
// Device tensors (Ops::device() == kCuda) are staged through host buffers, so several processes
// can share one GPU in tests. Every wait has a deadline.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "parallel/communicator.h"

namespace tpserve {

class Ops;

// Builds a communicator over a duplicate of `comm` (the caller keeps `comm`). `ops` stages
// device tensors (CopyToHost / CopyToDevice, which must be synchronous); it may be null when
// only host tensors are passed. `name` (e.g. "tp group 1") starts every error message.
//
// Semantics:
//  - AllReduceSum supports f32 and bf16. It all-gathers every rank's values and sums them on
//    each rank in rank order (bf16: converted to f32, summed in f32, rounded back to bf16 once),
//    so all ranks hold bitwise-identical results that do not depend on MPI's algorithm choice.
//  - AllGather, Broadcast, Send and Recv move raw bytes of any dtype.
//  - Every operation is non-blocking MPI polled with MPI_Test until `timeout` after it starts.
//    Past the deadline it returns DeadlineExceeded naming the group, this rank, the peer (or
//    "all ranks") and the operation. An MPI error (e.g. a dead peer's connection) returns
//    Unavailable. After either, the communicator is unusable (every call fails at once) and
//    MPI may still write into the buffers of the abandoned operation: the process should
//    report the error and exit (mpirun then ends the other ranks).
//  - Not thread-safe: one thread uses a communicator at a time. MPI must be initialized with
//    at least MPI_THREAD_SERIALIZED when that thread is not the one that called MPI_Init.
absl::StatusOr<std::unique_ptr<Communicator>> MakeMpiCommunicator(MPI_Comm comm, Ops* ops,
                                                                  absl::Duration timeout,
                                                                  std::string name);

// Waits for `request` by polling MPI_Test until `deadline`. Returns DeadlineExceeded (with
// `what` in the message) on timeout, Unavailable on an MPI error. Used by the bootstrap too.
absl::Status MpiWaitWithDeadline(MPI_Request* request, absl::Time deadline,
                                 const std::string& what);

}  // namespace tpserve
