// Minimal leveled logging to stderr: TP_LOG(INFO) << "..."; TP_LOG(FATAL) aborts.
// TPSERVE_LOG_LEVEL=debug|info|warning|error sets the threshold (default info).
#pragma once

#include <sstream>
#include <string>

namespace tpserve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };

LogLevel MinLogLevel();
void SetLogPrefix(std::string prefix);  // e.g. "worker 3", shown on every line

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
