#include "common/sampling/token_history.h"

#include <algorithm>

namespace shardserve {

TokenHistory::TokenHistory(absl::Span<const int32_t> prompt, bool with_prompt) {
  if (!with_prompt) return;
  ids_.assign(prompt.begin(), prompt.end());
  std::sort(ids_.begin(), ids_.end());
  ids_.erase(std::unique(ids_.begin(), ids_.end()), ids_.end());
  counts_.assign(ids_.size(), 0);
}

void TokenHistory::AddGenerated(int32_t id) {
  const auto it = std::lower_bound(ids_.begin(), ids_.end(), id);
  const auto at = it - ids_.begin();
  if (it != ids_.end() && *it == id) {
    ++counts_[static_cast<size_t>(at)];
    return;
  }
  ids_.insert(it, id);
  counts_.insert(counts_.begin() + at, 1);
}

}  // namespace shardserve
