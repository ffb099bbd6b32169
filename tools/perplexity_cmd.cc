// `tpserve perplexity`: held-out perplexity of a model on text files, in this process, through
// the engine's prefill (so the KV cache dtype counts: every position's attention reads the
// cache). The windows are those of tools/train_tiny_coder.py's evaluation: the files' tokens
// (each with the tokenizer's special tokens, then EOS) concatenated, cut into non-overlapping
// windows of --window inputs, each predicting the next --window tokens.
#include "tools/perplexity_cmd.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "kernels/ops.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

absl::StatusOr<std::vector<std::string>> ReadList(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the file list ", path));
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(line);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, " lists no files"));
  return out;
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

const CommandSpec& PerplexityFlagSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve perplexity",
      "Loads the model in this process and measures its perplexity on text files (each file's "
      "tokens with the tokenizer's special tokens and EOS, cut into windows).",
      {StringFlag("model", "DIR", "model directory, with tokenizer.json [required]"),
       StringFlag("files-from", "LIST", "a file naming one text file per line [required]"),
       IntFlag("window", 2, 1 << 20, "inputs per window (default 512)"),
       IntFlag("max-windows", 1, 1 << 30, "evaluate only the first N windows"),
       StringFlag("device", "cpu|cuda|auto", "where to run (default auto)"), KvCacheDTypeFlag(),
       BoolFlag("json", "print one JSON object")},
      "Text files are read as they are (CRLF is not rewritten). The reported loss is the mean\n"
      "negative log-likelihood in nats per predicted token; perplexity is exp(loss)."};
  return *spec;
}

absl::Status RunPerplexityCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags a, Flags::Parse(PerplexityFlagSpec(), args));
  if (a.help()) return PrintUsage(PerplexityFlagSpec());
  TP_ASSIGN_OR_RETURN(const std::string model_dir, a.Required("model"));
  TP_ASSIGN_OR_RETURN(const std::string list, a.Required("files-from"));
  const int window = static_cast<int>(a.GetInt("window", 512));
  TP_ASSIGN_OR_RETURN(const std::vector<std::string> files, ReadList(list));
  TP_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Load(model_dir));

  EngineOptions options;
  options.device = a.GetOr("device", "auto");
  TP_ASSIGN_OR_RETURN(options.kv_cache_dtype, ParseKvCacheDType(a.GetOr("kv-cache-dtype", "auto")));
  options.model.max_batch_tokens = window;
  options.model.max_batch_seqs = window;  // every position's logits
  options.num_kv_blocks = (window + options.block_size - 1) / options.block_size;
  const auto t0 = std::chrono::steady_clock::now();
  TP_ASSIGN_OR_RETURN(auto engine, Engine::Create(model_dir, options));
  std::optional<int32_t> eos = tokenizer->eos_id();
  if (!eos && !engine->config().eos_token_ids.empty()) eos = engine->config().eos_token_ids[0];
  if (!eos) return absl::InvalidArgumentError("the model names no EOS token");

  std::vector<int32_t> ids;
  for (const std::string& f : files) {
    TP_ASSIGN_OR_RETURN(const std::string text, ReadText(f));
    const std::vector<int32_t> e = tokenizer->Encode(text, /*add_special_tokens=*/true);
    ids.insert(ids.end(), e.begin(), e.end());
    ids.push_back(*eos);
  }
  int64_t windows = (static_cast<int64_t>(ids.size()) - 1) / window;
  if (a.Has("max-windows")) windows = std::min<int64_t>(windows, a.GetInt("max-windows", 0));
  if (windows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the files hold ", ids.size(), " tokens: not one window of ", window, " + 1"));
  }
  const int64_t vocab = engine->config().vocab_size;
  const auto t1 = std::chrono::steady_clock::now();
  double nll = 0;
  for (int64_t w = 0; w < windows; ++w) {
    const std::vector<int32_t> x(ids.begin() + w * window, ids.begin() + (w + 1) * window);
    TP_ASSIGN_OR_RETURN(const std::vector<std::vector<float>> logits, engine->PromptLogits(x));
    for (int i = 0; i < window; ++i) {
      const std::vector<float>& row = logits.at(i);
      nll += LogSumExp(row.data(), vocab) - row[ids[w * window + i + 1]];
    }
  }
  const double eval_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const int64_t predicted = windows * window;
  const double loss = nll / static_cast<double>(predicted);
  const std::string kv = std::string(KvCacheDTypeName(engine->runner().kv_dtype()));
  const std::string device = ResolveDevice(options.device);
  if (a.Flag("json")) {
    nlohmann::json j;
    j["model"] = model_dir;
    j["device"] = device;
    j["kv_cache_dtype"] = kv;
    j["files"] = files.size();
    j["tokens"] = ids.size();
    j["windows"] = windows;
    j["window"] = window;
    j["predicted_tokens"] = predicted;
    j["loss"] = loss;
    j["perplexity"] = std::exp(loss);
    j["seconds"] = eval_s;
    j["load_seconds"] = std::chrono::duration<double>(t1 - t0).count();
    std::cout << j.dump() << std::endl;
  } else {
    std::cout << absl::StrFormat(
                     "perplexity %.4f (loss %.5f nats/token) over %ld predicted tokens in %ld "
                     "windows of %d; %zu files, KV cache %s, %s, %.1f s",
                     std::exp(loss), loss, static_cast<long>(predicted), static_cast<long>(windows),
                     window, files.size(), kv, device, eval_s)
              << std::endl;
  }
  return absl::OkStatus();
}

}  // namespace tpserve
