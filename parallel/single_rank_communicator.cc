// The communicator of a group of one: collectives are identities, AllGather a copy.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/ops.h"
#include "parallel/comm_util.h"
#include "parallel/communicator.h"

namespace tpserve {
namespace {

class SingleRankCommunicator : public Communicator {
 public:
  explicit SingleRankCommunicator(Ops* ops) : ops_(ops) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "single rank"; }

  absl::Status AllReduceSum(Tensor t) override {
    return comm_internal::CheckAllReduceDType(name(), t);
  }

  absl::Status AllGather(const Tensor& in, Tensor out) override {
    TP_RETURN_IF_ERROR(comm_internal::CheckAllGatherShapes(name(), in, out, 1));
    if (in.data == out.data || in.bytes() == 0) return absl::OkStatus();
    if (in.device == Device::kCpu) {
      std::memcpy(out.data, in.data, in.bytes());
    } else if (ops_ != nullptr) {
      ops_->CopyDeviceToDevice(out.data, in.data, in.bytes());
    } else {
      return absl::InvalidArgumentError(
          "single rank: AllGather of a device tensor needs the communicator's Ops");
    }
    return absl::OkStatus();
  }

  absl::Status Send(const Tensor& t, int peer) override { return NoPeer("Send", peer); }
  absl::Status Recv(Tensor t, int peer) override { return NoPeer("Recv", peer); }
  absl::Status Broadcast(Tensor t, int root) override {
    if (root != 0) return comm_internal::CheckPeer(name(), "Broadcast root", root, 1);
    return absl::OkStatus();
  }

 private:
  absl::Status NoPeer(const char* op, int peer) {
    return absl::InvalidArgumentError(absl::StrCat("single rank: ", op, " to/from peer ", peer,
                                                   " in a group of one (no other rank exists)"));
  }
  Ops* ops_;
};

}  // namespace

std::unique_ptr<Communicator> MakeSingleRankCommunicator(Ops* ops) {
  return std::make_unique<SingleRankCommunicator>(ops);
}

}  // namespace tpserve
