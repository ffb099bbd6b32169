// Runs the real binaries: `--help` / `-h` on every tpserve subcommand and every executable exits
// 0 and prints each declared flag on stdout; bad flags exit 2 with a message naming them.
#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/env.h"
#include "coordinator/coordinator_flags.h"
#include "tools/run_cmd.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;

struct Result {
  std::string out;  // stdout only (stderr is kept apart: --help must print to stdout)
  int code = -1;
};

// stdout of `cmd`, or its stderr when `want_stderr`.
Result RunCli(const std::string& cmd, bool want_stderr = false) {
  Result r;
  const std::string redirect =
      want_stderr ? " 2>&1 >/dev/null </dev/null" : " 2>/dev/null </dev/null";
  FILE* p = popen((cmd + redirect).c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// `-h` is checked too where `both_forms` (each run costs about half a second on CI).
void ExpectHelpListsFlags(const std::string& cmd, const std::vector<std::string>& flags,
                          bool both_forms = false) {
  for (const char* h : {"--help", "-h"}) {
    if (!both_forms && std::string(h) == "-h") break;
    const Result r = RunCli(cmd + " " + h);
    EXPECT_EQ(r.code, 0) << cmd << " " << h;
    EXPECT_THAT(r.out, HasSubstr("usage: ")) << cmd;
    for (const std::string& f : flags)
      EXPECT_THAT(r.out, HasSubstr("--" + f)) << cmd << "\n" << r.out;
  }
}

std::vector<std::string> Names(const CommandSpec& spec) {
  std::vector<std::string> names;
  for (const FlagSpec& f : spec.flags) names.push_back(f.name);
  return names;
}

const std::string kCli = TPSERVE_CLI_BIN;

TEST(CliHelpTest, ServeAndCoordinatorPrintEveryDeclaredFlag) {
  ASSERT_GT(Names(CoordinatorFlagSpec(true)).size(), 20u);
  ExpectHelpListsFlags(kCli + " serve", Names(CoordinatorFlagSpec(true)), true);
  ExpectHelpListsFlags(TPSERVE_COORDINATOR_BIN, Names(CoordinatorFlagSpec(false)), true);
}

TEST(CliHelpTest, RunPrintsEveryDeclaredFlag) {
  ExpectHelpListsFlags(kCli + " run", Names(RunFlagSpec()), true);
}

TEST(CliHelpTest, WorkerPrintsItsFlags) {
  ExpectHelpListsFlags(
      TPSERVE_WORKER_BIN,
      {"coordinator", "rank", "world-size", "device", "gpu", "connect-timeout", "all-reduce"},
      true);
}

TEST(CliHelpTest, EverySubcommandAndTheEngineBenchAnswerHelp) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> commands = {
      {kCli + " generate", {"server", "prompt", "prompt-ids", "stream", "timeout"}},
      {kCli + " info", {"server", "timeout"}},
      {kCli + " health", {"server", "service", "timeout"}},
      {kCli + " bench",
       {"server", "preset", "request-rate", "list-presets", "info-timeout", "logprobs",
        "check-deterministic"}},
      {kCli + " random-model", {"config", "out", "seed", "dtype", "shard-size-mb", "threads"}},
      {kCli + " tokenize", {"tokenizer", "add-special-tokens"}},
      {kCli + " detokenize", {"tokenizer", "skip-special-tokens"}},
      {TPSERVE_ENGINE_BENCH_BIN, {"model", "prompt-len", "batches", "profile", "kv-cache-mb"}},
  };
  for (const auto& [cmd, flags] : commands) ExpectHelpListsFlags(cmd, flags);
  const Result top = RunCli(kCli + " --help");
  EXPECT_EQ(top.code, 0);
  for (const char* c : {"serve", "run", "generate", "info", "health", "bench", "random-model",
                        "tokenize", "detokenize"}) {
    EXPECT_THAT(top.out, HasSubstr(c));
  }
}

// Exit code 2 and the message on stderr.
void ExpectUsageError(const std::string& cmd, const std::string& message) {
  const Result r = RunCli(cmd, /*want_stderr=*/true);
  EXPECT_EQ(r.code, 2) << cmd;  // a connection or load failure would exit 1
  EXPECT_THAT(r.out, HasSubstr(message)) << cmd;
}

TEST(CliHelpTest, BadFlagsExitTwoNamingTheFlag) {
  ExpectUsageError(kCli + " serve --model m --port 99999", "--port");
  ExpectUsageError(kCli + " run --model m --prompt x extra", "'extra'");
  ExpectUsageError(std::string(TPSERVE_COORDINATOR_BIN) + " --model m --bogus",
                   "unknown flag --bogus");
  ExpectUsageError(std::string(TPSERVE_COORDINATOR_BIN) + " --model m --all-reduce fast",
                   "--all-reduce must be auto, nccl or custom");
}

TEST(CliHelpTest, WorkerRefusesABadGpuOrConnectTimeout) {
  const std::string worker = std::string(TPSERVE_WORKER_BIN) + " --coordinator 127.0.0.1:1";
  ExpectUsageError(worker + " --gpu abc", "--gpu expects an integer");
  ExpectUsageError(worker + " --gpu -1", "--gpu expects an integer");
  ExpectUsageError(worker + " --connect-timeout 0", "--connect-timeout expects an integer");
  ExpectUsageError(worker + " --connect-timeout soon", "--connect-timeout expects an integer");
  ExpectUsageError(worker + " --all-reduce fast", "--all-reduce must be auto, nccl or custom");
}

// `tpserve run` has the workers' repetition penalty (the same shard runner applies it) and the
// sampling check every front end uses.
TEST(CliHelpTest, RunAppliesARepetitionPenalty) {
  const std::string run = kCli + " run --model " + std::string(TPSERVE_SOURCE_DIR) +
                          "/models/tiny-coder --device cpu --prompt-ids 5,6,7,5,6,7,5,6,7 "
                          "--max-new-tokens 24 --ignore-eos --json";
  const Result plain = RunCli(run);
  const Result penalized = RunCli(run + " --repetition-penalty 1.8");
  ASSERT_EQ(plain.code, 0) << plain.out;
  ASSERT_EQ(penalized.code, 0) << penalized.out;
  auto ids = [](const std::string& json) {
    const size_t at = json.find("\"output_ids\"");
    return at == std::string::npos ? std::string() : json.substr(at, json.find(']', at) - at);
  };
  EXPECT_FALSE(ids(plain.out).empty()) << plain.out;
  EXPECT_NE(ids(plain.out), ids(penalized.out)) << "the penalty changed nothing";
  ExpectUsageError(run + " --repetition-penalty 0", "--repetition-penalty");
}

TEST(CliHelpTest, EnvListsTheSwitchesWithTheirCurrentValues) {
  const Result r = RunCli("TPSERVE_PDL=0 TPSERVE_LOG_LEVEL=loud " + kCli + " env");
  EXPECT_EQ(r.code, 0);
  for (const EnvVar* v : DeclaredEnvVars()) EXPECT_THAT(r.out, HasSubstr(v->name));
  // name, type, default, current value: TPSERVE_PDL is set to 0, the bad level is not taken.
  EXPECT_THAT(r.out, ::testing::ContainsRegex("TPSERVE_PDL +bool +1 +0 "));
  const size_t level = r.out.find("TPSERVE_LOG_LEVEL ");
  ASSERT_NE(level, std::string::npos);
  const std::string line = r.out.substr(level, r.out.find('\n', level) - level);
  EXPECT_THAT(line, ::testing::ContainsRegex("choice +info"));
  EXPECT_THAT(line, HasSubstr("(unset)"));
  const Result err = RunCli("TPSERVE_LOG_LEVEL=loud " + kCli + " env", /*want_stderr=*/true);
  EXPECT_THAT(err.out, HasSubstr("TPSERVE_LOG_LEVEL='loud' is ignored"));
  EXPECT_EQ(RunCli(kCli + " env --help").code, 0);
}

}  // namespace
}  // namespace tpserve
