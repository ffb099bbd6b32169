// tpserve-engine-bench --profile: a few eager forward steps (decode at batch 1 and 64, one long
// prefill) with the CUDA op profiler on; prints one table per scenario and returns them as JSON.
#pragma once

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "worker/engine.h"

namespace tpserve {

struct OpProfileScenario {
  std::string name;
  int seqs = 1;
  int context = 1;       // tokens in the cache after the step, per sequence
  bool prefill = false;  // one sequence, `context` query tokens; else one query per sequence
  int steps = 3;
  // Decode only: the last sequence's last `chunk` tokens are queries (a prompt chunk beside the
  // other sequences' decode rows, as continuous batching runs them); 0: none.
  int chunk = 0;
};

// The default scenarios: decode batch 1 at context 768, decode batch 64 at context 1024, 63
// decode rows at context 1024 beside a 449-token prompt chunk (a served step of 512 tokens),
// prefill of `prefill_len` tokens; and decode batch 1 at `batch1_context` too where that is
// another context (the benchmark's batch-1 run, whose mean context is its prompt plus half its
// new tokens: a short one takes other attention splits than 768).
std::vector<OpProfileScenario> DefaultOpProfileScenarios(int prefill_len, int batch1_context);

// Runs each scenario that fits the engine's KV cache and batch limits (others are reported as
// skipped). Needs the CUDA ops.
absl::StatusOr<nlohmann::json> ProfileEngineOps(Engine& engine, int block_size,
                                                const std::vector<OpProfileScenario>& scenarios);

}  // namespace tpserve
