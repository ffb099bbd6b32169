// Bootstrap of the processes of one job, before any communicator exists: MPI start-up and the
// split of an MPMD launch (`mpirun -np 1 tpserve-coordinator : -np N tpserve-worker`: the
// workers get their own communicator, color 0; the coordinator takes color 1), leaving MPI
// without taking the job down, and the NCCL-id relay of launches without MPI (the ids travel
// over the coordinator's control stream). No CUDA: the coordinator links it too.
#pragma once

#include <mpi.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tpserve {

// MPI's text for an error code.
std::string MpiError(int rc);

// MPI_Init_thread (asking for MPI_THREAD_MULTIPLE, requiring at least SERIALIZED) with
// MPI_ERRORS_RETURN on MPI_COMM_WORLD, so that MPI errors come back as statuses. No-op when
// MPI is already initialized.
absl::Status InitMpi(int* argc, char*** argv);

// The coordinator's part of an MPMD launch (UnderMpi(), common/env.h): joins MPI and the split
// that gives the workers their communicator. No-op when not started by mpirun.
absl::Status JoinMpiAsCoordinator(int* argc, char*** argv);
// MPI_Finalize when JoinMpiAsCoordinator joined.
void LeaveMpiAsCoordinator();

// A worker's place among the workers under MPI.
struct MpiWorkers {
  MPI_Comm comm = MPI_COMM_NULL;  // the workers only (the coordinator split off)
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // among the workers of this node
};
absl::StatusOr<MpiWorkers> JoinMpiAsWorker(int* argc, char*** argv);

// Leaves MPI at the end of a worker. After a failure (`failed`) the rank neither calls
// MPI_Abort (it would take the whole job down, the coordinator of an MPMD launch included) nor
// MPI_Finalize (it may wait for ranks still blocked on this one): it just ends, and the
// coordinator learns of the failure from the control stream (the worker's fatal_error or the
// stream closing).
void LeaveMpiAsWorker(MpiWorkers* workers, bool failed);

// NCCL ids of the groups, as bytes (see process_groups.h).
struct NcclGroupIds {
  std::vector<std::string> tp_ids;  // one per stage (groups with tp > 1)
  std::vector<std::string> pp_ids;  // one per tp_rank (chains with pp > 1)
};

// The control stream as seen by the relay.
struct NcclIdChannel {
  std::function<bool(const NcclGroupIds&)> send;  // to the coordinator
  std::function<bool(NcclGroupIds*)> receive;     // from the coordinator
};

// Without MPI: the rank told to (`make_ids`) makes the ids with `make` and sends them to the
// coordinator, which relays them to every other worker; the others receive them.
absl::StatusOr<NcclGroupIds> RelayNcclIds(bool make_ids,
                                          const std::function<absl::StatusOr<NcclGroupIds>()>& make,
                                          const NcclIdChannel& channel);

}  // namespace tpserve
