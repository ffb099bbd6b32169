// Benchmark-only switches of CudaOps (see bench_knobs.h).
#include "kernels/cuda/bench_knobs.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/env.h"
#include "common/logging.h"

namespace tpserve {

absl::StatusOr<std::set<std::string, std::less<>>> ParseAblatedOps(absl::string_view list) {
  std::set<std::string, std::less<>> ops;
  for (absl::string_view op : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    if (op != "AttentionDecode" && op != "AddRmsNorm" && op != "Gemm.square") {
      return absl::InvalidArgumentError(
          absl::StrCat(env::kAblateOps.name, ": unknown op '", op,
                       "' (AttentionDecode, AddRmsNorm, Gemm.square)"));
    }
    ops.insert(std::string(op));
  }
  return ops;
}

absl::Status ApplyBenchKnobs(CudaOps* ops) {
  if (EnvIsSet(env::kFusedSkinny)) ops->set_fused_skinny(EnvBool(env::kFusedSkinny));
  if (EnvIsSet(env::kFusedNorm)) ops->set_fused_norm(EnvBool(env::kFusedNorm));
  if (EnvBool(env::kOpProfile)) ops->set_op_profiling(true);
  const std::string ablate = EnvString(env::kAblateOps);
  if (!ablate.empty()) {
    absl::StatusOr<std::set<std::string, std::less<>>> ablated = ParseAblatedOps(ablate);
    if (!ablated.ok()) return ablated.status();
    ops->set_ablated_ops(*std::move(ablated));
    TP_LOG(WARNING) << env::kAblateOps.name << "=" << ablate
                    << ": these ops are skipped, every result is wrong (benchmarking only)";
  }
  return absl::OkStatus();
}

}  // namespace tpserve
