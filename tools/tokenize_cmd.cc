// `tpserve tokenize` / `tpserve detokenize`, reading stdin and writing stdout.
#include "tools/tokenize_cmd.h"

#include <iostream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "common/status.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace tpserve {
namespace {

std::string ReadStdin() {
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

const CommandSpec& TokenizeSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve tokenize",
      "Prints the token ids of stdin as a JSON array.",
      {StringFlag("tokenizer", "PATH", "tokenizer.json or a model directory [required]"),
       BoolFlag("add-special-tokens", "add the tokenizer's special tokens (e.g. BOS)")},
      ""};
  return *spec;
}

const CommandSpec& DetokenizeSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve detokenize",
      "Prints the text of a JSON array of token ids read from stdin.",
      {StringFlag("tokenizer", "PATH", "tokenizer.json or a model directory [required]"),
       BoolFlag("skip-special-tokens", "leave special tokens out of the text")},
      ""};
  return *spec;
}

}  // namespace

absl::Status RunTokenizeCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags cli, Flags::Parse(TokenizeSpec(), args));
  if (cli.help()) return PrintUsage(TokenizeSpec());
  TP_ASSIGN_OR_RETURN(std::string path, cli.Required("tokenizer"));
  TP_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Load(path));
  std::string text = ReadStdin();
  std::vector<int32_t> ids = tokenizer->Encode(text, cli.Flag("add-special-tokens"));
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, ids[i]);
  }
  out += "]\n";
  std::cout << out << std::flush;
  return absl::OkStatus();
}

absl::Status RunDetokenizeCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags cli, Flags::Parse(DetokenizeSpec(), args));
  if (cli.help()) return PrintUsage(DetokenizeSpec());
  TP_ASSIGN_OR_RETURN(std::string path, cli.Required("tokenizer"));
  TP_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Load(path));
  std::string input = ReadStdin();
  nlohmann::json j = nlohmann::json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_array()) {
    return absl::InvalidArgumentError("detokenize: stdin must be a JSON array of token ids");
  }
  std::vector<int32_t> ids;
  ids.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    if (!j[i].is_number_integer() || j[i].get<int64_t>() < 0 ||
        j[i].get<int64_t>() >= tokenizer->vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("detokenize: element ", i, " (", j[i].dump(),
                                                     ") is not a token id in [0, ",
                                                     tokenizer->vocab_size(), ")"));
    }
    ids.push_back(static_cast<int32_t>(j[i].get<int64_t>()));
  }
  std::cout << tokenizer->Decode(ids, cli.Flag("skip-special-tokens")) << std::flush;
  return absl::OkStatus();
}

}  // namespace tpserve
