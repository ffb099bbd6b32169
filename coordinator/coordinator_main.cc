// tpserve-coordinator: the coordinator process (flags: coordinator_flags.h, --help).
#include <cstdio>
#include <string>
#include <vector>

#include "coordinator/coordinator_flags.h"
#include "coordinator/server.h"
#include "parallel/bootstrap.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  auto options = tpserve::ParseCoordinatorFlags(args, /*serve_command=*/false);
  if (options.ok() && options->help) {
    return tpserve::PrintUsage(tpserve::CoordinatorFlagSpec(false)).ok() ? 0 : 1;
  }
  // Under an MPMD mpirun the workers' communicator split needs this rank even when the flags
  // are wrong, so MPI is joined before the flag error is reported.
  absl::Status status = tpserve::JoinMpiAsCoordinator(&argc, &argv);
  if (status.ok()) status = options.ok() ? tpserve::RunCoordinator(*options) : options.status();
  tpserve::LeaveMpiAsCoordinator();
  if (!status.ok()) {
    std::fprintf(stderr, "tpserve-coordinator: %s\n", std::string(status.message()).c_str());
    return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
