// tpserve-coordinator: the coordinator process (see server.h for the flags).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "coordinator/server.h"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("%s\n", tpserve::kCoordinatorUsage);
      return 0;
    }
  }
  absl::Status status = tpserve::MaybeJoinMpi(&argc, &argv);
  if (status.ok()) {
    std::vector<std::string> args(argv + 1, argv + argc);
    auto options = tpserve::ParseCoordinatorFlags(args, /*serve_command=*/false);
    status = options.ok() ? tpserve::RunCoordinator(*options) : options.status();
  }
  tpserve::MaybeFinalizeMpi();
  if (!status.ok()) {
    std::fprintf(stderr, "tpserve-coordinator: %s\n", std::string(status.message()).c_str());
    return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
