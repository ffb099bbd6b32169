// Process groups / bootstrap: the tp x pp grid from MPI (split communicators, NCCL ids by
// MPI_Ibcast) or from relayed NCCL ids.
#include "parallel/process_groups.h"

#include "absl/strings/str_cat.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/status.h"
#include "kernels/ops.h"
#include "parallel/mpi_communicator.h"
#ifdef TPSERVE_WITH_NCCL
#include "parallel/custom_communicator.h"
#include "parallel/nccl_communicator.h"
#endif

namespace tpserve {

absl::StatusOr<AllReduceImpl> ParseAllReduceImpl(const std::string& text) {
  if (text == "nccl") return AllReduceImpl::kBackend;
  if (text == "custom") return AllReduceImpl::kCustom;
  if (text == "auto") return AllReduceImpl::kAuto;
  return absl::InvalidArgumentError(
      absl::StrCat("--all-reduce must be auto, nccl or custom, got \"", text, "\""));
}

namespace {

absl::Status CheckGrid(int world_size, const GroupOptions& options) {
  if (options.tp < 1 || options.pp < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tp and pp must be at least 1 (got tp=", options.tp, ", pp=", options.pp, ")"));
  }
  if (world_size != options.tp * options.pp) {
    return absl::InvalidArgumentError(
        absl::StrCat("the world has ", world_size, " ranks but tp=", options.tp,
                     " x pp=", options.pp, " needs ", options.tp * options.pp));
  }
  return absl::OkStatus();
}

void Place(ProcessGroups& g, int rank, int world_size, const GroupOptions& options) {
  g.rank = rank;
  g.world_size = world_size;
  g.tp = options.tp;
  g.pp = options.pp;
  g.tp_rank = rank % options.tp;
  g.stage = rank / options.tp;
}

std::string TpName(int stage) { return absl::StrCat("tp group of stage ", stage); }
std::string PpName(int tp_rank) { return absl::StrCat("pp chain of tp rank ", tp_rank); }

#ifdef TPSERVE_WITH_NCCL
absl::StatusOr<std::unique_ptr<Communicator>> NcclFromBytes(const std::string& id_bytes, int rank,
                                                            int size, const GroupOptions& options,
                                                            std::string name) {
  TP_ASSIGN_OR_RETURN(ncclUniqueId id, NcclUniqueIdFromBytes(id_bytes));
  return MakeNcclCommunicator(id, rank, size, static_cast<cudaStream_t>(options.cuda_stream),
                              options.timeout, std::move(name));
}
#endif

// The PP chain's custom communicator: its Send / Recv carry a stage's activations (decode
// batches and prompt chunks up to this many bytes; larger ones go to the backend) and the
// sampled ids; its all-reduce is unused, so its data halves are small.
constexpr size_t kPpP2pMaxBytes = size_t{32} << 20;
constexpr size_t kPpAllReduceMaxBytes = size_t{256} << 10;

// A group's communicator with the custom communicator in front of `inner` when
// options.all_reduce asks for it and is possible (see AllReduceImpl): for a TP group its
// all-reduce and all-gather, for a PP chain (`pp_chain`) its Send and Recv. A PP chain takes the
// custom one only where possible (kCustom acts as kAuto there: stages on other hosts keep the
// backend). `exchange` moves bytes between the group's ranks.
template <typename MakeExchange>
absl::StatusOr<std::unique_ptr<Communicator>> WithCustom(std::unique_ptr<Communicator> inner,
                                                         const GroupOptions& options, Ops* ops,
                                                         bool pp_chain,
                                                         MakeExchange make_exchange) {
  if (options.all_reduce == AllReduceImpl::kBackend || inner->size() == 1) return inner;
  const bool custom = options.all_reduce == AllReduceImpl::kCustom && !pp_chain;
  if (ops == nullptr || ops->device() != Device::kCuda || options.cuda_stream == nullptr) {
    if (!custom) return inner;
    return absl::InvalidArgumentError(
        absl::StrCat(inner->name(),
                     ": the custom all-reduce needs CUDA ops and GroupOptions::cuda_stream (the "
                     "ops' stream)"));
  }
#ifdef TPSERVE_WITH_NCCL
  CustomAllReduceOptions o;
  o.stream = static_cast<cudaStream_t>(options.cuda_stream);
  o.timeout = options.timeout;
  o.impl = custom ? AllReduceImpl::kCustom : AllReduceImpl::kAuto;
  o.fuse_add_rms_norm = EnvBool(env::kFusedAllReduceNorm);
  if (pp_chain) {
    o.max_bytes = kPpAllReduceMaxBytes;
    o.p2p_max_bytes = kPpP2pMaxBytes;
  }
  Communicator* raw = inner.get();
  return MakeCustomAllReduceCommunicator(std::move(inner), make_exchange(raw), o);
#else
  (void)make_exchange;
  if (!custom) return inner;
  return absl::UnimplementedError(absl::StrCat(
      inner->name(), ": the custom all-reduce needs a CUDA build (this one has none)"));
#endif
}

// One group's communicator over the split MPI communicator `sub` (freed here).
absl::StatusOr<std::unique_ptr<Communicator>> GroupFromMpi(MPI_Comm sub,
                                                           const GroupOptions& options, Ops* ops,
                                                           const std::string& name, bool tp_group) {
  int rank = 0, size = 1;
  MPI_Comm_rank(sub, &rank);
  MPI_Comm_size(sub, &size);
  absl::StatusOr<std::unique_ptr<Communicator>> comm;
  CommBackend backend = options.backend;
#ifdef TPSERVE_WITH_NCCL
  if (size > 1 && backend == CommBackend::kNccl) {
    // NCCL refuses a group with two ranks on one GPU; such a group (several workers sharing the
    // one GPU of a machine) exchanges through MPI instead (its TP all-reduce can still be the
    // custom kernel).
    TP_ASSIGN_OR_RETURN(
        std::string shared,
        RanksSharingAGpu(MpiBytesAllGather(
            sub, options.timeout, absl::StrCat(name, ": rank ", rank, " describing its GPU"))));
    if (!shared.empty()) {
      if (rank == 0) {
        TP_LOG(INFO) << name << ": " << shared
                     << "; NCCL needs one GPU per rank, so this group uses MPI (device tensors "
                        "staged through the host)";
      }
      backend = CommBackend::kMpi;
    }
  }
#endif
  if (size == 1) {
    comm = MakeSingleRankCommunicator(ops);
  } else if (backend == CommBackend::kMpi) {
    comm = MakeMpiCommunicator(sub, ops, options.timeout, name);
  } else {
#ifdef TPSERVE_WITH_NCCL
    std::string id(sizeof(ncclUniqueId), '\0');
    if (rank == 0) {
      TP_ASSIGN_OR_RETURN(id, NewNcclUniqueIdBytes());
    }
    MPI_Request req;
    const int rc = MPI_Ibcast(id.data(), static_cast<int>(id.size()), MPI_BYTE, 0, sub, &req);
    if (rc != MPI_SUCCESS) {
      return absl::UnavailableError(
          absl::StrCat(name, ": rank ", rank, " broadcasting the NCCL id: ", MpiError(rc)));
    }
    TP_RETURN_IF_ERROR(MpiWaitWithDeadline(
        &req, absl::Now() + options.timeout,
        absl::StrCat(name, ": rank ", rank, " receiving the NCCL id from rank 0")));
    comm = NcclFromBytes(id, rank, size, options, name);
#else
    comm = absl::UnimplementedError(
        absl::StrCat(name, ": the NCCL backend needs a CUDA build (this one has none)"));
#endif
  }
  if (comm.ok()) {
    comm = WithCustom(std::move(comm).value(), options, ops, !tp_group, [&](Communicator*) {
#ifdef TPSERVE_WITH_NCCL
      return MpiBytesAllGather(sub, options.timeout,
                               absl::StrCat(name, ": rank ", rank, " exchanging CUDA IPC handles"));
#else
      return 0;
#endif
    });
  }
  MPI_Comm_free(&sub);
  return comm;
}

}  // namespace

absl::StatusOr<ProcessGroups> MakeProcessGroupsFromMpi(MPI_Comm world, const GroupOptions& options,
                                                       Ops* ops) {
  int rank = 0, world_size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &world_size);
  TP_RETURN_IF_ERROR(CheckGrid(world_size, options));
  MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN);
  ProcessGroups g;
  Place(g, rank, world_size, options);
  // MPI_Comm_split has no non-blocking form: a non-blocking barrier with a deadline first makes
  // sure every rank arrived, so a missing rank is an error here rather than a hang in the split.
  MPI_Request req;
  int rc = MPI_Ibarrier(world, &req);
  if (rc != MPI_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("bootstrap: rank ", rank, " MPI_Ibarrier failed: ", MpiError(rc)));
  }
  TP_RETURN_IF_ERROR(
      MpiWaitWithDeadline(&req, absl::Now() + options.timeout,
                          absl::StrCat("bootstrap: rank ", rank, " of ", world_size,
                                       " waiting for every rank to start (barrier)")));
  // Color = the group, key = the index inside it (as FasterTransformer's grid).
  MPI_Comm tp_sub = MPI_COMM_NULL, pp_sub = MPI_COMM_NULL;
  rc = MPI_Comm_split(world, g.stage, g.tp_rank, &tp_sub);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_split(world, g.tp_rank, g.stage, &pp_sub);
  if (rc != MPI_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("bootstrap: rank ", rank, " MPI_Comm_split failed: ", MpiError(rc)));
  }
  GroupOptions effective = options;
#ifdef TPSERVE_WITH_NCCL
  if (options.all_reduce != AllReduceImpl::kBackend && ops != nullptr &&
      ops->device() == Device::kCuda && world_size > 1) {
    // Decided once for the whole job (every rank the same), before any group wraps itself.
    TP_ASSIGN_OR_RETURN(const std::string why,
                        CustomKernelsUnreliable(MpiBytesAllGather(
                            world, options.timeout,
                            absl::StrCat("bootstrap: rank ", rank, " describing its GPU"))));
    if (!why.empty()) {
      if (options.all_reduce == AllReduceImpl::kCustom) {
        MPI_Comm_free(&tp_sub);
        MPI_Comm_free(&pp_sub);
        return absl::FailedPreconditionError(
            absl::StrCat("--all-reduce custom: ", why, " (or use --all-reduce nccl or auto)"));
      }
      if (rank == 0) TP_LOG(INFO) << "custom all-reduce and p2p off: " << why;
      effective.all_reduce = AllReduceImpl::kBackend;
    }
  }
#endif
  TP_ASSIGN_OR_RETURN(g.tp_comm, GroupFromMpi(tp_sub, effective, ops, TpName(g.stage), true));
  TP_ASSIGN_OR_RETURN(g.pp_comm, GroupFromMpi(pp_sub, effective, ops, PpName(g.tp_rank), false));
  TP_CHECK(g.tp_comm->rank() == g.tp_rank && g.tp_comm->size() == g.tp);
  TP_CHECK(g.pp_comm->rank() == g.stage && g.pp_comm->size() == g.pp);
  return g;
}

absl::StatusOr<NcclGroupIds> NewNcclGroupIds(int tp, int pp) {
#ifdef TPSERVE_WITH_NCCL
  NcclGroupIds ids;
  for (int s = 0; s < pp; ++s) {
    TP_ASSIGN_OR_RETURN(std::string id, NewNcclUniqueIdBytes());
    ids.tp_ids.push_back(std::move(id));
  }
  for (int t = 0; t < tp; ++t) {
    TP_ASSIGN_OR_RETURN(std::string id, NewNcclUniqueIdBytes());
    ids.pp_ids.push_back(std::move(id));
  }
  return ids;
#else
  return absl::UnimplementedError("NCCL ids need a CUDA build (this one has none)");
#endif
}

absl::StatusOr<ProcessGroups> MakeProcessGroupsFromNcclIds(int rank, const GroupOptions& options,
                                                           const NcclGroupIds& ids, Ops* ops) {
  TP_RETURN_IF_ERROR(CheckGrid(options.tp * options.pp, options));
  if (rank < 0 || rank >= options.tp * options.pp) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the world of ", options.tp * options.pp));
  }
  if (static_cast<int>(ids.tp_ids.size()) != options.pp ||
      static_cast<int>(ids.pp_ids.size()) != options.tp) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL ids: expected ", options.pp, " tp group ids and ", options.tp,
                     " pp chain ids, got ", ids.tp_ids.size(), " and ", ids.pp_ids.size()));
  }
  ProcessGroups g;
  Place(g, rank, options.tp * options.pp, options);
#ifdef TPSERVE_WITH_NCCL
  // Both groups are joined in the same order on every rank (tp first) so that no two ranks
  // wait on each other's second group.
  if (g.tp == 1) {
    g.tp_comm = MakeSingleRankCommunicator(ops);
  } else {
    TP_ASSIGN_OR_RETURN(
        g.tp_comm, NcclFromBytes(ids.tp_ids[g.stage], g.tp_rank, g.tp, options, TpName(g.stage)));
    TP_ASSIGN_OR_RETURN(g.tp_comm,
                        WithCustom(std::move(g.tp_comm), options, ops, /*pp_chain=*/false,
                                   [](Communicator* c) { return DeviceBytesAllGather(c); }));
  }
  if (g.pp == 1) {
    g.pp_comm = MakeSingleRankCommunicator(ops);
  } else {
    TP_ASSIGN_OR_RETURN(
        g.pp_comm, NcclFromBytes(ids.pp_ids[g.tp_rank], g.stage, g.pp, options, PpName(g.tp_rank)));
    TP_ASSIGN_OR_RETURN(g.pp_comm,
                        WithCustom(std::move(g.pp_comm), options, ops, /*pp_chain=*/true,
                                   [](Communicator* c) { return DeviceBytesAllGather(c); }));
  }
  return g;
#else
  if (g.world_size == 1) {
    g.tp_comm = MakeSingleRankCommunicator(ops);
    g.pp_comm = MakeSingleRankCommunicator(ops);
    return g;
  }
  return absl::UnimplementedError("NCCL groups need a CUDA build (this one has none)");
#endif
}

ProcessGroups MakeSingleRankGroups(Ops* ops) {
  ProcessGroups g;
  g.tp_comm = MakeSingleRankCommunicator(ops);
  g.pp_comm = MakeSingleRankCommunicator(ops);
  return g;
}

}  // namespace tpserve
