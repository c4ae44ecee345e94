// Structured one-line logs: key=value fields after the glog prefix, e.g.
//   I0412 10:01:02.345 123 request_log.cc:40] event=request_end request_id=req-7 status=OK ...
// so that `grep request_id=req-7` over every process's log follows one request through the
// coordinator and each stage. LogValue() makes any value safe on such a line.
#ifndef SHARDSERVE_COMMON_LOG_FIELDS_H_
#define SHARDSERVE_COMMON_LOG_FIELDS_H_

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardserve {

// Longest value written as is; longer ones (a client's request id, say) are cut and marked.
inline constexpr size_t kMaxLogValueBytes = 128;

// `value` unchanged when it is non-empty and made only of [A-Za-z0-9._:/@+-]; otherwise in double
// quotes with C escapes (so a value can never break the line or fake another field). Values longer
// than kMaxLogValueBytes are cut there and end in "...". Pure, thread-safe.
inline std::string LogValue(absl::string_view value) {
  const bool cut = value.size() > kMaxLogValueBytes;
  if (cut) value = value.substr(0, kMaxLogValueBytes);
  bool plain = !value.empty();
  for (const char c : value) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == ':' || c == '/' || c == '@' || c == '+' || c == '-';
    if (!ok) {
      plain = false;
      break;
    }
  }
  if (plain) return cut ? absl::StrCat(value, "...") : std::string(value);
  return absl::StrCat("\"", absl::CEscape(value), cut ? "..." : "", "\"");
}

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_LOG_FIELDS_H_
