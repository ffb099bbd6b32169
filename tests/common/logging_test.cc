// common/logging: every line carries a UTC timestamp with milliseconds, the level, the process
// role and file:line.
#include "common/logging.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tpserve {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

TEST(LoggingTest, FormatIsUtcMillisecondsLevelRoleFileLine) {
  // 2026-12-03T15:04:05.123Z
  const auto t = std::chrono::system_clock::time_point(std::chrono::milliseconds(1796310245123));
  EXPECT_EQ(FormatLogLine(LogLevel::kInfo, t, "coordinator", "coordinator/server.cc", 42, "hello"),
            "2026-12-03T15:04:05.123Z I coordinator server.cc:42] hello\n");
  EXPECT_EQ(FormatLogLine(LogLevel::kWarning, t + std::chrono::milliseconds(7), "worker rank 3",
                          "w.cc", 1, "m"),
            "2026-12-03T15:04:05.130Z W worker rank 3 w.cc:1] m\n");
  EXPECT_EQ(FormatLogLine(LogLevel::kError, t, "", "x.cc", 9, "no role"),
            "2026-12-03T15:04:05.123Z E x.cc:9] no role\n");
}

TEST(LoggingTest, LinesOnStderrCarryTheRoleSet) {
  SetLogPrefix("engine");
  ::testing::internal::CaptureStderr();
  TP_LOG(WARNING) << "one " << 2;
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z "
                                "W engine logging_test\\.cc:[0-9]+\\] one 2\n"));
  SetLogPrefix("worker rank 1");
  ::testing::internal::CaptureStderr();
  TP_LOG(ERROR) << "x";
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), HasSubstr(" E worker rank 1 "));
}

}  // namespace
}  // namespace tpserve
