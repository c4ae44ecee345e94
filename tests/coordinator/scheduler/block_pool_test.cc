// BlockPool: allocation, reference counts, prefix matching, eviction order; and a randomized run
// against a shadow model that records which tokens each block really holds.
#include "coordinator/scheduler/block_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

namespace shardserve::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

std::vector<int32_t> Take(BlockPool& pool, int64_t n) {
  std::vector<int32_t> out;
  EXPECT_TRUE(pool.Allocate(n, out));
  return out;
}

// A sequence that wrote `tokens` into `blocks` and let them go.
void Write(BlockPool& pool, const std::vector<int32_t>& blocks, const std::vector<int32_t>& tokens) {
  int64_t cached = 0;
  pool.Commit(blocks, tokens, static_cast<int64_t>(tokens.size()), &cached);
}

TEST(BlockPoolTest, HandsOutTheLowestIdsFirstAndCountsReferences) {
  BlockPool pool(5, 4, true);
  EXPECT_EQ(pool.available(), 5);
  std::vector<int32_t> a = Take(pool, 2);
  EXPECT_THAT(a, ElementsAre(0, 1));
  EXPECT_EQ(pool.held(), 2);
  std::vector<int32_t> too_many;
  EXPECT_FALSE(pool.Allocate(4, too_many));
  EXPECT_THAT(too_many, IsEmpty()) << "a failed Allocate takes nothing";
  pool.Release(a);
  EXPECT_EQ(pool.held(), 0);
  EXPECT_EQ(pool.cached(), 0) << "nothing was committed, so nothing is cached";
  pool.CheckInvariantsForTest();
}

TEST(BlockPoolTest, MatchesOnlyFullCommittedBlocksOfTheSamePrefix) {
  BlockPool pool(8, 4, true);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  std::vector<int32_t> blocks = Take(pool, 3);
  Write(pool, blocks, tokens);  // blocks 0 and 1 are full; block 2 holds 2 of 4 positions
  EXPECT_EQ(pool.cached(), 2);
  pool.Release(blocks);
  EXPECT_EQ(pool.available(), 8) << "cached blocks nobody holds can be handed out";
  EXPECT_THAT(pool.Match(tokens, 9), ElementsAre(blocks[0], blocks[1]));
  EXPECT_THAT(pool.Match(tokens, 7), ElementsAre(blocks[0])) << "only blocks inside max_tokens";
  // The second block's tokens after another first block are another prefix.
  EXPECT_THAT(pool.Match({9, 9, 9, 9, 5, 6, 7, 8, 0}, 8), IsEmpty());
  EXPECT_THAT(pool.Match({1, 2, 3, 4, 5, 6, 7, 0, 0}, 8), ElementsAre(blocks[0]));
  pool.CheckInvariantsForTest();
}

TEST(BlockPoolTest, SharedBlocksStayUntilTheLastHolderLetsGo) {
  BlockPool pool(4, 2, true);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  std::vector<int32_t> a = Take(pool, 3);
  Write(pool, a, tokens);
  std::vector<int32_t> b = pool.Match(tokens, 4);
  ASSERT_THAT(b, ElementsAre(a[0], a[1]));
  EXPECT_EQ(pool.CountUnreferenced(b), 0);
  pool.Acquire(b);
  pool.Release(a);
  EXPECT_EQ(pool.held(), 2) << "the second sequence still holds the shared prefix";
  std::vector<int32_t> rest;
  EXPECT_TRUE(pool.Allocate(2, rest));
  EXPECT_FALSE(pool.Allocate(1, rest)) << "held cached blocks are not evicted";
  pool.Release(rest);
  pool.Release(b);
  EXPECT_EQ(pool.held(), 0);
  pool.CheckInvariantsForTest();
}

TEST(BlockPoolTest, EvictsTheLeastRecentlyReleasedTailFirst) {
  BlockPool pool(6, 1, true);
  // Sequence x: 3 blocks of tokens 1,2,3; sequence y: 2 blocks of 7,8 (released later).
  std::vector<int32_t> x = Take(pool, 3);
  std::vector<int32_t> y = Take(pool, 2);
  Write(pool, x, {1, 2, 3});
  Write(pool, y, {7, 8});
  pool.Release(x);
  pool.Release(y);
  EXPECT_EQ(pool.cached(), 5);
  std::vector<int32_t> fresh = Take(pool, 1);  // the one never-used block
  EXPECT_EQ(pool.cached(), 5);
  fresh.clear();
  EXPECT_TRUE(pool.Allocate(1, fresh));  // evicts x's tail (token 3) first
  EXPECT_EQ(fresh[0], x[2]);
  EXPECT_THAT(pool.Match({1, 2, 3, 0}, 3), ElementsAre(x[0], x[1]));
  fresh.clear();
  EXPECT_TRUE(pool.Allocate(1, fresh));
  EXPECT_EQ(fresh[0], x[1]);
  fresh.clear();
  EXPECT_TRUE(pool.Allocate(1, fresh));
  EXPECT_EQ(fresh[0], x[0]);
  EXPECT_THAT(pool.Match({1, 2, 3, 0}, 3), IsEmpty());
  EXPECT_THAT(pool.Match({7, 8, 0}, 2), ElementsAre(y[0], y[1]));
  pool.CheckInvariantsForTest();
}

TEST(BlockPoolTest, TheFirstCopyOfAPrefixStaysTheCachedOne) {
  BlockPool pool(6, 2, true);
  std::vector<int32_t> a = Take(pool, 2), b = Take(pool, 2);
  Write(pool, a, {1, 2, 3, 4});
  int64_t cached_b = 0;
  pool.Commit(b, {1, 2, 3, 4}, 4, &cached_b);  // computed the same blocks meanwhile
  EXPECT_EQ(cached_b, 0);
  EXPECT_EQ(pool.cached(), 2);
  pool.Release(b);
  EXPECT_EQ(pool.cached(), 2);
  EXPECT_EQ(pool.available(), 4) << "b's copies went back to the free list";
  EXPECT_THAT(pool.Match({1, 2, 3, 4, 5}, 4), ElementsAre(a[0], a[1]));
  pool.Release(a);
  pool.CheckInvariantsForTest();
}

TEST(BlockPoolTest, WithoutCachingNothingIsKept) {
  BlockPool pool(4, 2, false);
  std::vector<int32_t> a = Take(pool, 2);
  Write(pool, a, {1, 2, 3, 4});
  pool.Release(a);
  EXPECT_EQ(pool.cached(), 0);
  EXPECT_THAT(pool.Match({1, 2, 3, 4, 5}, 4), IsEmpty());
  pool.CheckInvariantsForTest();
}

// Sequences over a 3-token alphabet (so prefixes collide often) take, grow, commit and release
// blocks at random on a small pool. A shadow map records the tokens each block was last written
// with by its sequence; every block Match returns must hold exactly the tokens asked for.
TEST(BlockPoolTest, RandomizedMatchesAlwaysHoldTheAskedTokens) {
  constexpr int32_t kBlockSize = 2;
  BlockPool pool(24, kBlockSize, true);
  std::mt19937 rng(7);
  struct Seq {
    std::vector<int32_t> tokens, blocks;
    int64_t written = 0, cached = 0;
  };
  std::vector<Seq> live;
  std::map<int32_t, std::vector<int32_t>> shadow;  // block -> tokens of its positions (full blocks)
  int64_t hits = 0;
  for (int op = 0; op < 20000; ++op) {
    const uint32_t kind = rng() % 4;
    if (kind == 0 && live.size() < 6) {
      Seq s;
      const int len = 1 + static_cast<int>(rng() % 9);
      for (int i = 0; i < len; ++i) s.tokens.push_back(static_cast<int32_t>(rng() % 3));
      std::vector<int32_t> m = pool.Match(s.tokens, len - 1);
      for (size_t j = 0; j < m.size(); ++j) {
        const std::vector<int32_t> want(s.tokens.begin() + static_cast<int64_t>(j) * kBlockSize,
                                        s.tokens.begin() + static_cast<int64_t>(j + 1) * kBlockSize);
        ASSERT_EQ(shadow.at(m[j]), want) << "block " << m[j] << " matched for the wrong tokens";
      }
      const int64_t need = (len + kBlockSize - 1) / kBlockSize - static_cast<int64_t>(m.size());
      if (need + pool.CountUnreferenced(m) > pool.available()) continue;
      pool.Acquire(m);
      s.blocks = m;
      s.written = s.cached = static_cast<int64_t>(m.size());
      s.written *= kBlockSize;
      hits += static_cast<int64_t>(m.size());
      ASSERT_TRUE(pool.Allocate(need, s.blocks));
      live.push_back(std::move(s));
    } else if (kind == 1 && !live.empty()) {
      // Write some more positions, then commit.
      Seq& s = live[rng() % live.size()];
      const int64_t to = std::min<int64_t>(static_cast<int64_t>(s.tokens.size()), s.written + 1 + rng() % 4);
      for (int64_t j = s.written / kBlockSize; j < to / kBlockSize; ++j) {
        // A block the sequence writes is its own (never a shared cached one).
        ASSERT_GE(j, s.cached);
        shadow[s.blocks[static_cast<size_t>(j)]] = std::vector<int32_t>(s.tokens.begin() + j * kBlockSize,
                                                                        s.tokens.begin() + (j + 1) * kBlockSize);
      }
      s.written = to;
      pool.Commit(s.blocks, s.tokens, s.written, &s.cached);
    } else if (kind == 2 && !live.empty()) {
      const size_t i = rng() % live.size();
      pool.Release(live[i].blocks);
      live.erase(live.begin() + static_cast<int64_t>(i));
    } else if (kind == 3 && !live.empty()) {
      // Grow a sequence by a token (as decoding does), when a block is available.
      Seq& s = live[rng() % live.size()];
      s.tokens.push_back(static_cast<int32_t>(rng() % 3));
      const int64_t need = (static_cast<int64_t>(s.tokens.size()) + kBlockSize - 1) / kBlockSize -
                           static_cast<int64_t>(s.blocks.size());
      if (!pool.Allocate(need, s.blocks)) s.tokens.pop_back();
    }
    pool.CheckInvariantsForTest();
  }
  EXPECT_GT(hits, 1000) << "the run should exercise sharing";
  for (Seq& s : live) pool.Release(s.blocks);
  EXPECT_EQ(pool.held(), 0);
  pool.CheckInvariantsForTest();
}

}  // namespace
}  // namespace shardserve::coordinator
