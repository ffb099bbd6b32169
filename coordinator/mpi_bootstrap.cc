// The coordinator's part in an MPMD mpirun launch (see server.h): it must take part in MPI_Init
// and in the split that gives the workers their own communicator (color 0 = workers).
#include <mpi.h>

#include "absl/strings/str_cat.h"
#include "common/env.h"
#include "coordinator/server.h"

namespace tpserve {
namespace {
bool g_mpi = false;
}

absl::Status MaybeJoinMpi(int* argc, char*** argv) {
  if (!UnderMpi()) return absl::OkStatus();
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    return absl::UnavailableError("MPI_Init_thread failed in the coordinator");
  }
  g_mpi = true;
  MPI_Comm coordinator_comm = MPI_COMM_NULL;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // Same split as the workers' (worker/worker_main.cc): color 1 here, 0 for workers.
  if (MPI_Comm_split(MPI_COMM_WORLD, 1, rank, &coordinator_comm) != MPI_SUCCESS) {
    return absl::UnavailableError("MPI_Comm_split failed in the coordinator");
  }
  MPI_Comm_free(&coordinator_comm);
  return absl::OkStatus();
}

void MaybeFinalizeMpi() {
  if (g_mpi) MPI_Finalize();
  g_mpi = false;
}

}  // namespace tpserve
