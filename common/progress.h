// Progress of a long operation counted in bytes (weight loading), drawn on one terminal line
// that rewrites itself, only when stderr is a terminal; otherwise nothing (the operation logs
// one line when it is done), so logs stay one line per event.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace tpserve {

class ByteProgress {
 public:
  ByteProgress(std::string label, int64_t total_bytes);
  ~ByteProgress();  // clears the line
  // `done` bytes of the total; redraws at most every 100 ms.
  void Update(int64_t done);

 private:
  void Draw(int64_t done);

  const std::string label_;
  const int64_t total_;
  const bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_{};
};

// "1.5 GiB", "730.0 MiB", "12 B".
std::string HumanBytes(int64_t bytes);

}  // namespace tpserve
