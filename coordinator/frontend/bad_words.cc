#include "coordinator/frontend/bad_words.h"

#include <string_view>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "coordinator/scheduler/sequence.h"

namespace shardserve::coordinator::frontend {

absl::StatusOr<std::vector<std::vector<int32_t>>> BadWordSequences(const Tokenizer& tokenizer,
                                                                   absl::Span<const std::string> words,
                                                                   absl::string_view field) {
  if (words.size() > kMaxBadWords) {
    return InvalidRequestField(field, absl::StrCat(field, " holds ", words.size(), " words; at most ", kMaxBadWords,
                                                   " are taken"));
  }
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string entry = absl::StrCat(field, "[", i, "]");
    auto invalid = [&](auto&&... message) { return InvalidRequestField(entry, absl::StrCat(entry, message...)); };
    if (words[i].size() > kMaxBadWordBytes) {
      return invalid(" is ", words[i].size(), " bytes long; at most ", kMaxBadWordBytes, " are taken");
    }
    const absl::string_view word = absl::StripLeadingAsciiWhitespace(words[i]);
    if (absl::StripTrailingAsciiWhitespace(word).empty()) return invalid(" is empty (or only whitespace)");
    absl::StatusOr<std::vector<int32_t>> alone =
        tokenizer.Encode(std::string_view(word.data(), word.size()), /*add_special_tokens=*/false);
    if (!alone.ok()) return invalid(": ", alone.status().message());
    if (alone->empty() || alone->size() > kMaxBadWordTokens) {
      return invalid(" is spelled with ", alone->size(), " tokens; it must be 1 to ", kMaxBadWordTokens);
    }
    absl::StatusOr<std::vector<int32_t>> spaced = tokenizer.Encode(absl::StrCat(" ", word), false);
    if (!spaced.ok()) return invalid(": ", spaced.status().message());
    const bool distinct = spaced->size() == alone->size() && spaced->front() != alone->front();
    out.push_back(*std::move(alone));
    if (distinct) out.push_back(*std::move(spaced));
  }
  return out;
}

}  // namespace shardserve::coordinator::frontend
