// GPU tests of the custom all-reduce over CUDA IPC (parallel/custom_communicator.h), under mpirun
// with every rank on one GPU (rank % device count): bf16 and f32 sums of many sizes (odd ones and
// a misaligned tensor too) equal, bit for bit, the fp32 sum in rank order rounded once (and the
// fp64 sum within bf16 rounding), on every rank, by one-shot and two-shot alike; a CUDA graph of
// two all-reduces replayed with new inputs; host tensors and the other operations delegated to
// the inner communicator; a rank alone in an all-reduce gives up after the timeout with an error
// naming the ranks; the process groups wrap the TP group with --all-reduce custom / auto.
// Point-to-point (p2p slots): Send / Recv around the ring of ranks, byte for byte, at odd sizes
// and offsets, many messages in a row with no host wait (slot reuse, two sends ahead of their
// receives), interleaved with all-reduces, captured in a CUDA graph and replayed with new inputs;
// a Recv whose sender never comes and a Send whose receiver never comes give up at the deadline
// naming the ranks; the process groups wrap the PP chain for its Send / Recv.
#include "parallel/custom_communicator.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/launchers.h"
#include "parallel/mpi_communicator.h"
#include "tests/testing/mp_test_util.h"

namespace tpserve {
namespace {

using mp_test::WorldRank;
using mp_test::WorldSize;
using ::testing::HasSubstr;

#define SKIP_WITHOUT_GPU()                          \
  if (!HaveGpu()) {                                 \
    std::printf("no CUDA device, test skipped\n");  \
    GTEST_SKIP() << "no CUDA device, test skipped"; \
  }

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

constexpr absl::Duration kTimeout = absl::Seconds(60);

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Rank `rank`'s input element i of call `salt`: uniform in [-2, 2), exactly representable in the
// dtype (every rank regenerates everybody's inputs for its reference).
float Input(int rank, uint64_t salt, int64_t i, bool f32) {
  const uint64_t r = SplitMix((salt * 131 + rank) * 0x100000001b3ull ^ static_cast<uint64_t>(i));
  const float v = static_cast<float>((r >> 40) * (1.0 / (1ull << 24)) * 4.0 - 2.0);
  return f32 ? v : Bf16ToF32(F32ToBf16(v));
}

// Host data of one call: this rank's input bytes and the expected result bytes (the fp32 sum in
// rank order, rounded once), with the fp64 sums.
struct Case {
  std::vector<char> input;
  std::vector<char> expected;
  std::vector<double> exact;
};

Case MakeCase(int64_t numel, bool f32, uint64_t salt) {
  const int n = WorldSize(), me = WorldRank();
  const size_t es = f32 ? 4 : 2;
  Case c;
  c.input.resize(numel * es);
  c.expected.resize(numel * es);
  c.exact.resize(numel);
  for (int64_t i = 0; i < numel; ++i) {
    float acc = 0;
    double exact = 0;
    for (int r = 0; r < n; ++r) {
      const float v = Input(r, salt, i, f32);
      acc = r == 0 ? v : acc + v;
      exact += v;
      if (r == me) {
        if (f32) {
          std::memcpy(&c.input[i * 4], &v, 4);
        } else {
          const uint16_t b = F32ToBf16(v);
          std::memcpy(&c.input[i * 2], &b, 2);
        }
      }
    }
    if (f32) {
      std::memcpy(&c.expected[i * 4], &acc, 4);
    } else {
      const uint16_t b = F32ToBf16(acc);
      std::memcpy(&c.expected[i * 2], &b, 2);
    }
    c.exact[i] = exact;
  }
  return c;
}

// Checks `got` (host bytes of the result) against the case: bit-exact, within rounding of the
// fp64 sum, identical on every rank. Returns the number of mismatching elements.
int64_t Mismatches(const Case& c, const std::vector<char>& got, bool f32) {
  const int64_t numel = static_cast<int64_t>(c.exact.size());
  int64_t bad = 0;
  for (int64_t i = 0; i < numel; ++i) {
    float v = 0;
    if (f32) {
      std::memcpy(&v, &got[i * 4], 4);
    } else {
      uint16_t b = 0;
      std::memcpy(&b, &got[i * 2], 2);
      v = Bf16ToF32(b);
    }
    const bool same_bits =
        std::memcmp(&got[i * (f32 ? 4 : 2)], &c.expected[i * (f32 ? 4 : 2)], f32 ? 4 : 2) == 0;
    const double tol = std::fabs(c.exact[i]) * (f32 ? 1e-6 : 1.0 / 256) + 1e-6;
    if (!same_bits || std::fabs(v - c.exact[i]) > tol) {
      if (bad < 5) {
        ADD_FAILURE() << "element " << i << " of " << numel << ": got " << v << ", fp64 sum "
                      << c.exact[i];
      }
      ++bad;
    }
  }
  return bad;
}

class CustomAllReduceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) return;
    int n = 0;
    cudaGetDeviceCount(&n);
    ASSERT_EQ(cudaSetDevice(WorldRank() % n), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    world_ = mp_test::MakeWorld(kTimeout);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::unique_ptr<CustomAllReduceCommunicator> Make(size_t max_bytes, size_t one_shot_max_bytes,
                                                    absl::Duration timeout = kTimeout,
                                                    size_t p2p_max_bytes = 0) {
    absl::StatusOr<std::unique_ptr<Communicator>> inner =
        MakeMpiCommunicator(MPI_COMM_WORLD, nullptr, timeout, "test group");
    TP_CHECK(inner.ok()) << inner.status();
    CustomAllReduceOptions o;
    o.stream = stream_;
    o.timeout = timeout;
    o.max_bytes = max_bytes;
    o.one_shot_max_bytes = one_shot_max_bytes;
    o.p2p_max_bytes = p2p_max_bytes;
    o.impl = AllReduceImpl::kCustom;
    absl::StatusOr<std::unique_ptr<Communicator>> c = MakeCustomAllReduceCommunicator(
        std::move(inner).value(), MpiBytesAllGather(MPI_COMM_WORLD, timeout, "test exchange"), o);
    TP_CHECK(c.ok()) << c.status();
    return std::unique_ptr<CustomAllReduceCommunicator>(
        static_cast<CustomAllReduceCommunicator*>(c->release()));
  }

  // Every rank's hash of `bytes` is the same.
  void ExpectSameOnEveryRank(const void* data, size_t bytes, const std::string& what) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
    const int n = WorldSize();
    std::vector<int64_t> all(n);
    int64_t mine = static_cast<int64_t>(h);
    ASSERT_TRUE(
        world_->AllGather(Tensor(&mine, {1}, DType::kI64), Tensor(all.data(), {n}, DType::kI64))
            .ok());
    for (int r = 0; r < n; ++r) EXPECT_EQ(all[r], all[0]) << what << ": rank " << r << " differs";
  }

  // One all-reduce of `numel` elements placed `offset_elems` into a device allocation, checked.
  void RunAndCheck(CustomAllReduceCommunicator& comm, int64_t numel, bool f32, uint64_t salt,
                   int64_t offset_elems = 0) {
    SCOPED_TRACE(::testing::Message() << numel << (f32 ? " f32" : " bf16") << " elements, offset "
                                      << offset_elems << ", salt " << salt);
    const size_t es = f32 ? 4 : 2;
    const Case c = MakeCase(numel, f32, salt);
    char* d = nullptr;
    CUDA_OK(cudaMalloc(&d, (numel + offset_elems) * es));
    char* t = d + offset_elems * es;
    CUDA_OK(cudaMemcpyAsync(t, c.input.data(), numel * es, cudaMemcpyHostToDevice, stream_));
    const absl::Status launched =
        comm.AllReduceSum(Tensor(t, {numel}, f32 ? DType::kF32 : DType::kBF16, Device::kCuda));
    ASSERT_TRUE(launched.ok()) << launched;
    const absl::Status s = comm.Synchronize();
    ASSERT_TRUE(s.ok()) << s;
    std::vector<char> got(numel * es);
    CUDA_OK(cudaMemcpy(got.data(), t, numel * es, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(d));
    EXPECT_EQ(Mismatches(c, got, f32), 0);
    ExpectSameOnEveryRank(got.data(), got.size(), "result");
  }

  // One all-gather of `bytes` bytes per rank (input and output placed `offset` bytes into their
  // allocations), checked byte for byte against every rank's known input.
  void GatherAndCheck(CustomAllReduceCommunicator& comm, int64_t bytes, uint64_t salt,
                      int64_t offset = 0) {
    SCOPED_TRACE(::testing::Message()
                 << "all-gather of " << bytes << " bytes, offset " << offset << ", salt " << salt);
    const int n = WorldSize(), me = WorldRank();
    auto byte_of = [&](int rank, int64_t i) {
      return static_cast<char>(SplitMix(salt * 1000003 + rank * 7919 + i) & 0xff);
    };
    std::vector<char> in(bytes), want(bytes * n);
    for (int64_t i = 0; i < bytes; ++i) in[i] = byte_of(me, i);
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < bytes; ++i) want[r * bytes + i] = byte_of(r, i);
    }
    char *d_in = nullptr, *d_out = nullptr;
    CUDA_OK(cudaMalloc(&d_in, bytes + offset));
    CUDA_OK(cudaMalloc(&d_out, bytes * n + offset));
    CUDA_OK(cudaMemsetAsync(d_out, 0x5a, bytes * n + offset, stream_));
    CUDA_OK(cudaMemcpyAsync(d_in + offset, in.data(), bytes, cudaMemcpyHostToDevice, stream_));
    const absl::Status launched =
        comm.AllGather(Tensor(d_in + offset, {bytes}, DType::kI8, Device::kCuda),
                       Tensor(d_out + offset, {bytes * n}, DType::kI8, Device::kCuda));
    ASSERT_TRUE(launched.ok()) << launched;
    const absl::Status s = comm.Synchronize();
    ASSERT_TRUE(s.ok()) << s;
    std::vector<char> got(bytes * n + offset);
    CUDA_OK(cudaMemcpy(got.data(), d_out, got.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(d_in));
    CUDA_OK(cudaFree(d_out));
    int64_t bad = 0;
    for (int64_t i = 0; i < bytes * n; ++i) bad += got[offset + i] != want[i];
    for (int64_t i = 0; i < offset; ++i) bad += got[i] != 0x5a;  // nothing written before out
    EXPECT_EQ(bad, 0);
  }

  void Barrier() {
    int32_t token = 0;
    ASSERT_TRUE(world_->Broadcast(Tensor(&token, {1}, DType::kI32), 0).ok());
  }

  static char MessageByte(int src, uint64_t salt, int64_t i) {
    return static_cast<char>(SplitMix(salt * 1000003 + src * 7919 + i) & 0xff);
  }

  // Device buffers of one ring message: what this rank sends to rank + 1 and what it receives
  // from rank - 1, each `offset` bytes into its allocation.
  struct Message {
    int64_t bytes = 0;
    int64_t offset = 0;
    uint64_t salt = 0;
    std::vector<char> host_in;  // kept until the stream passed its upload
    char* d_send = nullptr;
    char* d_recv = nullptr;
  };

  Message NewMessage(int64_t bytes, int64_t offset, uint64_t salt) {
    Message m;
    m.bytes = bytes;
    m.offset = offset;
    m.salt = salt;
    m.host_in.resize(bytes);
    for (int64_t i = 0; i < bytes; ++i) m.host_in[i] = MessageByte(WorldRank(), salt, i);
    TP_CHECK(cudaMalloc(&m.d_send, bytes + offset + 1) == cudaSuccess);
    TP_CHECK(cudaMalloc(&m.d_recv, bytes + offset + 1) == cudaSuccess);
    TP_CHECK(cudaMemsetAsync(m.d_recv, 0x5a, bytes + offset + 1, stream_) == cudaSuccess);
    TP_CHECK(cudaMemcpyAsync(m.d_send + offset, m.host_in.data(), bytes, cudaMemcpyHostToDevice,
                             stream_) == cudaSuccess);
    return m;
  }

  // After the stream finished: the bytes received are the previous rank's, nothing around them
  // was written. Frees the buffers.
  void CheckAndFree(Message& m) {
    const int prev = (WorldRank() + WorldSize() - 1) % WorldSize();
    std::vector<char> got(m.bytes + m.offset + 1);
    CUDA_OK(cudaMemcpy(got.data(), m.d_recv, got.size(), cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t i = 0; i < m.bytes; ++i) bad += got[m.offset + i] != MessageByte(prev, m.salt, i);
    for (int64_t i = 0; i < m.offset; ++i) bad += got[i] != 0x5a;
    bad += got[m.offset + m.bytes] != 0x5a;
    EXPECT_EQ(bad, 0) << "message of " << m.bytes << " bytes at offset " << m.offset << ", salt "
                      << m.salt;
    cudaFree(m.d_send);
    cudaFree(m.d_recv);
  }

  // `count` messages around the ring (rank r sends to r + 1, receives from r - 1), sizes and
  // offsets cycled, enqueued `burst` sends ahead of their receives with no host wait in
  // between, then checked byte for byte.
  void RingExchange(CustomAllReduceCommunicator& comm, const std::vector<int64_t>& sizes, int count,
                    int burst, uint64_t salt) {
    SCOPED_TRACE(::testing::Message() << count << " ring messages, burst " << burst);
    const int n = WorldSize(), me = WorldRank();
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    const int64_t offsets[] = {0, 1, 6, 13};
    std::vector<Message> msgs;
    for (int i = 0; i < count; ++i) {
      msgs.push_back(NewMessage(sizes[i % sizes.size()], offsets[i % 4], salt + i));
    }
    for (int i = 0; i < count; i += burst) {
      for (int j = i; j < std::min(count, i + burst); ++j) {
        const Message& m = msgs[j];
        const absl::Status s =
            comm.Send(Tensor(m.d_send + m.offset, {m.bytes}, DType::kI8, Device::kCuda), next);
        ASSERT_TRUE(s.ok()) << s;
      }
      for (int j = i; j < std::min(count, i + burst); ++j) {
        const Message& m = msgs[j];
        const absl::Status s =
            comm.Recv(Tensor(m.d_recv + m.offset, {m.bytes}, DType::kI8, Device::kCuda), prev);
        ASSERT_TRUE(s.ok()) << s;
      }
    }
    const absl::Status s = comm.Synchronize();
    ASSERT_TRUE(s.ok()) << s;
    for (Message& m : msgs) CheckAndFree(m);
  }

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Communicator> world_;
};

TEST_F(CustomAllReduceTest, Bf16ManySizesMatchTheRankOrderSumOnEveryRank) {
  SKIP_WITHOUT_GPU();
  auto comm = Make(size_t{64} << 20, size_t{256} << 10);  // the defaults
  EXPECT_THAT(comm->name(), HasSubstr("custom all-reduce"));
  uint64_t salt = 1;
  for (int64_t bytes :
       {int64_t{8} << 10, (int64_t{8} << 10) + 2, int64_t{16} << 10, (int64_t{32} << 10) + 6,
        int64_t{64} << 10, int64_t{256} << 10, (int64_t{256} << 10) + 2, int64_t{1} << 20,
        (int64_t{4} << 20) + 14, int64_t{16} << 20, (int64_t{64} << 20) - 2, int64_t{64} << 20}) {
    RunAndCheck(*comm, bytes / 2, /*f32=*/false, salt++);
  }
}

TEST_F(CustomAllReduceTest, OneShotAndTwoShotGiveTheSameBitsForOddSizesAndOffsets) {
  SKIP_WITHOUT_GPU();
  const size_t max = size_t{4} << 20;
  auto one_shot = Make(max, max);
  auto two_shot = Make(max, 0);
  uint64_t salt = 100;
  for (int64_t numel : {1, 2, 7, 9, 1001, 4097, 65537, 1000003, 2 * 1024 * 1024}) {
    for (int64_t offset : {0, 1, 3}) {
      if ((numel + offset) * 2 > static_cast<int64_t>(max) && offset > 0) continue;
      RunAndCheck(*one_shot, numel, false, salt, offset);
      RunAndCheck(*two_shot, numel, false, salt, offset);
      ++salt;
    }
  }
}

TEST_F(CustomAllReduceTest, F32BothAlgorithms) {
  SKIP_WITHOUT_GPU();
  auto comm = Make(size_t{8} << 20, size_t{64} << 10);
  uint64_t salt = 200;
  for (int64_t numel : {3, 2048, 16383, 16384, 16385, 300001, 2 * 1024 * 1024}) {
    RunAndCheck(*comm, numel, /*f32=*/true, salt++);
    RunAndCheck(*comm, numel, /*f32=*/true, salt++, /*offset_elems=*/1);
  }
}

// Two all-reduces (one-shot and two-shot) captured once and replayed with new inputs: the epochs
// live on the device, so every replay synchronises with the peers' replays.
TEST_F(CustomAllReduceTest, CapturedGraphReplaysWithNewInputs) {
  SKIP_WITHOUT_GPU();
  auto comm = Make(size_t{8} << 20, size_t{64} << 10);
  const int64_t small = 12 * 1024 + 5, large = 1536 * 1024 + 3;  // bf16 elements
  char *a = nullptr, *b = nullptr;
  CUDA_OK(cudaMalloc(&a, small * 2));
  CUDA_OK(cudaMalloc(&b, large * 2));
  RunAndCheck(*comm, 4096, false, 299);  // an eager call first: epochs need not start at 0
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  const absl::Status s1 = comm->AllReduceSum(Tensor(a, {small}, DType::kBF16, Device::kCuda));
  const absl::Status s2 = comm->AllReduceSum(Tensor(b, {large}, DType::kBF16, Device::kCuda));
  CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  ASSERT_TRUE(s1.ok()) << s1;
  ASSERT_TRUE(s2.ok()) << s2;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint64_t replay = 0; replay < 6; ++replay) {
    SCOPED_TRACE(::testing::Message() << "replay " << replay);
    const Case ca = MakeCase(small, false, 300 + 2 * replay);
    const Case cb = MakeCase(large, false, 301 + 2 * replay);
    CUDA_OK(cudaMemcpyAsync(a, ca.input.data(), small * 2, cudaMemcpyHostToDevice, stream_));
    CUDA_OK(cudaMemcpyAsync(b, cb.input.data(), large * 2, cudaMemcpyHostToDevice, stream_));
    CUDA_OK(cudaGraphLaunch(exec, stream_));
    const absl::Status s = comm->Synchronize();
    ASSERT_TRUE(s.ok()) << s;
    std::vector<char> got_a(small * 2), got_b(large * 2);
    CUDA_OK(cudaMemcpy(got_a.data(), a, small * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got_b.data(), b, large * 2, cudaMemcpyDeviceToHost));
    EXPECT_EQ(Mismatches(ca, got_a, false), 0);
    EXPECT_EQ(Mismatches(cb, got_b, false), 0);
    ExpectSameOnEveryRank(got_b.data(), got_b.size(), "replayed result");
  }
  RunAndCheck(*comm, 100000, false, 399);  // eager again after the replays
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(a);
  cudaFree(b);
}

// The all-gather kernel: odd sizes and offsets (partial and unaligned 16-byte units), sizes up
// to max_bytes per rank, alternating with all-reduces on the same epochs and data halves.
TEST_F(CustomAllReduceTest, AllGatherCopiesEveryRanksBytesInRankOrder) {
  SKIP_WITHOUT_GPU();
  const size_t max = size_t{4} << 20;
  auto comm = Make(max, size_t{64} << 10);
  uint64_t salt = 600;
  for (int64_t bytes :
       {int64_t{1}, int64_t{2}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{4097},
        int64_t{64} << 10, (int64_t{129} << 10) + 6, int64_t{1} << 20,
        static_cast<int64_t>(max) - 2, static_cast<int64_t>(max)}) {
    for (int64_t offset : {0, 1, 6}) {
      GatherAndCheck(*comm, bytes, salt++, offset);
      RunAndCheck(*comm, 1000 + bytes % 5000, false, salt++);  // then an all-reduce
    }
  }
}

// An all-reduce and an all-gather (as in a TP decode step: the residual, then the logits)
// captured once and replayed with new inputs.
TEST_F(CustomAllReduceTest, CapturedAllReduceAndAllGatherReplay) {
  SKIP_WITHOUT_GPU();
  auto comm = Make(size_t{8} << 20, size_t{64} << 10);
  const int n = WorldSize(), me = WorldRank();
  const int64_t numel = 4096 + 3, bytes = 5 * 4001;  // bf16 elements; gathered bytes per rank
  char *a = nullptr, *g_in = nullptr, *g_out = nullptr;
  CUDA_OK(cudaMalloc(&a, numel * 2));
  CUDA_OK(cudaMalloc(&g_in, bytes));
  CUDA_OK(cudaMalloc(&g_out, bytes * n));
  GatherAndCheck(*comm, 100, 699);  // an eager call first: epochs need not start at 0
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  const absl::Status s1 = comm->AllReduceSum(Tensor(a, {numel}, DType::kBF16, Device::kCuda));
  const absl::Status s2 = comm->AllGather(Tensor(g_in, {bytes}, DType::kI8, Device::kCuda),
                                          Tensor(g_out, {bytes * n}, DType::kI8, Device::kCuda));
  CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  ASSERT_TRUE(s1.ok()) << s1;
  ASSERT_TRUE(s2.ok()) << s2;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint64_t replay = 0; replay < 6; ++replay) {
    SCOPED_TRACE(::testing::Message() << "replay " << replay);
    const Case ca = MakeCase(numel, false, 700 + replay);
    std::vector<char> in(bytes);
    for (int64_t i = 0; i < bytes; ++i)
      in[i] = static_cast<char>((i * 31 + me * 7 + replay) & 0xff);
    CUDA_OK(cudaMemcpyAsync(a, ca.input.data(), numel * 2, cudaMemcpyHostToDevice, stream_));
    CUDA_OK(cudaMemcpyAsync(g_in, in.data(), bytes, cudaMemcpyHostToDevice, stream_));
    CUDA_OK(cudaGraphLaunch(exec, stream_));
    const absl::Status s = comm->Synchronize();
    ASSERT_TRUE(s.ok()) << s;
    std::vector<char> got_a(numel * 2), got_g(bytes * n);
    CUDA_OK(cudaMemcpy(got_a.data(), a, numel * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got_g.data(), g_out, bytes * n, cudaMemcpyDeviceToHost));
    EXPECT_EQ(Mismatches(ca, got_a, false), 0);
    int64_t bad = 0;
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < bytes; ++i) {
        bad += got_g[r * bytes + i] != static_cast<char>((i * 31 + r * 7 + replay) & 0xff);
      }
    }
    EXPECT_EQ(bad, 0);
  }
  GatherAndCheck(*comm, 100000, 799);  // eager again after the replays
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(a);
  cudaFree(g_in);
  cudaFree(g_out);
}

// The all-reduce fused with the residual add and RMSNorm gives the bits of AllReduceSum followed
// by the norm kernel of kernels/cuda (cuda::LaunchAddRmsNorm) on every rank: residual and normed
// output, for 1 to 32 rows of hidden 4096 and of an odd multiple of 8 (a partial last vector
// loop), eagerly and captured in a graph; beyond one_shot_max_bytes, other dtypes or a hidden size
// the kernel cannot hold, it declines (false) and nothing is written.
TEST_F(CustomAllReduceTest, AllReduceAddRmsNormEqualsTheTwoStepsBitForBit) {
  SKIP_WITHOUT_GPU();
  auto comm = Make(size_t{8} << 20, size_t{256} << 10);
  const int me = WorldRank();
  uint64_t salt = 900;
  auto random_bf16 = [&](int64_t n, float scale, uint64_t seed) {
    std::vector<uint16_t> v(n);
    for (int64_t i = 0; i < n; ++i) {
      const double u = (SplitMix(seed * 7919 + i) >> 11) * (1.0 / 9007199254740992.0);
      v[i] = F32ToBf16(static_cast<float>((u - 0.5) * 2 * scale));
    }
    return v;
  };
  for (const auto& [rows, hidden] : {std::pair<int64_t, int64_t>{1, 4096},
                                     {2, 4096},
                                     {7, 4096},
                                     {32, 4096},
                                     {3, 2056},
                                     {33, 1024}}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows of " << hidden);
    const int64_t n = rows * hidden;
    const auto x = random_bf16(n, 1.0f, salt * 31 + me);  // each rank's partial sums
    const auto res = random_bf16(n, 4.0f, salt);          // the residual: the same on every rank
    const auto w = random_bf16(hidden, 1.5f, salt + 1);
    ++salt;
    auto dev = [&](const std::vector<uint16_t>& h) {
      void* d = nullptr;
      EXPECT_EQ(cudaMalloc(&d, h.size() * 2), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      return d;
    };
    void *x1 = dev(x), *r1 = dev(res), *x2 = dev(x), *r2 = dev(res), *wd = dev(w);
    void *o1 = dev(std::vector<uint16_t>(n)), *o2 = dev(std::vector<uint16_t>(n));
    auto t = [&](void* p, int64_t r, int64_t c) {
      return Tensor(p, {r, c}, DType::kBF16, Device::kCuda);
    };
    const Tensor weight(wd, {hidden}, DType::kBF16, Device::kCuda);
    // The two steps.
    ASSERT_TRUE(comm->AllReduceSum(t(x1, rows, hidden)).ok());
    cuda::LaunchAddRmsNorm(t(r1, rows, hidden), t(x1, rows, hidden), weight, 1e-5f,
                           t(o1, rows, hidden), stream_);
    // Fused: once eagerly; for 7 rows also captured and replayed (residual restored first).
    absl::StatusOr<bool> fused = comm->AllReduceAddRmsNorm(t(x2, rows, hidden), t(r2, rows, hidden),
                                                           weight, 1e-5f, t(o2, rows, hidden));
    ASSERT_TRUE(fused.ok()) << fused.status();
    EXPECT_TRUE(*fused);
    ASSERT_TRUE(comm->Synchronize().ok());
    if (rows == 7) {
      cudaGraph_t graph = nullptr;
      CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      fused = comm->AllReduceAddRmsNorm(t(x2, rows, hidden), t(r2, rows, hidden), weight, 1e-5f,
                                        t(o2, rows, hidden));
      CUDA_OK(cudaStreamEndCapture(stream_, &graph));
      ASSERT_TRUE(fused.ok() && *fused);
      cudaGraphExec_t exec = nullptr;
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 3; ++replay) {
        CUDA_OK(cudaMemcpyAsync(r2, res.data(), n * 2, cudaMemcpyHostToDevice, stream_));
        CUDA_OK(cudaGraphLaunch(exec, stream_));
      }
      ASSERT_TRUE(comm->Synchronize().ok());
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
    std::vector<uint16_t> got_r1(n), got_r2(n), got_o1(n), got_o2(n);
    CUDA_OK(cudaMemcpy(got_r1.data(), r1, n * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got_r2.data(), r2, n * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got_o1.data(), o1, n * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got_o2.data(), o2, n * 2, cudaMemcpyDeviceToHost));
    int64_t bad_r = 0, bad_o = 0;
    for (int64_t i = 0; i < n; ++i) {
      bad_r += got_r1[i] != got_r2[i];
      bad_o += got_o1[i] != got_o2[i];
    }
    EXPECT_EQ(bad_r, 0) << "residual elements differing";
    EXPECT_EQ(bad_o, 0) << "normed elements differing";
    // The residual really changed (a no-op would pass the comparison above only if both did).
    int64_t changed = 0;
    for (int64_t i = 0; i < n; ++i) changed += got_r2[i] != res[i];
    EXPECT_GT(changed, n / 2);
    ExpectSameOnEveryRank(got_o2.data(), got_o2.size() * 2, "normed");
    for (void* p : {x1, r1, x2, r2, wd, o1, o2}) cudaFree(p);
  }
  // Declined: larger than one-shot, f32, hidden not a multiple of 8 or too large.
  void* big = nullptr;
  CUDA_OK(cudaMalloc(&big, size_t{4} << 20));
  const Tensor w4096(big, {4096}, DType::kBF16, Device::kCuda);
  auto declined = [&](Tensor x, const Tensor& w) {
    absl::StatusOr<bool> r = comm->AllReduceAddRmsNorm(x, x, w, 1e-5f, x);
    return r.ok() && !*r;
  };
  EXPECT_TRUE(declined(Tensor(big, {64, 4096}, DType::kBF16, Device::kCuda), w4096));  // 512 KB
  EXPECT_TRUE(declined(Tensor(big, {2, 4096}, DType::kF32, Device::kCuda), w4096));
  EXPECT_TRUE(declined(Tensor(big, {2, 4100}, DType::kBF16, Device::kCuda),
                       Tensor(big, {4100}, DType::kBF16, Device::kCuda)));
  EXPECT_TRUE(declined(Tensor(big, {1, 20480}, DType::kBF16, Device::kCuda),
                       Tensor(big, {20480}, DType::kBF16, Device::kCuda)));
  cudaFree(big);
  RunAndCheck(*comm, 5000, false, 999);  // still in step with the peers
}

TEST_F(CustomAllReduceTest, HostTensorsAndOtherOperationsGoToTheInnerCommunicator) {
  SKIP_WITHOUT_GPU();
  auto comm = Make(size_t{1} << 20, size_t{64} << 10);
  const int n = WorldSize(), me = WorldRank();
  EXPECT_EQ(comm->rank(), me);
  EXPECT_EQ(comm->size(), n);
  std::vector<float> x(1000, static_cast<float>(me + 1));
  ASSERT_TRUE(comm->AllReduceSum(Tensor(x.data(), {1000}, DType::kF32)).ok());
  EXPECT_EQ(x[999], n * (n + 1) / 2.0f);
  std::vector<int32_t> all(n);
  int32_t mine = 10 * me;
  ASSERT_TRUE(
      comm->AllGather(Tensor(&mine, {1}, DType::kI32), Tensor(all.data(), {n}, DType::kI32)).ok());
  for (int r = 0; r < n; ++r) EXPECT_EQ(all[r], 10 * r);
  int32_t root_value = me == 0 ? 77 : -1;
  ASSERT_TRUE(comm->Broadcast(Tensor(&root_value, {1}, DType::kI32), 0).ok());
  EXPECT_EQ(root_value, 77);
  // An i32 device tensor is not the kernel's either (the inner MPI one refuses it).
  int32_t* d = nullptr;
  CUDA_OK(cudaMalloc(&d, 64));
  EXPECT_FALSE(comm->AllReduceSum(Tensor(d, {16}, DType::kI32, Device::kCuda)).ok());
  cudaFree(d);
  RunAndCheck(*comm, 3000, false, 500);  // still in step after the delegated calls
}

// Rank 0 all-reduces alone: its kernel gives up after the timeout and the error names the rank;
// the communicator then refuses everything at once.
TEST_F(CustomAllReduceTest, ARankAloneGivesUpAfterTheTimeout) {
  SKIP_WITHOUT_GPU();
  auto comm = Make(size_t{1} << 20, size_t{64} << 10, absl::Milliseconds(500));
  if (WorldRank() == 0) {
    char* d = nullptr;
    CUDA_OK(cudaMalloc(&d, 8192));
    CUDA_OK(cudaMemset(d, 0, 8192));
    const absl::Time start = absl::Now();
    ASSERT_TRUE(comm->AllReduceSum(Tensor(d, {4096}, DType::kBF16, Device::kCuda)).ok());
    const absl::Status s = comm->Synchronize();
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("rank 0: an all-reduce kernel"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("stage its input"));
    EXPECT_LT(took, absl::Seconds(20));
    const absl::Status again = comm->AllReduceSum(Tensor(d, {4096}, DType::kBF16, Device::kCuda));
    EXPECT_EQ(again.code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(std::string(again.message()), HasSubstr("AllReduceSum: "));
    EXPECT_FALSE(comm->Broadcast(Tensor(d, {1}, DType::kI32, Device::kCuda), 0).ok());
    cudaFree(d);
  }
  Barrier();  // nobody frees its buffer while rank 0's kernel may still write flags into it
}

// Send / Recv by the p2p kernels around the ring: odd sizes (partial 16-byte units) and
// unaligned offsets, up to p2p_max_bytes; one message at a time, then many in a row with no host
// wait (each slot reused many times), then two sends ahead of their receives (both slots full).
TEST_F(CustomAllReduceTest, SendRecvAroundTheRingByteForByte) {
  SKIP_WITHOUT_GPU();
  const size_t p2p_max = size_t{2} << 20;
  auto comm = Make(size_t{1} << 20, size_t{64} << 10, kTimeout, p2p_max);
  EXPECT_THAT(comm->name(), HasSubstr("custom all-reduce and p2p"));
  EXPECT_TRUE(comm->stream_ordered_p2p());
  EXPECT_EQ(comm->stream_ordered_p2p_max_bytes(), p2p_max);
  EXPECT_EQ(comm->buffered_small_sends(), 2);
  const std::vector<int64_t> sizes = {
      1, 2, 15, 16, 17, 4097, 65536, (1 << 20) + 6, 12345, static_cast<int64_t>(p2p_max) - 13};
  uint64_t salt = 1000;
  for (int64_t bytes : sizes) {
    RingExchange(*comm, {bytes}, 1, 1, salt);
    salt += 10;
  }
  RingExchange(*comm, sizes, 40, 1, salt += 100);        // slot reuse: each slot 20 times
  RingExchange(*comm, sizes, 40, 2, salt += 100);        // two sends before their receives
  RingExchange(*comm, {8, 4096}, 200, 2, salt += 1000);  // many small ones (the ids of a step)
}

// The p2p counters are independent of the all-reduce's epochs: sends, all-reduces and receives
// alternate on one stream, checked after each round.
TEST_F(CustomAllReduceTest, SendRecvInterleavedWithAllReduces) {
  SKIP_WITHOUT_GPU();
  auto comm = Make(size_t{4} << 20, size_t{64} << 10, kTimeout, size_t{1} << 20);
  const int n = WorldSize(), me = WorldRank();
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    Message m = NewMessage(1000 + 777 * round, round % 3, 2000 + round);
    const int64_t numel = round % 2 == 0 ? 3001 : 400001;  // one-shot, two-shot
    const Case c = MakeCase(numel, false, 2100 + round);
    char* d = nullptr;
    CUDA_OK(cudaMalloc(&d, numel * 2));
    CUDA_OK(cudaMemcpyAsync(d, c.input.data(), numel * 2, cudaMemcpyHostToDevice, stream_));
    ASSERT_TRUE(
        comm->Send(Tensor(m.d_send + m.offset, {m.bytes}, DType::kI8, Device::kCuda), (me + 1) % n)
            .ok());
    ASSERT_TRUE(comm->AllReduceSum(Tensor(d, {numel}, DType::kBF16, Device::kCuda)).ok());
    ASSERT_TRUE(comm->Recv(Tensor(m.d_recv + m.offset, {m.bytes}, DType::kI8, Device::kCuda),
                           (me + n - 1) % n)
                    .ok());
    const absl::Status s = comm->Synchronize();
    ASSERT_TRUE(s.ok()) << s;
    std::vector<char> got(numel * 2);
    CUDA_OK(cudaMemcpy(got.data(), d, numel * 2, cudaMemcpyDeviceToHost));
    cudaFree(d);
    EXPECT_EQ(Mismatches(c, got, false), 0);
    CheckAndFree(m);
  }
}

// A pipeline stage's boundary as a decode graph holds it: a Send to the next rank and a Recv from
// the previous one captured once, replayed with new inputs (the message counters live on the
// device), with eager messages before and after.
TEST_F(CustomAllReduceTest, CapturedSendAndRecvReplayWithNewInputs) {
  SKIP_WITHOUT_GPU();
  auto comm = Make(size_t{1} << 20, size_t{64} << 10, kTimeout, size_t{1} << 20);
  const int n = WorldSize(), me = WorldRank();
  const int64_t bytes = 2 * 4096 * 8 + 6;  // a residual of 8 rows, and an odd tail
  RingExchange(*comm, {100}, 3, 1, 3000);  // eager first: counters need not start at 0
  Message m = NewMessage(bytes, 0, 0);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  const absl::Status s1 =
      comm->Send(Tensor(m.d_send, {bytes}, DType::kI8, Device::kCuda), (me + 1) % n);
  const absl::Status s2 =
      comm->Recv(Tensor(m.d_recv, {bytes}, DType::kI8, Device::kCuda), (me + n - 1) % n);
  CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  ASSERT_TRUE(s1.ok()) << s1;
  ASSERT_TRUE(s2.ok()) << s2;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint64_t replay = 0; replay < 7; ++replay) {
    SCOPED_TRACE(::testing::Message() << "replay " << replay);
    std::vector<char> in(bytes);
    for (int64_t i = 0; i < bytes; ++i) in[i] = MessageByte(me, 3100 + replay, i);
    CUDA_OK(cudaMemcpyAsync(m.d_send, in.data(), bytes, cudaMemcpyHostToDevice, stream_));
    CUDA_OK(cudaGraphLaunch(exec, stream_));
    const absl::Status s = comm->Synchronize();
    ASSERT_TRUE(s.ok()) << s;
    std::vector<char> got(bytes);
    CUDA_OK(cudaMemcpy(got.data(), m.d_recv, bytes, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t i = 0; i < bytes; ++i) {
      bad += got[i] != MessageByte((me + n - 1) % n, 3100 + replay, i);
    }
    EXPECT_EQ(bad, 0);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(m.d_send);
  cudaFree(m.d_recv);
  RingExchange(*comm, {5000, 7}, 5, 2, 3200);  // eager again after the replays
}

// Rank 0 receives from rank 1, which never sends: the Recv kernel gives up at the deadline and
// the error names both ranks and the message; then rank 1 sends three messages to rank 0, which
// never receives: the third Send (slot 1 again) gives up waiting for the first to be received.
TEST_F(CustomAllReduceTest, P2pWithAPeerThatNeverComesGivesUpAtTheDeadline) {
  SKIP_WITHOUT_GPU();
  char* d = nullptr;
  CUDA_OK(cudaMalloc(&d, 4096));
  {
    auto comm = Make(size_t{1} << 20, size_t{64} << 10, absl::Milliseconds(500), size_t{1} << 20);
    if (WorldRank() == 0) {
      const absl::Time start = absl::Now();
      ASSERT_TRUE(comm->Recv(Tensor(d, {4096}, DType::kI8, Device::kCuda), 1).ok());
      const absl::Status s = comm->Synchronize();
      EXPECT_LT(absl::Now() - start, absl::Seconds(20));
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_THAT(std::string(s.message()),
                  HasSubstr("rank 0: a Recv kernel (message 1 from rank 1"));
      EXPECT_THAT(std::string(s.message()), HasSubstr("waiting for rank 1 to send it"));
      const absl::Status again = comm->Send(Tensor(d, {16}, DType::kI8, Device::kCuda), 1);
      EXPECT_EQ(again.code(), absl::StatusCode::kDeadlineExceeded);
      EXPECT_THAT(std::string(again.message()), HasSubstr("Send: "));
      EXPECT_FALSE(comm->Health().ok());
    }
    Barrier();  // nobody frees its buffer while rank 0's kernel may still read flags
  }
  {
    auto comm = Make(size_t{1} << 20, size_t{64} << 10, absl::Milliseconds(500), size_t{1} << 20);
    if (WorldRank() == 1) {
      for (int i = 0; i < 3; ++i) {
        ASSERT_TRUE(comm->Send(Tensor(d, {4096}, DType::kI8, Device::kCuda), 0).ok());
      }
      const absl::Status s = comm->Synchronize();
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_THAT(std::string(s.message()),
                  HasSubstr("rank 1: a Send kernel (message 3 to rank 0"));
      EXPECT_THAT(std::string(s.message()), HasSubstr("waiting for rank 0 to receive message 1"));
    }
    Barrier();
  }
  cudaFree(d);
}

// The process groups put the custom communicator in front of the PP chain (for its Send / Recv)
// when the TP all-reduce is custom: activations down the chain, ids from the last stage up.
TEST_F(CustomAllReduceTest, ProcessGroupsWrapThePpChain) {
  SKIP_WITHOUT_GPU();
  int device = 0;
  CUDA_OK(cudaGetDevice(&device));
  CudaOps ops(device);
  GroupOptions o;
  o.tp = 1;
  o.pp = WorldSize();
  o.backend = CommBackend::kMpi;
  o.timeout = kTimeout;
  o.cuda_stream = ops.stream();
  o.all_reduce = AllReduceImpl::kCustom;
  absl::StatusOr<ProcessGroups> g = MakeProcessGroupsFromMpi(MPI_COMM_WORLD, o, &ops);
  ASSERT_TRUE(g.ok()) << g.status();
  Communicator& pp = *g->pp_comm;
  EXPECT_THAT(pp.name(), HasSubstr("custom all-reduce and p2p"));
  EXPECT_TRUE(pp.stream_ordered_p2p());
  EXPECT_EQ(pp.buffered_small_sends(), 2);
  const int stage = g->stage, last = WorldSize() - 1;
  const int64_t numel = 4096 * 3 + 1;  // bf16 activations
  uint16_t* act = static_cast<uint16_t*>(ops.Alloc(numel * 2));
  int32_t* ids = static_cast<int32_t*>(ops.Alloc(64 * 4));
  for (int step = 0; step < 5; ++step) {
    std::vector<uint16_t> a(numel);
    if (stage == 0) {
      for (int64_t i = 0; i < numel; ++i) a[i] = static_cast<uint16_t>(i * 3 + step);
      ops.CopyToDevice(act, a.data(), numel * 2);
    } else {
      ASSERT_TRUE(pp.Recv(Tensor(act, {numel}, DType::kBF16, Device::kCuda), stage - 1).ok());
    }
    if (stage < last) {
      ASSERT_TRUE(pp.Send(Tensor(act, {numel}, DType::kBF16, Device::kCuda), stage + 1).ok());
    }
    std::vector<int32_t> got_ids(64, -1);
    if (stage == last) {
      ops.CopyToHost(a.data(), act, numel * 2);
      int64_t bad = 0;
      for (int64_t i = 0; i < numel; ++i) bad += a[i] != static_cast<uint16_t>(i * 3 + step);
      EXPECT_EQ(bad, 0) << "step " << step;
      for (int i = 0; i < 64; ++i) got_ids[i] = 100 * step + i;
      ops.CopyToDevice(ids, got_ids.data(), 64 * 4);
      for (int s = 0; s < last; ++s) {
        ASSERT_TRUE(pp.Send(Tensor(ids, {64}, DType::kI32, Device::kCuda), s).ok());
      }
    } else {
      ASSERT_TRUE(pp.Recv(Tensor(ids, {64}, DType::kI32, Device::kCuda), last).ok());
      ops.CopyToHost(got_ids.data(), ids, 64 * 4);
      for (int i = 0; i < 64; ++i) EXPECT_EQ(got_ids[i], 100 * step + i) << "step " << step;
    }
    EXPECT_TRUE(pp.Health().ok());
  }
  ops.Synchronize();
  ops.Free(act);
  ops.Free(ids);
  Barrier();
}

// The process groups put the custom all-reduce in front of the TP group's backend when asked.
TEST_F(CustomAllReduceTest, ProcessGroupsWrapTheTpGroup) {
  SKIP_WITHOUT_GPU();
  int device = 0;
  CUDA_OK(cudaGetDevice(&device));
  CudaOps ops(device);
  for (AllReduceImpl impl : {AllReduceImpl::kCustom, AllReduceImpl::kAuto}) {
    GroupOptions o;
    o.tp = WorldSize();
    o.pp = 1;
    o.backend = CommBackend::kMpi;
    o.timeout = kTimeout;
    o.cuda_stream = ops.stream();
    o.all_reduce = impl;
    absl::StatusOr<ProcessGroups> g = MakeProcessGroupsFromMpi(MPI_COMM_WORLD, o, &ops);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_THAT(g->tp_comm->name(), HasSubstr("custom all-reduce"));
    EXPECT_THAT(g->pp_comm->name(), ::testing::Not(HasSubstr("custom")));
    const int64_t numel = 5000;
    uint16_t* d = static_cast<uint16_t*>(ops.Alloc(numel * 2));
    std::vector<uint16_t> ones(numel, F32ToBf16(1.0f));
    ops.CopyToDevice(d, ones.data(), numel * 2);
    ASSERT_TRUE(g->tp_comm->AllReduceSum(Tensor(d, {numel}, DType::kBF16, Device::kCuda)).ok());
    std::vector<uint16_t> back(numel);
    ops.CopyToHost(back.data(), d, numel * 2);  // ordered after the kernel on the ops' stream
    for (int64_t i = 0; i < numel; i += 997) EXPECT_EQ(Bf16ToF32(back[i]), WorldSize()) << i;
    ops.Free(d);
    Barrier();  // no rank unmaps its buffer while a peer's kernel may still read it
  }
  GroupOptions o;
  o.tp = WorldSize();
  o.all_reduce = AllReduceImpl::kCustom;  // no stream: refused with the reason
  absl::StatusOr<ProcessGroups> g = MakeProcessGroupsFromMpi(MPI_COMM_WORLD, o, &ops);
  ASSERT_FALSE(g.ok());
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("cuda_stream"));
  EXPECT_EQ(ParseAllReduceImpl("auto").value(), AllReduceImpl::kAuto);
  EXPECT_FALSE(ParseAllReduceImpl("fast").ok());
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) { return tpserve::mp_test::RunMpiTests(&argc, argv); }
