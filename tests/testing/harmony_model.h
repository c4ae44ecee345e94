// A tokenizer and chat template in GPT-OSS's harmony format, for the front-end tests: the qwen2
// test tokenizer (byte-level, 256 ids) with harmony's special tokens added after it, and the
// harmony-style chat template that tests/coordinator/http/jinja_golden.json records (jinja2's
// renders of it are checked there).
#ifndef SHARDSERVE_TESTS_TESTING_HARMONY_MODEL_H_
#define SHARDSERVE_TESTS_TESTING_HARMONY_MODEL_H_

#include <string>

namespace shardserve::testing {

// tokenizer.json's text; the special tokens <|start|>, <|channel|>, <|message|>, <|end|>,
// <|return|>, <|call|>, <|constrain|> and <|endoftext|> are ids 256 to 263, in that order.
std::string HarmonyTokenizerJson();
inline constexpr int kHarmonyReturnId = 260;
inline constexpr int kHarmonyCallId = 261;

// The chat template (a tokenizer_config.json "chat_template").
std::string HarmonyChatTemplate();

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_HARMONY_MODEL_H_
