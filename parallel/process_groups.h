// Process groups of a tp x pp grid of ranks (rank = stage * tp + tp_rank): this rank's TP group
// communicator and its PP chain communicator, bootstrapped from MPI (MPI_Comm_split like
// FasterTransformer's grid, NCCL ids sent with MPI_Bcast) or from NCCL ids relayed by the
// coordinator for launches without MPI.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "parallel/bootstrap.h"  // InitMpi, NcclGroupIds
#include "parallel/communicator.h"

namespace tpserve {

class Ops;

enum class CommBackend {
  kMpi,   // host memory over MPI (device tensors staged through the host)
  kNccl,  // device memory over NCCL (needs a CUDA build and one GPU per rank)
};

// Which all-reduce a TP group uses (--all-reduce, TPSERVE_ALL_REDUCE).
enum class AllReduceImpl {
  kBackend,  // "nccl": the backend communicator's own (NCCL, or MPI staging through the host)
  kCustom,   // "custom": the CUDA IPC kernel (custom_communicator.h); refused with the reason
             // when a rank cannot map a peer's memory
  kAuto,     // "auto": custom when every rank of the group can map every peer's memory (one
             // host; the same GPU or GPUs with peer access), else the backend's
};
absl::StatusOr<AllReduceImpl> ParseAllReduceImpl(const std::string& text);

struct GroupOptions {
  int tp = 1;
  int pp = 1;
  CommBackend backend = CommBackend::kMpi;
  absl::Duration timeout = absl::Seconds(60);  // of every operation, bootstrap included
  // NCCL only: the stream that produces and consumes the tensors (a cudaStream_t; null = the
  // legacy default stream). The current CUDA device must already be set.
  void* cuda_stream = nullptr;
  // TP groups of device tensors (ops on CUDA, cuda_stream set): the custom all-reduce wraps the
  // backend communicator (AllReduceSum of up to 64 MiB by the IPC kernel, everything else by
  // the backend). PP chains: with kCustom or kAuto, the custom communicator wraps the chain
  // where every stage can map every other's memory (kAuto's rule, even for kCustom), for its
  // Send and Recv of device tensors up to 32 MiB (stream-ordered, so a CUDA graph captures a
  // stage's boundary); else the backend.
  AllReduceImpl all_reduce = AllReduceImpl::kBackend;
};

// This rank's place in the grid and its two communicators.
//  tp_comm: the ranks of this stage, indexed by tp_rank (all-reduce, all-gather).
//  pp_comm: the ranks with this tp_rank, indexed by stage (Send to next_stage(), Recv from
//           prev_stage()). Groups of one are single-rank communicators.
struct ProcessGroups {
  int rank = 0;
  int world_size = 1;
  int tp = 1;
  int pp = 1;
  int tp_rank = 0;
  int stage = 0;
  std::unique_ptr<Communicator> tp_comm;
  std::unique_ptr<Communicator> pp_comm;

  int prev_stage() const { return stage > 0 ? stage - 1 : -1; }       // peer in pp_comm
  int next_stage() const { return stage + 1 < pp ? stage + 1 : -1; }  // peer in pp_comm
};

// Builds the groups from an MPI communicator of exactly tp * pp ranks (the workers; the rank
// in `world` is the global rank). Collective over `world`: every rank must call it. All waits
// have options.timeout as deadline (a non-blocking barrier first, so a missing rank is
// reported instead of hanging in MPI_Comm_split).
absl::StatusOr<ProcessGroups> MakeProcessGroupsFromMpi(MPI_Comm world, const GroupOptions& options,
                                                       Ops* ops);

// Bootstrap without MPI (Kubernetes, srun): one rank (or any process with NCCL) makes the ids,
// the coordinator relays them to every worker as bytes (RelayNcclIds, bootstrap.h), and each
// worker joins its groups.
// Unimplemented in builds without NCCL.
absl::StatusOr<NcclGroupIds> NewNcclGroupIds(int tp, int pp);
absl::StatusOr<ProcessGroups> MakeProcessGroupsFromNcclIds(int rank, const GroupOptions& options,
                                                           const NcclGroupIds& ids, Ops* ops);

// Groups of one for a single rank (tp = pp = 1).
ProcessGroups MakeSingleRankGroups(Ops* ops);

}  // namespace tpserve
