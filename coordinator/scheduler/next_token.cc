#include "coordinator/scheduler/next_token.h"

#include <algorithm>
#include <utility>

namespace shardserve::coordinator {
namespace {

void SortUnique(std::vector<int32_t>& ids) {
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
}

bool MaskAllows(const std::string& mask, int32_t token) {
  const size_t byte = static_cast<size_t>(token) / 8;
  return token >= 0 && byte < mask.size() && ((static_cast<unsigned char>(mask[byte]) >> (token % 8)) & 1) != 0;
}

// Whether some id of [0, vocab_size) is neither in `suppress` (ascending, distinct) nor outside
// `mask` (when set).
bool AnyAllowed(const std::vector<int32_t>& suppress, const std::string* mask, int64_t vocab_size) {
  if (mask == nullptr) {
    const int64_t inside = std::count_if(suppress.begin(), suppress.end(),
                                         [&](int32_t id) { return id >= 0 && id < vocab_size; });
    return inside < vocab_size;
  }
  const int64_t bits = std::min<int64_t>(vocab_size, static_cast<int64_t>(mask->size()) * 8);
  auto next = suppress.begin();
  for (int64_t byte = 0; byte * 8 < bits; ++byte) {
    const auto m = static_cast<unsigned char>((*mask)[static_cast<size_t>(byte)]);
    if (m == 0) continue;
    for (int bit = 0; bit < 8 && byte * 8 + bit < bits; ++bit) {
      if (((m >> bit) & 1) == 0) continue;
      const auto id = static_cast<int32_t>(byte * 8 + bit);
      next = std::lower_bound(next, suppress.end(), id);
      if (next == suppress.end() || *next != id) return true;
    }
  }
  return false;
}

}  // namespace

void AppendBadWordBans(absl::Span<const std::vector<int32_t>> bad_words, absl::Span<const int32_t> output,
                       std::vector<int32_t>* out) {
  for (const std::vector<int32_t>& word : bad_words) {
    if (word.empty()) continue;
    const size_t prefix = word.size() - 1;
    if (prefix > output.size()) continue;
    if (std::equal(word.begin(), word.begin() + static_cast<std::ptrdiff_t>(prefix), output.end() - prefix)) {
      out->push_back(word.back());
    }
  }
}

bool NextTokenRules::Allows(int32_t token) const {
  if (std::binary_search(suppress.begin(), suppress.end(), token)) return false;
  return mask == nullptr || MaskAllows(*mask, token);
}

NextTokenRules NextTokenRulesOf(const SequenceRequest& request, absl::Span<const int32_t> eos_token_ids,
                                int64_t vocab_size, absl::Span<const int32_t> output, int32_t constraint_state) {
  NextTokenRules rules;
  if (request.constraint != nullptr) rules.mask = request.constraint->AllowedMask(constraint_state);
  if (static_cast<int64_t>(output.size()) < request.min_tokens) {
    rules.suppress = request.stop_token_ids;
    if (!request.ignore_eos && (request.constraint == nullptr || !request.constraint->DecidesEos())) {
      rules.suppress.insert(rules.suppress.end(), eos_token_ids.begin(), eos_token_ids.end());
    }
  }
  if (request.bad_words.empty()) {
    SortUnique(rules.suppress);
    return rules;
  }
  std::vector<int32_t> with_bans = rules.suppress;
  AppendBadWordBans(request.bad_words, output, &with_bans);
  const bool banned = with_bans.size() > rules.suppress.size();
  SortUnique(rules.suppress);
  if (!banned) return rules;
  SortUnique(with_bans);
  if (AnyAllowed(with_bans, rules.mask.get(), vocab_size)) rules.suppress = std::move(with_bans);
  return rules;
}

}  // namespace shardserve::coordinator
