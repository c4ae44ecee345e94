#include "coordinator/frontend/harmony.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardserve::coordinator::frontend::harmony {
namespace {

// The word after `key` in `header`: up to a space or the next special token.
std::string WordAfter(absl::string_view header, absl::string_view key) {
  const size_t at = header.find(key);
  if (at == absl::string_view::npos) return "";
  absl::string_view rest = header.substr(at + key.size());
  size_t end = 0;
  while (end < rest.size() && rest[end] != ' ' && rest[end] != '\n' && rest[end] != '\t' &&
         !absl::StartsWith(rest.substr(end), "<|")) {
    ++end;
  }
  return std::string(rest.substr(0, end));
}

}  // namespace

bool UsesHarmony(absl::string_view chat_template) {
  return absl::StrContains(chat_template, kChannel) && absl::StrContains(chat_template, kMessage);
}

Header ParseHeader(absl::string_view header) {
  return Header{.channel = WordAfter(header, kChannel), .recipient = WordAfter(header, "to=")};
}

std::string CallText(absl::string_view function, absl::string_view arguments) {
  return absl::StrCat(kCallPrefix, function, kChannel, "commentary json", kMessage, arguments, kCall);
}

}  // namespace shardserve::coordinator::frontend::harmony
