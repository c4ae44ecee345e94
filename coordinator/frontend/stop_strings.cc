#include "coordinator/frontend/stop_strings.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardserve::coordinator::frontend {

absl::Status ValidateStopStrings(const std::vector<std::string>& stops, absl::string_view field) {
  if (stops.size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has ", stops.size(), " strings; at most ", kMaxStopStrings, " are allowed"));
  }
  for (size_t i = 0; i < stops.size(); ++i) {
    if (stops[i].empty()) return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] is empty"));
    if (stops[i].size() > kMaxStopStringBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] has ", stops[i].size(),
                                                     " bytes; at most ", kMaxStopStringBytes, " are allowed"));
    }
  }
  return absl::OkStatus();
}

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops, bool include_stop) : include_stop_(include_stop) {
  for (std::string& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

StopStringMatcher::Result StopStringMatcher::Feed(absl::string_view piece) {
  Result result;
  if (stopped_) {
    result.stopped = true;
    return result;
  }
  if (stops_.empty()) {
    result.text = std::string(piece);
    return result;
  }
  std::string text = std::move(held_);
  held_.clear();
  text.append(piece.data(), piece.size());
  // The earliest match wins (the text before it is what the client would have seen first).
  size_t match = std::string::npos;
  size_t matched_size = 0;
  for (const std::string& stop : stops_) {
    const size_t at = text.find(stop);
    if (at < match) {
      match = at;
      matched_size = stop.size();
    }
  }
  if (match != std::string::npos) {
    stopped_ = true;
    result.stopped = true;
    result.text = text.substr(0, include_stop_ ? match + matched_size : match);
    return result;
  }
  // No match: hold back the longest tail that is a proper prefix of a stop string. Such a tail is
  // shorter than the longest stop string, so only those last bytes need checking.
  size_t keep = 0;
  for (const std::string& stop : stops_) {
    const size_t most = std::min(stop.size() - 1, text.size());
    for (size_t len = most; len > keep; --len) {
      if (absl::string_view(text).substr(text.size() - len) == absl::string_view(stop).substr(0, len)) {
        keep = len;
        break;
      }
    }
  }
  held_ = text.substr(text.size() - keep);
  text.resize(text.size() - keep);
  result.text = std::move(text);
  return result;
}

std::string StopStringMatcher::Finish() {
  std::string out = std::move(held_);
  held_.clear();
  return out;
}

}  // namespace shardserve::coordinator::frontend
