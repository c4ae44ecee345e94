// Clock: where code that reasons about time (heartbeat timeouts, ages shown to operators) reads the
// current time, so that tests can substitute a FakeClock (tests/testing/fake_clock.h) and advance
// time explicitly instead of sleeping.
//
// Only reading the time goes through a Clock. Waiting (condition variables with timeouts, gRPC
// deadlines) still uses real time: a Clock never blocks.
//
// Thread-safety: implementations must be safe to call from any thread.
#ifndef SHARDSERVE_COMMON_CONCURRENCY_CLOCK_H_
#define SHARDSERVE_COMMON_CONCURRENCY_CLOCK_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardserve {

class Clock {
 public:
  virtual ~Clock() = default;
  // The current time. Never decreases for a given Clock (a RealClock follows the system clock,
  // which an operator may step; callers clamp negative differences to zero).
  virtual absl::Time Now() const = 0;
};

// The system clock (absl::Now()). Stateless.
class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }

  // A process-wide instance that is never destroyed, for callers that do not inject a clock.
  static Clock* Get() {
    static RealClock* const clock = new RealClock();
    return clock;
  }
};

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_CONCURRENCY_CLOCK_H_
