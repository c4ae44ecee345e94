// SpinFor: polls a condition for a short, bounded time before the caller goes to sleep on a
// CondVar, so that a hand-off that arrives soon is seen without a sleeping thread's wake-up.
//
// Why: on these machines a thread that sleeps in a futex takes 25-150 us to run again once
// signalled (more after idling), while a spinning one sees the change within a microsecond. A
// pipeline hop hands each micro-batch and each answer from one thread to another (the stream's
// reader to the stage thread; the stream's reader to the coordinator's step thread); when the next
// hand-off comes within the spin budget, the wake-up leaves the critical path. The price is up to
// `budget` of one core per wait that does not pay off, so budgets stay in the hundreds of
// microseconds.
//
// The condition must be cheap and safe to call without the lock that guards the state (an atomic
// the producer sets before it signals); after SpinFor the caller still takes the lock and checks
// the real state, so a stale read costs only the fallback to the CondVar.
//
// Thread-safety: a free function; `done` is called on the calling thread only.
#ifndef SHARDSERVE_COMMON_CONCURRENCY_SPIN_H_
#define SHARDSERVE_COMMON_CONCURRENCY_SPIN_H_

#include <chrono>
#include <thread>

#include "absl/time/time.h"

namespace shardserve {

// Tells the CPU that this is a spin-wait loop (saves power and lets a sibling hyper-thread run).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Returns true as soon as done() returns true, false once `budget` has passed (at once when
// budget <= 0). Yields the CPU now and then, so that on a busy machine the spinner does not keep
// the thread it waits for off a core.
template <typename Done>
bool SpinFor(absl::Duration budget, Done&& done) {
  if (done()) return true;
  if (budget <= absl::ZeroDuration()) return false;
  const auto end = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(budget);
  for (int i = 1;; ++i) {
    if (done()) return true;
    if ((i & 63) == 0) {
      if (std::chrono::steady_clock::now() >= end) return false;
      std::this_thread::yield();
    } else {
      CpuRelax();
    }
  }
}

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_CONCURRENCY_SPIN_H_
