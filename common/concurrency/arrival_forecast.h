// ArrivalForecast: when to poll for an event that comes in a regular cycle.
//
// Why: a pipeline stage waits for each micro-batch while the other stages compute, and a
// coordinator waits for each step's answer while the pipeline computes. In steady decoding those
// waits last about the same every time (milliseconds on a large model). A thread that sleeps
// through such a wait lets its core go idle, and the event then pays the cold wake-up of a core:
// on this project's 2-core VM, the one-way trips of a pipeline hop that follow a stage's compute
// took 184 and 196 us (median) against 49 us for one that follows a short wait, most of the
// difference in waking the halted vCPU and the cold caches behind it (issue 23's note has the
// syscall-level timeline). Polling through the whole wait (SpinFor) keeps the core awake, but
// burns a core for as long as the others compute.
//
// ArrivalForecast learns how long the last waits lasted and plans the next one: sleep until
// shortly before the earliest likely arrival, then poll until shortly after the latest likely one
// (at most `max_poll`, and at most `max_fraction` of a typical wait), then sleep until the event
// comes. So the core is awake when the event comes, for a bounded share of the wait.
//
// Thread-safety: none; one waiting thread owns it.
#ifndef SHARDSERVE_COMMON_CONCURRENCY_ARRIVAL_FORECAST_H_
#define SHARDSERVE_COMMON_CONCURRENCY_ARRIVAL_FORECAST_H_

#include <algorithm>
#include <array>
#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/concurrency/spin.h"

namespace shardserve {

class ArrivalForecast {
 public:
  struct Options {
    // The longest poll of one wait; zero turns planning off (every plan says: sleep).
    absl::Duration max_poll = absl::ZeroDuration();
    // Polling starts this long before the earliest likely arrival and ends this long after the
    // latest.
    absl::Duration margin = absl::Microseconds(100);
    // Waits typically shorter than this are not polled for: the core does not go deep idle in so
    // short a wait (the guest's halt-polling covers ~200 us), and polling would take a core the
    // awaited work may need.
    absl::Duration min_wait = absl::Microseconds(300);
    // At most this fraction of the median wait is polled, in (0, 1].
    double max_fraction = 0.25;
  };
  // Both measured from the start of the wait: sleep until `sleep` (or the event), then poll until
  // `sleep + poll`, then sleep until the event. poll == 0: no polling, sleep at once.
  struct Plan {
    absl::Duration sleep = absl::ZeroDuration();
    absl::Duration poll = absl::ZeroDuration();
  };

  // The number of waits remembered, and how many must be seen before any poll is planned.
  static constexpr int kHistory = 16;
  static constexpr int kMinSamples = 8;

  ArrivalForecast() = default;
  explicit ArrivalForecast(Options options) : options_(options) {}

  // The plan for the next wait, from the last kHistory waits: polls from the 10th percentile less
  // the margin to the 90th plus the margin, narrowed around the median to the poll budget.
  Plan Next() const;
  // How long a wait lasted: from its start to the event (not to when the waiter saw it). Negative
  // durations count as zero.
  void Record(absl::Duration waited);

  const Options& options() const { return options_; }

 private:
  Options options_;
  std::array<int64_t, kHistory> waits_ns_{};
  int64_t count_ = 0;  // waits recorded in all
};

// Follows `plan` for a wait that started at `start`: sleeps until the poll is due, then polls
// ready() until the plan's poll ends, and returns (at once when the plan polls nothing). Neither
// phase goes past `limit` (a deadline of the whole wait). sleep_until(t) must sleep until t or
// until the awaited event, whichever comes first (a condition-variable wait with that deadline);
// ready() must be cheap and safe without the caller's lock (an atomic load). The caller then
// waits for the event as it would without a plan.
template <typename SleepUntil, typename Ready>
void SleepThenPoll(const ArrivalForecast::Plan& plan, absl::Time start, absl::Time limit, SleepUntil&& sleep_until,
                   Ready&& ready) {
  if (plan.poll <= absl::ZeroDuration()) return;
  sleep_until(std::min(start + plan.sleep, limit));
  SpinFor(std::min(start + plan.sleep + plan.poll, limit) - absl::Now(), ready);
}

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_CONCURRENCY_ARRIVAL_FORECAST_H_
