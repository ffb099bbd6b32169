// A rank that dies or stalls mid-run makes the job fail with a clear error within the timeout:
// runs dead_rank_helper under mpirun (itself under `timeout`, so this test can never hang) and
// checks the wall time, the exit status and the message.
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

constexpr int kCommTimeoutMs = 3000;
constexpr int kHardLimitS = 60;  // `timeout` around mpirun: exit status 124 means it hung

using testing_util::RunCommand;
using testing_util::RunResult;

RunResult RunJob(const std::string& mode, int np) {
  const std::string cmd =
      absl::StrCat("timeout -k 5 ", kHardLimitS, " ", TPSERVE_MPIEXEC,
                   " --allow-run-as-root --oversubscribe -np ", np, " ", TPSERVE_DEAD_RANK_HELPER,
                   " ", mode, " ", kCommTimeoutMs, " 2>&1");
  return RunCommand(cmd);
}

void ExpectFailedFast(const RunResult& r) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "the job hung until the hard limit\n" << r.output;
  EXPECT_NE(r.exit_code, 137) << "the job hung until the hard limit\n" << r.output;
  // Communicator timeout + mpirun start-up and teardown on a loaded 2-core machine.
  EXPECT_LT(r.wall, absl::Milliseconds(kCommTimeoutMs) + absl::Seconds(25)) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("finished without noticing"))) << r.output;
}

TEST(DeadRankTest, StalledRankMakesSurvivorsTimeOutWithRankPeerAndOp) {
  for (int np : {2, 4}) {
    RunResult r = RunJob("stall", np);
    SCOPED_TRACE(absl::StrCat("np=", np, ", wall ", absl::FormatDuration(r.wall)));
    ExpectFailedFast(r);
    // At least one survivor (not the stalled rank 1) reports its own deadline error, naming
    // group, rank, peer/op. Which one prints first varies: mpiexec ends the job at the first
    // non-zero exit, possibly before rank 0 has printed.
    EXPECT_THAT(r.output, ContainsRegex("dead_rank_helper: rank [023] failed at iteration 3: "
                                        "DEADLINE_EXCEEDED: test group \\(mpi\\): rank [023] "
                                        "(AllReduceSum with all ranks|Send with peer 1|Recv with "
                                        "peer [0-9]+) did not finish within 3s"))
        << r.output;
    EXPECT_GE(r.wall, absl::Milliseconds(kCommTimeoutMs));
  }
}

TEST(DeadRankTest, AbortedRankEndsTheJobWithAMessageNamingIt) {
  RunResult r = RunJob("abort", 3);
  SCOPED_TRACE(absl::StrCat("wall ", absl::FormatDuration(r.wall)));
  ExpectFailedFast(r);
  // Either mpirun ends the job (Open MPI's errmgr) and names the rank, or a survivor reports
  // the error itself first.
  EXPECT_THAT(r.output,
              AnyOf(ContainsRegex(
                        "process rank 1 with PID [0-9]+ on[[:space:]]+node .* exited on[[:space:]]+"
                        "signal 6"),
                    ContainsRegex("rank [02] failed at iteration 3")))
      << r.output;
}

TEST(DeadRankTest, RankExitingWithoutFinalizeEndsTheJobWithAMessageNamingIt) {
  // Exit code 5, then exit code 0: both without MPI_Finalize.
  for (const char* mode : {"exit", "exit0"}) {
    RunResult r = RunJob(mode, 3);
    SCOPED_TRACE(absl::StrCat(mode, ", wall ", absl::FormatDuration(r.wall)));
    ExpectFailedFast(r);
    EXPECT_THAT(r.output, AnyOf(ContainsRegex("Process name: \\[\\[[0-9]+,[0-9]+\\],1\\]"),
                                ContainsRegex("process rank 1 with PID [0-9]+ on[[:space:]]+node"),
                                ContainsRegex("rank [02] failed at iteration 3")))
        << r.output;
  }
}

}  // namespace
}  // namespace tpserve
