// Byte progress lines: drawn on a terminal, silent otherwise (logs stay one line per event).
#include "common/progress.h"

#include <fcntl.h>
#include <pty.h>
#include <unistd.h>

#include <cstdio>

#include <gtest/gtest.h>

namespace tpserve {
namespace {

TEST(ProgressTest, HumanBytes) {
  EXPECT_EQ(HumanBytes(12), "12 B");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(int64_t{3} << 30), "3.0 GiB");
}

// Runs `body` with stderr redirected to `fd`; returns nothing (the caller reads fd's other end).
template <typename F>
void WithStderr(int fd, F body) {
  std::fflush(stderr);
  const int saved = dup(STDERR_FILENO);
  dup2(fd, STDERR_FILENO);
  body();
  std::fflush(stderr);
  dup2(saved, STDERR_FILENO);
  close(saved);
}

std::string ReadAvailable(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
  return out;
}

TEST(ProgressTest, DrawsBytesOnATerminal) {
  int master = -1, slave = -1;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  WithStderr(slave, [] {
    ByteProgress p("loading weights", int64_t{2} << 30);
    p.Update(int64_t{1} << 30);
  });
  const std::string out = ReadAvailable(master);
  EXPECT_NE(out.find("loading weights 1.0 GiB / 2.0 GiB (50%)"), std::string::npos) << out;
  close(master);
  close(slave);
}

TEST(ProgressTest, SilentWhenStderrIsNotATerminal) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  WithStderr(fds[1], [] {
    ByteProgress p("loading weights", 100);
    p.Update(50);
  });
  close(fds[1]);
  EXPECT_EQ(ReadAvailable(fds[0]), "");
  close(fds[0]);
}

}  // namespace
}  // namespace tpserve
