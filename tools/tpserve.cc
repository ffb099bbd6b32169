// The `tpserve` command line: subcommands for in-process generation, model tools and the
// tokenizer (and, with the service, the gRPC client).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/env.h"
#include "common/flags.h"
#include "common/logging.h"
#include "tools/bench/bench_cmd.h"
#include "tools/client_cmd.h"
#include "tools/kv_compare_cmd.h"
#include "tools/perplexity_cmd.h"
#include "tools/random_model.h"
#include "tools/run_cmd.h"
#include "tools/tokenize_cmd.h"

namespace {

// `tpserve env`: the declared environment switches with their current values (common/env.h).
absl::Status RunEnvCommand(const std::vector<std::string>& args) {
  static const tpserve::CommandSpec* const spec = new tpserve::CommandSpec{
      "tpserve env",
      "Lists the environment variables tpserve reads: name, type, default, current value, "
      "meaning.",
      {},
      ""};
  absl::StatusOr<tpserve::Flags> flags = tpserve::Flags::Parse(*spec, args);
  if (!flags.ok()) return flags.status();
  if (flags->help()) return tpserve::PrintUsage(*spec);
  const std::string table = tpserve::EnvWithoutLogging().Table();
  std::fwrite(table.data(), 1, table.size(), stdout);
  for (const std::string& w : tpserve::EnvWithoutLogging().warnings()) {
    std::fprintf(stderr, "warning: %s\n", w.c_str());
  }
  return absl::OkStatus();
}

struct Command {
  const char* name;
  const char* help;
  absl::Status (*run)(const std::vector<std::string>&);
};

const Command kCommands[] = {
    {"serve", "start the service: gRPC, OpenAI-compatible HTTP (coordinator + local workers)",
     tpserve::RunServeCommand},
    {"generate", "generate through a running server (gRPC)", tpserve::RunGenerateCommand},
    {"info", "print a server's model info as JSON", tpserve::RunInfoCommand},
    {"health", "check a server's health (grpc.health.v1)", tpserve::RunHealthCommand},
    {"bench", "measure a running server: throughput, latency percentiles (presets, JSON)",
     tpserve::RunBenchCommand},
    {"run", "generate a completion in this process", tpserve::RunRunCommand},
    {"perplexity", "measure a model's perplexity on text files in this process",
     tpserve::RunPerplexityCommand},
    {"kv-compare", "measure how far quantized KV caches move logits and greedy tokens",
     tpserve::RunKvCompareCommand},
    {"random-model", "write a model directory with random weights for a config",
     tpserve::RunRandomModelCommand},
    {"tokenize", "print the token ids of stdin as a JSON array", tpserve::RunTokenizeCommand},
    {"detokenize", "print the text of a JSON array of ids read from stdin",
     tpserve::RunDetokenizeCommand},
    {"env", "list the environment switches (type, default, current value, meaning)", RunEnvCommand},
};

void PrintUsage(FILE* out) {
  std::fprintf(out, "usage: tpserve COMMAND [flags]\n\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-14s %s\n", c.name, c.help);
  std::fprintf(out, "\n`tpserve COMMAND --help` lists the flags of a command.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    PrintUsage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const Command& c : kCommands) {
    if (std::strcmp(argv[1], c.name) == 0) {
      std::vector<std::string> args(argv + 2, argv + argc);
      // The role on log lines: `run` loads the engine here, `serve` names itself coordinator.
      tpserve::SetLogPrefix(std::strcmp(c.name, "run") == 0 ? "engine" : "cli");
      absl::Status status = c.run(args);
      if (!status.ok()) {
        // Flag errors name the command already ("tpserve serve: --port ...").
        const std::string prefix = std::string("tpserve ") + c.name + ": ";
        std::string message(status.message());
        if (message.rfind(prefix, 0) == 0) message.erase(0, prefix.size());
        std::fprintf(stderr, "%s%s\n", prefix.c_str(), message.c_str());
        return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
      }
      return 0;
    }
  }
  std::fprintf(stderr, "tpserve: unknown command '%s'\n", argv[1]);
  PrintUsage(stderr);
  return 2;
}
