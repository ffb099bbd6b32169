// `tpserve bench` (see bench_cmd.h): flags, presets, the progress bar, the text and JSON reports.
#include "tools/bench/bench_cmd.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <thread>

#include <google/protobuf/util/json_util.h>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/env.h"
#include "common/flags.h"
#include "common/status.h"
#include "tools/bench/determinism.h"
#include "tools/bench/load_gen.h"
#include "tools/bench/workload.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

using bench::LengthDist;

const CommandSpec& BenchSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve bench",
      "Measures a running server: throughput and latency percentiles (presets, JSON).",
      WithServerEndpointFlags(
          {StringFlag("preset", "latency|batch32|batch64|batch128|chat|shared-prefix",
                      "a named workload (--list-presets)"),
           IntFlag("concurrency", 0, 1 << 20, "requests in flight (open loop: a cap; default 1)"),
           StringFlag("request-rate", "R|inf", "open loop: Poisson arrivals at R requests/s"),
           IntFlag("num-requests", 1, int64_t{1} << 30, "requests to send (default 16)"),
           IntFlag("warmup", 0, 1 << 20, "warm-up requests, not measured (default 1)"),
           FloatFlag("timeout", 0, 1e9, "deadline of each request in seconds (default 600)", "S",
                     /*min_exclusive=*/true),
           FloatFlag("info-timeout", 0, 1e9,
                     "seconds to wait for the server to answer GetModelInfo (default 60)", "S"),
           StringFlag("prompt-len", "N|DIST", "prompt length in tokens (default 512)"),
           StringFlag("prompt-len-dist", "DIST", "prompt length distribution"),
           StringFlag("output-len", "N|DIST", "output length in tokens (default 128)"),
           StringFlag("output-len-dist", "DIST", "output length distribution"),
           IntFlag("turns", 0, 1 << 20, "chat: turns per conversation", "T"),
           IntFlag("num-conversations", 1, 1 << 20, "chat: conversations", "C"),
           StringFlag("user-turn-len", "N|DIST", "chat: tokens the user adds per turn"),
           StringFlag("user-turn-len-dist", "DIST", "chat: distribution of the user turn length"),
           IntFlag("shared-prefix-len", 0, 1 << 20,
                   "one shared prefix of N tokens in front of every prompt (default 0)"),
           StringFlag("prompt-kind", "ids|text",
                      "random token ids below the vocab size, or their text (default ids)"),
           IntFlag("seed", INT64_MIN, INT64_MAX,
                   "seed of prompts, lengths and arrivals (default 0)", "S"),
           FloatFlag("temperature", 0, 1e6, "sampling temperature", "T"),
           FloatFlag("top-p", 0, 1, "nucleus sampling mass", "P"),
           IntFlag("top-k", 0, int64_t{1} << 30, "sample among the K most likely tokens", "K"),
           IntFlag("sampling-seed", INT64_MIN, INT64_MAX, "sampling seed", "S"),
           FloatFlag("repetition-penalty", 0, 1e6, "penalty of tokens already present", "R"),
           IntFlag("logprobs", 0, 20,
                   "ask for every token's logprob and the N most likely tokens (default: none)",
                   "N"),
           BoolFlag(
               "check-deterministic",
               "send the requests all at once, then one at a time, and compare every answer "
               "(token ids; logprobs bit for bit with --logprobs); exit 1 when one differs. "
               "Even requests sample (--temperature, default 1; seed --sampling-seed + index), "
               "odd ones are greedy. --num-requests defaults to the preset's concurrency"),
           BoolFlag("no-ignore-eos", "stop at the end-of-sequence token"),
           BoolFlag("no-stream", "unary calls (no TTFT / ITL)"),
           StringFlag("json", "FILE|-",
                      "write the JSON report (-: on stdout instead of the table)"),
           BoolFlag("per-request", "add every request's record to the JSON"),
           StringFlag("label", "TEXT", "label stored in the report"),
           BoolFlag("progress", "draw a progress bar on stderr"),
           BoolFlag("no-progress", "no progress bar (default when stderr is not a terminal)"),
           BoolFlag("allow-errors", "exit 0 even if requests failed"),
           BoolFlag("list-presets", "list the presets and exit"),
           StringFlag(
               "compare-engine", "MODEL_DIR",
               "after the served run, run the in-process engine on the first --concurrency "
               "planned requests as one batch; print served TPOT / engine ms per decode step"),
           StringFlag("engine-device", "cpu|cuda|auto", "--compare-engine's device (default auto)"),
           FloatFlag("engine-gpu-memory-utilization", 0, 1,
                     "--compare-engine's share of the GPU (default 0.4; start the server with room "
                     "for it)",
                     "F", /*min_exclusive=*/true)}),
      "DIST: uniform:LO:HI or normal:MEAN:STD[:MIN:MAX]"};
  return *spec;
}

struct BenchFlags {
  ServerEndpoint server;
  std::string preset;
  std::string label;
  bench::WorkloadSpec spec;
  bench::LoadOptions load;
  std::string json_path;
  bool per_request = false;
  bool progress = false;
  bool allow_errors = false;
  bool check_deterministic = false;
  std::string engine_model;  // --compare-engine
  std::string engine_device = "auto";
  double engine_gpu_memory_utilization = 0.4;
};

// The in-process engine on the same lengths: one batch of the plan's first `concurrency`
// requests, greedy (lengths matter here, not tokens), after a warm-up.
struct EngineComparison {
  int batch = 0;
  double ms_per_token = 0;  // median over the batch of each sequence's mean decode step
};

absl::StatusOr<EngineComparison> RunEngine(const BenchFlags& f,
                                           const std::vector<bench::PlannedRequest>& plan) {
  EngineOptions options;
  options.device = f.engine_device;
  options.gpu_memory_utilization = f.engine_gpu_memory_utilization;
  options.model.max_batch_seqs = static_cast<int>(std::max<int64_t>(f.load.concurrency, 1));
  TP_ASSIGN_OR_RETURN(auto engine, Engine::Create(f.engine_model, options));
  std::vector<GenerateRequest> reqs;
  for (const bench::PlannedRequest& p : plan) {
    if (static_cast<int64_t>(reqs.size()) >= std::max<int64_t>(f.load.concurrency, 1)) break;
    GenerateRequest r;
    r.prompt = p.prompt;
    r.max_new_tokens = static_cast<int>(p.max_new_tokens);
    r.ignore_eos = true;
    reqs.push_back(std::move(r));
  }
  if (reqs.empty()) return absl::InvalidArgumentError("--compare-engine: no request planned");
  std::vector<GenerateRequest> warm = reqs;
  for (GenerateRequest& r : warm) r.max_new_tokens = std::min(r.max_new_tokens, 4);
  TP_RETURN_IF_ERROR(engine->Generate(warm).status());
  TP_ASSIGN_OR_RETURN(std::vector<GenerateResult> results, engine->Generate(reqs));
  std::vector<double> per_seq;
  for (const GenerateResult& r : results) {
    if (r.step_ms.size() < 2) continue;  // the first step is the prefill
    double sum = 0;
    for (size_t i = 1; i < r.step_ms.size(); ++i) sum += r.step_ms[i];
    per_seq.push_back(sum / static_cast<double>(r.step_ms.size() - 1));
  }
  if (per_seq.empty()) {
    return absl::InvalidArgumentError("--compare-engine needs --output-len of at least 2");
  }
  std::sort(per_seq.begin(), per_seq.end());
  EngineComparison c;
  c.batch = static_cast<int>(reqs.size());
  c.ms_per_token = per_seq[per_seq.size() / 2];
  return c;
}

absl::StatusOr<LengthDist> LengthFlag(const Flags& a, const std::string& name,
                                      const LengthDist& fallback) {
  const std::string dist_name = name + "-dist";
  if (a.Has(name) && a.Has(dist_name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("give at most one of --", name, " and --", dist_name));
  }
  if (a.Has(name)) return LengthDist::Parse(name, *a.Get(name));
  if (a.Has(dist_name)) return LengthDist::Parse(dist_name, *a.Get(dist_name));
  return fallback;
}

absl::StatusOr<int64_t> PositiveInt(const Flags& a, const std::string& name, int64_t fallback,
                                    int64_t min = 1) {
  const int64_t v = a.GetInt(name, fallback);
  if (v < min) return absl::InvalidArgumentError(absl::StrCat("--", name, " must be >= ", min));
  return v;
}

absl::StatusOr<BenchFlags> ParseFlags(const Flags& a) {
  BenchFlags f;
  TP_ASSIGN_OR_RETURN(f.server, ServerEndpointFromFlags(a));
  bench::Preset preset;  // defaults when no preset is named
  preset.name = "";
  preset.prompt_len = 512;
  preset.output_len = 128;
  preset.concurrency = 1;
  preset.num_requests = 16;
  if (a.Has("preset")) {
    TP_ASSIGN_OR_RETURN(preset, bench::FindPreset(*a.Get("preset")));
  }
  f.preset = preset.name;
  f.label = a.GetOr("label", "");
  bench::WorkloadSpec& s = f.spec;
  TP_ASSIGN_OR_RETURN(s.prompt_len,
                      LengthFlag(a, "prompt-len", LengthDist::Fixed(preset.prompt_len)));
  TP_ASSIGN_OR_RETURN(s.output_len,
                      LengthFlag(a, "output-len", LengthDist::Fixed(preset.output_len)));
  f.check_deterministic = a.Flag("check-deterministic");
  // The check sends every request at once: a named preset's concurrency is its request count.
  const int64_t default_requests = f.check_deterministic && a.Has("preset")
                                       ? preset.concurrency
                                       : std::max<int64_t>(preset.num_requests, 1);
  TP_ASSIGN_OR_RETURN(s.num_requests, PositiveInt(a, "num-requests", default_requests));
  TP_ASSIGN_OR_RETURN(s.turns, PositiveInt(a, "turns", preset.turns, 0));
  TP_ASSIGN_OR_RETURN(s.conversations, PositiveInt(a, "num-conversations",
                                                   std::max<int64_t>(preset.conversations, 1)));
  TP_ASSIGN_OR_RETURN(s.user_turn_len,
                      LengthFlag(a, "user-turn-len",
                                 LengthDist::Fixed(std::max<int64_t>(preset.user_turn_len, 1))));
  if (s.turns == 0 && (a.Has("num-conversations") || a.Has("user-turn-len"))) {
    return absl::InvalidArgumentError(
        "--num-conversations / --user-turn-len need --turns (or --preset chat)");
  }
  if (s.turns > 0 && a.Has("num-requests")) {
    return absl::InvalidArgumentError(
        "--num-requests does not apply to chat: it sends --num-conversations x --turns requests");
  }
  TP_ASSIGN_OR_RETURN(s.shared_prefix_len,
                      PositiveInt(a, "shared-prefix-len", preset.shared_prefix_len, 0));
  const int64_t seed = a.GetInt("seed", 0);
  s.seed = static_cast<uint64_t>(seed);

  bench::LoadOptions& l = f.load;
  l.server = f.server;
  TP_ASSIGN_OR_RETURN(l.concurrency, PositiveInt(a, "concurrency", preset.concurrency,
                                                 a.Has("request-rate") ? 0 : 1));
  if (a.Has("request-rate")) {
    const std::string rate = absl::AsciiStrToLower(*a.Get("request-rate"));
    if (rate == "inf") {
      s.request_rate = INFINITY;
    } else {
      if (!absl::SimpleAtod(rate, &s.request_rate) || !(s.request_rate > 0)) {
        return absl::InvalidArgumentError("--request-rate must be > 0 (requests/s) or inf");
      }
    }
    l.open_loop = true;
    // Open loop: --concurrency caps the requests in flight; unset = no cap.
    if (!a.Has("concurrency")) l.concurrency = 0;
  }
  l.stream = !a.Flag("no-stream");
  l.ignore_eos = !a.Flag("no-ignore-eos");
  const std::string kind = a.GetOr("prompt-kind", "ids");
  if (kind != "ids" && kind != "text") {
    return absl::InvalidArgumentError(
        absl::StrCat("--prompt-kind '", kind, "': expected ids or text"));
  }
  l.text_prompts = kind == "text";
  if (a.Has("temperature")) {
    const double v = a.GetDouble("temperature", 0);
    l.sampling.set_temperature(static_cast<float>(v));
  }
  if (a.Has("top-p")) {
    const double v = a.GetDouble("top-p", 1);
    l.sampling.set_top_p(static_cast<float>(v));
  }
  if (a.Has("top-k")) {
    const int64_t v = a.GetInt("top-k", 0);
    l.sampling.set_top_k(static_cast<int32_t>(v));
  }
  if (a.Has("sampling-seed")) {
    const int64_t v = a.GetInt("sampling-seed", 0);
    l.sampling.set_seed(static_cast<uint64_t>(v));
  }
  if (a.Has("repetition-penalty")) {
    const double v = a.GetDouble("repetition-penalty", 1);
    l.sampling.set_repetition_penalty(static_cast<float>(v));
  }
  if (a.Has("logprobs")) l.sampling.set_logprobs(static_cast<int32_t>(a.GetInt("logprobs", 0)));
  l.timeout_s = a.GetDouble("timeout", 600);
  if (!(l.timeout_s > 0)) return absl::InvalidArgumentError("--timeout must be > 0 (seconds)");
  TP_ASSIGN_OR_RETURN(l.warmup, PositiveInt(a, "warmup", 1, 0));
  f.json_path = a.GetOr("json", "");
  f.per_request = a.Flag("per-request");
  f.progress = a.Flag("progress") || (!a.Flag("no-progress") && isatty(STDERR_FILENO));
  f.allow_errors = a.Flag("allow-errors");
  f.engine_model = a.GetOr("compare-engine", "");
  f.engine_device = a.GetOr("engine-device", f.engine_device);
  f.engine_gpu_memory_utilization =
      a.GetDouble("engine-gpu-memory-utilization", f.engine_gpu_memory_utilization);
  if (f.check_deterministic) {
    for (const char* flag : {"concurrency", "request-rate", "compare-engine"}) {
      if (a.Has(flag)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--check-deterministic sends all --num-requests at once, then one at a time: no --",
            flag));
      }
    }
    if (s.turns > 0) {
      return absl::InvalidArgumentError(
          "--check-deterministic compares single requests, not chat turns (no --turns)");
    }
    if (!a.Has("temperature")) l.sampling.set_temperature(1);
    if (!(l.sampling.temperature() > 0)) {
      return absl::InvalidArgumentError(
          "--check-deterministic: --temperature must be > 0 (the odd requests are greedy)");
    }
    if (!l.sampling.has_seed()) l.sampling.set_seed(0);
    l.concurrency = s.num_requests;
  }
  return f;
}

// The server's prefix cache over the measured run (the difference of its counters).
struct PrefixCacheReport {
  bool known = false;  // both readings of GetModelInfo succeeded
  bool enabled = false;
  int64_t queries = 0, hits = 0, evictions = 0;
  int64_t computed_prompt_tokens = 0;  // prefill work of the run, caching on or off
  double hit_rate = 0;
};

PrefixCacheReport PrefixCacheDelta(const v1::ModelInfo& before, const v1::ModelInfo& after) {
  PrefixCacheReport r;
  r.known = true;
  r.enabled = after.prefix_cache().enabled();
  r.queries = after.prefix_cache().queries() - before.prefix_cache().queries();
  r.hits = after.prefix_cache().hits() - before.prefix_cache().hits();
  r.evictions = after.prefix_cache().evictions() - before.prefix_cache().evictions();
  r.computed_prompt_tokens = after.prefix_cache().computed_prompt_tokens() -
                             before.prefix_cache().computed_prompt_tokens();
  r.hit_rate = r.queries > 0 ? static_cast<double>(r.hits) / static_cast<double>(r.queries) : 0;
  return r;
}

nlohmann::json SummaryJson(const bench::Summary& s) {
  return {{"count", s.count}, {"mean", s.mean}, {"median", s.median}, {"p90", s.p90},
          {"p99", s.p99},     {"min", s.min},   {"max", s.max}};
}

nlohmann::json ReportJson(const BenchFlags& f, const v1::ModelInfo& info, const bench::Report& r,
                          const bench::LoadResult& result, const PrefixCacheReport& pc) {
  nlohmann::json j;
  j["tool"] = "tpserve bench";
  j["backend"] = "tpserve";
  j["label"] = f.label;
  j["preset"] = f.preset;
  j["server"] = f.server.address;
  j["model"] = info.model();
  j["tp"] = info.tp();
  j["pp"] = info.pp();
  j["world_size"] = info.rank_devices_size();
  j["rank_devices"] =
      std::vector<std::string>(info.rank_devices().begin(), info.rank_devices().end());
  const bench::WorkloadSpec& s = f.spec;
  const bool chat = s.turns > 0;
  j["config"] = {
      {"mode", f.load.open_loop ? "open" : "closed"},
      {"concurrency", f.load.concurrency},
      {"request_rate", f.load.open_loop
                           ? (std::isfinite(s.request_rate) ? nlohmann::json(s.request_rate)
                                                            : nlohmann::json("inf"))
                           : nlohmann::json(nullptr)},
      {"num_requests", chat ? s.conversations * s.turns : s.num_requests},
      {"prompt_len", s.prompt_len.ToString()},
      {"output_len", s.output_len.ToString()},
      {"turns", s.turns},
      {"num_conversations", chat ? s.conversations : 0},
      {"user_turn_len",
       chat ? nlohmann::json(s.user_turn_len.ToString()) : nlohmann::json(nullptr)},
      {"shared_prefix_len", s.shared_prefix_len},
      {"prompt_kind", f.load.text_prompts ? "text" : "ids"},
      {"stream", f.load.stream},
      {"ignore_eos", f.load.ignore_eos},
      {"seed", s.seed},
      {"warmup", f.load.warmup},
      {"timeout_s", f.load.timeout_s},
  };
  std::string sampling;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  google::protobuf::util::MessageToJsonString(f.load.sampling, &sampling, o);
  j["config"]["sampling"] = nlohmann::json::parse(sampling.empty() ? "{}" : sampling);
  j["num_requests"] = r.num_requests;
  j["completed"] = r.completed;
  j["failed"] = r.failed;
  j["errors"] = r.errors;
  j["output_length_mismatches"] = r.output_length_mismatches;
  j["duration_s"] = r.duration_s;
  j["total_input_tokens"] = r.input_tokens;
  j["total_output_tokens"] = r.output_tokens;
  j["request_throughput"] = r.request_throughput;
  j["output_throughput"] = r.output_throughput;
  j["total_token_throughput"] = r.total_token_throughput;
  j["ttft_ms"] = SummaryJson(r.ttft_ms);
  j["tpot_ms"] = SummaryJson(r.tpot_ms);
  j["itl_ms"] = SummaryJson(r.itl_ms);
  j["e2e_ms"] = SummaryJson(r.e2e_ms);
  j["server_ttft_ms"] = SummaryJson(r.server_ttft_ms);
  // Prompt tokens the server looked up in its prefix cache during the run and found there.
  j["prefix_cache"] = pc.known
                          ? nlohmann::json{{"enabled", pc.enabled},
                                           {"queries", pc.queries},
                                           {"hits", pc.hits},
                                           {"hit_rate", pc.hit_rate},
                                           {"evictions", pc.evictions},
                                           {"computed_prompt_tokens", pc.computed_prompt_tokens}}
                          : nlohmann::json(nullptr);
  if (f.per_request) {
    nlohmann::json reqs = nlohmann::json::array();
    for (const bench::RequestRecord& q : result.records) {
      nlohmann::json e = {{"index", q.index},
                          {"ok", q.ok},
                          {"start_s", q.start_s},
                          {"ttft_s", q.ttft_s},
                          {"e2e_s", q.e2e_s},
                          {"prompt_tokens", q.prompt_tokens},
                          {"output_tokens", q.output_tokens},
                          {"max_new_tokens", q.max_new_tokens},
                          {"itl_s", q.itl_s}};
      if (q.conversation >= 0) {
        e["conversation"] = q.conversation;
        e["turn"] = q.turn;
      }
      if (!q.ok) {
        e["error_code"] = q.error_code;
        e["error_message"] = q.error_message;
      }
      reqs.push_back(std::move(e));
    }
    j["requests"] = std::move(reqs);
  }
  return j;
}

void PrintTable(const BenchFlags& f, const v1::ModelInfo& info, const bench::Report& r,
                const PrefixCacheReport& pc) {
  const bench::WorkloadSpec& s = f.spec;
  std::printf("===== tpserve bench%s%s =====\n", f.preset.empty() ? "" : ": preset ",
              f.preset.c_str());
  std::printf("%-30s %s (model %s, tp %d, pp %d, %d ranks)\n", "server", f.server.address.c_str(),
              info.model().c_str(), info.tp(), info.pp(), info.rank_devices_size());
  if (f.load.open_loop) {
    std::printf("%-30s open loop, Poisson %s req/s, %s\n", "load",
                std::isfinite(s.request_rate) ? absl::StrCat(s.request_rate).c_str() : "inf",
                f.load.concurrency > 0
                    ? absl::StrCat("at most ", f.load.concurrency, " in flight").c_str()
                    : "no cap on requests in flight");
  } else {
    std::printf("%-30s closed loop, %lld client(s)\n", "load",
                static_cast<long long>(f.load.concurrency));
  }
  std::printf("%-30s prompt %s, output %s%s%s\n", "lengths (tokens)",
              s.prompt_len.ToString().c_str(), s.output_len.ToString().c_str(),
              s.turns > 0 ? absl::StrCat(", chat: ", s.conversations, " conversations x ", s.turns,
                                         " turns, user turn ", s.user_turn_len.ToString())
                                .c_str()
                          : "",
              f.load.stream ? "" : " (unary: no TTFT / ITL)");
  std::printf("%-30s %lld (completed %lld, failed %lld)\n", "requests",
              static_cast<long long>(r.num_requests), static_cast<long long>(r.completed),
              static_cast<long long>(r.failed));
  for (const auto& [code, n] : r.errors) {
    std::printf("  %-28s %lld\n", code.c_str(), static_cast<long long>(n));
  }
  if (r.output_length_mismatches > 0) {
    std::printf("%-30s %lld\n", "output != max_new_tokens",
                static_cast<long long>(r.output_length_mismatches));
  }
  std::printf("%-30s %.3f\n", "duration (s)", r.duration_s);
  std::printf("%-30s %lld / %lld\n", "input / output tokens",
              static_cast<long long>(r.input_tokens), static_cast<long long>(r.output_tokens));
  std::printf("%-30s %.3f\n", "request throughput (req/s)", r.request_throughput);
  std::printf("%-30s %.2f\n", "output throughput (tok/s)", r.output_throughput);
  std::printf("%-30s %.2f\n", "total throughput (tok/s)", r.total_token_throughput);
  if (pc.known && pc.enabled) {
    std::printf("%-30s %.1f%% (%lld of %lld prompt tokens cached, %lld blocks evicted)\n",
                "prefix cache hit rate", 100 * pc.hit_rate, static_cast<long long>(pc.hits),
                static_cast<long long>(pc.queries), static_cast<long long>(pc.evictions));
  } else if (pc.known) {
    std::printf("%-30s off\n", "prefix cache");
  }
  if (pc.known) {
    std::printf("%-30s %lld\n", "prompt tokens computed",
                static_cast<long long>(pc.computed_prompt_tokens));
  }
  std::printf("%-30s %10s %10s %10s %10s %8s\n", "latency (ms)", "mean", "median", "p90", "p99",
              "n");
  auto row = [](const char* name, const bench::Summary& x) {
    if (x.count == 0) {
      std::printf("%-30s %10s %10s %10s %10s %8d\n", name, "-", "-", "-", "-", 0);
      return;
    }
    std::printf("%-30s %10.2f %10.2f %10.2f %10.2f %8lld\n", name, x.mean, x.median, x.p90, x.p99,
                static_cast<long long>(x.count));
  };
  row("time to first token", r.ttft_ms);
  row("time per output token", r.tpot_ms);
  row("inter-token latency", r.itl_ms);
  row("end to end", r.e2e_ms);
  row("server-side first token", r.server_ttft_ms);
}

// A one-line progress bar on stderr, redrawn a few times a second.
class ProgressBar {
 public:
  ProgressBar(bench::Progress* p, int64_t total) : p_(p), total_(total) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~ProgressBar() {
    stop_ = true;
    thread_.join();
    Draw();
    std::fprintf(stderr, "\n");
  }

 private:
  void Loop() {
    while (!stop_) {
      Draw();
      for (int i = 0; i < 5 && !stop_; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  void Draw() {
    const int64_t done = p_->done.load();
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    constexpr int kWidth = 30;
    const int filled = total_ > 0 ? static_cast<int>(kWidth * done / total_) : 0;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(stderr, "\r[%s] %lld/%lld  %.1f s  %.2f req/s  %.1f tok/s  %lld failed ",
                 bar.c_str(), static_cast<long long>(done), static_cast<long long>(total_), t,
                 t > 0 ? done / t : 0.0, t > 0 ? p_->output_tokens.load() / t : 0.0,
                 static_cast<long long>(p_->failed.load()));
    std::fflush(stderr);
  }

  bench::Progress* p_;
  int64_t total_;
  std::atomic<bool> stop_{false};
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::thread thread_;
};

// The ids from position - 3 to position + 3 (where two answers part), as far as they go.
std::vector<int32_t> IdsAround(const std::vector<int32_t>& ids, int64_t position) {
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t lo = std::clamp<int64_t>(position - 3, 0, n);
  const int64_t hi = std::clamp<int64_t>(position + 4, lo, n);
  return std::vector<int32_t>(ids.begin() + lo, ids.begin() + hi);
}

nlohmann::json RunJson(const bench::Report& r, const bench::ServerSteps& steps) {
  nlohmann::json j = {{"duration_s", r.duration_s},
                      {"completed", r.completed},
                      {"failed", r.failed},
                      {"output_throughput", r.output_throughput},
                      {"tpot_ms", SummaryJson(r.tpot_ms)},
                      {"e2e_ms", SummaryJson(r.e2e_ms)},
                      {"server_steps", nullptr},
                      {"server_tokens", nullptr}};
  if (steps.known) {
    j["server_steps"] = steps.steps;
    j["server_tokens"] = steps.tokens;
  }
  return j;
}

// ", 530 server steps (61.9 tokens a step)", or nothing when the counters could not be read.
std::string StepsText(const bench::ServerSteps& s) {
  if (!s.known || s.steps <= 0) return "";
  char per_step[32];
  std::snprintf(per_step, sizeof(per_step), "%.1f",
                static_cast<double>(s.tokens) / static_cast<double>(s.steps));
  return absl::StrCat(", ", s.steps, " server steps (", per_step, " tokens a step)");
}

// --check-deterministic: both runs, the comparison, the report (table or JSON); an error status
// when an answer differs or a request failed.
absl::Status RunCheck(const BenchFlags& f, const v1::ModelInfo& info,
                      const std::vector<bench::PlannedRequest>& plan) {
  bench::Progress progress;
  absl::StatusOr<bench::DeterminismRun> run;
  {
    std::unique_ptr<ProgressBar> bar;
    if (f.progress) {
      bar = std::make_unique<ProgressBar>(&progress, 2 * static_cast<int64_t>(plan.size()));
    }
    run = bench::RunDeterminismCheck(f.load, plan, &progress);
  }
  TP_RETURN_IF_ERROR(run.status());
  const bench::DeterminismReport& d = run->report;
  const bench::Report concurrent =
      bench::ComputeReport(run->concurrent.records, run->concurrent.duration_s);
  const bench::Report sequential =
      bench::ComputeReport(run->sequential.records, run->sequential.duration_s);
  int64_t greedy = 0, greedy_identical = 0, sampled_identical = 0;
  std::vector<double> positions, token_positions;
  nlohmann::json differences = nlohmann::json::array();
  nlohmann::json answers = nlohmann::json::array();
  for (size_t i = 0; i < d.answers.size(); ++i) {
    const bench::AnswerComparison& c = d.answers[i];
    const bool is_greedy = bench::IsGreedy(run->sampling[i]);
    const bool identical = c.divergence == bench::Divergence::kNone;
    greedy += is_greedy;
    (is_greedy ? greedy_identical : sampled_identical) += identical;
    nlohmann::json e = {{"index", c.index},
                        {"sampling", is_greedy ? "greedy" : "sampled"},
                        {"seed", run->sampling[i].seed()},
                        {"divergence", bench::DivergenceName(c.divergence)},
                        {"first_difference", c.first_difference},
                        {"first_token_difference", c.first_token_difference},
                        {"lengths", {c.length_a, c.length_b}}};
    const std::vector<int32_t>& a = run->concurrent.records[i].output_ids;
    const std::vector<int32_t>& b = run->sequential.records[i].output_ids;
    if (c.divergence == bench::Divergence::kFailed) e["error"] = c.error;
    if (c.first_difference >= 0) {
      positions.push_back(static_cast<double>(c.first_difference));
      if (c.first_token_difference >= 0) {
        token_positions.push_back(static_cast<double>(c.first_token_difference));
      }
      e["concurrent_ids_around"] = IdsAround(a, c.first_difference);
      e["sequential_ids_around"] = IdsAround(b, c.first_difference);
    }
    if (!identical) differences.push_back(e);
    if (f.per_request) {
      e["concurrent_ids"] = a;
      e["sequential_ids"] = b;
      answers.push_back(std::move(e));
    }
  }
  const int64_t sampled = d.requests - greedy;
  const bool passed = d.identical == d.requests;
  nlohmann::json j = ReportJson(f, info, concurrent, run->concurrent, PrefixCacheReport());
  j.erase("prefix_cache");
  nlohmann::json check = {
      {"passed", passed},
      {"server_deterministic", info.deterministic()},
      {"max_num_seqs", info.max_num_seqs()},
      {"requests", d.requests},
      {"identical", d.identical},
      {"differing", d.differing},
      {"failed", d.failed},
      {"logprob_tokens", d.logprob_tokens},
      {"sampled", {{"requests", sampled}, {"identical", sampled_identical}}},
      {"greedy", {{"requests", greedy}, {"identical", greedy_identical}}},
      {"first_difference", SummaryJson(bench::Summarize(positions))},
      // Answers whose token ids differ (or one ends first), and where.
      {"ids_differing", token_positions.size()},
      {"first_token_difference", SummaryJson(bench::Summarize(token_positions))},
      {"concurrent", RunJson(concurrent, run->concurrent_steps)},
      {"sequential", RunJson(sequential, run->sequential_steps)},
      {"differences", differences}};
  if (f.per_request) check["answers"] = std::move(answers);
  j["deterministic_check"] = std::move(check);

  if (f.json_path == "-") {
    std::cout << j.dump(2) << std::endl;
  } else {
    const bench::WorkloadSpec& s = f.spec;
    std::printf("===== tpserve bench --check-deterministic%s%s =====\n",
                f.preset.empty() ? "" : ": preset ", f.preset.c_str());
    std::printf("%-30s %s (model %s, tp %d, pp %d), --deterministic %s, max_num_seqs %d\n",
                "server", f.server.address.c_str(), info.model().c_str(), info.tp(), info.pp(),
                info.deterministic() ? "on" : "off", info.max_num_seqs());
    const v1::SamplingOptions& so = f.load.sampling;
    std::printf(
        "%-30s %lld: %lld sampled (temperature %g%s%s, seed %llu + index), %lld greedy; "
        "logprobs %s\n",
        "requests", static_cast<long long>(d.requests), static_cast<long long>(sampled),
        so.temperature(), so.has_top_p() ? absl::StrCat(", top-p ", so.top_p()).c_str() : "",
        so.has_top_k() ? absl::StrCat(", top-k ", so.top_k()).c_str() : "",
        static_cast<unsigned long long>(so.seed()), static_cast<long long>(greedy),
        so.has_logprobs() ? absl::StrCat("top ", so.logprobs()).c_str() : "off");
    std::printf("%-30s prompt %s, output %s\n", "lengths (tokens)", s.prompt_len.ToString().c_str(),
                s.output_len.ToString().c_str());
    if (info.max_num_seqs() > 0 && d.requests > info.max_num_seqs()) {
      std::printf("%-30s the server runs at most %d sequences a step: not all %lld share one\n",
                  "note", info.max_num_seqs(), static_cast<long long>(d.requests));
    }
    auto run_line = [](const char* name, const bench::Report& r, const bench::ServerSteps& st) {
      char tpot[48] = "";  // no TPOT without streaming
      if (r.tpot_ms.count > 0) {
        std::snprintf(tpot, sizeof(tpot), ", TPOT median %.2f ms", r.tpot_ms.median);
      }
      std::printf("%-30s %.3f s, output %.1f tok/s%s, %lld failed%s\n", name, r.duration_s,
                  r.output_throughput, tpot, static_cast<long long>(r.failed),
                  StepsText(st).c_str());
    };
    run_line("all at once", concurrent, run->concurrent_steps);
    run_line("one at a time", sequential, run->sequential_steps);
    std::printf(
        "%-30s %lld of %lld (sampled %lld of %lld, greedy %lld of %lld); %lld differ (token "
        "ids in %zu), %lld failed\n",
        "identical answers", static_cast<long long>(d.identical),
        static_cast<long long>(d.requests), static_cast<long long>(sampled_identical),
        static_cast<long long>(sampled), static_cast<long long>(greedy_identical),
        static_cast<long long>(greedy), static_cast<long long>(d.differing), token_positions.size(),
        static_cast<long long>(d.failed));
    for (const nlohmann::json& e : differences) {
      const std::string who = absl::StrCat("  request ", e["index"].get<int64_t>(), " (",
                                           e["sampling"].get<std::string>(), ")");
      const std::string what = e["divergence"].get<std::string>();
      if (what == "failed") {
        std::printf("%-30s failed: %s\n", who.c_str(), e["error"].get<std::string>().c_str());
        continue;
      }
      const int64_t at = e["first_difference"].get<int64_t>();
      std::string line = what == "length"
                             ? absl::StrCat("lengths differ (", e["lengths"][0].get<int64_t>(),
                                            " at once, ", e["lengths"][1].get<int64_t>(),
                                            " alone), same ids up to position ", at)
                             : absl::StrCat(what, " differ from position ", at);
      if (what == "logprobs" && e["first_token_difference"].get<int64_t>() >= 0) {
        absl::StrAppend(&line, ", token ids from ", e["first_token_difference"].get<int64_t>());
      }
      if (what == "tokens") {
        absl::StrAppend(&line, " (ids from position ", std::max<int64_t>(at - 3, 0), ": ",
                        e["concurrent_ids_around"].dump(), " at once, ",
                        e["sequential_ids_around"].dump(), " alone)");
      }
      std::printf("%-30s %s\n", who.c_str(), line.c_str());
    }
    std::printf("%-30s %s\n", "result", passed ? "PASS: every answer identical" : "FAIL");
    if (!f.json_path.empty()) {
      std::ofstream out(f.json_path);
      out << j.dump(2) << "\n";
      if (!out) return absl::InternalError(absl::StrCat("--json: cannot write ", f.json_path));
    }
  }
  if (passed) return absl::OkStatus();
  return absl::AbortedError(
      absl::StrCat(d.differing, " of ", d.requests,
                   " answers differ between the requests sent all at once and one at a time",
                   d.failed > 0 ? absl::StrCat(", ", d.failed, " failed") : "",
                   " (deterministic_check in the report)"));
}

}  // namespace

absl::Status RunBenchCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags parsed, Flags::Parse(BenchSpec(), args));
  if (parsed.help()) return PrintUsage(BenchSpec());
  if (parsed.Flag("list-presets")) {
    for (const bench::Preset& p : bench::Presets()) {
      std::printf("%-14s %s\n", p.name.c_str(), p.description.c_str());
    }
    return absl::OkStatus();
  }
  TP_ASSIGN_OR_RETURN(BenchFlags f, ParseFlags(parsed));

  const double info_timeout = parsed.GetDouble("info-timeout", 60);
  TP_ASSIGN_OR_RETURN(v1::ModelInfo info, bench::FetchModelInfo(f.server, info_timeout));
  if (info.vocab_size() < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat(f.server.address, " reports vocab_size ", info.vocab_size()));
  }
  if (f.load.text_prompts && !info.has_tokenizer()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--prompt-kind text: the model on ", f.server.address, " has no tokenizer"));
  }
  f.spec.vocab_size = info.vocab_size();
  f.spec.context_length = info.context_length();
  TP_ASSIGN_OR_RETURN(auto plan, bench::PlanRequests(f.spec));
  if (f.check_deterministic) return RunCheck(f, info, plan);

  // The prefix cache counters right before the measured run (after the warm-up) and after it.
  absl::StatusOr<v1::ModelInfo> info_before = absl::UnknownError("not read");
  f.load.before_run = [&] { info_before = bench::FetchModelInfo(f.server, 10); };
  bench::Progress progress;
  absl::StatusOr<bench::LoadResult> result;
  {
    std::unique_ptr<ProgressBar> bar;
    if (f.progress)
      bar = std::make_unique<ProgressBar>(&progress, static_cast<int64_t>(plan.size()));
    result = bench::RunLoad(f.load, plan, &progress);
  }
  TP_RETURN_IF_ERROR(result.status());
  const bench::Report report = bench::ComputeReport(result->records, result->duration_s);
  PrefixCacheReport pc;
  if (info_before.ok()) {
    absl::StatusOr<v1::ModelInfo> info_after = bench::FetchModelInfo(f.server, 10);
    if (info_after.ok()) pc = PrefixCacheDelta(*info_before, *info_after);
  }
  nlohmann::json j = ReportJson(f, info, report, *result, pc);
  // The server's own step counters over the measured run (after the warm-up): how much of a
  // step the coordinator costs.
  absl::StatusOr<v1::ModelInfo> after = bench::FetchModelInfo(f.server, info_timeout);
  const v1::ModelInfo& base = info_before.ok() ? *info_before : info;
  if (after.ok() && after->steps().steps() > base.steps().steps()) {
    const v1::StepStats& a = after->steps();
    const v1::StepStats& b = base.steps();
    const double n = static_cast<double>(a.steps() - b.steps());
    j["server_steps"] = {
        {"steps", a.steps() - b.steps()},
        {"overlap_scheduling", a.overlap_scheduling()},
        {"step_ms", (a.step_seconds() - b.step_seconds()) * 1e3 / n},
        {"forward_ms", (a.forward_seconds() - b.forward_seconds()) * 1e3 / n},
        {"scheduler_cpu_ms", (a.scheduler_cpu_seconds() - b.scheduler_cpu_seconds()) * 1e3 / n},
        {"scheduler_plan_cpu_ms",
         (a.scheduler_plan_cpu_seconds() - b.scheduler_plan_cpu_seconds()) * 1e3 / n},
        {"scheduler_send_cpu_ms",
         (a.scheduler_send_cpu_seconds() - b.scheduler_send_cpu_seconds()) * 1e3 / n},
        {"scheduler_apply_cpu_ms",
         (a.scheduler_apply_cpu_seconds() - b.scheduler_apply_cpu_seconds()) * 1e3 / n},
        {"delivery_cpu_ms", (a.delivery_cpu_seconds() - b.delivery_cpu_seconds()) * 1e3 / n},
        {"sender_cpu_ms", (a.sender_cpu_seconds() - b.sender_cpu_seconds()) * 1e3 / n},
        {"dropped_tokens", a.dropped_tokens() - b.dropped_tokens()}};
  }
  std::optional<EngineComparison> engine;
  if (!f.engine_model.empty()) {
    TP_ASSIGN_OR_RETURN(engine, RunEngine(f, plan));
    const double ratio =
        engine->ms_per_token > 0 ? report.tpot_ms.median / engine->ms_per_token : 0.0;
    j["engine"] = {{"model", f.engine_model},
                   {"batch", engine->batch},
                   {"ms_per_token", engine->ms_per_token},
                   {"served_tpot_median_ms", report.tpot_ms.median},
                   {"served_over_engine", ratio}};
  }
  if (f.json_path == "-") {
    std::cout << j.dump(2) << std::endl;
  } else {
    PrintTable(f, info, report, pc);
    if (j.contains("server_steps")) {
      const nlohmann::json& st = j["server_steps"];
      std::printf(
          "%-30s %lld steps (overlap %s): per step %.3f ms, worker forward %.3f ms, "
          "scheduler CPU %.3f ms; %lld tokens dropped after stops\n",
          "server steps", static_cast<long long>(st["steps"].get<int64_t>()),
          st["overlap_scheduling"].get<bool>() ? "on" : "off", st["step_ms"].get<double>(),
          st["forward_ms"].get<double>(), st["scheduler_cpu_ms"].get<double>(),
          static_cast<long long>(st["dropped_tokens"].get<int64_t>()));
      std::printf(
          "%-30s plan %.3f ms, send %.3f ms, apply %.3f ms; delivery thread %.3f ms, sender "
          "thread %.3f ms\n",
          "scheduler CPU per step", st["scheduler_plan_cpu_ms"].get<double>(),
          st["scheduler_send_cpu_ms"].get<double>(), st["scheduler_apply_cpu_ms"].get<double>(),
          st["delivery_cpu_ms"].get<double>(), st["sender_cpu_ms"].get<double>());
    }
    if (engine) {
      std::printf("%-30s %.3f ms per decode step (batch of %d, in-process)\n", "engine",
                  engine->ms_per_token, engine->batch);
      std::printf("%-30s %.3f (served median TPOT %.3f ms / engine %.3f ms)\n", "served / engine",
                  j["engine"]["served_over_engine"].get<double>(), report.tpot_ms.median,
                  engine->ms_per_token);
    }
    if (!f.json_path.empty()) {
      std::ofstream out(f.json_path);
      out << j.dump(2) << "\n";
      if (!out) return absl::InternalError(absl::StrCat("--json: cannot write ", f.json_path));
    }
  }
  for (const bench::RequestRecord& q : result->records) {
    if (!q.ok) {
      std::fprintf(stderr, "first failed request (%lld): %s: %s\n", static_cast<long long>(q.index),
                   q.error_code.c_str(), q.error_message.c_str());
      break;
    }
  }
  if (report.failed > 0 && !f.allow_errors) {
    return absl::AbortedError(absl::StrCat(report.failed, " of ", report.num_requests,
                                           " requests failed (see errors in the report; "
                                           "--allow-errors to exit 0)"));
  }
  return absl::OkStatus();
}

}  // namespace tpserve
