// Terminal progress lines (see progress.h).
#include "common/progress.h"

#include <unistd.h>

#include <cstdio>

#include "absl/strings/str_format.h"

namespace tpserve {

std::string HumanBytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrFormat("%d B", bytes) : absl::StrFormat("%.1f %s", v, units[u]);
}

ByteProgress::ByteProgress(std::string label, int64_t total_bytes)
    : label_(std::move(label)), total_(total_bytes), enabled_(isatty(STDERR_FILENO) == 1) {}

ByteProgress::~ByteProgress() {
  if (drawn_) std::fprintf(stderr, "\r\033[K");  // the caller logs the result
}

void ByteProgress::Update(int64_t done) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && done < total_ && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  Draw(done);
}

void ByteProgress::Draw(int64_t done) {
  const double pct = total_ > 0 ? 100.0 * static_cast<double>(done) / total_ : 100.0;
  std::fprintf(stderr, "\r\033[K%s %s / %s (%.0f%%)", label_.c_str(), HumanBytes(done).c_str(),
               HumanBytes(total_).c_str(), pct);
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace tpserve
