// Cost of the host-staged MPI communicator (label bench, under mpirun): median time of
// AllReduceSum (f32, bf16) and Send/Recv per message size after warm-up, with the algorithm
// bandwidth (bytes / time) as nccl-tests reports it. Host tensors: staging would add two
// device copies per call on a GPU.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/time/clock.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_groups.h"

namespace tpserve {
namespace {

double MedianUs(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double TimeUs(F f, int iters) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<double> us;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const absl::Time t = absl::Now();
    f();
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
  }
  return MedianUs(us);
}

int Main() {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto comm = MakeMpiCommunicator(MPI_COMM_WORLD, nullptr, absl::Seconds(60), "bench");
  if (!comm.ok()) return 1;
  Communicator& c = **comm;
  if (rank == 0) {
    printf("host-staged MPI communicator, %d ranks; median us (algorithm GB/s)\n", size);
    printf("%12s %22s %22s %22s\n", "bytes", "allreduce f32", "allreduce bf16", "send/recv");
  }
  for (int64_t bytes : {int64_t{4096}, int64_t{65536}, int64_t{1} << 20, int64_t{16} << 20}) {
    const int iters = bytes >= (int64_t{16} << 20) ? 10 : 50;
    std::vector<char> buf(bytes, 0);
    Tensor f32(buf.data(), {bytes / 4}, DType::kF32);
    Tensor bf16(buf.data(), {bytes / 2}, DType::kBF16);
    const double ar = TimeUs([&] { (void)c.AllReduceSum(f32); }, iters);
    const double arb = TimeUs([&] { (void)c.AllReduceSum(bf16); }, iters);
    const double p2p = TimeUs(
        [&] {
          if (rank == 0) (void)c.Send(f32, 1);
          if (rank == 1) (void)c.Recv(f32, 0);
        },
        iters);
    if (rank == 0) {
      auto gbs = [&](double us) { return bytes / us / 1e3; };
      printf("%12lld %12.1f (%6.2f) %12.1f (%6.2f) %12.1f (%6.2f)\n", static_cast<long long>(bytes),
             ar, gbs(ar), arb, gbs(arb), p2p, gbs(p2p));
    }
  }
  return 0;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) {
  if (!tpserve::InitMpi(&argc, &argv).ok()) return 1;
  const int rc = tpserve::Main();
  MPI_Finalize();
  return rc;
}
