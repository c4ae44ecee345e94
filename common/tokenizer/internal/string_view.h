// Debian's Abseil 20220623 is built with its own absl::string_view class (not an alias of
// std::string_view), so absl::StrCat and friends do not take a std::string_view. AbslView bridges
// the two without copying.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_STRING_VIEW_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_STRING_VIEW_H_

#include <string_view>

#include "absl/strings/string_view.h"

namespace shardserve::tokenizer_internal {

inline absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_STRING_VIEW_H_
