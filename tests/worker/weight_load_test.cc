// Weight loading on a device takes another path than on the CPU: tensors stored in the compute
// dtype stream from the mapped file through the ops' uploader (column slices as strided rows),
// others are converted on the host first. Here both device paths run on host memory (an Ops
// stand-in that reports CUDA, with the default uploader) and must fill the weight allocation
// with exactly the bytes the host path reads, for every rank of tp = 1 and 2, bf16 and f32 files.
#include <cstring>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/model_files.h"
#include "parallel/communicator.h"
#include "parallel/shard_plan.h"
#include "tests/testing/fake_ops.h"
#include "tests/testing/test_models.h"
#include "worker/model.h"

namespace tpserve {
namespace {

// Host memory reporting `device`, computing in `dtype`, remembering its allocations.
class RecordingOps : public FakeOps {
 public:
  RecordingOps(Device device, DType dtype) : FakeOps(device), dtype_(dtype) {}
  DType compute_dtype() const override { return dtype_; }
  void* Alloc(size_t bytes) override {
    void* p = FakeOps::Alloc(bytes);
    std::memset(p, 0, bytes);  // the alignment gaps between tensors compare equal
    allocs.push_back({p, bytes});
    return p;
  }
  struct Block {
    void* ptr;
    size_t bytes;
  };
  std::vector<Block> allocs;

 private:
  DType dtype_;
};

// A group member that loading never talks to.
class IdleCommunicator : public Communicator {
 public:
  IdleCommunicator(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllReduceSum(Tensor) override { return Unused(); }
  absl::Status AllGather(const Tensor&, Tensor) override { return Unused(); }
  absl::Status Send(const Tensor&, int) override { return Unused(); }
  absl::Status Recv(Tensor, int) override { return Unused(); }
  absl::Status Broadcast(Tensor, int) override { return Unused(); }
  std::string name() const override { return "idle"; }

 private:
  static absl::Status Unused() { return absl::UnimplementedError("not used while loading"); }
  int rank_, size_;
};

ModelConfig Config() {
  ModelConfig c = testing_util::AwkwardConfig();
  c.head_dim = 64;  // a head size the CUDA kernels take (the check runs on a "CUDA" device)
  c.hidden_size = 96;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.intermediate_size = 100;
  c.attention_bias = true;
  c.o_proj_bias = true;
  return c;
}

// The weight allocation (the first one a load makes) after loading `rank` on `ops`.
std::vector<char> LoadedWeights(const ModelFiles& files, const ShardPlan& plan, int rank,
                                RecordingOps& ops) {
  const RankShard shard = plan.ForRank(files.config(), rank);
  IdleCommunicator tp(shard.tp_rank, plan.tp), pp(shard.stage, plan.pp);
  auto model = LlamaModel::Load(files, plan, rank, &ops, {&tp, &pp}, ModelOptions{});
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok() || ops.allocs.empty()) return {};
  EXPECT_EQ(ops.allocs[0].bytes, (*model)->weight_bytes());
  const char* p = static_cast<const char*>(ops.allocs[0].ptr);
  return std::vector<char>(p, p + ops.allocs[0].bytes);
}

TEST(WeightLoadTest, DevicePathLoadsTheBytesTheHostPathReads) {
  for (DType file_dtype : {DType::kBF16, DType::kF32}) {
    const std::string dtype_name(DTypeName(file_dtype));
    const std::string name = "weight_load_" + dtype_name;
    const std::string dir = testing_util::WriteTestModel(Config(), name, 11, file_dtype);
    auto files = ModelFiles::Open(dir);
    ASSERT_TRUE(files.ok()) << files.status();
    for (int tp : {1, 2}) {
      PlanOptions po;
      po.tp = tp;
      po.bytes_per_elem = 2;
      auto plan = PlanShards(files->config(), po);
      ASSERT_TRUE(plan.ok()) << plan.status();
      for (int rank = 0; rank < tp; ++rank) {
        SCOPED_TRACE(absl::StrCat(dtype_name, " file, tp ", tp, " rank ", rank));
        RecordingOps host(Device::kCpu, DType::kBF16), device(Device::kCuda, DType::kBF16);
        const std::vector<char> want = LoadedWeights(*files, *plan, rank, host);
        const std::vector<char> got = LoadedWeights(*files, *plan, rank, device);
        ASSERT_FALSE(want.empty());
        ASSERT_EQ(got.size(), want.size());
        EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0);
        EXPECT_GT(device.to_device, 1);  // the weights went through the uploader
        EXPECT_EQ(host.to_device, 1);    // only the RoPE frequencies
      }
    }
  }
}

}  // namespace
}  // namespace tpserve
