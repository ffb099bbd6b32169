// `tpserve kv-compare`: how far a quantized KV cache moves the model's logits and greedy tokens.
// A baseline engine (--baseline-kv-cache-dtype) runs N random prompts greedily; then, one engine
// at a time, each compared KV dtype runs them (a) teacher-forced on the baseline's tokens, giving
// logits rows at the same positions (relative L2 error, top-1 agreement), and (b) greedily on its
// own (how long it keeps to the baseline's tokens). Every pass is the same sequence of steps
// (one prefill step per prompt, then decode steps over all prompts together), so a baseline
// compared with itself differs by nothing.
#include "tools/kv_compare_cmd.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <random>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/model_files.h"
#include "common/status.h"
#include "tools/bench/stats.h"
#include "worker/engine.h"
#include "worker/shard_loader.h"

namespace tpserve {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// One pass of one prompt through an engine.
struct Trace {
  // [decode_steps + 1][vocab]: the prompt's last position, then each decode step's row.
  std::vector<std::vector<float>> rows;
  std::vector<int32_t> tokens;  // the greedy id the sampler drew from each row
};

// A KV dtype as asked for (the flag's word) and parsed.
struct KvChoice {
  std::string name;
  std::optional<DType> dtype;
};

absl::StatusOr<std::vector<KvChoice>> ParseDTypeList(const std::string& list) {
  std::vector<KvChoice> out;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    const std::string name(absl::StripAsciiWhitespace(part));
    absl::StatusOr<std::optional<DType>> t = ParseKvCacheDType(name);
    if (!t.ok())
      return absl::InvalidArgumentError(absl::StrCat("--kv-cache-dtypes: ", t.status().message()));
    out.push_back({name, *t});
  }
  if (out.empty()) return absl::InvalidArgumentError("--kv-cache-dtypes is empty");
  return out;
}

// Lowest id on ties, as the greedy sampler (common/sampling.h).
int64_t ArgMax(const std::vector<float>& row) {
  return std::max_element(row.begin(), row.end()) - row.begin();
}

double RelativeError(const std::vector<float>& row, const std::vector<float>& base) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    const double d = static_cast<double>(row[i]) - base[i];
    diff += d * d;
    norm += static_cast<double>(base[i]) * base[i];
  }
  return std::sqrt(diff) / std::sqrt(norm);
}

// Runs every prompt through `engine`: one prefill step per prompt, then `decode_steps` decode
// steps of all prompts together. Each decode step feeds, per prompt, forced[p][j] when `forced`
// is given, else the id the previous step sampled (greedy). Prompt p owns KV blocks
// [p * blocks_per_seq, (p + 1) * blocks_per_seq). Sequence ids are fresh from `next_seq_id`;
// the runner forgets them at the end.
absl::StatusOr<std::vector<Trace>> RunPrompts(Engine& engine,
                                              const std::vector<std::vector<int32_t>>& prompts,
                                              int decode_steps,
                                              const std::vector<std::vector<int32_t>>* forced,
                                              uint64_t& next_seq_id) {
  ShardRunner& runner = engine.runner();
  const int bs = runner.block_size();
  const int64_t longest = static_cast<int64_t>(prompts.at(0).size()) + decode_steps;
  const int blocks_per_seq = static_cast<int>((longest + bs - 1) / bs);
  const int64_t need = static_cast<int64_t>(blocks_per_seq) * prompts.size();
  if (need > runner.num_blocks()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the prompts need ", need, " KV blocks of ", bs, " tokens but the cache has ",
                     runner.num_blocks(), " (raise --kv-cache-mb or --gpu-memory-utilization)"));
  }
  std::vector<uint64_t> ids;
  std::vector<std::vector<int32_t>> tables;
  for (size_t p = 0; p < prompts.size(); ++p) {
    ids.push_back(next_seq_id++);
    std::vector<int32_t> table;
    for (int b = 0; b < blocks_per_seq; ++b)
      table.push_back(static_cast<int32_t>(p * blocks_per_seq + b));
    tables.push_back(std::move(table));
  }
  auto add_seq = [&](worker::StepPlan& plan, size_t p, int32_t start, const int32_t* tokens,
                     size_t n) {
    worker::SeqStep* s = plan.add_seqs();
    s->set_seq_id(ids[p]);
    s->set_start_pos(start);
    s->mutable_token_ids()->Assign(tokens, tokens + n);
    s->mutable_block_table()->Assign(tables[p].begin(), tables[p].end());
    s->set_sample(true);  // the default worker::Sampling is greedy (temperature 0)
  };
  std::vector<Trace> traces(prompts.size());
  uint64_t step_id = 0;
  auto run = [&](const worker::StepPlan& plan, const std::vector<size_t>& order) -> absl::Status {
    std::vector<std::vector<float>> logits;
    TP_ASSIGN_OR_RETURN(worker::StepResult result, runner.Run(plan, &logits));
    if (logits.size() != order.size() ||
        result.token_ids_size() != static_cast<int>(order.size())) {
      return absl::InternalError(absl::StrCat("step ", plan.step_id(), " returned ", logits.size(),
                                              " logits rows and ", result.token_ids_size(),
                                              " ids for ", order.size(), " sequences"));
    }
    for (size_t k = 0; k < order.size(); ++k) {
      traces[order[k]].rows.push_back(std::move(logits[k]));
      traces[order[k]].tokens.push_back(result.token_ids(static_cast<int>(k)));
    }
    return absl::OkStatus();
  };
  for (size_t p = 0; p < prompts.size(); ++p) {
    worker::StepPlan plan;
    plan.set_step_id(++step_id);
    add_seq(plan, p, 0, prompts[p].data(), prompts[p].size());
    TP_RETURN_IF_ERROR(run(plan, {p}));
  }
  std::vector<size_t> all(prompts.size());
  for (size_t p = 0; p < prompts.size(); ++p) all[p] = p;
  for (int j = 0; j < decode_steps; ++j) {
    worker::StepPlan plan;
    plan.set_step_id(++step_id);
    for (size_t p = 0; p < prompts.size(); ++p) {
      const int32_t token = forced ? (*forced)[p].at(j) : traces[p].tokens.back();
      add_seq(plan, p, static_cast<int32_t>(prompts[p].size()) + j, &token, 1);
    }
    TP_RETURN_IF_ERROR(run(plan, all));
  }
  runner.Forget(ids);
  return traces;
}

// What one compared dtype did against the baseline.
struct Comparison {
  std::string requested;
  std::string stored;  // what the engine's cache holds (KvCacheDTypeName)
  int64_t capacity_tokens = 0;
  std::vector<double> errors;  // one per teacher-forced row, every prompt
  int64_t top1_equal = 0;
  std::vector<int> first_divergence;                      // per prompt, steps if none
  std::vector<std::vector<int32_t>> greedy_tokens;        // [prompt][steps], free-running
  std::vector<std::vector<int64_t>> teacher_forced_top1;  // [prompt][steps + 1] argmax per row
  int64_t tokens_equal = 0;  // free-running tokens equal position by position
  double load_s = 0, teacher_forced_s = 0, free_running_s = 0;
};

nlohmann::json ComparisonJson(const Comparison& c, int steps) {
  const bench::Summary errors = bench::Summarize(c.errors);
  const int64_t n = errors.count;
  const size_t prompts = c.first_divergence.size();
  double divergence_sum = 0;
  int all_match = 0;
  for (int d : c.first_divergence) {
    divergence_sum += d;
    all_match += d == steps;
  }
  nlohmann::json j;
  j["kv_cache_dtype"] = c.requested;
  j["stored_kv_cache_dtype"] = c.stored;
  j["kv_capacity_tokens"] = c.capacity_tokens;
  j["rows"] = n;
  j["rel_error_min"] = errors.min;
  j["rel_error_median"] = errors.median;
  j["rel_error_mean"] = errors.mean;
  j["rel_error_max"] = errors.max;
  j["top1_agreement"] = static_cast<double>(c.top1_equal) / n;
  j["greedy_first_divergence"] = c.first_divergence;
  j["greedy_tokens"] = c.greedy_tokens;
  j["teacher_forced_top1_tokens"] = c.teacher_forced_top1;
  j["greedy_first_divergence_mean"] = divergence_sum / prompts;
  j["greedy_all_match_fraction"] = static_cast<double>(all_match) / prompts;
  j["greedy_token_match_fraction"] =
      static_cast<double>(c.tokens_equal) / (static_cast<double>(prompts) * steps);
  j["load_seconds"] = c.load_s;
  j["teacher_forced_seconds"] = c.teacher_forced_s;
  j["free_running_seconds"] = c.free_running_s;
  return j;
}

}  // namespace

const CommandSpec& KvCompareFlagSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve kv-compare",
      "Loads the model in this process once per KV-cache dtype and measures how far each moves "
      "the logits and greedy tokens of random prompts against a baseline KV dtype.",
      {StringFlag("model", "DIR", "model directory [required]"),
       StringFlag("device", "cpu|cuda|auto", "where to run (default auto)"),
       StringFlag("kv-cache-dtypes", "LIST",
                  "comma list of KV-cache dtypes to compare, each as --kv-cache-dtype takes it "
                  "(default fp8,int8,int4)"),
       StringFlag("baseline-kv-cache-dtype", "auto|bf16|fp32|fp8|int8|int4",
                  "the reference's KV cache (default auto: the compute dtype, bf16 on CUDA, fp32 "
                  "on the CPU)"),
       IntFlag("prompts", 1, 4096, "random prompts (default 4)"),
       IntFlag("prompt-len", 1, 1 << 20, "tokens per prompt (default 512)", "L"),
       IntFlag("steps", 1, 1 << 20, "greedy decode steps after each prompt (default 64)", "S"),
       IntFlag("seed", 0, INT64_MAX, "seed of the random prompts (default 1)"),
       FloatFlag("gpu-memory-utilization", 0, 1,
                 "size the KV cache from this fraction of the GPU instead of prompts * (L + S) "
                 "tokens",
                 "F", /*min_exclusive=*/true),
       IntFlag("kv-cache-mb", 1, int64_t{1} << 30,
               "KV cache in MiB instead of prompts * (L + S) tokens", "MB"),
       BoolFlag("json", "print one JSON object")},
      "Prompts are token ids drawn uniformly from the vocabulary with --seed. Per compared dtype:\n"
      "teacher-forced (the baseline's greedy tokens fed back), the S + 1 logits rows of each\n"
      "prompt (its last position, then each step) against the baseline's: relative L2 error\n"
      "||l - l_base|| / ||l_base|| (median, mean, max over all rows) and top-1 agreement;\n"
      "free-running greedy, the first of the S generated tokens that differs from the baseline's\n"
      "(S when none) and the fraction of equal tokens. One engine is loaded at a time."};
  return *spec;
}

absl::Status RunKvCompareCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags a, Flags::Parse(KvCompareFlagSpec(), args));
  if (a.help()) return PrintUsage(KvCompareFlagSpec());
  TP_ASSIGN_OR_RETURN(const std::string model_dir, a.Required("model"));
  TP_ASSIGN_OR_RETURN(const std::vector<KvChoice> compared,
                      ParseDTypeList(a.GetOr("kv-cache-dtypes", "fp8,int8,int4")));
  const std::string baseline_name = a.GetOr("baseline-kv-cache-dtype", "auto");
  TP_ASSIGN_OR_RETURN(const std::optional<DType> baseline_dtype, ParseKvCacheDType(baseline_name));
  const int num_prompts = static_cast<int>(a.GetInt("prompts", 4));
  const int prompt_len = static_cast<int>(a.GetInt("prompt-len", 512));
  const int steps = static_cast<int>(a.GetInt("steps", 64));
  const uint64_t seed = static_cast<uint64_t>(a.GetInt("seed", 1));

  // Everything that can be refused is checked before any engine loads.
  ModelConfig config;
  {
    TP_ASSIGN_OR_RETURN(ModelFiles files, ModelFiles::Open(model_dir));
    config = files.config();
  }
  if (static_cast<int64_t>(prompt_len) + steps > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("--prompt-len ", prompt_len, " + --steps ",
                                                   steps, " exceeds the model's context of ",
                                                   config.max_position_embeddings, " tokens"));
  }
  const std::string device = ResolveModelDevice(a.GetOr("device", "auto"), config.head_dim);
  {
    TP_ASSIGN_OR_RETURN(std::unique_ptr<Ops> ops, MakeOps(device));
    // The engine's own check, named after this command's flag.
    auto check = [&](const std::optional<DType>& t, const char* flag) -> absl::Status {
      const absl::Status s = ResolveKvCacheDType(*ops, t, config.head_dim).status();
      return s.ok() ? s : absl::Status(s.code(), absl::StrCat(flag, ": ", s.message()));
    };
    TP_RETURN_IF_ERROR(check(baseline_dtype, "--baseline-kv-cache-dtype"));
    for (const KvChoice& c : compared) TP_RETURN_IF_ERROR(check(c.dtype, "--kv-cache-dtypes"));
  }

  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config.vocab_size - 1));
  std::vector<std::vector<int32_t>> prompts(num_prompts);
  for (std::vector<int32_t>& p : prompts) {
    p.resize(prompt_len);
    for (int32_t& t : p) t = token(rng);
  }

  EngineOptions options;
  options.device = device;
  options.model.max_batch_tokens = std::max(prompt_len, num_prompts);
  options.model.max_batch_seqs = num_prompts;
  if (a.Has("kv-cache-mb")) {
    options.kv_cache_bytes = a.GetInt("kv-cache-mb", 0) * (int64_t{1} << 20);
  } else if (a.Has("gpu-memory-utilization")) {
    options.gpu_memory_utilization = a.GetDouble("gpu-memory-utilization", 0.9);
  } else {
    const int64_t per_seq = (prompt_len + steps + options.block_size - 1) / options.block_size;
    options.num_kv_blocks = per_seq * num_prompts;
  }
  uint64_t next_seq_id = 1;

  // The baseline: greedy, S decode steps (S + 1 rows, the tokens fed to the others).
  std::vector<Trace> base;
  std::string base_stored;
  {
    options.kv_cache_dtype = baseline_dtype;
    const auto t0 = Clock::now();
    TP_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(model_dir, options));
    const double load_s = SecondsSince(t0);
    base_stored = std::string(KvCacheDTypeName(engine->runner().kv_dtype()));
    const auto t1 = Clock::now();
    TP_ASSIGN_OR_RETURN(base, RunPrompts(*engine, prompts, steps, nullptr, next_seq_id));
    std::fprintf(stderr, "[kv-compare] baseline %s: load %.2f s, greedy run %.2f s\n",
                 base_stored.c_str(), load_s, SecondsSince(t1));
  }  // freed before the next engine loads: two may not fit one GPU

  std::vector<Comparison> results;
  for (const KvChoice& choice : compared) {
    Comparison c;
    c.requested = choice.name;
    options.kv_cache_dtype = choice.dtype;
    const auto t0 = Clock::now();
    TP_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(model_dir, options));
    c.load_s = SecondsSince(t0);
    c.stored = std::string(KvCacheDTypeName(engine->runner().kv_dtype()));
    c.capacity_tokens = engine->kv_capacity_tokens();
    std::vector<std::vector<int32_t>> forced;
    for (const Trace& t : base) forced.emplace_back(t.tokens.begin(), t.tokens.begin() + steps);
    const auto t1 = Clock::now();
    TP_ASSIGN_OR_RETURN(const std::vector<Trace> teacher,
                        RunPrompts(*engine, prompts, steps, &forced, next_seq_id));
    c.teacher_forced_s = SecondsSince(t1);
    // S generated tokens: the prefill's and S - 1 decode steps'.
    const auto t2 = Clock::now();
    TP_ASSIGN_OR_RETURN(const std::vector<Trace> free,
                        RunPrompts(*engine, prompts, steps - 1, nullptr, next_seq_id));
    c.free_running_s = SecondsSince(t2);
    for (int p = 0; p < num_prompts; ++p) {
      std::vector<int64_t> top1;
      for (int r = 0; r <= steps; ++r) {
        c.errors.push_back(RelativeError(teacher[p].rows.at(r), base[p].rows.at(r)));
        top1.push_back(ArgMax(teacher[p].rows[r]));
        c.top1_equal += top1.back() == ArgMax(base[p].rows[r]);
      }
      c.teacher_forced_top1.push_back(std::move(top1));
      int first = steps;
      for (int s = 0; s < steps; ++s) {
        const bool equal = free[p].tokens.at(s) == base[p].tokens.at(s);
        c.tokens_equal += equal;
        if (!equal && first == steps) first = s;
      }
      c.first_divergence.push_back(first);
      c.greedy_tokens.push_back(free[p].tokens);
    }
    std::fprintf(
        stderr, "[kv-compare] %s (stores %s): load %.2f s, teacher-forced %.2f s, greedy %.2f s\n",
        c.requested.c_str(), c.stored.c_str(), c.load_s, c.teacher_forced_s, c.free_running_s);
    results.push_back(std::move(c));
  }

  nlohmann::json j;
  j["model"] = model_dir;
  j["device"] = device;
  j["prompts"] = num_prompts;
  j["prompt_len"] = prompt_len;
  j["steps"] = steps;
  j["seed"] = seed;
  j["baseline_kv_cache_dtype"] = base_stored;
  // For a check against `tpserve run`: the prompts and the baseline's S greedy tokens.
  j["prompt_ids"] = prompts;
  j["baseline_greedy_tokens"] = nlohmann::json::array();
  for (const Trace& t : base) {
    j["baseline_greedy_tokens"].push_back(
        std::vector<int32_t>(t.tokens.begin(), t.tokens.begin() + steps));
  }
  j["results"] = nlohmann::json::array();
  for (const Comparison& c : results) j["results"].push_back(ComparisonJson(c, steps));
  if (a.Flag("json")) {
    std::cout << j.dump() << std::endl;
    return absl::OkStatus();
  }
  std::cout << absl::StrFormat(
      "%d random prompts of %d tokens, %d greedy steps, %s, baseline KV cache %s\n", num_prompts,
      prompt_len, steps, device, base_stored);
  std::cout << absl::StrFormat("%-6s %-6s %6s %11s %11s %11s %7s %12s %9s %9s\n", "kv", "stores",
                               "rows", "rel_median", "rel_mean", "rel_max", "top1", "first_div",
                               "all_match", "tok_match");
  for (const nlohmann::json& r : j["results"]) {
    std::cout << absl::StrFormat(
        "%-6s %-6s %6d %11.3e %11.3e %11.3e %7.4f %12.2f %9.3f %9.4f\n",
        r["kv_cache_dtype"].get<std::string>(), r["stored_kv_cache_dtype"].get<std::string>(),
        r["rows"].get<int>(), r["rel_error_median"].get<double>(),
        r["rel_error_mean"].get<double>(), r["rel_error_max"].get<double>(),
        r["top1_agreement"].get<double>(), r["greedy_first_divergence_mean"].get<double>(),
        r["greedy_all_match_fraction"].get<double>(),
        r["greedy_token_match_fraction"].get<double>());
  }
  return absl::OkStatus();
}

}  // namespace tpserve
