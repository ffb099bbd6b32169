// GPU tests of the NCCL communicator at world size 1 (one GPU): collectives on device memory,
// the refusal of host tensors, and an init whose peers never join timing out instead of hanging.
#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

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

}  // namespace
}  // namespace tpserve
