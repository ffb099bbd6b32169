// Argument checks shared by the Communicator implementations (internal to parallel/).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace tpserve {
namespace comm_internal {

inline absl::Status CheckAllReduceDType(const std::string& who, const Tensor& t) {
  if (t.dtype != DType::kF32 && t.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": AllReduceSum supports f32 and bf16, got ", t.ShapeString()));
  }
  return absl::OkStatus();
}

inline absl::Status CheckAllGatherShapes(const std::string& who, const Tensor& in,
                                         const Tensor& out, int size) {
  if (in.dtype != out.dtype || out.numel() != size * in.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": AllGather needs out of ", size, " x in's elements and the same dtype (in ",
        in.ShapeString(), ", out ", out.ShapeString(), ")"));
  }
  if (in.device != out.device) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": AllGather in and out must be on the same device"));
  }
  return absl::OkStatus();
}

inline absl::Status CheckPeer(const std::string& who, const char* op, int peer, int size) {
  if (peer < 0 || peer >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", op, " peer ", peer, " is outside the group of ", size, " ranks"));
  }
  return absl::OkStatus();
}

}  // namespace comm_internal
}  // namespace tpserve
