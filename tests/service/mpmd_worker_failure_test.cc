// An MPMD launch (`mpirun -np 1 tpserve-coordinator : -np 1 tpserve-worker`) whose worker fails
// after registering: the worker tells the coordinator on its control stream and leaves its rank
// without MPI_Abort (which would take the coordinator down with it); the coordinator reports the
// worker's error, naming the rank, and everything ends within a bounded time.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include "tests/testing/http_test_util.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using service_test::FreePort;

TEST(MpmdWorkerFailureTest, AFailingWorkerDoesNotAbortTheCoordinator) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const int control_port = FreePort();
  ASSERT_GT(control_port, 0);
  const std::string addr = "127.0.0.1:" + std::to_string(control_port);
  const std::string secret =
      (std::filesystem::path(::testing::TempDir()) / ("mpmd_secret_" + std::to_string(getpid())))
          .string();
  std::ofstream(secret) << "mpmd-test-secret\n";
  // --kv-cache-mb far beyond what a KV slot id can address: the worker refuses the assignment
  // with an error after registering (a clean failure of one rank).
  const std::string cmd =
      std::string("OPENBLAS_NUM_THREADS=1 timeout 120 ") + TPSERVE_MPIEXEC +
      " --allow-run-as-root --oversubscribe -np 1 " + TPSERVE_COORDINATOR_BIN +
      " --model models/tiny-coder --host 127.0.0.1 --port " + std::to_string(port) +
      " --control-port " + std::to_string(control_port) + " --cluster-secret-file " + secret +
      " --workers 1 --kv-cache-mb 100000000 --register-timeout 60 : -np 1 " + TPSERVE_WORKER_BIN +
      " --coordinator " + addr + " --cluster-secret-file " + secret + " --device cpu 2>&1";
  const auto start = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != 124)
      << "the job must fail, and not by the timeout\n"
      << out;
  EXPECT_LT(seconds, 60) << out;
  // The coordinator learned of the failure from the control stream, with the worker's reason.
  EXPECT_THAT(out,
              ::testing::ContainsRegex(" coordinator worker_group\\.cc:[0-9]+\\] worker rank 0 "
                                       "\\([^)]*\\) failed: --kv-cache-mb"))
      << out;
  EXPECT_THAT(out, HasSubstr("leaving the job without MPI_Finalize")) << out;
  EXPECT_THAT(out, Not(HasSubstr("MPI_ABORT was invoked"))) << out;
}

}  // namespace
}  // namespace tpserve
