#include "common/tokenizer/internal/sentencepiece_normalizer.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/tokenizer/internal/string_view.h"
#include "common/tokenizer/utf8.h"

namespace shardserve::tokenizer_internal {

PrefixTrie::PrefixTrie(const std::vector<std::string>& words) : nodes_(1, false) {
  for (const std::string& w : words) {
    if (w.empty()) continue;
    int32_t node = 0;
    for (char ch : w) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(ch);
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        nodes_.push_back(false);
        it = edges_.emplace(key, static_cast<int32_t>(nodes_.size() - 1)).first;
      }
      node = it->second;
    }
    nodes_[node] = true;
  }
}

size_t PrefixTrie::LongestPrefix(std::string_view s) const {
  if (empty()) return 0;
  size_t best = 0;
  int32_t node = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    auto it = edges_.find((static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(s[i]));
    if (it == edges_.end()) break;
    node = it->second;
    if (nodes_[node]) best = i + 1;
  }
  return best;
}

SpNormalizer::SpNormalizer(const SpModel& model, const std::vector<std::string>& user_defined)
    : add_dummy_prefix_(model.add_dummy_prefix),
      remove_extra_whitespaces_(model.remove_extra_whitespaces),
      escape_whitespaces_(model.escape_whitespaces),
      user_defined_(user_defined) {}

absl::StatusOr<std::unique_ptr<SpNormalizer>> SpNormalizer::Create(const SpModel& model,
                                                                   const std::vector<std::string>& user_defined,
                                                                   std::string_view label) {
  auto n = std::unique_ptr<SpNormalizer>(new SpNormalizer(model, user_defined));
  const std::string& blob = model.precompiled_charsmap;
  if (!blob.empty()) {
    // <trie size in bytes: uint32 little-endian><double-array units><replacement strings>
    uint32_t trie_bytes = 0;
    if (blob.size() > 4) std::memcpy(&trie_bytes, blob.data(), 4);
    if (blob.size() <= 4 || trie_bytes == 0 || trie_bytes % 4 != 0 || trie_bytes > blob.size() - 4) {
      return absl::InvalidArgumentError(absl::StrCat(AbslView(label),
                                                     ": the normalizer's precompiled_charsmap is malformed (trie size ",
                                                     trie_bytes, " in a ", blob.size(), "-byte blob)"));
    }
    n->trie_.resize(trie_bytes / 4);
    std::memcpy(n->trie_.data(), blob.data() + 4, trie_bytes);
    n->replacements_ = blob.substr(4 + trie_bytes);
  }
  return n;
}

// Darts-clone unit layout: bit 8 = has_leaf, label = bits 0..7 (and bit 31 for leaves), offset =
// (unit >> 10) << ((unit & (1 << 9)) >> 6), value = unit & 0x7FFFFFFF.
bool SpNormalizer::LongestRule(std::string_view s, uint32_t* value, size_t* length) const {
  if (trie_.empty()) return false;
  auto offset = [](uint32_t unit) { return (unit >> 10) << ((unit & (1u << 9)) >> 6); };
  bool found = false;
  uint32_t id = offset(trie_[0]);
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<uint8_t>(s[i]);
    id ^= c;
    if (id >= trie_.size()) return found;
    const uint32_t unit = trie_[id];
    if ((unit & ((1u << 31) | 0xFF)) != c) return found;
    id ^= offset(unit);
    if (id >= trie_.size()) return found;
    if ((unit >> 8) & 1) {  // has a leaf: the key s[0..i] has a value
      *value = trie_[id] & ((1u << 31) - 1);
      *length = i + 1;
      found = true;
    }
  }
  return found;
}

std::pair<std::string_view, size_t> SpNormalizer::NormalizePrefix(std::string_view input) const {
  const size_t user = user_defined_.LongestPrefix(input);
  if (user > 0) return {input.substr(0, user), user};
  uint32_t value = 0;
  size_t length = 0;
  if (LongestRule(input, &value, &length) && value < replacements_.size()) {
    const char* replacement = replacements_.data() + value;
    const size_t max_len = replacements_.size() - value;
    return {std::string_view(replacement, strnlen(replacement, max_len)), length};
  }
  size_t len = 0;
  DecodeUtf8Char(input, &len);  // input is valid UTF-8
  return {input.substr(0, len), len};
}

// Mirrors sentencepiece::normalizer::Normalizer::Normalize.
std::string SpNormalizer::Normalize(std::string_view input) const {
  std::string out;
  if (remove_extra_whitespaces_) {
    while (!input.empty()) {
      const auto [piece, consumed] = NormalizePrefix(input);
      if (piece != " ") break;
      input.remove_prefix(consumed);
    }
  }
  if (input.empty()) return out;
  out.reserve(input.size() * 3 / 2 + 3);
  auto add_space = [&] {
    if (escape_whitespaces_) {
      out.append(kSpaceSymbol);
    } else {
      out.push_back(' ');
    }
  };
  if (add_dummy_prefix_) add_space();
  bool prev_space = remove_extra_whitespaces_;
  while (!input.empty()) {
    auto [piece, consumed] = NormalizePrefix(input);
    while (prev_space && piece.starts_with(' ')) piece.remove_prefix(1);
    if (!piece.empty()) {
      for (char c : piece) {
        if (escape_whitespaces_ && c == ' ') {
          out.append(kSpaceSymbol);
        } else {
          out.push_back(c);
        }
      }
      prev_space = piece.ends_with(' ');
    }
    input.remove_prefix(consumed);
    if (!remove_extra_whitespaces_) prev_space = false;
  }
  if (remove_extra_whitespaces_) {
    const std::string_view space = escape_whitespaces_ ? kSpaceSymbol : " ";
    size_t end = out.size();
    while (std::string_view(out.data(), end).ends_with(space)) end -= space.size();
    out.erase(end);
  }
  return out;
}

}  // namespace shardserve::tokenizer_internal
