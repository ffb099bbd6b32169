// MPI start-up, the MPMD split and the NCCL-id relay (see bootstrap.h).
#include "parallel/bootstrap.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/status.h"

namespace tpserve {
namespace {

// Color of the MPI_COMM_WORLD split: the workers form their communicator from color 0.
constexpr int kWorkerColor = 0;
constexpr int kCoordinatorColor = 1;

bool g_coordinator_joined = false;

}  // namespace

std::string MpiError(int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  return std::string(msg, len);
}

absl::Status InitMpi(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) {
      return absl::UnavailableError(absl::StrCat("MPI_Init_thread failed: ", MpiError(rc)));
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      return absl::FailedPreconditionError(
          absl::StrCat("MPI provides thread level ", provided,
                       "; tpserve needs at least MPI_THREAD_SERIALIZED"));
    }
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return absl::OkStatus();
}

absl::Status JoinMpiAsCoordinator(int* argc, char*** argv) {
  if (!UnderMpi()) return absl::OkStatus();
  TP_RETURN_IF_ERROR(Annotate(InitMpi(argc, argv), "MPI in the coordinator"));
  g_coordinator_joined = true;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm coordinator_comm = MPI_COMM_NULL;
  const int rc = MPI_Comm_split(MPI_COMM_WORLD, kCoordinatorColor, rank, &coordinator_comm);
  if (rc != MPI_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("MPI_Comm_split failed in the coordinator: ", MpiError(rc)));
  }
  MPI_Comm_free(&coordinator_comm);
  return absl::OkStatus();
}

void LeaveMpiAsCoordinator() {
  if (g_coordinator_joined) MPI_Finalize();
  g_coordinator_joined = false;
}

absl::StatusOr<MpiWorkers> JoinMpiAsWorker(int* argc, char*** argv) {
  TP_RETURN_IF_ERROR(Annotate(InitMpi(argc, argv), "MPI in a worker"));
  MpiWorkers w;
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  int rc = MPI_Comm_split(MPI_COMM_WORLD, kWorkerColor, world_rank, &w.comm);
  if (rc != MPI_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("MPI_Comm_split of the workers failed: ", MpiError(rc)));
  }
  MPI_Comm_rank(w.comm, &w.rank);
  MPI_Comm_size(w.comm, &w.world_size);
  MPI_Comm local = MPI_COMM_NULL;
  rc = MPI_Comm_split_type(w.comm, MPI_COMM_TYPE_SHARED, w.rank, MPI_INFO_NULL, &local);
  if (rc != MPI_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("MPI_Comm_split_type of the workers failed: ", MpiError(rc)));
  }
  MPI_Comm_rank(local, &w.local_rank);
  MPI_Comm_free(&local);
  return w;
}

void LeaveMpiAsWorker(MpiWorkers* workers, bool failed) {
  if (failed) {
    TP_LOG(ERROR) << "leaving the job without MPI_Finalize; the coordinator was told";
    return;
  }
  if (workers->comm != MPI_COMM_NULL) MPI_Comm_free(&workers->comm);
  MPI_Finalize();
}

absl::StatusOr<NcclGroupIds> RelayNcclIds(bool make_ids,
                                          const std::function<absl::StatusOr<NcclGroupIds>()>& make,
                                          const NcclIdChannel& channel) {
  NcclGroupIds ids;
  if (make_ids) {
    absl::StatusOr<NcclGroupIds> made = make();
    if (!made.ok()) return made.status();
    ids = *std::move(made);
    if (!channel.send(ids)) return absl::UnavailableError("could not send the NCCL ids");
    return ids;
  }
  if (!channel.receive(&ids)) {
    return absl::UnavailableError("expected the NCCL ids from the coordinator");
  }
  return ids;
}

}  // namespace tpserve
