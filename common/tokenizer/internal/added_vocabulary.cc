#include "common/tokenizer/internal/added_vocabulary.h"

#include <unicode/uchar.h>

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"
#include "common/tokenizer/internal/normalizer.h"
#include "common/tokenizer/utf8.h"

namespace shardserve::tokenizer_internal {
namespace {

// The `tokenizers` library tests single_word boundaries with the Rust regex crate's Unicode \w:
// Alphabetic, marks, decimal numbers, connector punctuation and join controls (UTS #18 Annex C).
bool IsWordChar(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  const auto uc = static_cast<UChar32>(c);
  if (u_hasBinaryProperty(uc, UCHAR_ALPHABETIC) || u_hasBinaryProperty(uc, UCHAR_JOIN_CONTROL)) return true;
  const int8_t type = u_charType(uc);
  return type == U_NON_SPACING_MARK || type == U_COMBINING_SPACING_MARK || type == U_ENCLOSING_MARK ||
         type == U_DECIMAL_DIGIT_NUMBER || type == U_CONNECTOR_PUNCTUATION;
}

char32_t LastChar(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  size_t len = 0;
  return DecodeUtf8Char(s.substr(i), &len);
}

// Byte offset where the run of whitespace at the end of `s` begins.
size_t TrailingSpaceStart(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t i = end - 1;
    while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
    size_t len = 0;
    if (!IsUnicodeWhitespace(DecodeUtf8Char(s.substr(i), &len))) break;
    end = i;
  }
  return end;
}

// Length in bytes of the run of whitespace at the start of `s`.
size_t LeadingSpaceLength(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t len = 0;
    if (!IsUnicodeWhitespace(DecodeUtf8Char(s.substr(i), &len))) break;
    i += len;
  }
  return i;
}

}  // namespace

absl::StatusOr<std::vector<AddedToken>> ParseAddedTokens(const Json& j, const JsonWhere& where, int64_t max_id) {
  std::vector<AddedToken> tokens;
  if (j.is_null()) return tokens;
  if (!j.is_array()) return where.Error("is not a list");
  for (size_t i = 0; i < j.size(); ++i) {
    const JsonWhere at = where.Index(i);
    const Json& e = j[i];
    if (!e.is_object()) return at.Error("is not an object");
    AddedToken t;
    ASSIGN_OR_RETURN(int64_t id, JsonIntOr(e, "id", -1, 0, max_id - 1, at));
    if (id < 0) return at.Child("id").Error("is missing");
    t.id = static_cast<int32_t>(id);
    ASSIGN_OR_RETURN(t.content, JsonString(e, "content", at));
    if (t.content.empty()) return at.Child("content").Error("is empty");
    ASSIGN_OR_RETURN(t.single_word, JsonBoolOr(e, "single_word", false, at));
    ASSIGN_OR_RETURN(t.lstrip, JsonBoolOr(e, "lstrip", false, at));
    ASSIGN_OR_RETURN(t.rstrip, JsonBoolOr(e, "rstrip", false, at));
    ASSIGN_OR_RETURN(t.special, JsonBoolOr(e, "special", false, at));
    // The library's default: special tokens are not normalized, others are.
    ASSIGN_OR_RETURN(t.normalized, JsonBoolOr(e, "normalized", !t.special, at));
    tokens.push_back(std::move(t));
  }
  return tokens;
}

AddedTokenMatcher::AddedTokenMatcher(const std::vector<const AddedToken*>& tokens,
                                     const std::vector<std::string>& patterns)
    : tokens_(tokens) {
  nodes_.emplace_back();
  for (size_t t = 0; t < tokens.size(); ++t) {
    const std::string& p = patterns[t];
    if (p.empty()) continue;
    first_byte_[static_cast<uint8_t>(p[0])] = true;
    int32_t node = 0;
    for (char ch : p) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(ch);
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        nodes_.emplace_back();
        it = edges_.emplace(key, static_cast<int32_t>(nodes_.size() - 1)).first;
      }
      node = it->second;
    }
    // The first token with a given spelling wins, as in the library's trie.
    if (nodes_[node].token < 0) nodes_[node].token = static_cast<int32_t>(t);
  }
}

int32_t AddedTokenMatcher::Child(int32_t node, uint8_t byte) const {
  auto it = edges_.find((static_cast<uint64_t>(node) << 8) | byte);
  return it == edges_.end() ? -1 : it->second;
}

// Mirrors AddedVocabulary::find_matches: leftmost-longest matches (aho-corasick LeftmostLongest),
// then single_word filtering and lstrip/rstrip widening.
void AddedTokenMatcher::Split(std::string_view text, std::vector<Segment>* out) const {
  size_t start_offset = 0;  // end of the previous emitted segment
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    if (!first_byte_[static_cast<uint8_t>(text[i])]) {
      ++i;
      continue;
    }
    int32_t node = 0;
    int32_t best = -1;
    size_t best_end = i;
    for (size_t j = i; j < n; ++j) {
      node = Child(node, static_cast<uint8_t>(text[j]));
      if (node < 0) break;
      if (nodes_[node].token >= 0) {
        best = nodes_[node].token;
        best_end = j + 1;
      }
    }
    if (best < 0) {
      ++i;
      continue;
    }
    const AddedToken& token = *tokens_[best];
    size_t start = i;
    size_t stop = best_end;
    i = best_end;  // the next search starts after this match, even when it is skipped below
    if (token.single_word) {
      const bool start_ok = start == 0 || !IsWordChar(LastChar(text.substr(0, start)));
      size_t len = 0;
      const bool stop_ok = stop == n || !IsWordChar(DecodeUtf8Char(text.substr(stop), &len));
      if (!start_ok || !stop_ok) continue;
    }
    if (token.lstrip) start = std::max(TrailingSpaceStart(text.substr(0, start)), start_offset);
    if (token.rstrip) stop += LeadingSpaceLength(text.substr(stop));
    i = stop;  // keeps segments disjoint when rstrip widened the match
    if (start_offset < start) out->push_back(Segment{-1, start_offset, start});
    out->push_back(Segment{token.id, start, stop});
    start_offset = stop;
  }
  if (start_offset < n) out->push_back(Segment{-1, start_offset, n});
}

}  // namespace shardserve::tokenizer_internal
