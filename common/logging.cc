// Implementation of the stderr logger.
#include "common/logging.h"

#include <chrono>
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
  static std::string prefix;
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

LogMessage::LogMessage(LogLevel level, const char* file, int line)
    : level_(level), file_(file), line_(line) {}

LogMessage::~LogMessage() {
  static const char kLetters[] = {'D', 'I', 'W', 'E', 'F'};
  const char* base = std::strrchr(file_, '/');
  base = base ? base + 1 : file_;
  std::string prefix;
  {
    std::lock_guard<std::mutex> lock(PrefixMutex());
    prefix = Prefix();
  }
  std::string line = std::string(1, kLetters[static_cast<int>(level_)]) + " " +
                     (prefix.empty() ? "" : "[" + prefix + "] ") + base + ":" +
                     std::to_string(line_) + "] " + stream_.str() + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  if (level_ == LogLevel::kFatal) {
    std::fflush(stderr);
    std::abort();
  }
}

}  // namespace tpserve
