// GPU tests of the NCCL communicator at world size 1 (one GPU): collectives on device memory,
// their capture into a CUDA graph, the watchdog that gives up a stalled operation, the refusal
// of host tensors, and an init whose peers never join timing out instead of hanging.
#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <vector>

#include "absl/time/clock.h"
#include "common/bf16.h"
#include "common/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_GPU()                          \
  if (!HaveGpu()) {                                 \
    printf("no CUDA device, test skipped\n");       \
    GTEST_SKIP() << "no CUDA device, test skipped"; \
  }

std::unique_ptr<Communicator> WorldOfOne(cudaStream_t stream) {
  absl::StatusOr<std::string> id = NewNcclUniqueIdBytes();
  TP_CHECK(id.ok()) << id.status();
  absl::StatusOr<ncclUniqueId> uid = NcclUniqueIdFromBytes(*id);
  TP_CHECK(uid.ok());
  absl::StatusOr<std::unique_ptr<Communicator>> c =
      MakeNcclCommunicator(*uid, 0, 1, stream, absl::Seconds(60), "solo");
  TP_CHECK(c.ok()) << c.status();
  return std::move(c).value();
}

TEST(NcclCommunicatorTest, WorldOfOneCollectives) {
  SKIP_WITHOUT_GPU();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  std::unique_ptr<Communicator> c = WorldOfOne(stream);
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->name(), "solo (nccl)");
  const int64_t n = 4096;
  std::vector<float> host(n);
  for (int64_t i = 0; i < n; ++i) host[i] = 0.5f * i - 7;
  float *d_in = nullptr, *d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_in, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, n * 4), cudaSuccess);
  // Written on the compute stream: the communicator must order itself after it.
  ASSERT_EQ(cudaMemcpyAsync(d_in, host.data(), n * 4, cudaMemcpyHostToDevice, stream), cudaSuccess);
  Tensor in(d_in, {n}, DType::kF32, Device::kCuda);
  Tensor out(d_out, {n}, DType::kF32, Device::kCuda);
  ASSERT_TRUE(c->AllReduceSum(in).ok());
  ASSERT_TRUE(c->AllGather(in, out).ok());
  ASSERT_TRUE(c->Broadcast(out, 0).ok());
  std::vector<float> back(n);
  ASSERT_EQ(cudaMemcpy(back.data(), d_out, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  // bf16 all-reduce.
  std::vector<uint16_t> b(n);
  for (int64_t i = 0; i < n; ++i) b[i] = F32ToBf16(0.25f * (i % 100));
  ASSERT_EQ(cudaMemcpy(d_in, b.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(c->AllReduceSum(Tensor(d_in, {n}, DType::kBF16, Device::kCuda)).ok());
  std::vector<uint16_t> b2(n);
  ASSERT_EQ(cudaMemcpy(b2.data(), d_in, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(b2, b);
  // Host tensors are refused with a hint.
  absl::Status s = c->AllReduceSum(Tensor(host.data(), {n}, DType::kF32));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("needs a device tensor"));
  c.reset();
  cudaFree(d_in);
  cudaFree(d_out);
  cudaStreamDestroy(stream);
}

// The collectives are stream-ordered: captured into a CUDA graph at world size 1 (the capture
// path runs wherever one GPU is) and replayed with new inputs, ordered after the copies queued
// before each replay on the same stream.
TEST(NcclCommunicatorTest, WorldOfOneCollectivesCapturedInAGraph) {
  SKIP_WITHOUT_GPU();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::unique_ptr<Communicator> c = WorldOfOne(stream);
  EXPECT_TRUE(c->stream_ordered_collectives());
  EXPECT_TRUE(c->stream_ordered_p2p());     // Send / Recv on the same stream
  EXPECT_EQ(c->buffered_small_sends(), 0);  // a Send waits for its Recv: no micro-batches
  const int64_t n = 3001;
  float *d_in = nullptr, *d_out = nullptr;
  uint16_t* d_b = nullptr;
  ASSERT_EQ(cudaMalloc(&d_in, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_b, n * 2), cudaSuccess);
  Tensor in(d_in, {n}, DType::kF32, Device::kCuda);
  Tensor out(d_out, {n}, DType::kF32, Device::kCuda);
  Tensor b(d_b, {n}, DType::kBF16, Device::kCuda);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const absl::Status s1 = c->AllReduceSum(in);
  const absl::Status s2 = c->AllReduceSum(b);
  const absl::Status s3 = c->AllGather(in, out);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(s1.ok()) << s1;
  ASSERT_TRUE(s2.ok()) << s2;
  ASSERT_TRUE(s3.ok()) << s3;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 4; ++replay) {
    std::vector<float> host(n);
    std::vector<uint16_t> hb(n);
    for (int64_t i = 0; i < n; ++i) {
      host[i] = 0.25f * i - replay;
      hb[i] = F32ToBf16(0.5f * (i % 50) + replay);
    }
    ASSERT_EQ(cudaMemcpyAsync(d_in, host.data(), n * 4, cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(d_b, hb.data(), n * 2, cudaMemcpyHostToDevice, stream), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d_out, 0, n * 4, stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    c->TrackStreamWork("a test replay");
    std::vector<float> back(n);
    std::vector<uint16_t> back_b(n);
    ASSERT_EQ(cudaMemcpyAsync(back.data(), d_out, n * 4, cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(back_b.data(), d_b, n * 2, cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(back, host) << "replay " << replay;
    EXPECT_EQ(back_b, hb) << "replay " << replay;
  }
  EXPECT_TRUE(c->Health().ok()) << c->Health();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  c.reset();
  cudaFree(d_in);
  cudaFree(d_out);
  cudaFree(d_b);
  cudaStreamDestroy(stream);
}

TEST(NcclCommunicatorTest, InitWithAMissingPeerTimesOut) {
  SKIP_WITHOUT_GPU();
  absl::StatusOr<std::string> id = NewNcclUniqueIdBytes();
  ASSERT_TRUE(id.ok());
  absl::StatusOr<ncclUniqueId> uid = NcclUniqueIdFromBytes(*id);
  const absl::Time start = absl::Now();
  // Rank 0 of 2; rank 1 never joins.
  absl::StatusOr<std::unique_ptr<Communicator>> c =
      MakeNcclCommunicator(*uid, 0, 2, nullptr, absl::Seconds(2), "pair");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("pair (nccl): rank 0 of 2 init"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

TEST(NcclCommunicatorTest, BadIdBytes) {
  absl::StatusOr<ncclUniqueId> uid = NcclUniqueIdFromBytes("short");
  ASSERT_FALSE(uid.ok());
  EXPECT_THAT(std::string(uid.status().message()), HasSubstr("got 5"));
}

// The watchdog: an operation queued behind work that does not finish (a host function that
// blocks the stream, standing in for a peer that never comes) is given up after the timeout;
// Health() names the rank and the operation, and every later call fails at once. Last in this
// file: an aborted NCCL communicator may leave the device context unusable.
TEST(NcclCommunicatorTest, WatchdogAbortsAnOperationPastItsDeadline) {
  SKIP_WITHOUT_GPU();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  absl::StatusOr<std::string> id = NewNcclUniqueIdBytes();
  ASSERT_TRUE(id.ok());
  absl::StatusOr<ncclUniqueId> uid = NcclUniqueIdFromBytes(*id);
  ASSERT_TRUE(uid.ok());
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      MakeNcclCommunicator(*uid, 0, 1, stream, absl::Seconds(1), "stalled");
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<Communicator> c = std::move(made).value();
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 1024 * 4), cudaSuccess);
  struct Gate {
    std::atomic<bool> open{false};
  };
  static Gate gate;  // outlives the stream's host function whatever happens
  gate.open = false;
  auto block = [](void* g) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);  // never hang the test run
    while (!static_cast<Gate*>(g)->open.load() && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(1));
    }
  };
  ASSERT_EQ(cudaLaunchHostFunc(stream, block, &gate), cudaSuccess);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(c->AllReduceSum(Tensor(d, {1024}, DType::kF32, Device::kCuda)).ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500)) << "the call waited on the host";
  EXPECT_TRUE(c->Health().ok());
  while (c->Health().ok() && absl::Now() - start < absl::Seconds(20)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const absl::Status h = c->Health();
  EXPECT_EQ(h.code(), absl::StatusCode::kDeadlineExceeded) << h;
  EXPECT_THAT(std::string(h.message()), HasSubstr("stalled (nccl): rank 0 AllReduceSum"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(900));
  const absl::Status later = c->AllReduceSum(Tensor(d, {1024}, DType::kF32, Device::kCuda));
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
  EXPECT_THAT(std::string(later.message()), HasSubstr("unusable after an earlier error"));
  gate.open = true;
  // The aborted operation's kernel may still run, on a communicator being torn down: whatever
  // the stream reports now is not this test's subject (it runs last in this binary).
  const cudaError_t drained = cudaStreamSynchronize(stream);
  printf("stream after the abort: %s\n", cudaGetErrorName(drained));
  c.reset();
  cudaFree(d);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace tpserve
