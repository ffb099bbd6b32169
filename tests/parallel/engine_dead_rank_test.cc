// A rank that dies or stalls in the middle of Engine::Generate (tiny-coder, TP=2, PP=2,
// TP=2 x PP=2 over MPI) makes the job fail with a clear error within the timeout: runs
// engine_dead_rank_helper under mpirun (itself under `timeout`, so this test can never hang)
// and checks the wall time, the exit status and the message naming the group, rank and
// operation.
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/run_command.h"

namespace tpserve {
namespace {

using ::testing::AnyOf;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kCommTimeoutMs = 3000;
constexpr int kHardLimitS = 90;  // `timeout` around mpirun: exit status 124 means it hung

using testing_util::RunCommand;
using testing_util::RunResult;

// Runs the helper with tp x pp ranks; `victim` dies (`mode`) at its `die_at`-th operation.
RunResult RunJob(int tp, int pp, const std::string& mode, int victim, int die_at) {
  const std::string cmd = absl::StrCat("timeout -k 5 ", kHardLimitS, " ", TPSERVE_MPIEXEC,
                                       " --allow-run-as-root --oversubscribe -np ", tp * pp, " ",
                                       TPSERVE_ENGINE_DEAD_RANK_HELPER, " ", tp, " ", pp, " ", mode,
                                       " ", victim, " ", die_at, " ", kCommTimeoutMs, " 2>&1");
  return RunCommand(cmd);
}

void ExpectFailedFast(const RunResult& r) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "the job hung until the hard limit\n" << r.output;
  EXPECT_NE(r.exit_code, 137) << "the job hung until the hard limit\n" << r.output;
  // Model load + communicator timeout + mpirun start-up and teardown on a loaded 2-core machine.
  EXPECT_LT(r.wall, absl::Milliseconds(kCommTimeoutMs) + absl::Seconds(30)) << r.output;
  EXPECT_THAT(r.output, HasSubstr("engine_dead_rank_helper: victim")) << "nobody died\n"
                                                                      << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("finished without noticing"))) << r.output;
}

// Tiny-coder's operations per step: TP=2: 1 embedding all-reduce + 2 per layer x 4 + 1 logits
// all-gather = 10; PP=2: a send or receive + the broadcast of the ids = 2. Dying at about the
// tenth step puts the failure in the decode loop.
TEST(EngineDeadRankTest, StalledTpPeerMakesGenerateTimeOutNamingGroupRankAndOp) {
  RunResult r = RunJob(2, 1, "stall", 1, 101);
  SCOPED_TRACE(absl::StrCat("wall ", absl::FormatDuration(r.wall)));
  ExpectFailedFast(r);
  EXPECT_THAT(r.output,
              ContainsRegex("engine_dead_rank_helper: rank 0: Generate failed: DEADLINE_EXCEEDED: "
                            "tp group of stage 0 \\(mpi\\): rank 0 (AllReduceSum|AllGather) with "
                            "all ranks did not finish within 3s"))
      << r.output;
  EXPECT_GE(r.wall, absl::Milliseconds(kCommTimeoutMs));
}

TEST(EngineDeadRankTest, StalledLastStageMakesFirstStageTimeOut) {
  RunResult r = RunJob(1, 2, "stall", 1, 20);
  SCOPED_TRACE(absl::StrCat("wall ", absl::FormatDuration(r.wall)));
  ExpectFailedFast(r);
  // Stage 0 waits for the sampled ids (Recv) or for its send of the activations to be taken.
  EXPECT_THAT(r.output,
              ContainsRegex("engine_dead_rank_helper: rank 0: Generate failed: DEADLINE_EXCEEDED: "
                            "pp chain of tp rank 0 \\(mpi\\): rank 0 (Recv|Send) with peer 1 did "
                            "not finish within 3s"))
      << r.output;
}

TEST(EngineDeadRankTest, StalledFirstStageMakesLastStageTimeOut) {
  RunResult r = RunJob(1, 2, "stall", 0, 21);
  SCOPED_TRACE(absl::StrCat("wall ", absl::FormatDuration(r.wall)));
  ExpectFailedFast(r);
  EXPECT_THAT(r.output,
              ContainsRegex("engine_dead_rank_helper: rank 1: Generate failed: DEADLINE_EXCEEDED: "
                            "pp chain of tp rank 0 \\(mpi\\): rank 1 Recv with peer 0 did not "
                            "finish within 3s"))
      << r.output;
}

TEST(EngineDeadRankTest, StalledRankOfTwoByTwoGridMakesSurvivorsTimeOut) {
  RunResult r = RunJob(2, 2, "stall", 2, 61);
  SCOPED_TRACE(absl::StrCat("wall ", absl::FormatDuration(r.wall)));
  ExpectFailedFast(r);
  // Its TP peer (rank 3) and its PP peer (rank 0) both wait on it.
  EXPECT_THAT(r.output, ContainsRegex("engine_dead_rank_helper: rank [013]: Generate failed: "
                                      "DEADLINE_EXCEEDED: (tp group of stage 1|pp chain of tp "
                                      "rank [01]) \\(mpi\\): rank [0-9]"))
      << r.output;
  // Group ranks differ from world ranks here; the messages give both: world rank 3 in the tp
  // group of stage 1 is its rank 1, and the stalled world rank 2 is peer 1 of the pp chain of
  // tp rank 0 (or rank 0 of stage 1's tp group, waited on by all ranks).
  EXPECT_THAT(r.output,
              ContainsRegex("tp group of stage 1 \\(mpi\\): rank 1 \\(world rank 3\\) "
                            "[A-Za-z]+ with all ranks|pp chain of tp rank 0 \\(mpi\\): rank 0 "
                            "[A-Za-z]+ with peer 1 \\(world rank 2\\)"))
      << r.output;
}

TEST(EngineDeadRankTest, AbortedRankEndsTheJobWithAMessageNamingIt) {
  RunResult r = RunJob(2, 2, "abort", 1, 40);
  SCOPED_TRACE(absl::StrCat("wall ", absl::FormatDuration(r.wall)));
  ExpectFailedFast(r);
  // Either mpirun ends the job (Open MPI's errmgr) and names the rank, or a survivor reports the
  // error itself first.
  EXPECT_THAT(r.output,
              AnyOf(ContainsRegex("process rank 1 with PID [0-9]+ on[[:space:]]+node .* exited "
                                  "on[[:space:]]+signal 6"),
                    ContainsRegex("engine_dead_rank_helper: rank [023]: Generate failed")))
      << r.output;
}

TEST(EngineDeadRankTest, RankExitingWithoutFinalizeEndsTheJobWithAMessageNamingIt) {
  RunResult r = RunJob(1, 2, "exit", 1, 30);
  SCOPED_TRACE(absl::StrCat("wall ", absl::FormatDuration(r.wall)));
  ExpectFailedFast(r);
  EXPECT_THAT(r.output, AnyOf(ContainsRegex("Process name: \\[\\[[0-9]+,[0-9]+\\],1\\]"),
                              ContainsRegex("process rank 1 with PID [0-9]+ on[[:space:]]+node"),
                              ContainsRegex("engine_dead_rank_helper: rank 0: Generate failed")))
      << r.output;
}

}  // namespace
}  // namespace tpserve
