// All-reduce latency between processes (label bench, under mpirun; every rank on GPU
// rank % device count, so one GPU serves them all): the custom IPC all-reduce (eager, and
// replayed from a CUDA graph of 20 calls, which leaves out the launch cost) against the
// inner communicator (MPI staging device tensors through the host), bf16, nccl-tests columns:
// time per call in us (median of 5 rounds of the average over `iters` back-to-back calls after
// warm-up), algorithm bandwidth = bytes / time and bus bandwidth = algbw * 2 (n - 1) / n.
// Each size is checked once: every rank's input is rank + 1, the sum is n (n + 1) / 2.
// Ranks sharing one GPU without MPS are time-sliced: the figures then measure the scheduler's
// time slice more than the kernel; under MPS (nvidia-cuda-mps-control -d) they are co-resident.
//   mpirun -np 2 custom_all_reduce_bench [--max-mb 64] [--one-shot-kb 256]
// (--one-shot-kb 0: two-shot at every size; --one-shot-kb 65536: one-shot at every size.)
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "parallel/bootstrap.h"
#include "parallel/custom_communicator.h"
#include "parallel/mpi_communicator.h"

namespace tpserve {
namespace {

constexpr int kRounds = 5;
constexpr int kGraphCalls = 20;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median over rounds of the average us per call of `iters` calls enqueued by `enqueue(i)`.
template <typename Enqueue>
double TimeUs(cudaStream_t stream, int iters, Enqueue enqueue) {
  cudaEvent_t start, stop;
  TP_CUDA_CHECK(cudaEventCreate(&start));
  TP_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) enqueue();  // warm-up
  TP_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> us;
  for (int round = 0; round < kRounds; ++round) {
    MPI_Barrier(MPI_COMM_WORLD);
    TP_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < iters; ++i) enqueue();
    TP_CUDA_CHECK(cudaEventRecord(stop, stream));
    TP_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(1e3 * ms / iters);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return Median(us);
}

int Main(int argc, char** argv) {
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int64_t max_mb = 64, one_shot_kb = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--max-mb") == 0) max_mb = std::atoll(argv[i + 1]);
    if (std::strcmp(argv[i], "--one-shot-kb") == 0) one_shot_kb = std::atoll(argv[i + 1]);
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    if (rank == 0) std::printf("no CUDA device, bench skipped\n");
    return 0;
  }
  const int device = rank % devices;
  TP_CUDA_CHECK(cudaSetDevice(device));
  CudaOps ops(device);
  const absl::Duration timeout = absl::Seconds(60);
  auto inner = MakeMpiCommunicator(MPI_COMM_WORLD, &ops, timeout, "bench");
  TP_CHECK(inner.ok()) << inner.status();
  auto baseline = MakeMpiCommunicator(MPI_COMM_WORLD, &ops, timeout, "bench baseline");
  TP_CHECK(baseline.ok()) << baseline.status();
  CustomAllReduceOptions o;
  o.stream = ops.stream();
  o.timeout = timeout;
  o.max_bytes = static_cast<size_t>(max_mb) << 20;
  o.one_shot_max_bytes = static_cast<size_t>(one_shot_kb) << 10;
  o.impl = AllReduceImpl::kCustom;
  auto custom = MakeCustomAllReduceCommunicator(
      std::move(inner).value(), MpiBytesAllGather(MPI_COMM_WORLD, timeout, "bench exchange"), o);
  TP_CHECK(custom.ok()) << custom.status();
  auto* c = static_cast<CustomAllReduceCommunicator*>(custom->get());
  Communicator& mpi = **baseline;
  if (rank == 0) {
    std::printf(
        "all-reduce bf16, %d ranks on %d GPU(s); one-shot up to %lld KiB; us per call, "
        "GB/s\n",
        n, devices, static_cast<long long>(one_shot_kb));
    std::printf("%12s %10s | %9s %7s %7s | %9s %7s | %9s %7s %7s | %s\n", "bytes", "elements",
                "custom", "algbw", "busbw", "graph", "busbw", "mpi", "algbw", "busbw", "check");
  }
  const double bus = n > 1 ? 2.0 * (n - 1) / n : 1.0;
  for (int64_t bytes = int64_t{8} << 10; bytes <= (max_mb << 20); bytes *= 2) {
    const int64_t numel = bytes / 2;
    void* d = ops.Alloc(bytes);
    Tensor t(d, {numel}, DType::kBF16, Device::kCuda);
    // Correctness once: inputs rank + 1.
    std::vector<uint16_t> host(numel, F32ToBf16(static_cast<float>(rank + 1)));
    ops.CopyToDevice(d, host.data(), bytes);
    TP_CHECK(c->AllReduceSum(t).ok());
    const absl::Status synced = c->Synchronize();
    TP_CHECK(synced.ok()) << synced;
    ops.CopyToHost(host.data(), d, bytes);
    const uint16_t want = F32ToBf16(n * (n + 1) / 2.0f);
    const bool ok = std::all_of(host.begin(), host.end(), [&](uint16_t v) { return v == want; });
    // Timing on zeros (repeated in-place sums stay finite).
    TP_CUDA_CHECK(cudaMemsetAsync(d, 0, bytes, ops.stream()));
    const int iters = static_cast<int>(std::clamp<int64_t>((int64_t{64} << 20) / bytes, 5, 50));
    const double custom_us =
        TimeUs(ops.stream(), iters, [&] { TP_CHECK(c->AllReduceSum(t).ok()); });
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    TP_CUDA_CHECK(cudaStreamBeginCapture(ops.stream(), cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kGraphCalls; ++i) TP_CHECK(c->AllReduceSum(t).ok());
    TP_CUDA_CHECK(cudaStreamEndCapture(ops.stream(), &graph));
    TP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const double graph_us = TimeUs(ops.stream(), std::max(1, iters / kGraphCalls),
                                   [&] { TP_CUDA_CHECK(cudaGraphLaunch(exec, ops.stream())); }) /
                            kGraphCalls;
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    const double mpi_us =
        TimeUs(ops.stream(), std::max(3, iters / 10), [&] { TP_CHECK(mpi.AllReduceSum(t).ok()); });
    const absl::Status after = c->Synchronize();
    TP_CHECK(after.ok()) << after;
    int all_ok = ok ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank == 0) {
      auto algbw = [&](double us) { return bytes / us / 1e3; };
      std::printf("%12lld %10lld | %9.1f %7.1f %7.1f | %9.1f %7.1f | %9.1f %7.2f %7.2f | %s\n",
                  static_cast<long long>(bytes), static_cast<long long>(numel), custom_us,
                  algbw(custom_us), algbw(custom_us) * bus, graph_us, algbw(graph_us) * bus, mpi_us,
                  algbw(mpi_us), algbw(mpi_us) * bus, all_ok ? "ok" : "WRONG");
      std::fflush(stdout);
    }
    ops.Free(d);
  }
  return 0;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) {
  if (!tpserve::InitMpi(&argc, &argv).ok()) return 1;
  const int rc = tpserve::Main(argc, argv);
  MPI_Finalize();
  return rc;
}
