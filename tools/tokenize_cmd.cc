// `tpserve tokenize` / `tpserve detokenize`, reading stdin and writing stdout.
#include "tools/tokenize_cmd.h"

#include <iostream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tools/cli_args.h"

namespace tpserve {
namespace {

std::string ReadStdin() {
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

}  // namespace

absl::Status RunTokenizeCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(CliArgs cli, CliArgs::Parse(args, {"tokenizer"}, {"add-special-tokens"}));
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
  TP_ASSIGN_OR_RETURN(CliArgs cli, CliArgs::Parse(args, {"tokenizer"}, {"skip-special-tokens"}));
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
