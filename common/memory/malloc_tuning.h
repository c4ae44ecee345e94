// Process-wide settings of glibc's allocator for the serving daemons.
//
// A stage handles megabytes per prefill micro-batch: the engine's output, gRPC's read buffers, the
// parsed 2 MiB chunks and their reassembly. By default glibc serves every block above a threshold
// (128 KiB, raised dynamically up to 32 MiB) with mmap and gives freed memory at the top of its heap
// back to the kernel (trim), so each such block costs fresh pages: page faults, zeroing, and TLB
// shootdowns when it goes. Measured with shardserve-bench-transfer (32 MiB of hidden states per
// micro-batch between two stages in one process, 2-core VM), per micro-batch: 26-31 ms with
// glibc's defaults, 16-20 ms with blocks up to 32 MiB kept in the heap (either of the two settings
// alone was slower than neither: setting one switches the dynamic threshold off), 11.5 ms with mmap
// off altogether (the 32 MiB reassembled tensor and the engine's output then reuse heap pages too).
#ifndef SHARDSERVE_COMMON_MEMORY_MALLOC_TUNING_H_
#define SHARDSERVE_COMMON_MEMORY_MALLOC_TUNING_H_

#include <malloc.h>

#include <cstddef>

namespace shardserve {

// Free memory the heap keeps at its top before giving it back to the kernel.
inline constexpr size_t kHeapKeepBytes = size_t{1} << 30;

// Serves every block from the heap (mmap only where an arena's heap cannot hold it: a thread's
// arena falls back to mmap for blocks above 64 MiB) and keeps up to kHeapKeepBytes of freed memory
// there for reuse. Call at the start of main(), before threads start. The price: memory a burst
// freed stays with the process (its resident size stays near its peak, which a serving daemon
// reaches every prefill anyway). Returns false when the allocator refused (not glibc's, or a
// sanitizer's).
inline bool KeepLargeBlocksInTheHeap() {
  const bool mmap_ok = mallopt(M_MMAP_MAX, 0) == 1;
  const bool trim_ok = mallopt(M_TRIM_THRESHOLD, static_cast<int>(kHeapKeepBytes)) == 1;
  return mmap_ok && trim_ok;
}

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_MEMORY_MALLOC_TUNING_H_
