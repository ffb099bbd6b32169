// Minimal leveled logging to stderr: TP_LOG(INFO) << "..."; TP_LOG(FATAL) aborts. Every line
// reads "2026-12-03T15:04:05.123Z I coordinator server.cc:120] message": UTC time with
// milliseconds, level, the process role (SetLogPrefix: "coordinator", "worker rank 3",
// "engine", "cli"; the program name until one is set), file:line.
// TPSERVE_LOG_LEVEL=debug|info|warning|error sets the threshold (default info; common/env.h).
#pragma once

#include <chrono>
#include <sstream>
#include <string>

namespace tpserve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };

LogLevel MinLogLevel();
void SetLogPrefix(std::string prefix);  // the process role, shown on every line

// One log line (with its newline), as LogMessage writes it.
std::string FormatLogLine(LogLevel level, std::chrono::system_clock::time_point time,
                          const std::string& role, const char* file, int line,
                          const std::string& message);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

}  // namespace tpserve

#define TP_LOG_LEVEL_DEBUG ::tpserve::LogLevel::kDebug
#define TP_LOG_LEVEL_INFO ::tpserve::LogLevel::kInfo
#define TP_LOG_LEVEL_WARNING ::tpserve::LogLevel::kWarning
#define TP_LOG_LEVEL_ERROR ::tpserve::LogLevel::kError
#define TP_LOG_LEVEL_FATAL ::tpserve::LogLevel::kFatal

#define TP_LOG(level)                                    \
  if (TP_LOG_LEVEL_##level < ::tpserve::MinLogLevel()) { \
  } else                                                 \
    ::tpserve::LogMessage(TP_LOG_LEVEL_##level, __FILE__, __LINE__).stream()

// Invariant check: aborts with file:line and the condition when false.
#define TP_CHECK(cond) \
  if (cond) {          \
  } else               \
    TP_LOG(FATAL) << "Check failed: " #cond " "
