// `tpserve run --model DIR (--prompt TEXT | --prompt-ids 1,2,3) ...`: loads the model in this
// process, generates, prints the completion (or one JSON object with --json).
#include "tools/run_cmd.h"

#include <chrono>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/sampling.h"
#include "common/status.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

// A token's text as a quoted JSON string ("" without a tokenizer).
std::string QuotedToken(const Tokenizer* tokenizer, int32_t id) {
  if (tokenizer == nullptr) return "";
  return nlohmann::json(tokenizer->Decode({id}, false))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

nlohmann::json LogprobsJson(const GenerateResult& r, const Tokenizer* tokenizer) {
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < r.logprobs.size() && i < r.output_ids.size(); ++i) {
    nlohmann::json t;
    t["token_id"] = r.output_ids[i];
    if (tokenizer) t["text"] = tokenizer->Decode({r.output_ids[i]}, false);
    t["logprob"] = r.logprobs[i].logprob;
    t["top_logprobs"] = nlohmann::json::array();
    for (const TokenLogprob& alt : r.logprobs[i].top) {
      nlohmann::json a;
      a["token_id"] = alt.id;
      if (tokenizer) a["text"] = tokenizer->Decode({alt.id}, false);
      a["logprob"] = alt.logprob;
      t["top_logprobs"].push_back(a);
    }
    out.push_back(t);
  }
  return out;
}

}  // namespace

const CommandSpec& RunFlagSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve run",
      "Loads the model in this process and generates one completion; give exactly one of "
      "--prompt and --prompt-ids.",
      {StringFlag("model", "DIR", "model directory [required]"),
       StringFlag("prompt", "TEXT", "the prompt text (needs the model's tokenizer.json)"),
       StringFlag("prompt-ids", "1,2,3", "the prompt as token ids"),
       IntFlag("max-new-tokens", 1, 1 << 20, "tokens to generate (default 64)"),
       FloatFlag("temperature", 0, 1e6, "sampling temperature; 0: greedy (default)", "T"),
       FloatFlag("top-p", 0, 1, "nucleus sampling mass (default 1)", "P", /*min_exclusive=*/true),
       IntFlag("top-k", 0, int64_t{1} << 30, "sample among the K most likely tokens; 0: all", "K"),
       IntFlag("seed", INT64_MIN, INT64_MAX, "sampling seed (default 0)", "S"),
       FloatFlag("repetition-penalty", 0, 1e6,
                 "Hugging Face's penalty of tokens already in the prompt or output; 1: off "
                 "(default)",
                 "R", /*min_exclusive=*/true),
       BoolFlag("ignore-eos", "keep generating past the end-of-sequence token"),
       StringFlag("device", "cpu|cuda|auto", "where to run (default auto)"),
       FloatFlag("gpu-memory-utilization", 0, 1,
                 "fraction of the GPU for weights, workspace and KV cache (default 0.9)", "F",
                 /*min_exclusive=*/true),
       IntFlag("kv-cache-mb", 0, int64_t{1} << 30, "KV cache in MiB; 0: sized automatically", "MB"),
       KvCacheDTypeFlag(),
       BoolFlag("deterministic",
                "batch-invariant kernels, as tpserve serve --deterministic (same tokens as a "
                "server in that mode)"),
       IntFlag("logprobs", 0, kMaxLogprobs,
               "each token's log-probability and the N most likely alternatives (raw "
               "distribution, before temperature / top-k / top-p)"),
       BoolFlag("json", "print one JSON object")},
      "On a GPU the KV cache takes what --gpu-memory-utilization of the device's memory leaves\n"
      "after the weights; on the CPU it holds this one request."};
  return *spec;
}

absl::Status RunRunCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags a, Flags::Parse(RunFlagSpec(), args));
  if (a.help()) return PrintUsage(RunFlagSpec());
  TP_ASSIGN_OR_RETURN(std::string model_dir, a.Required("model"));
  if (a.Has("prompt") == a.Has("prompt-ids")) {
    return absl::InvalidArgumentError(
        "give exactly one of --prompt and --prompt-ids (see tpserve run --help)");
  }
  GenerateRequest req;
  const int64_t kv_mb = a.GetInt("kv-cache-mb", 0);
  const double utilization = a.GetDouble("gpu-memory-utilization", 0.90);
  req.max_new_tokens = static_cast<int>(a.GetInt("max-new-tokens", 64));
  req.sampling.temperature = static_cast<float>(a.GetDouble("temperature", 0.0));
  req.sampling.top_p = static_cast<float>(a.GetDouble("top-p", 1.0));
  req.sampling.top_k = static_cast<int32_t>(a.GetInt("top-k", 0));
  req.sampling.seed = static_cast<uint64_t>(a.GetInt("seed", 0));
  req.sampling.logprobs = static_cast<int32_t>(a.GetInt("logprobs", -1));
  req.sampling.repetition_penalty = static_cast<float>(a.GetDouble("repetition-penalty", 1.0));
  // The one check the service, the engine and the workers use (flag ranges come first).
  TP_RETURN_IF_ERROR(ValidateSampling(req.sampling, "sampling "));
  req.ignore_eos = a.Flag("ignore-eos");

  std::unique_ptr<Tokenizer> tokenizer;
  if (a.Has("prompt")) {
    TP_ASSIGN_OR_RETURN(tokenizer, Tokenizer::Load(model_dir));
    req.prompt = tokenizer->Encode(*a.Get("prompt"), /*add_special_tokens=*/true);
  } else {
    TP_ASSIGN_OR_RETURN(req.prompt, ParseTokenIds("prompt-ids", *a.Get("prompt-ids")));
    auto tok = Tokenizer::Load(model_dir);  // optional: only to print text
    if (tok.ok()) tokenizer = std::move(*tok);
  }

  EngineOptions options;
  options.device = a.GetOr("device", "auto");
  options.kv_cache_bytes = kv_mb * (int64_t{1} << 20);
  options.gpu_memory_utilization = utilization;
  options.deterministic = a.Flag("deterministic");
  TP_ASSIGN_OR_RETURN(options.kv_cache_dtype, ParseKvCacheDType(a.GetOr("kv-cache-dtype", "auto")));
  if (ResolveDevice(options.device) == "cpu") {
    // The CPU has no device memory budget: a cache for this one request.
    const int64_t need = static_cast<int64_t>(req.prompt.size()) + req.max_new_tokens;
    options.num_kv_blocks = static_cast<int>((need + options.block_size - 1) / options.block_size);
  }
  options.model.max_batch_seqs = 1;
  const auto t0 = std::chrono::steady_clock::now();
  TP_ASSIGN_OR_RETURN(auto engine, Engine::Create(model_dir, options));
  const auto t1 = std::chrono::steady_clock::now();
  TP_ASSIGN_OR_RETURN(auto results, engine->Generate({req}));
  const auto t2 = std::chrono::steady_clock::now();
  const GenerateResult& r = results.at(0);
  const double load_s = std::chrono::duration<double>(t1 - t0).count();
  const double gen_s = std::chrono::duration<double>(t2 - t1).count();

  std::string text = tokenizer ? tokenizer->Decode(r.output_ids, true) : "";
  if (a.Flag("json")) {
    nlohmann::json j;
    j["prompt_ids"] = req.prompt;
    j["output_ids"] = r.output_ids;
    if (tokenizer) j["text"] = text;
    if (req.sampling.logprobs >= 0) j["logprobs"] = LogprobsJson(r, tokenizer.get());
    j["finish_reason"] = r.finish_reason;
    j["device"] = ResolveDevice(options.device);
    j["load_seconds"] = load_s;
    j["kv_capacity_tokens"] = engine->kv_capacity_tokens();
    j["kv_cache_dtype"] = std::string(KvCacheDTypeName(engine->runner().kv_dtype()));
    j["generate_seconds"] = gen_s;
    j["tokens_per_second"] = r.output_ids.size() / gen_s;
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  } else {
    if (tokenizer && a.Has("prompt")) std::cout << *a.Get("prompt");
    if (tokenizer) {
      std::cout << text << std::endl;
    } else {
      for (size_t i = 0; i < r.output_ids.size(); ++i) {
        std::cout << (i ? "," : "") << r.output_ids[i];
      }
      std::cout << std::endl;
    }
    if (req.sampling.logprobs >= 0) {
      // One line per token: id, text, logprob, then the alternatives.
      std::cout << "logprobs (token: logprob | top " << req.sampling.logprobs << "):\n";
      for (size_t i = 0; i < r.logprobs.size() && i < r.output_ids.size(); ++i) {
        const int32_t id = r.output_ids[i];
        std::cout << absl::StrFormat("%6d %-16s %9.4f |", id, QuotedToken(tokenizer.get(), id),
                                     r.logprobs[i].logprob);
        for (const TokenLogprob& alt : r.logprobs[i].top) {
          std::cout << absl::StrFormat(" %d %s %.4f;", alt.id, QuotedToken(tokenizer.get(), alt.id),
                                       alt.logprob);
        }
        std::cout << "\n";
      }
    }
    std::fprintf(stderr, "[%zu tokens in %.2f s, %.1f tokens/s on %s; load %.2f s; finish: %s]\n",
                 r.output_ids.size(), gen_s, r.output_ids.size() / gen_s,
                 ResolveDevice(options.device).c_str(), load_s, r.finish_reason.c_str());
  }
  return absl::OkStatus();
}

}  // namespace tpserve
