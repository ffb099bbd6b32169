// Multiprocess tests of the MPI communicator and the process groups, run under mpirun at world
// sizes 2 and 4: all-reduce, all-gather, send/recv and broadcast on known inputs (f32 and bf16,
// host and device-staged tensors), the tp x pp grid, argument errors and the deadline.
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_groups.h"
#include "tests/testing/fake_ops.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;

int WorldRank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int WorldSize() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

std::unique_ptr<Communicator> MakeWorld(Ops* ops, absl::Duration timeout = absl::Seconds(30)) {
  absl::StatusOr<std::unique_ptr<Communicator>> c =
      MakeMpiCommunicator(MPI_COMM_WORLD, ops, timeout, "world");
  TP_CHECK(c.ok()) << c.status();
  return std::move(c).value();
}

// Runs each test on host tensors and on "device" tensors staged through the host.
class MpiCommTest : public ::testing::TestWithParam<Device> {
 protected:
  MpiCommTest() : ops_(GetParam()), comm_(MakeWorld(&ops_)) {}
  Device dev() const { return GetParam(); }
  void ExpectStaged() {
    if (dev() == Device::kCuda) {
      EXPECT_GT(ops_.to_host + ops_.to_device, 0) << "device tensors go through the host";
    } else {
      EXPECT_EQ(ops_.to_host + ops_.to_device, 0) << "host tensors are used directly";
    }
  }
  FakeOps ops_;
  std::unique_ptr<Communicator> comm_;
};

TEST_P(MpiCommTest, RankAndName) {
  EXPECT_EQ(comm_->rank(), WorldRank());
  EXPECT_EQ(comm_->size(), WorldSize());
  EXPECT_EQ(comm_->name(), "world (mpi)");
}

TEST_P(MpiCommTest, AllReduceSumF32) {
  const int n = WorldSize(), r = WorldRank();
  for (int64_t len : {1, 7, 1000, 300000}) {
    std::vector<float> v(len);
    for (int64_t i = 0; i < len; ++i) v[i] = r * 1000.0f + 0.5f * (i % 4096);
    ASSERT_TRUE(comm_->AllReduceSum(Tensor(v.data(), {len}, DType::kF32, dev())).ok());
    for (int64_t i = 0; i < len; ++i) {
      const float want = 1000.0f * n * (n - 1) / 2 + n * 0.5f * (i % 4096);  // exact
      ASSERT_EQ(v[i], want) << "element " << i << " of " << len;
    }
  }
  ExpectStaged();
}

TEST_P(MpiCommTest, AllReduceSumBf16AccumulatesInF32AndRoundsOnce) {
  const int n = WorldSize(), r = WorldRank();
  const int64_t len = 4099;
  std::vector<uint16_t> v(len);
  auto value = [](int rank, int64_t i) {
    // Values whose bf16 sum differs from bf16-by-bf16 accumulation: 256 + small parts.
    return F32ToBf16((i % 3 == 0 ? 256.0f : 1.0f) + 0.0078125f * ((rank * 7 + i) % 17));
  };
  for (int64_t i = 0; i < len; ++i) v[i] = value(r, i);
  ASSERT_TRUE(comm_->AllReduceSum(Tensor(v.data(), {len}, DType::kBF16, dev())).ok());
  for (int64_t i = 0; i < len; ++i) {
    float acc = 0;
    for (int k = 0; k < n; ++k) acc += Bf16ToF32(value(k, i));
    ASSERT_EQ(v[i], F32ToBf16(acc)) << "element " << i;
  }
  ExpectStaged();
}

TEST_P(MpiCommTest, AllReduceResultIsBitwiseIdenticalOnAllRanks) {
  const int r = WorldRank();
  std::vector<float> v(513);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.37f * i + r) * std::pow(10.0f, r % 5);
  ASSERT_TRUE(comm_->AllReduceSum(Tensor(v.data(), {513}, DType::kF32, dev())).ok());
  std::vector<float> root = v;
  ASSERT_TRUE(comm_->Broadcast(Tensor(root.data(), {513}, DType::kF32, dev()), 0).ok());
  EXPECT_EQ(std::memcmp(root.data(), v.data(), v.size() * 4), 0);
}

TEST_P(MpiCommTest, AllGather) {
  const int n = WorldSize(), r = WorldRank();
  const int64_t len = 1001;
  std::vector<float> in(len), out(len * n, -1.0f);
  for (int64_t i = 0; i < len; ++i) in[i] = r * 10000.0f + i;
  ASSERT_TRUE(comm_
                  ->AllGather(Tensor(in.data(), {len}, DType::kF32, dev()),
                              Tensor(out.data(), {n, len}, DType::kF32, dev()))
                  .ok());
  for (int k = 0; k < n; ++k) {
    for (int64_t i = 0; i < len; ++i) ASSERT_EQ(out[k * len + i], k * 10000.0f + i);
  }
  // bf16: raw bytes in rank order.
  std::vector<uint16_t> bin(3, F32ToBf16(r + 0.5f)), bout(3 * n);
  ASSERT_TRUE(comm_
                  ->AllGather(Tensor(bin.data(), {3}, DType::kBF16, dev()),
                              Tensor(bout.data(), {3 * n}, DType::kBF16, dev()))
                  .ok());
  for (int k = 0; k < n; ++k) EXPECT_EQ(Bf16ToF32(bout[3 * k + 2]), k + 0.5f);
  ExpectStaged();
}

TEST_P(MpiCommTest, SendRecvRing) {
  const int n = WorldSize(), r = WorldRank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  // Small (eager) and large (rendezvous) messages; even ranks send first to avoid a cycle.
  for (int64_t len : {5, 2000000}) {
    std::vector<float> out(len), in(len, -1.0f);
    for (int64_t i = 0; i < len; ++i) out[i] = r + 0.25f * (i % 1000);
    Tensor t_out(out.data(), {len}, DType::kF32, dev());
    Tensor t_in(in.data(), {len}, DType::kF32, dev());
    if (r % 2 == 0) {
      ASSERT_TRUE(comm_->Send(t_out, next).ok());
      ASSERT_TRUE(comm_->Recv(t_in, prev).ok());
    } else {
      ASSERT_TRUE(comm_->Recv(t_in, prev).ok());
      ASSERT_TRUE(comm_->Send(t_out, next).ok());
    }
    for (int64_t i = 0; i < len; ++i) ASSERT_EQ(in[i], prev + 0.25f * (i % 1000));
  }
  // bf16 from rank 0 to the last rank.
  std::vector<uint16_t> b(4, F32ToBf16(r == 0 ? 3.5f : 0.0f));
  Tensor tb(b.data(), {4}, DType::kBF16, dev());
  if (r == 0) {
    ASSERT_TRUE(comm_->Send(tb, n - 1).ok());
  }
  if (r == n - 1) {
    ASSERT_TRUE(comm_->Recv(tb, 0).ok());
    EXPECT_EQ(Bf16ToF32(b[3]), 3.5f);
  }
  ExpectStaged();
}

TEST_P(MpiCommTest, BroadcastFromEveryRoot) {
  const int n = WorldSize(), r = WorldRank();
  for (int root = 0; root < n; ++root) {
    std::vector<float> v(77, r == root ? root + 0.5f : -1.0f);
    ASSERT_TRUE(comm_->Broadcast(Tensor(v.data(), {77}, DType::kF32, dev()), root).ok());
    for (float x : v) ASSERT_EQ(x, root + 0.5f);
    std::vector<uint16_t> b(9, F32ToBf16(r == root ? -2.0f * root : 7.0f));
    ASSERT_TRUE(comm_->Broadcast(Tensor(b.data(), {9}, DType::kBF16, dev()), root).ok());
    for (uint16_t x : b) ASSERT_EQ(Bf16ToF32(x), -2.0f * root);
  }
  ExpectStaged();
}

TEST_P(MpiCommTest, ArgumentErrorsAreLocalAndClear) {
  const int n = WorldSize(), r = WorldRank();
  std::vector<float> a(4), b(4 * n + 1);
  absl::Status s = comm_->AllGather(Tensor(a.data(), {4}, DType::kF32, dev()),
                                    Tensor(b.data(), {4 * n + 1}, DType::kF32, dev()));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("AllGather needs out of"));
  s = comm_->Send(Tensor(a.data(), {4}, DType::kF32, dev()), r);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cannot Send to itself"));
  s = comm_->Recv(Tensor(a.data(), {4}, DType::kF32, dev()), n);
  EXPECT_THAT(std::string(s.message()), HasSubstr("peer " + std::to_string(n) + " is outside"));
  std::vector<int32_t> ints(4);
  s = comm_->AllReduceSum(Tensor(ints.data(), {4}, DType::kI32, dev()));
  EXPECT_THAT(std::string(s.message()), HasSubstr("supports f32 and bf16"));
  // The communicator still works after argument errors.
  std::vector<float> one(1, 1.0f);
  ASSERT_TRUE(comm_->AllReduceSum(Tensor(one.data(), {1}, DType::kF32, dev())).ok());
  EXPECT_EQ(one[0], n);
}

INSTANTIATE_TEST_SUITE_P(HostAndStaged, MpiCommTest, ::testing::Values(Device::kCpu, Device::kCuda),
                         [](const auto& info) {
                           return info.param == Device::kCpu ? "Host" : "DeviceStaged";
                         });

TEST(MpiCommDeadlineTest, MissingPeerTimesOutWithRankPeerAndOp) {
  const int n = WorldSize(), r = WorldRank();
  FakeOps ops(Device::kCpu);
  std::unique_ptr<Communicator> comm = MakeWorld(&ops, absl::Milliseconds(300));
  if (r == 0) {
    // Nobody sends to rank 0 on this communicator.
    std::vector<float> v(16);
    const absl::Time start = absl::Now();
    absl::Status s = comm->Recv(Tensor(v.data(), {16}, DType::kF32), n - 1);
    const absl::Duration waited = absl::Now() - start;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("world (mpi): rank 0 Recv with peer " + std::to_string(n - 1) +
                          " did not finish within"));
    EXPECT_GE(waited, absl::Milliseconds(300));
    EXPECT_LT(waited, absl::Seconds(3));
    // Unusable afterwards, at once.
    s = comm->AllReduceSum(Tensor(v.data(), {16}, DType::kF32));
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(s.message()), HasSubstr("unusable after an earlier error"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiCommDeadlineTest, CollectiveMissingOnOneRankTimesOut) {
  const int r = WorldRank();
  FakeOps ops(Device::kCpu);
  std::unique_ptr<Communicator> comm = MakeWorld(&ops, absl::Milliseconds(300));
  if (r != 0) {
    // Every rank but 0 enters the all-reduce; rank 0 never does.
    std::vector<float> v(8, 1.0f);
    absl::Status s = comm->AllReduceSum(Tensor(v.data(), {8}, DType::kF32));
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("rank " + std::to_string(r) + " AllReduceSum with all ranks"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

struct Grid {
  int tp, pp;
};

TEST(ProcessGroupsTest, GridsOfTheWorld) {
  const int n = WorldSize(), r = WorldRank();
  std::vector<Grid> grids;
  for (int tp = 1; tp <= n; ++tp) {
    if (n % tp == 0) grids.push_back({tp, n / tp});
  }
  for (Grid grid : grids) {
    SCOPED_TRACE("tp=" + std::to_string(grid.tp) + " pp=" + std::to_string(grid.pp));
    FakeOps ops(Device::kCpu);
    GroupOptions o;
    o.tp = grid.tp;
    o.pp = grid.pp;
    o.timeout = absl::Seconds(30);
    absl::StatusOr<ProcessGroups> g = MakeProcessGroupsFromMpi(MPI_COMM_WORLD, o, &ops);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->rank, r);
    EXPECT_EQ(g->tp_rank, r % grid.tp);
    EXPECT_EQ(g->stage, r / grid.tp);
    EXPECT_EQ(g->tp_comm->rank(), g->tp_rank);
    EXPECT_EQ(g->tp_comm->size(), grid.tp);
    EXPECT_EQ(g->pp_comm->rank(), g->stage);
    EXPECT_EQ(g->pp_comm->size(), grid.pp);
    EXPECT_EQ(g->prev_stage(), g->stage - 1);
    EXPECT_EQ(g->next_stage(), g->stage + 1 < grid.pp ? g->stage + 1 : -1);
    // TP all-reduce: the sum of the world ranks of this stage.
    float v = r;
    ASSERT_TRUE(g->tp_comm->AllReduceSum(Tensor(&v, {1}, DType::kF32)).ok());
    const int first = g->stage * grid.tp;
    EXPECT_EQ(v, grid.tp * first + grid.tp * (grid.tp - 1) / 2.0f);
    // PP chain: pass a value from stage 0 to the last stage, each stage adding its world rank.
    float x = 0;
    if (g->prev_stage() >= 0) {
      ASSERT_TRUE(g->pp_comm->Recv(Tensor(&x, {1}, DType::kF32), g->prev_stage()).ok());
    }
    x += r;
    if (g->next_stage() >= 0) {
      ASSERT_TRUE(g->pp_comm->Send(Tensor(&x, {1}, DType::kF32), g->next_stage()).ok());
    } else {
      float want = 0;
      for (int s = 0; s < grid.pp; ++s) want += s * grid.tp + g->tp_rank;
      EXPECT_EQ(x, want);
    }
  }
}

TEST(ProcessGroupsTest, WrongGridIsRefused) {
  FakeOps ops(Device::kCpu);
  GroupOptions o;
  o.tp = WorldSize() + 1;
  absl::StatusOr<ProcessGroups> g = MakeProcessGroupsFromMpi(MPI_COMM_WORLD, o, &ops);
  ASSERT_FALSE(g.ok());
  EXPECT_THAT(std::string(g.status().message()),
              HasSubstr("the world has " + std::to_string(WorldSize()) + " ranks but tp="));
  o.tp = WorldSize();
  o.backend = CommBackend::kNccl;
#ifndef TPSERVE_WITH_NCCL
  g = MakeProcessGroupsFromMpi(MPI_COMM_WORLD, o, &ops);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnimplemented);
#endif
}

// Only rank 0 prints the usual progress; other ranks print their failures.
class FailuresOnly : public ::testing::EmptyTestEventListener {
 public:
  explicit FailuresOnly(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed()) {
      fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, result.file_name(), result.line_number(),
              result.summary());
    }
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  absl::Status s = tpserve::InitMpi(&argc, &argv);
  if (!s.ok()) {
    fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 1;
  }
  const int rank = tpserve::WorldRank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new tpserve::FailuresOnly(rank));
  }
  const int rc = RUN_ALL_TESTS();
  MPI_Finalize();
  return rc;
}
