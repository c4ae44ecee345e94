#include "common/concurrency/abseil_mutex.h"

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"

namespace shardserve {
namespace {

// Two absl::Mutexes taken in both orders by one thread: no deadlock can happen, but a lock-order
// cycle is what deadlock detection reports; with kAbort (the default of an Abseil built without
// NDEBUG, as Debian's is) the process would abort at the second order.
void LockInBothOrders() {
  absl::Mutex a, b;
  {
    absl::MutexLock la(&a);
    absl::MutexLock lb(&b);
  }
  {
    absl::MutexLock lb(&b);
    absl::MutexLock la(&a);
  }
}

TEST(AbseilMutexTest, ReleaseSettingIgnoresLockOrderCycles) {
  UseReleaseAbseilMutexes();
  LockInBothOrders();
  SUCCEED();
}

TEST(AbseilMutexDeathTest, DefaultSettingAbortsOnLockOrderCycles) {
  // Shows the setting above is what keeps the cycle from aborting: kAbort dies on it.
  EXPECT_DEATH(
      {
        absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kAbort);
        LockInBothOrders();
      },
      "");
}

}  // namespace
}  // namespace shardserve
