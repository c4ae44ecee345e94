// KeepLargeBlocksInTheHeap (common/memory/malloc_tuning.h): after it, a block that glibc would map
// on its own (8 MiB, above its default 128 KiB threshold) comes from the heap, and freed memory
// stays there for the next one. mallinfo2's hblks counts the blocks glibc has mapped. Not under a
// sanitizer, whose allocator ignores mallopt (the function then returns false, which the worker
// logs).
#include "common/memory/malloc_tuning.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdlib>
#include <cstring>

namespace shardserve {
namespace {

// Allocates, touches and frees `bytes`; returns how many mapped blocks it had added while alive.
size_t MappedBlocksWhileHolding(size_t bytes) {
  const size_t before = mallinfo2().hblks;
  void* p = std::malloc(bytes);
  EXPECT_NE(p, nullptr);
  std::memset(p, 1, bytes);
  const size_t during = mallinfo2().hblks;
  std::free(p);
  return during - before;
}

TEST(MallocTuningTest, LargeBlocksComeFromTheHeapAfterIt) {
  constexpr size_t kBlock = size_t{8} << 20;
  ASSERT_EQ(MappedBlocksWhileHolding(kBlock), 1u) << "glibc's default maps a block of 8 MiB on its own";
  ASSERT_TRUE(KeepLargeBlocksInTheHeap());
  EXPECT_EQ(MappedBlocksWhileHolding(kBlock), 0u);
  EXPECT_EQ(MappedBlocksWhileHolding(size_t{48} << 20), 0u);  // above glibc's largest mmap threshold
}

}  // namespace
}  // namespace shardserve
