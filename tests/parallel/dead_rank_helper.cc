// Helper of dead_rank_test, run under mpirun: every rank runs all-reduces and a send/recv ring
// over the MPI communicator; at iteration 3 rank 1 aborts, exits (code 5 or 0) without
// MPI_Finalize, or stalls forever. Survivors must report an error (naming rank, peer and operation)
// and exit non-zero within the timeout, or be ended by mpirun; nothing may hang. Usage:
// dead_rank_helper <abort|exit|exit0|stall> <timeout_ms>
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "parallel/mpi_communicator.h"
#include "parallel/process_groups.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s <abort|exit|exit0|stall> <timeout_ms>\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const int timeout_ms = std::atoi(argv[2]);
  absl::Status s = tpserve::InitMpi(&argc, &argv);
  if (!s.ok()) {
    fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 2;
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  absl::StatusOr<std::unique_ptr<tpserve::Communicator>> comm = tpserve::MakeMpiCommunicator(
      MPI_COMM_WORLD, nullptr, absl::Milliseconds(timeout_ms), "test group");
  if (!comm.ok()) {
    fprintf(stderr, "rank %d: %s\n", rank, std::string(comm.status().message()).c_str());
    return 3;
  }
  std::vector<float> v(1024), in(1024);
  for (int iter = 0; iter < 1000; ++iter) {
    if (rank == 1 && iter == 3) {
      fprintf(stderr, "dead_rank_helper: rank 1 %s now (iteration %d)\n", mode.c_str(), iter);
      fflush(stderr);
      if (mode == "abort") std::abort();
      if (mode == "exit") _exit(5);
      if (mode == "exit0") _exit(0);
      if (mode == "stall") {
        while (true) sleep(1000);
      }
    }
    for (float& x : v) x = rank;
    s = (*comm)->AllReduceSum(tpserve::Tensor(v.data(), {1024}, tpserve::DType::kF32));
    if (s.ok()) {
      const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
      tpserve::Tensor out(v.data(), {1024}, tpserve::DType::kF32);
      tpserve::Tensor got(in.data(), {1024}, tpserve::DType::kF32);
      if (rank % 2 == 0) {
        s = (*comm)->Send(out, next);
        if (s.ok()) s = (*comm)->Recv(got, prev);
      } else {
        s = (*comm)->Recv(got, prev);
        if (s.ok()) s = (*comm)->Send(out, next);
      }
    }
    if (!s.ok()) {
      // What a worker does: report the error and exit; mpirun then ends the other ranks.
      fprintf(stderr, "dead_rank_helper: rank %d failed at iteration %d: %s\n", rank, iter,
              s.ToString().c_str());
      fflush(stderr);
      _exit(4);
    }
  }
  fprintf(stderr, "dead_rank_helper: rank %d finished without noticing the dead rank\n", rank);
  MPI_Finalize();
  return 0;
}
