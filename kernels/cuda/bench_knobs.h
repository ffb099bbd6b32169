// Benchmark-only switches of CudaOps: forced unfused paths for A/B runs, op ablation and op
// profiling, read from the environment (common/env.h) by the benchmarks (tpserve-engine-bench,
// tpserve-cuda-bench). The service never applies them.
#pragma once

#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/cuda_ops.h"

namespace tpserve {

// "AttentionDecode,AddRmsNorm,Gemm.square" (any of them, comma-separated) into the set that
// CudaOps::set_ablated_ops takes; an unknown name is an error that lists the known ones.
absl::StatusOr<std::set<std::string, std::less<>>> ParseAblatedOps(absl::string_view list);

// Applies TPSERVE_FUSED_SKINNY, TPSERVE_FUSED_NORM, TPSERVE_ABLATE_OPS and TPSERVE_OP_PROFILE
// to `ops` (before its first step: CUDA graphs capture what is set then).
absl::Status ApplyBenchKnobs(CudaOps* ops);

}  // namespace tpserve
