#include "coordinator/scheduler/block_pool.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "common/log/log.h"

namespace shardserve::coordinator {

BlockPool::BlockPool(int64_t num_blocks, int32_t block_size, bool caching)
    : block_size_(block_size), caching_(caching) {
  CHECK(num_blocks >= 1 && num_blocks <= std::numeric_limits<int32_t>::max()) << num_blocks;
  CHECK_GE(block_size, 1);
  const auto n = static_cast<size_t>(num_blocks);
  refs_.assign(n, 0);
  lru_pos_.resize(n);
  // Lowest id at the back: a fresh pool hands out blocks 0, 1, 2, ...
  free_.reserve(n);
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

std::vector<int32_t> BlockPool::Match(absl::Span<const int32_t> tokens, int64_t max_tokens) const {
  std::vector<int32_t> out;
  if (!caching_ || entries_.empty()) return out;
  const int64_t limit = std::min<int64_t>(max_tokens, static_cast<int64_t>(tokens.size()));
  Key key;
  for (int64_t j = 0; (j + 1) * block_size_ <= limit; ++j) {
    key.tokens.assign(tokens.begin() + j * block_size_, tokens.begin() + (j + 1) * block_size_);
    auto it = index_.find(key);
    if (it == index_.end()) break;
    out.push_back(it->second);
    key.parent = it->second;
  }
  return out;
}

int64_t BlockPool::CountUnreferenced(absl::Span<const int32_t> blocks) const {
  int64_t n = 0;
  for (int32_t b : blocks) n += refs_[static_cast<size_t>(b)] == 0 ? 1 : 0;
  return n;
}

void BlockPool::Acquire(absl::Span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    const auto i = static_cast<size_t>(b);
    CHECK(entries_.contains(b)) << "block " << b << " is not cached";
    if (refs_[i]++ == 0) lru_.erase(lru_pos_[i]);
  }
}

bool BlockPool::Allocate(int64_t n, std::vector<int32_t>& out) {
  if (n <= 0) return true;
  if (n > available()) return false;
  for (int64_t k = 0; k < n; ++k) {
    if (free_.empty()) Uncache(lru_.front());  // moves it (and its descendants) to free_
    const int32_t b = free_.back();
    free_.pop_back();
    refs_[static_cast<size_t>(b)] = 1;
    out.push_back(b);
  }
  return true;
}

void BlockPool::Release(absl::Span<const int32_t> blocks) {
  // Last block first: a prefix's tail becomes evictable before its head.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int32_t b = *it;
    const auto i = static_cast<size_t>(b);
    CHECK_GT(refs_[i], 0) << "block " << b << " released more often than taken";
    if (--refs_[i] > 0) continue;
    if (entries_.contains(b)) {
      lru_pos_[i] = lru_.insert(lru_.end(), b);
    } else {
      free_.push_back(b);
    }
  }
}

void BlockPool::Commit(absl::Span<const int32_t> blocks, absl::Span<const int32_t> tokens, int64_t written,
                       int64_t* cached_blocks) {
  if (!caching_) return;
  const int64_t full = std::min<int64_t>(written / block_size_, static_cast<int64_t>(blocks.size()));
  for (int64_t j = *cached_blocks; j < full; ++j) {
    // Blocks past the cached ones were allocated fresh: none is cached yet.
    const int32_t b = blocks[static_cast<size_t>(j)];
    DCHECK(!entries_.contains(b)) << "block " << b;
    Key key;
    key.parent = j == 0 ? -1 : blocks[static_cast<size_t>(j - 1)];
    key.tokens.assign(tokens.begin() + j * block_size_, tokens.begin() + (j + 1) * block_size_);
    if (index_.contains(key)) return;  // another block holds these contents
    index_.emplace(key, b);
    if (key.parent >= 0) entries_.at(key.parent).children.push_back(b);
    entries_.emplace(b, Entry{.key = std::move(key)});
    *cached_blocks = j + 1;
    ++epoch_;
  }
}

void BlockPool::Uncache(int32_t block) {
  std::vector<int32_t> stack = {block};
  // Unlink `block` from its parent's children (its descendants go with it, so only the top one).
  const Entry& top = entries_.at(block);
  if (top.key.parent >= 0) std::erase(entries_.at(top.key.parent).children, block);
  while (!stack.empty()) {
    const int32_t b = stack.back();
    stack.pop_back();
    auto it = entries_.find(b);
    Entry entry = std::move(it->second);
    entries_.erase(it);
    index_.erase(entry.key);
    stack.insert(stack.end(), entry.children.begin(), entry.children.end());
    const auto i = static_cast<size_t>(b);
    CHECK_EQ(refs_[i], 0) << "evicting cached block " << b << ", which a sequence holds";
    lru_.erase(lru_pos_[i]);  // cached and unreferenced: it is in lru_
    free_.push_back(b);
  }
  ++epoch_;
}

void BlockPool::CheckInvariantsForTest() const {
  const size_t n = refs_.size();
  std::vector<int> seen(n, 0);
  for (int32_t b : free_) {
    CHECK_EQ(refs_[static_cast<size_t>(b)], 0);
    CHECK(!entries_.contains(b));
    ++seen[static_cast<size_t>(b)];
  }
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    const auto b = static_cast<size_t>(*it);
    CHECK_EQ(refs_[b], 0);
    CHECK(entries_.contains(*it));
    CHECK(lru_pos_[b] == it) << "block " << b << ": its lru_ position is stale";
    ++seen[b];
  }
  for (size_t b = 0; b < n; ++b) {
    if (refs_[b] > 0) ++seen[b];
    CHECK_EQ(seen[b], 1) << "block " << b << " is in " << seen[b] << " states";
  }
  CHECK_EQ(entries_.size(), index_.size());
  for (const auto& [b, e] : entries_) {
    CHECK_EQ(static_cast<int64_t>(e.key.tokens.size()), block_size_);
    auto it = index_.find(e.key);
    CHECK(it != index_.end() && it->second == b);
    if (e.key.parent >= 0) {
      const auto p = entries_.find(e.key.parent);
      CHECK(p != entries_.end()) << "cached block " << b << " has an uncached parent";
      CHECK(std::count(p->second.children.begin(), p->second.children.end(), b) == 1);
      // A holder of a block holds its parent.
      CHECK(refs_[static_cast<size_t>(b)] == 0 || refs_[static_cast<size_t>(e.key.parent)] > 0);
    }
    for (int32_t c : e.children) {
      const auto ch = entries_.find(c);
      CHECK(ch != entries_.end() && ch->second.key.parent == b);
    }
  }
}

}  // namespace shardserve::coordinator
