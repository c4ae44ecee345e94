// Counts heap allocations (malloc, calloc, realloc, and so operator new) of the whole process and
// of the calling thread, for benchmarks and tests of the serving path's per-step allocations.
//
// Linking this library into an executable replaces the C allocator's entry points with counting
// ones that forward to glibc's (the executable's definitions take precedence over libc's for every
// shared library, gRPC's and protobuf's included). Aligned allocations (aligned_alloc,
// posix_memalign) are not counted. Under a sanitizer, which replaces the allocator itself, nothing
// is counted: Available() is false and the counts stay 0.
#ifndef SHARDSERVE_TESTS_TESTING_ALLOC_COUNTER_H_
#define SHARDSERVE_TESTS_TESTING_ALLOC_COUNTER_H_

#include <cstdint>

namespace shardserve::testing {

// Whether allocations are counted in this build.
bool AllocationsCounted();
// Allocations made so far by every thread of the process.
uint64_t ProcessAllocations();
// Allocations made so far by the calling thread.
uint64_t ThreadAllocations();

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_ALLOC_COUNTER_H_
