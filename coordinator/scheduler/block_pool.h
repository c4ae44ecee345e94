// BlockPool: the KV cache blocks of one replica, as the scheduler hands them out, with prefix
// caching.
//
// A replica's KV cache is kv_blocks blocks of block_size positions on every stage; the scheduler
// owns the block ids (the workers only index them). A block is, at any time, exactly one of:
//   - FREE: holds nothing useful;
//   - HELD: referenced by one or more running sequences (ref count >= 1);
//   - CACHED and unreferenced: a full block whose contents are known, kept after its last holder
//     let go so that a later sequence with the same prefix can reuse it instead of recomputing it.
// A held block may be cached too (shared by the sequences that matched it).
//
// What "contents are known" means: a cached block holds the keys and values of the positions
// [j * block_size, (j + 1) * block_size) of some sequence, for the tokens `tokens` at those
// positions, after the prefix its PARENT block (the cached block j - 1, or none for j = 0) holds.
// Since a position's keys and values depend only on the tokens up to it, two sequences whose
// first (j + 1) * block_size tokens are equal can share those j + 1 blocks. Entries are keyed by
// (parent block id, tokens) and compared exactly: no hash collision can make two prefixes share.
// A cached block's parent is always cached; evicting a block evicts its cached descendants too
// (nobody can reach them any more). Only full blocks are ever cached, and a sequence only ever
// writes positions after its matched prefix, so a cached block is never written while cached:
// no copy-on-write is needed.
//
// Eviction: Allocate takes FREE blocks first, then evicts the unreferenced cached block released
// least recently (a sequence's blocks are released last block first, so a prefix's tail goes
// before its head).
//
// With caching off, Match finds nothing and Commit caches nothing: a plain free list.
//
// Not thread-safe: the scheduler calls it under its lock.
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_BLOCK_POOL_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_BLOCK_POOL_H_

#include <cstdint>
#include <list>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace shardserve::coordinator {

class BlockPool {
 public:
  // num_blocks in [1, 2^31 - 1], block_size >= 1 (checked: a programmer error otherwise).
  BlockPool(int64_t num_blocks, int32_t block_size, bool caching);

  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  int64_t num_blocks() const { return static_cast<int64_t>(refs_.size()); }
  int32_t block_size() const { return block_size_; }
  bool caching() const { return caching_; }

  // Blocks that Allocate can hand out now: free ones plus unreferenced cached ones.
  int64_t available() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
  // Blocks referenced by at least one sequence.
  int64_t held() const { return num_blocks() - available(); }
  // Blocks whose contents are cached (held or not).
  int64_t cached() const { return static_cast<int64_t>(entries_.size()); }

  // The longest run of cached blocks holding tokens[0, k * block_size), for the largest k with
  // k * block_size <= max_tokens (callers pass at most tokens.size() - 1: the last token is always
  // computed, to get its logits). Takes nothing.
  std::vector<int32_t> Match(absl::Span<const int32_t> tokens, int64_t max_tokens) const;
  // How many of `blocks` are unreferenced now (taking them makes `available` smaller).
  int64_t CountUnreferenced(absl::Span<const int32_t> blocks) const;

  // Adds a reference to each block (blocks Match returned, before anything else changes the pool).
  void Acquire(absl::Span<const int32_t> blocks);
  // Appends `n` blocks, each with one reference, to `out`, evicting cached blocks when the free
  // ones run out. False, taking nothing, when fewer than `n` are available.
  bool Allocate(int64_t n, std::vector<int32_t>& out);
  // Drops one reference from each of a sequence's blocks (in position order). Blocks left
  // unreferenced become free, or evictable when cached, the last block first.
  void Release(absl::Span<const int32_t> blocks);

  // A sequence holding `blocks` (in position order) has the keys and values of tokens[0, written)
  // in them, and its first `*cached_blocks` blocks are cached entries (its matched prefix and what
  // earlier Commits added). Caches each further full block it can, in order, and advances
  // `*cached_blocks` past them; stops at the first block whose contents are already cached in
  // another block (that copy stays the cached one; this block is freed when released).
  void Commit(absl::Span<const int32_t> blocks, absl::Span<const int32_t> tokens, int64_t written,
              int64_t* cached_blocks);

  // Changes whenever the set of cached entries changes (a cheap way to know a Match is stale).
  uint64_t epoch() const { return epoch_; }

  // Checks every invariant (block states partition the ids, entries and index agree, parents are
  // cached); for tests. CHECK-fails on a violation.
  void CheckInvariantsForTest() const;

 private:
  struct Key {
    int32_t parent = -1;  // cached block id of the previous positions, -1 for the first block
    std::vector<int32_t> tokens;
    bool operator==(const Key& o) const { return parent == o.parent && tokens == o.tokens; }
    template <typename H>
    friend H AbslHashValue(H h, const Key& k) {
      return H::combine(std::move(h), k.parent, k.tokens);
    }
  };
  struct Entry {
    Key key;
    std::vector<int32_t> children;  // cached blocks whose parent this is
  };

  // Removes `block`'s entry and those of its descendants (all unreferenced, since a holder of a
  // block holds its parent); unreferenced ones go to the free list.
  void Uncache(int32_t block);

  const int32_t block_size_;
  const bool caching_;
  std::vector<int32_t> refs_;     // per block: sequences holding it
  std::vector<int32_t> free_;     // FREE blocks, taken from the back (the lowest id first when new)
  std::list<int32_t> lru_;        // unreferenced cached blocks, least recently released first
  // Per block: its place in lru_, valid exactly when the block is cached and unreferenced.
  std::vector<std::list<int32_t>::iterator> lru_pos_;
  absl::flat_hash_map<int32_t, Entry> entries_;  // cached blocks
  absl::flat_hash_map<Key, int32_t> index_;      // contents -> cached block
  uint64_t epoch_ = 0;
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_BLOCK_POOL_H_
