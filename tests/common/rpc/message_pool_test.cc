// MessagePool (common/rpc/message_pool.h): leased messages are empty, arenas come back and are
// reused, an arena that outgrew its first block comes back with a larger one, and a decode-sized
// StepRequest parsed into a reused lease takes heap allocations only for its long strings, where a
// heap message takes several per sequence.
#include "common/rpc/message_pool.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardserve/v1/stage.pb.h"
#include "tests/testing/alloc_counter.h"

namespace shardserve::rpc {
namespace {

using Pool = MessagePool<v1::StepRequest>;

// A decode micro-batch of `sequences` sequences, one token each, with hidden states of a 64-wide
// model (as a stage after the first receives it).
v1::StepRequest DecodeBatch(int sequences) {
  v1::StepRequest r;
  r.set_step_id(7);
  r.set_answer_route("route-of-the-coordinator-0001");
  for (int i = 0; i < sequences; ++i) {
    v1::StepSequence* s = r.add_sequences();
    for (int b = 0; b < 5; ++b) s->add_block_ids(i * 5 + b);
    s->set_pos_begin(70);
    s->set_num_tokens(1);
    s->set_sample(true);
    s->mutable_sampling()->set_temperature(0.7f);
    s->set_request_id("request-with-a-long-identifier-" + std::to_string(i));
    s->set_sample_index(3);
  }
  r.mutable_hidden()->set_dtype(v1::DTYPE_F32);
  r.mutable_hidden()->add_shape(sequences);
  r.mutable_hidden()->add_shape(64);
  r.mutable_hidden()->set_data(std::string(static_cast<size_t>(sequences) * 64 * 4, 'h'));
  return r;
}

TEST(MessagePoolTest, LeasesAreEmptyMessagesOnArenasThatComeBack) {
  const std::shared_ptr<Pool> pool = Pool::Create(4096, 2);
  EXPECT_EQ(pool->idle(), 0u);
  {
    Pool::Lease a = pool->Take();
    ASSERT_TRUE(a);
    EXPECT_NE(a->GetArena(), nullptr);
    *a = DecodeBatch(2);
    EXPECT_EQ(a->sequences_size(), 2);
    Pool::Lease moved = std::move(a);
    EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): a moved-from lease is empty
    EXPECT_EQ(moved->step_id(), 7u);
    EXPECT_EQ(pool->idle(), 0u);
  }
  EXPECT_EQ(pool->idle(), 1u);  // returned once, by the lease that held it
  Pool::Lease b = pool->Take();
  EXPECT_EQ(pool->idle(), 0u);  // the same arena, reused
  EXPECT_EQ(b->sequences_size(), 0);
  EXPECT_EQ(b->step_id(), 0u);
  EXPECT_FALSE(b->has_hidden());
  // At most max_idle arenas wait; the others are freed as they come back.
  {
    std::vector<Pool::Lease> many;
    for (int i = 0; i < 5; ++i) many.push_back(pool->Take());
  }
  EXPECT_EQ(pool->idle(), 2u);
}

TEST(MessagePoolTest, AnArenaThatOutgrewItsFirstBlockComesBackWithALargerOne) {
  const std::shared_ptr<Pool> pool = Pool::Create(1024, 1);
  const int64_t small = [&] {
    Pool::Lease a = pool->Take();
    return a->GetArena()->SpaceAllocated();
  }();
  {
    Pool::Lease big = pool->Take();
    *big = DecodeBatch(64);  // far more than 1 KiB of sequences
    EXPECT_GT(big->GetArena()->SpaceAllocated(), 1024);
  }
  Pool::Lease again = pool->Take();
  EXPECT_GT(again->GetArena()->SpaceAllocated(), small);  // its first block is the larger one
  EXPECT_EQ(again->sequences_size(), 0);
}

TEST(MessagePoolTest, LeasesMoveBetweenThreadsAndOutliveThePoolsOwner) {
  Pool::Lease kept;
  {
    const std::shared_ptr<Pool> pool = Pool::Create(2048, 4);
    kept = pool->Take();
  }
  *kept = DecodeBatch(3);
  std::thread t([lease = std::move(kept)]() mutable {
    EXPECT_EQ(lease->sequences_size(), 3);
    lease = Pool::Lease();  // returned to the pool, which the lease kept alive
  });
  t.join();
}

TEST(MessagePoolTest, AReusedLeaseParsesADecodeBatchWithAtMostOneAllocation) {
  const std::string wire = DecodeBatch(8).SerializeAsString();
  const std::shared_ptr<Pool> pool = Pool::Create(16 << 10, 4);
  // Warm: the arena's first block is sized by the first use.
  for (int i = 0; i < 2; ++i) {
    Pool::Lease lease = pool->Take();
    ASSERT_TRUE(lease->ParseFromString(wire));
  }
  const uint64_t before = testing::ThreadAllocations();
  {
    Pool::Lease lease = pool->Take();
    ASSERT_TRUE(lease->ParseFromString(wire));
    ASSERT_EQ(lease->sequences_size(), 8);
    EXPECT_EQ(lease->sequences(7).request_id(), "request-with-a-long-identifier-7");
  }
  const uint64_t pooled = testing::ThreadAllocations() - before;
  const uint64_t before_heap = testing::ThreadAllocations();
  {
    v1::StepRequest heap;
    ASSERT_TRUE(heap.ParseFromString(wire));
  }
  const uint64_t heap = testing::ThreadAllocations() - before_heap;
  if (!testing::AllocationsCounted()) {
    std::printf("allocations are not counted in this build (a sanitizer owns the allocator)\n");
    return;
  }
  // Only strings longer than the small-string buffer (15 characters): protobuf keeps their
  // characters on the heap, even on an arena. Here the hidden-state bytes, the answer route and the
  // 8 request ids.
  EXPECT_LE(pooled, 1u + 1u + 8u);
  EXPECT_GE(heap, 8u * 4u);  // each sequence, its sampling params, block ids and request id
  std::printf("parse of an 8-sequence decode batch: %llu allocations pooled, %llu on the heap\n",
              static_cast<unsigned long long>(pooled), static_cast<unsigned long long>(heap));
}

}  // namespace
}  // namespace shardserve::rpc
