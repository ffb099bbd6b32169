// Implementation of the stderr logger.
#include "common/logging.h"

#include <errno.h>
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/env.h"

namespace tpserve {
namespace {

LogLevel ParseLevel() {
  // Without logging the registry's notes: they are logged through this very threshold.
  const std::string level = EnvWithoutLogging().String(env::kLogLevel);
  if (level == "debug") return LogLevel::kDebug;
  if (level == "warning") return LogLevel::kWarning;
  if (level == "error") return LogLevel::kError;
  return LogLevel::kInfo;
}

std::mutex& PrefixMutex() {
  static std::mutex mu;
  return mu;
}
std::string& Prefix() {
  static std::string prefix = program_invocation_short_name;  // until a main names its role
  return prefix;
}

}  // namespace

LogLevel MinLogLevel() {
  static const LogLevel level = ParseLevel();
  return level;
}

void SetLogPrefix(std::string prefix) {
  std::lock_guard<std::mutex> lock(PrefixMutex());
  Prefix() = std::move(prefix);
}

std::string FormatLogLine(LogLevel level, std::chrono::system_clock::time_point time,
                          const std::string& role, const char* file, int line,
                          const std::string& message) {
  static const char kLetters[] = {'D', 'I', 'W', 'E', 'F'};
  const auto since_epoch = time.time_since_epoch();
  const time_t seconds =
      static_cast<time_t>(std::chrono::duration_cast<std::chrono::seconds>(since_epoch).count());
  const int millis = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count() % 1000);
  struct tm utc;
  gmtime_r(&seconds, &utc);
  char stamp[40];
  std::snprintf(stamp, sizeof(stamp), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900,
                utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, millis);
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  std::string out = stamp;
  out += ' ';
  out += kLetters[static_cast<int>(level)];
  out += ' ';
  if (!role.empty()) out += role + " ";
  out += std::string(base) + ":" + std::to_string(line) + "] " + message + "\n";
  return out;
}

LogMessage::LogMessage(LogLevel level, const char* file, int line)
    : level_(level), file_(file), line_(line) {}

LogMessage::~LogMessage() {
  std::string role;
  {
    std::lock_guard<std::mutex> lock(PrefixMutex());
    role = Prefix();
  }
  const std::string text =
      FormatLogLine(level_, std::chrono::system_clock::now(), role, file_, line_, stream_.str());
  std::fwrite(text.data(), 1, text.size(), stderr);
  if (level_ == LogLevel::kFatal) {
    std::fflush(stderr);
    std::abort();
  }
}

}  // namespace tpserve
