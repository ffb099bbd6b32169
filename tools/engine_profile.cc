// tpserve-engine-bench --profile (see engine_profile.h). Steps run eagerly (no CUDA graph) so
// that each op is bracketed by events; a device-side stall before each step lets the host
// queue the whole step first, so the ops run back to back as they do in a graph, less the
// overlap that programmatic dependent launch gives there (an event between two kernels
// serializes them).
#include "tools/engine_profile.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#ifdef TPSERVE_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace tpserve {
namespace {

// Sequence s owns blocks [s * per_seq, (s + 1) * per_seq); the cache rows hold whatever the
// earlier benchmark steps left there (the timing does not depend on the values).
BatchMeta ScenarioMeta(const OpProfileScenario& sc, int block_size) {
  const int per_seq = (sc.context + block_size - 1) / block_size;
  const int decode_qlen = sc.prefill ? sc.context : 1;
  BatchMeta m;
  m.num_seqs = sc.seqs;
  m.block_size = block_size;
  m.max_blocks_per_seq = per_seq;
  m.query_start.push_back(0);
  for (int s = 0; s < sc.seqs; ++s) {
    const int qlen = sc.chunk > 0 && s == sc.seqs - 1 ? sc.chunk : decode_qlen;
    for (int b = 0; b < per_seq; ++b) m.block_tables.push_back(s * per_seq + b);
    for (int p = sc.context - qlen; p < sc.context; ++p) {
      m.token_ids.push_back((s * 7919 + p * 31) % 1000);
      m.positions.push_back(p);
      m.slot_mapping.push_back((s * per_seq + p / block_size) * block_size + p % block_size);
    }
    m.num_tokens += qlen;
    m.query_start.push_back(m.num_tokens);
    m.context_lens.push_back(sc.context);
    m.logits_rows.push_back(m.num_tokens - 1);
  }
  return m;
}

}  // namespace

std::vector<OpProfileScenario> DefaultOpProfileScenarios(int prefill_len, int batch1_context) {
  std::vector<OpProfileScenario> s = {{"decode_b1_ctx768", 1, 768, false, 5}};
  if (batch1_context != 768) {
    s.push_back({absl::StrCat("decode_b1_ctx", batch1_context), 1, batch1_context, false, 5});
  }
  s.push_back({"decode_b64_ctx1024", 64, 1024, false, 3});
  s.push_back({"mixed_b63_ctx1024_chunk449", 64, 1024, false, 3, 449});
  s.push_back({absl::StrCat("prefill_", prefill_len), 1, prefill_len, true, 3});
  return s;
}

absl::StatusOr<nlohmann::json> ProfileEngineOps(Engine& engine, int block_size,
                                                const std::vector<OpProfileScenario>& scenarios) {
#ifndef TPSERVE_HAVE_CUDA
  (void)engine;
  (void)block_size;
  (void)scenarios;
  return absl::FailedPreconditionError("--profile needs a CUDA build");
#else
  auto* cuda = dynamic_cast<CudaOps*>(engine.ops());
  if (cuda == nullptr) {
    return absl::FailedPreconditionError("--profile times the CUDA ops: use --device cuda");
  }
  nlohmann::json out = nlohmann::json::object();
  for (const OpProfileScenario& sc : scenarios) {
    const int64_t blocks = int64_t{sc.seqs} * ((sc.context + block_size - 1) / block_size);
    if (blocks * block_size > engine.kv_capacity_tokens()) {
      std::fprintf(stderr, "op profile %s: skipped (needs %ld cache tokens, the cache has %ld)\n",
                   sc.name.c_str(), long(blocks * block_size), long(engine.kv_capacity_tokens()));
      out[sc.name] = {{"skipped", "KV cache too small"}};
      continue;
    }
    const BatchMeta meta = ScenarioMeta(sc, block_size);
    auto warm = engine.Forward(meta);  // sizes workspaces, picks cuBLASLt algorithms
    if (!warm.ok()) {
      std::fprintf(stderr, "op profile %s: skipped (%s)\n", sc.name.c_str(),
                   std::string(warm.status().message()).c_str());
      out[sc.name] = {{"skipped", std::string(warm.status().message())}};
      continue;
    }
    cuda->Synchronize();
    cuda->set_op_profiling(true);
    for (int i = 0; i < sc.steps; ++i) {
      cuda->StallStream(20000);
      cuda->BeginProfiledStep();
      auto r = engine.Forward(meta);
      cuda->EndProfiledStep();
      if (!r.ok()) {
        cuda->set_op_profiling(false);
        return r.status();
      }
    }
    const std::vector<OpProfileRow> rows = cuda->TakeOpProfile();
    cuda->set_op_profiling(false);
    std::fprintf(stderr, "op profile %s (%d seqs, context %d, %s, %d eager steps, PDL %s):\n%s",
                 sc.name.c_str(), sc.seqs, sc.context,
                 sc.prefill     ? "prefill"
                 : sc.chunk > 0 ? "mixed"
                                : "decode",
                 sc.steps, CudaOps::programmatic_launch() ? "allowed" : "off",
                 FormatOpProfile(rows, sc.steps).c_str());
    nlohmann::json table = nlohmann::json::array();
    for (const OpProfileRow& r : rows) {
      table.push_back(
          {{"op", r.op},
           {"shape", r.shape},
           {"calls_per_step", double(r.calls) / sc.steps},
           {"us_per_step", r.total_us / sc.steps},
           {"us_per_call", r.calls > 0 ? r.total_us / r.calls : 0.0},
           {"GBps", r.bytes > 0 && r.total_us > 0 ? r.bytes / (r.total_us * 1e3) : 0.0}});
    }
    out[sc.name] = {{"seqs", sc.seqs},   {"context", sc.context}, {"prefill", sc.prefill},
                    {"chunk", sc.chunk}, {"steps", sc.steps},     {"ops", table}};
  }
  return out;
#endif
}

}  // namespace tpserve
