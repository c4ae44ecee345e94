// StopStringMatcher: finds the first of a request's stop strings in generated text that arrives in
// pieces (the text deltas of a StreamDecoder), even when a stop string spans several pieces.
//
// Feed() returns the text that is safe to send on: it holds back the longest tail of the text seen
// so far that is the beginning of some stop string (it may still become a match), and on a match
// it returns the text before the match and reports the stop; the stop string itself and all text
// after it are dropped (OpenAI's and vLLM's behaviour: the output never contains the stop
// string), unless the matcher includes stops (vLLM's include_stop_str_in_output): then the text
// ends with the stop string. Finish() returns what is still held back when generation ends
// without a match.
//
// For pieces that are whole UTF-8 characters (what a StreamDecoder returns) every returned piece
// is whole characters too: a held-back tail always starts where a stop string starts.
//
// Not thread-safe: one matcher per sequence.
#ifndef SHARDSERVE_COORDINATOR_FRONTEND_STOP_STRINGS_H_
#define SHARDSERVE_COORDINATOR_FRONTEND_STOP_STRINGS_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace shardserve::coordinator::frontend {

// Limits on a request's stop strings (the same for the gRPC and the HTTP API).
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxStopStringBytes = 256;

// InvalidArgument naming `field` (e.g. "stop[2]") when there are more than kMaxStopStrings
// strings, or one is empty or longer than kMaxStopStringBytes. Pure.
absl::Status ValidateStopStrings(const std::vector<std::string>& stops, absl::string_view field);

class StopStringMatcher {
 public:
  // `stops` should be valid (ValidateStopStrings); empty strings are ignored. With no stop strings
  // Feed() returns every piece unchanged and never stops. `include_stop`: a match's text ends with
  // the stop string (the earliest match; of two at the same place, the one given first).
  explicit StopStringMatcher(std::vector<std::string> stops, bool include_stop = false);

  struct Result {
    std::string text;      // safe to send now (possibly empty)
    bool stopped = false;  // a stop string matched; `text` ends right before it (or with it)
  };

  // Appends `piece` to the text seen so far. After a match every further call returns an empty
  // result with stopped = true.
  Result Feed(absl::string_view piece);

  // The text held back (a possible stop-string start that never completed); clears it. Empty after
  // a match.
  std::string Finish();

  bool stopped() const { return stopped_; }
  bool empty() const { return stops_.empty(); }

 private:
  std::vector<std::string> stops_;
  bool include_stop_ = false;
  std::string held_;  // tail of the text that is a proper prefix of some stop string
  bool stopped_ = false;
};

}  // namespace shardserve::coordinator::frontend

#endif  // SHARDSERVE_COORDINATOR_FRONTEND_STOP_STRINGS_H_
