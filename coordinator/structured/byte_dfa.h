// ByteDfa: a deterministic finite automaton over bytes, compiled from a regular expression that
// must match the whole text (as Python's re.fullmatch). It is the character-level half of a
// structured-output constraint; token_constraint.h lifts it to the vocabulary.
//
// The pattern is UTF-8. Supported syntax: literals; escapes \\ \. \" \/ \- etc. (any escaped ASCII
// punctuation), \n \r \t \f \v \0, \xHH, \uHHHH, \d \D \w \W \s \S; `.` (any character but a
// newline); classes [a-z], [^...] (over Unicode, encoded as UTF-8 byte sequences); groups (...),
// (?:...); alternation |; quantifiers * + ? {m} {m,} {m,n} (a lazy suffix `?` is accepted and means
// nothing under full-match semantics); ^ at the very start and $ at the very end. Anything else
// (backreferences, lookaround, named groups, possessive quantifiers, anchors elsewhere) is
// InvalidArgument naming the construct and its offset.
//
// Every state of the DFA can still reach an accepting state ("live"): transitions that could not
// lead to a match are absent (-1), so a text that stays on transitions is always a prefix of some
// match.
//
// Thread-safety: immutable after construction; all const methods may be called concurrently.
#ifndef SHARDSERVE_COORDINATOR_STRUCTURED_BYTE_DFA_H_
#define SHARDSERVE_COORDINATOR_STRUCTURED_BYTE_DFA_H_

#include <bitset>
#include <cstdint>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve::structured {

struct DfaLimits {
  int32_t max_nfa_states = 400000;  // after expanding counted repetitions
  int32_t max_dfa_states = 20000;
  int32_t max_repeat = 1000;        // the largest m or n of {m,n}
};

class ByteDfa {
 public:
  // Compiles `pattern`. InvalidArgument for a syntax error or unsupported construct (naming it and
  // its byte offset), for a pattern that matches nothing, or when a limit is exceeded (naming it).
  static absl::StatusOr<ByteDfa> Compile(absl::string_view pattern, const DfaLimits& limits = {});

  int32_t start() const { return start_; }
  int32_t num_states() const { return static_cast<int32_t>(accepting_.size()); }
  // The state after `byte`, or -1 when no match continues with it.
  int32_t Next(int32_t state, uint8_t byte) const { return next_[static_cast<size_t>(state) * 256 + byte]; }
  bool IsAccepting(int32_t state) const { return accepting_[static_cast<size_t>(state)] != 0; }
  // Whether `state` has any transition.
  bool HasTransitions(int32_t state) const { return has_out_[static_cast<size_t>(state)] != 0; }
  // The bytes that lead from `state` back to itself (e.g. the ordinary characters inside a string).
  const std::bitset<256>& SelfLoops(int32_t state) const { return loops_[static_cast<size_t>(state)]; }
  // Runs `text` from `state`: the state reached, or -1.
  int32_t Walk(int32_t state, absl::string_view text) const;
  // Whether the whole of `text` matches.
  bool FullMatch(absl::string_view text) const;

 private:
  ByteDfa() = default;
  int32_t start_ = 0;
  std::vector<int32_t> next_;       // [num_states * 256]
  std::vector<uint8_t> accepting_;  // [num_states]
  std::vector<uint8_t> has_out_;    // [num_states]
  std::vector<std::bitset<256>> loops_;  // [num_states]: SelfLoops
};

}  // namespace shardserve::structured

#endif  // SHARDSERVE_COORDINATOR_STRUCTURED_BYTE_DFA_H_
