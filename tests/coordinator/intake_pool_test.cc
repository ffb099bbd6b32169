// IntakePool: tasks run once each, on the pool's threads; a full queue, a passed deadline and a
// shutdown are answered with their codes, and nothing waits forever.
#include "coordinator/intake_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/synchronization/notification.h"

namespace tpserve {
namespace {

using Clock = IntakePool::Clock;
constexpr auto kForever = Clock::time_point::max();

TEST(IntakePoolTest, RunsTasksOffTheCallerAndBoundsItsQueue) {
  IntakePool pool(/*threads=*/1, /*max_queued=*/2);
  absl::Notification started, release;
  std::thread::id ran_on;
  ASSERT_TRUE(pool.Post(kForever,
                        [&](absl::Status s) {
                          EXPECT_TRUE(s.ok()) << s;
                          ran_on = std::this_thread::get_id();
                          started.Notify();
                          release.WaitForNotification();
                        })
                  .ok());
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_NE(ran_on, std::this_thread::get_id());
  // The thread is busy: two tasks may wait, a third is refused unrun.
  std::atomic<int> ok_runs{0};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(pool.Post(kForever, [&](absl::Status s) { ok_runs += s.ok(); }).ok());
  }
  bool refused_ran = false;
  const absl::Status full = pool.Post(kForever, [&](absl::Status) { refused_ran = true; });
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_NE(full.message().find("at most 2"), std::string::npos) << full;
  release.Notify();
  // The two queued tasks run once the thread is free (a Shutdown before that would answer them
  // UNAVAILABLE instead: that is ShutdownAnswersWhatStillWaits).
  const auto end = Clock::now() + std::chrono::seconds(10);
  while (ok_runs.load() < 2 && Clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  pool.Shutdown();
  EXPECT_EQ(ok_runs.load(), 2);
  EXPECT_FALSE(refused_ran);
  EXPECT_TRUE(absl::IsUnavailable(pool.Post(kForever, [](absl::Status) {})));
}

TEST(IntakePoolTest, ADeadlinePassedInTheQueueSkipsTheWork) {
  IntakePool pool(1, 4);
  absl::Notification started, release;
  ASSERT_TRUE(pool.Post(kForever,
                        [&](absl::Status) {
                          started.Notify();
                          release.WaitForNotification();
                        })
                  .ok());
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::Status seen;
  absl::Notification answered;
  ASSERT_TRUE(pool.Post(Clock::now() + std::chrono::milliseconds(200),
                        [&](absl::Status s) {
                          seen = s;
                          answered.Notify();
                        })
                  .ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  release.Notify();
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(absl::IsDeadlineExceeded(seen)) << seen;
}

TEST(IntakePoolTest, ShutdownAnswersWhatStillWaits) {
  IntakePool pool(1, 4);
  absl::Notification started, release;
  ASSERT_TRUE(pool.Post(kForever,
                        [&](absl::Status) {
                          started.Notify();
                          release.WaitForNotification();
                        })
                  .ok());
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::Status seen;
  absl::Notification answered;
  ASSERT_TRUE(pool.Post(kForever,
                        [&](absl::Status s) {
                          seen = s;
                          answered.Notify();
                        })
                  .ok());
  std::thread stopper([&] { pool.Shutdown(); });
  // The waiting task is answered UNAVAILABLE at once, while the running one still runs.
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(absl::IsUnavailable(seen)) << seen;
  release.Notify();
  stopper.join();
}

}  // namespace
}  // namespace tpserve
