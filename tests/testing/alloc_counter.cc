#include "tests/testing/alloc_counter.h"

#include <atomic>
#include <cstddef>
#include <cstdlib>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || defined(SHARDSERVE_TSAN)
#define SHARDSERVE_ALLOC_COUNTER_OFF 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define SHARDSERVE_ALLOC_COUNTER_OFF 1
#endif
#endif

namespace {

std::atomic<uint64_t> process_allocations{0};
// Local-exec TLS in the executable: readable from the allocator's first call on a new thread.
thread_local uint64_t thread_allocations = 0;

inline void Count() {
  process_allocations.fetch_add(1, std::memory_order_relaxed);
  ++thread_allocations;
}

}  // namespace

#ifndef SHARDSERVE_ALLOC_COUNTER_OFF
extern "C" {
void* __libc_malloc(size_t size) noexcept;  // NOLINT(bugprone-reserved-identifier): glibc's allocator
void* __libc_calloc(size_t count, size_t size) noexcept;
void* __libc_realloc(void* ptr, size_t size) noexcept;

void* malloc(size_t size) noexcept {
  Count();
  return __libc_malloc(size);
}
void* calloc(size_t count, size_t size) noexcept {
  Count();
  return __libc_calloc(count, size);
}
void* realloc(void* ptr, size_t size) noexcept {
  Count();
  return __libc_realloc(ptr, size);
}
}  // extern "C"
#endif

namespace shardserve::testing {

bool AllocationsCounted() {
#ifdef SHARDSERVE_ALLOC_COUNTER_OFF
  return false;
#else
  return true;
#endif
}

uint64_t ProcessAllocations() { return process_allocations.load(std::memory_order_relaxed); }

uint64_t ThreadAllocations() { return thread_allocations; }

}  // namespace shardserve::testing
