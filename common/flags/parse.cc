#include "common/flags/parse.h"

#include <cmath>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardserve {

absl::StatusOr<std::vector<int32_t>> ParseTokenIdList(absl::string_view text, absl::string_view flag) {
  std::vector<int32_t> ids;
  if (absl::StripAsciiWhitespace(text).empty()) return absl::InvalidArgumentError(absl::StrCat(flag, " is empty"));
  int index = 0;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    part = absl::StripAsciiWhitespace(part);
    int32_t id = 0;
    if (part.empty() || !absl::SimpleAtoi(part, &id) || id < 0) {
      return absl::InvalidArgumentError(absl::StrCat(flag, " element ", index, " (\"", part,
                                                     "\") is not a non-negative integer"));
    }
    ids.push_back(id);
    ++index;
  }
  return ids;
}

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  const absl::string_view t = absl::StripAsciiWhitespace(text);
  size_t split = 0;
  while (split < t.size() && (absl::ascii_isdigit(static_cast<unsigned char>(t[split])) || t[split] == '.')) ++split;
  double value = 0;
  if (split == 0 || !absl::SimpleAtod(t.substr(0, split), &value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat("\"", text, "\" is not a size such as 8GiB or 512MiB"));
  }
  const std::string unit = absl::AsciiStrToLower(t.substr(split));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "kib") scale = 1024.0;
  else if (unit == "mib") scale = 1024.0 * 1024;
  else if (unit == "gib") scale = 1024.0 * 1024 * 1024;
  else if (unit == "tib") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb") scale = 1e3;
  else if (unit == "mb") scale = 1e6;
  else if (unit == "gb") scale = 1e9;
  else if (unit == "tb") scale = 1e12;
  else return absl::InvalidArgumentError(absl::StrCat("\"", text, "\": unknown unit \"", unit, "\""));
  const double bytes = value * scale;
  if (bytes > 9e18) return absl::InvalidArgumentError(absl::StrCat("\"", text, "\" is too large"));
  return static_cast<int64_t>(std::llround(bytes));
}

}  // namespace shardserve
