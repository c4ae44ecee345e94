// FakeClock: a Clock (common/concurrency/clock.h) that moves only when a test says so.
//
//   FakeClock clock;                       // starts at an arbitrary fixed time
//   WorkerRegistry registry(options, &clock);
//   clock.Advance(absl::Seconds(6));       // now past the heartbeat timeout
//
// Thread-safe: Now() may be read from any thread while the test advances it.
#ifndef SHARDSERVE_TESTS_TESTING_FAKE_CLOCK_H_
#define SHARDSERVE_TESTS_TESTING_FAKE_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/concurrency/clock.h"

namespace shardserve::testing {

class FakeClock final : public Clock {
 public:
  // 2024-01-01T00:00:00Z: fixed, so that test output does not depend on the day it runs.
  FakeClock() : now_(absl::FromUnixSeconds(1704067200)) {}
  explicit FakeClock(absl::Time start) : now_(start) {}

  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  // Moves the clock forward by `d` (must be >= 0; a negative step would break Clock's contract).
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    if (d > absl::ZeroDuration()) now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_FAKE_CLOCK_H_
