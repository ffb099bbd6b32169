// tpserve-engine-bench: the one-GPU engine benchmark of the DeepSeek-Coder bf16 guide's
// scenario. Reports weight load time, time to first token, ms per decode token and end-to-end
// time at batch 1, prefill throughput, and batched decode step times, each against the
// hardware limit measured in the same run (copy bandwidth, cuBLAS bf16 GEMM peak).
//
//   tpserve-engine-bench --model DIR [--device cuda] [--prompt-len 512] [--new-tokens 512]
//       [--prefill-len 2048] [--batches 8,32,64] [--context 1024] [--repeats 3] [--json FILE]
//       [--deterministic]
//       [--gpu-memory-utilization F | --kv-cache-mb MB] [--profile]
// The KV cache holds just what the scenarios need unless one of the last two flags sizes it as
// the server does.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "common/logging.h"
#include "common/model_files.h"
#include "common/status.h"
#include "tools/engine_profile.h"
#include "tools/hw_limits.h"
#include "worker/engine.h"
#include "worker/kv_cache.h"
#ifdef TPSERVE_HAVE_CUDA
#include "kernels/cuda/bench_knobs.h"
#endif

namespace tpserve {
namespace {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<int32_t> RandomPrompt(std::mt19937& rng, int len, int64_t vocab) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> p(len);
  for (auto& id : p) id = dist(rng);
  return p;
}

const CommandSpec& BenchSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve-engine-bench",
      "The one-GPU engine benchmark: load time, TTFT, ms per decode token, prefill throughput "
      "and batched decode, each against the hardware limit measured in the same run.",
      {StringFlag("model", "DIR", "model directory [required]"),
       StringFlag("device", "cpu|cuda|auto", "where to run (default auto)"),
       IntFlag("prompt-len", 1, 1 << 20, "batch-1 prompt length (default 512)"),
       IntFlag("new-tokens", 1, 1 << 20, "batch-1 generated tokens (default 512)"),
       IntFlag("prefill-len", 1, 1 << 20, "prefill scenario length (default 2048)"),
       StringFlag("batches", "B1,B2,..", "decode batch sizes (default 8,32,64)"),
       IntFlag("context", 1, 1 << 20, "context of the batched decode scenarios (default 1024)"),
       IntFlag("repeats", 1, 1000, "repeats of each scenario; the median is reported (default 3)"),
       IntFlag("max-batch-tokens", 1, 1 << 20, "tokens in one step (default 8192)"),
       StringFlag("json", "FILE", "write the results as JSON"),
       FloatFlag("gpu-memory-utilization", 0, 1,
                 "size the KV cache as the server does (default: just what the scenarios need)",
                 "F", /*min_exclusive=*/true),
       IntFlag("kv-cache-mb", 0, int64_t{1} << 30, "KV cache in MiB (as the server's flag)", "MB"),
       KvCacheDTypeFlag(), BoolFlag("profile", "per-op CUDA event times of eager steps"),
       BoolFlag("deterministic",
                "batch-invariant kernels (as serve --deterministic), to compare with the default")},
      "Benchmark-only environment switches (TPSERVE_ABLATE_OPS, TPSERVE_FUSED_SKINNY,\n"
      "TPSERVE_FUSED_NORM, TPSERVE_OP_PROFILE): see `tpserve env`."};
  return *spec;
}

absl::Status Main(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags a, Flags::Parse(BenchSpec(), args));
  if (a.help()) return PrintUsage(BenchSpec());
  TP_ASSIGN_OR_RETURN(std::string model_dir, a.Required("model"));
  const int64_t prompt_len = a.GetInt("prompt-len", 512);
  const int64_t new_tokens = a.GetInt("new-tokens", 512);
  const int64_t prefill_len = a.GetInt("prefill-len", 2048);
  const int64_t context = a.GetInt("context", 1024);
  const int64_t repeats = a.GetInt("repeats", 3);
  const int64_t max_batch_tokens = a.GetInt("max-batch-tokens", 8192);
  std::vector<int> batches;
  for (absl::string_view s :
       absl::StrSplit(a.GetOr("batches", "8,32,64"), ',', absl::SkipEmpty())) {
    int b;
    if (!absl::SimpleAtoi(s, &b) || b < 1) return absl::InvalidArgumentError("bad --batches");
    batches.push_back(b);
  }
  const std::string device = ResolveDevice(a.GetOr("device", "auto"));
  nlohmann::json out;
  out["device"] = device;
  out["deterministic"] = a.Flag("deterministic");
  out["model"] = model_dir;

  HwLimits hw;
  if (device == "cuda") {
    hw = MeasureHwLimits();
    out["copy_TBps"] = hw.copy_bytes_per_s / 1e12;
    out["gemm_TFLOPs"] = hw.gemm_flops_per_s / 1e12;
    out["gemm_sustained_TFLOPs"] = hw.gemm_sustained_flops_per_s / 1e12;
    std::fprintf(stderr,
                 "hardware: copy %.2f TB/s (read+write), bf16 GEMM %d^3 %.0f TFLOP/s (burst), "
                 "%.0f TFLOP/s sustained\n",
                 hw.copy_bytes_per_s / 1e12, hw.gemm_size, hw.gemm_flops_per_s / 1e12,
                 hw.gemm_sustained_flops_per_s / 1e12);
  }

  int max_batch = *std::max_element(batches.begin(), batches.end());
  EngineOptions options;
  options.device = device;
  options.deterministic = a.Flag("deterministic");
  TP_ASSIGN_OR_RETURN(options.kv_cache_dtype, ParseKvCacheDType(a.GetOr("kv-cache-dtype", "auto")));
  options.model.max_batch_tokens =
      static_cast<int>(std::max<int64_t>(max_batch_tokens, prefill_len));
  options.model.max_batch_seqs = std::max(max_batch, 1);
  const int64_t tokens_needed = std::max<int64_t>(
      {prompt_len + new_tokens, prefill_len,
       int64_t{max_batch} * (context + max_batch * context / options.model.max_batch_tokens + 24)});
  options.gpu_memory_utilization =
      a.GetDouble("gpu-memory-utilization", options.gpu_memory_utilization);
  const int64_t kv_mb = a.GetInt("kv-cache-mb", 0);
  options.kv_cache_bytes = kv_mb << 20;
  if (!a.Has("gpu-memory-utilization") && !a.Has("kv-cache-mb")) {
    options.num_kv_blocks =
        static_cast<int>((tokens_needed + 2 * max_batch) / options.block_size + 2 * max_batch + 8);
  }
  const auto t0 = std::chrono::steady_clock::now();
  TP_ASSIGN_OR_RETURN(auto engine, Engine::Create(model_dir, options));
  out["kv_cache_dtype"] = std::string(KvCacheDTypeName(engine->runner().kv_dtype()));
  out["kv_capacity_tokens"] = engine->kv_capacity_tokens();
#ifdef TPSERVE_HAVE_CUDA
  // Before the first step: decode graphs are captured lazily with what is set then.
  if (auto* cuda = dynamic_cast<CudaOps*>(engine->ops())) TP_RETURN_IF_ERROR(ApplyBenchKnobs(cuda));
#endif
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const ModelConfig& cfg = engine->config();
  const double weight_bytes = static_cast<double>(engine->model().weight_bytes());
  out["load_s"] = load_s;
  out["weight_GB"] = weight_bytes / 1e9;
  std::fprintf(stderr, "loaded %.2f GB of weights in %.2f s\n", weight_bytes / 1e9, load_s);
  std::mt19937 rng(1);

  // Batch 1: prompt_len prompt, new_tokens greedy tokens (warm-up run first).
  {
    GenerateRequest req;
    req.prompt = RandomPrompt(rng, static_cast<int>(prompt_len), cfg.vocab_size);
    req.max_new_tokens = static_cast<int>(new_tokens);
    req.ignore_eos = true;
    GenerateRequest warm = req;
    warm.max_new_tokens = 16;
    TP_RETURN_IF_ERROR(engine->Generate({warm}).status());
    std::vector<double> ttft, decode, e2e;
    for (int r = 0; r < repeats; ++r) {
      const auto s = std::chrono::steady_clock::now();
      TP_ASSIGN_OR_RETURN(auto res, engine->Generate({req}));
      e2e.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count());
      const auto& ms = res[0].step_ms;
      ttft.push_back(ms.at(0));
      decode.push_back(Median(std::vector<double>(ms.begin() + 1, ms.end())));
    }
    const double decode_ms = Median(decode);
    // HBM bandwidth is shared by reads and writes: a copy moving X bytes/s (read + write)
    // bounds a read-only stream at about X bytes/s.
    const double floor_ms = hw.copy_bytes_per_s > 0 ? weight_bytes / hw.copy_bytes_per_s * 1e3 : 0;
    out["batch1"] = {{"prompt_len", prompt_len},
                     {"new_tokens", new_tokens},
                     {"ttft_ms", Median(ttft)},
                     {"decode_ms_per_token", decode_ms},
                     {"e2e_s", Median(e2e)},
                     {"weight_read_floor_ms", floor_ms},
                     {"fraction_of_floor", floor_ms > 0 ? floor_ms / decode_ms : 0},
                     {"effective_weight_TBps", weight_bytes / (decode_ms * 1e-3) / 1e12}};
    std::fprintf(stderr,
                 "batch 1, prompt %ld, %ld new: TTFT %.2f ms, decode %.3f ms/token (floor %.3f ms,"
                 " %.0f%%), e2e %.2f s\n",
                 long(prompt_len), long(new_tokens), Median(ttft), decode_ms, floor_ms,
                 floor_ms > 0 ? 100 * floor_ms / decode_ms : 0.0, Median(e2e));
  }

  // Prefill of prefill_len tokens (one sequence, logits of the last row), two ways: isolated
  // (the GPU idle for half a second before each, as for a lone request: the clock starts at its
  // boost) and back to back (the GPU busy throughout, as under load: within ~0.2 s of sustained
  // GEMMs the H200 lowers its SM clock to stay under its 700 W power cap). The isolated figure
  // is held against the burst GEMM peak, the back-to-back one against the sustained peak.
  {
    // Wall-clock time, to line the prefill up with a clock/power log (tools/gpu_job.sh).
    auto wall_ms = [] {
      return static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
    };
    GenerateRequest req;
    req.prompt = RandomPrompt(rng, static_cast<int>(prefill_len), cfg.vocab_size);
    req.max_new_tokens = 1;
    req.ignore_eos = true;
    TP_RETURN_IF_ERROR(engine->Generate({req}).status());
    const int n_rep = static_cast<int>(std::max<int64_t>(repeats, 7));
    std::vector<double> isolated, back_to_back;
    std::fprintf(stderr, "prefill isolated from unix ms %lld\n", wall_ms());
    for (int r = 0; r < n_rep; ++r) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      TP_ASSIGN_OR_RETURN(auto res, engine->Generate({req}));
      isolated.push_back(res[0].step_ms.at(0));
    }
    std::fprintf(stderr, "prefill back-to-back from unix ms %lld\n", wall_ms());
    for (int r = 0; r < n_rep; ++r) {
      TP_ASSIGN_OR_RETURN(auto res, engine->Generate({req}));
      back_to_back.push_back(res[0].step_ms.at(0));
    }
    std::fprintf(stderr, "prefill back-to-back to unix ms %lld\n", wall_ms());
    // The projections of every layer for every token, the lm_head for the one row sampled, and
    // causal attention (QK^T and PV over n^2 / 2 pairs); the embedding is a lookup.
    const double n = static_cast<double>(prefill_len);
    const double h = cfg.hidden_size, d = cfg.head_dim;
    const double layer_params = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d +
                                cfg.num_heads * d * h + 3.0 * h * cfg.intermediate_size;
    const double flops = 2.0 * cfg.num_layers * layer_params * n + 2.0 * cfg.vocab_size * h +
                         2.0 * cfg.num_layers * n * n * cfg.num_heads * d;
    auto frac = [&](double ms, double peak) { return peak > 0 ? flops / (ms * 1e-3) / peak : 0; };
    const double ti = Median(isolated), tb = Median(back_to_back);
    out["prefill"] = {
        {"tokens", prefill_len},
        {"ms", ti},
        {"TFLOPs", flops / (ti * 1e-3) / 1e12},
        {"fraction_of_gemm_peak", frac(ti, hw.gemm_flops_per_s)},
        {"isolated_ms", isolated},
        {"back_to_back_ms", tb},
        {"back_to_back_TFLOPs", flops / (tb * 1e-3) / 1e12},
        {"back_to_back_fraction_of_sustained_gemm_peak", frac(tb, hw.gemm_sustained_flops_per_s)},
        {"back_to_back_repeats_ms", back_to_back}};
    auto print_all = [](const char* what, const std::vector<double>& v) {
      std::fprintf(stderr, "prefill %s repeats (ms):", what);
      for (double x : v) std::fprintf(stderr, " %.2f", x);
      std::fprintf(stderr, "\n");
    };
    print_all("isolated", isolated);
    print_all("back-to-back", back_to_back);
    std::fprintf(stderr,
                 "prefill %ld tokens: isolated %.2f ms, %.0f TFLOP/s (%.0f%% of the burst GEMM "
                 "peak); back to back %.2f ms, %.0f TFLOP/s (%.0f%% of the sustained GEMM peak)\n",
                 long(prefill_len), ti, flops / (ti * 1e-3) / 1e12,
                 100 * frac(ti, hw.gemm_flops_per_s), tb, flops / (tb * 1e-3) / 1e12,
                 100 * frac(tb, hw.gemm_sustained_flops_per_s));
  }

  // Batched decode at context `context`.
  nlohmann::json rows = nlohmann::json::array();
  for (int b : batches) {
    std::vector<GenerateRequest> reqs(b);
    for (auto& r : reqs) {
      r.prompt = RandomPrompt(rng, static_cast<int>(context), cfg.vocab_size);
      // Prefill chunks of later sequences share steps with the first ones' decode: run long
      // enough for 16 decode-only steps after every prompt is in.
      r.max_new_tokens = static_cast<int>(b * context / options.model.max_batch_tokens) + 20;
      r.ignore_eos = true;
    }
    TP_ASSIGN_OR_RETURN(auto res, engine->Generate(reqs));
    // Steps of the last sequence to be prefilled whose forward held exactly b tokens: all
    // sequences decoding. Its first such step is skipped (graph warm-up for this batch).
    const GenerateResult& last = res.back();
    std::vector<double> decode_steps;
    for (size_t i = 1; i < last.step_ms.size(); ++i) {
      if (last.step_tokens[i] == b) decode_steps.push_back(last.step_ms[i]);
    }
    if (decode_steps.size() < 4) {
      return absl::InternalError(
          absl::StrCat("batch ", b, ": only ", decode_steps.size(), " decode-only steps"));
    }
    const double step = Median(std::vector<double>(decode_steps.begin() + 1, decode_steps.end()));
    const double mean_context = double(context) + double(last.step_ms.size()) / 2;
    // The KV bytes a step reads, scales included, in the cache's dtype.
    const double kv_bytes =
        double(b) * mean_context *
        KvCache::BlockBytes(static_cast<int>(cfg.num_layers), 1, static_cast<int>(cfg.num_kv_heads),
                            static_cast<int>(cfg.head_dim), engine->runner().kv_dtype());
    const double floor_ms =
        hw.copy_bytes_per_s > 0 ? (weight_bytes + kv_bytes) / hw.copy_bytes_per_s * 1e3 : 0;
    rows.push_back({{"batch", b},
                    {"context", context},
                    {"step_ms", step},
                    {"tokens_per_s", b / (step * 1e-3)},
                    {"bytes_floor_ms", floor_ms},
                    {"ratio_to_floor", floor_ms > 0 ? step / floor_ms : 0}});
    std::fprintf(stderr,
                 "decode batch %d, context %ld: %.3f ms/step, %.0f tokens/s (floor %.3f ms,"
                 " %.2fx)\n",
                 b, long(context), step, b / (step * 1e-3), floor_ms,
                 floor_ms > 0 ? step / floor_ms : 0.0);
  }
  out["batched_decode"] = rows;
  if (a.Flag("profile")) {  // per-op CUDA event times of eager steps (tools/engine_profile.h)
    TP_ASSIGN_OR_RETURN(
        out["op_profile"],
        ProfileEngineOps(*engine, options.block_size,
                         DefaultOpProfileScenarios(static_cast<int>(prefill_len),
                                                   static_cast<int>(prompt_len + new_tokens / 2))));
  }
  // Device memory in use (a CUDA build run on the CPU, e.g. on a machine without a GPU, has none).
  out["peak_device_memory_GB"] = device == "cuda" ? DeviceMemoryInUse() / 1e9 : 0.0;
  // Whether steps were launched before the previous one finished (TPSERVE_LAUNCH_AHEAD), so
  // that an A/B run shows which path it measured.
  out["launch_ahead"] = engine->runner().launch_ahead();
  out["steps_launched_ahead"] = engine->runner().steps_launched_ahead();
  std::fprintf(stderr, "launch ahead: %s, %lld steps launched ahead\n",
               engine->runner().launch_ahead() ? "on" : "off",
               static_cast<long long>(engine->runner().steps_launched_ahead()));
#ifdef TPSERVE_HAVE_CUDA
  // How many cuBLASLt plans took the cuBLASLt table's choice (TPSERVE_CUBLASLT_TABLE).
  if (auto* cuda = dynamic_cast<CudaOps*>(engine->ops())) {
    const auto [plans, from_table] = cuda->CublasLtPlans();
    out["cublaslt_plans"] = plans;
    out["cublaslt_plans_from_table"] = from_table;
    std::fprintf(stderr, "cuBLASLt plans: %d, %d of them from the table\n", plans, from_table);
  }
#endif
  const std::string json_path = a.GetOr("json", "");
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
  std::cout << out.dump() << std::endl;
  return absl::OkStatus();
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) {
  tpserve::SetLogPrefix("engine");
  absl::Status s = tpserve::Main(std::vector<std::string>(argv + 1, argv + argc));
  if (!s.ok()) {
    std::fprintf(stderr, "tpserve-engine-bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
