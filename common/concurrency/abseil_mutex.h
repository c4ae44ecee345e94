// Process-wide settings for Abseil's own mutexes. Our code locks shardserve::Mutex (mutex.h, a
// std::mutex), but gRPC's core locks absl::Mutex (gpr_mu_lock) dozens of times per message, and
// Debian's Abseil is built without NDEBUG, so by default every such lock also updates Abseil's
// lock-order graph for deadlock detection: about 340 instructions per lock instead of about 125
// (callgrind, shardserve-bench-pipeline), a measurable part of every stage-stream hop.
#ifndef SHARDSERVE_COMMON_CONCURRENCY_ABSEIL_MUTEX_H_
#define SHARDSERVE_COMMON_CONCURRENCY_ABSEIL_MUTEX_H_

#include "absl/synchronization/mutex.h"

namespace shardserve {

// Turns Abseil's lock-order (deadlock) detection off, as a release build of Abseil has it. Call at
// the start of main(), before any thread starts: the serving binaries (worker, coordinator,
// shardserve-run) and benchmarks do. Debug and sanitizer runs of tests keep the detection on.
inline void UseReleaseAbseilMutexes() { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); }

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_CONCURRENCY_ABSEIL_MUTEX_H_
