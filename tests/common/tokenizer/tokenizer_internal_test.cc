// Pipeline stages of the tokenizer.json implementation, checked against outputs of the
// `tokenizers` library (0.23) recorded by hand.
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/tokenizer/internal/byte_level.h"
#include "common/tokenizer/internal/decoder.h"
#include "common/tokenizer/internal/pre_tokenizer.h"
#include "common/tokenizer/internal/regex.h"
#include "common/tokenizer/utf8.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::tokenizer_internal {
namespace {

using ::testing::ElementsAre;

std::vector<std::string> PreTokenizeWith(const std::string& pre_tokenizer_json, const std::string& text) {
  const Json j = Json::parse(pre_tokenizer_json);
  absl::StatusOr<std::unique_ptr<PreTokenizer>> p = PreTokenizer::FromJson(j, JsonWhere{"test.json", "pre_tokenizer"});
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return {};
  std::vector<std::string> out;
  EXPECT_TRUE((*p)->PreTokenizeToVector(text, true, &out).ok());
  return out;
}

std::string SplitJson(const char* pattern, const char* behavior, bool invert) {
  return std::string("{\"type\":\"Split\",\"pattern\":{\"String\":\"") + pattern + "\"},\"behavior\":\"" + behavior +
         "\",\"invert\":" + (invert ? "true" : "false") + "}";
}

TEST(TokenizerByteLevelTest, MapsBytesLikeGpt2) {
  EXPECT_EQ(ByteToChar(' '), U'\u0120');   // 'Ġ'
  EXPECT_EQ(ByteToChar('\n'), U'\u010A');  // 'Ċ'
  EXPECT_EQ(ByteToChar('A'), U'A');
  EXPECT_EQ(ByteToChar(0xAD), U'\u0143');  // the last remapped byte
  for (int b = 0; b < 256; ++b) EXPECT_EQ(CharToByte(ByteToChar(static_cast<uint8_t>(b))), b);
  std::string raw;
  EXPECT_TRUE(ByteLevelToBytes("\xC4\xA0hi", &raw));  // "Ġhi"
  EXPECT_EQ(raw, " hi");
  EXPECT_FALSE(ByteLevelToBytes("\xE2\x96\x81", &raw));  // '▁' is not in the map
}

TEST(TokenizerRegexTest, TranslatesOnigurumaClasses) {
  EXPECT_EQ(TranslateOnigurumaPattern(R"(\s+(?!\S))"), R"([\t-\r\x{85}\p{Z}]+(?![^\t-\r\x{85}\p{Z}]))");
  EXPECT_EQ(TranslateOnigurumaPattern(R"([^\s\p{L}])"), R"([^\t-\r\x{85}\p{Z}\p{L}])");
  EXPECT_EQ(TranslateOnigurumaPattern(R"(\\s)"), R"(\\s)");  // an escaped backslash, then 's'
  EXPECT_EQ(TranslateOnigurumaPattern(R"(\h)"), R"([0-9A-Fa-f])");
  EXPECT_EQ(TranslateOnigurumaPattern(R"([]\s])"), R"([]\t-\r\x{85}\p{Z}])");  // ']' first in a class is literal
}

TEST(TokenizerRegexTest, LookAheadAndUnicodeClasses) {
  absl::StatusOr<std::unique_ptr<Regex>> re = Regex::Compile(R"(\s+(?!\S)|\s+|\p{L}+)");
  ASSERT_TRUE(re.ok()) << re.status();
  std::vector<std::pair<size_t, size_t>> m;
  ASSERT_TRUE((*re)->FindAll("ab   cé", &m).ok());
  EXPECT_THAT(m, ElementsAre(std::pair<size_t, size_t>{0, 2}, std::pair<size_t, size_t>{2, 4},
                             std::pair<size_t, size_t>{4, 5}, std::pair<size_t, size_t>{5, 8}));
  m.clear();
  ASSERT_TRUE((*re)
                  ->FindAll("a\xE1\xA0\x8E"
                            "b",
                            &m)
                  .ok());  // U+180E is not \s for Oniguruma
  EXPECT_THAT(m, ElementsAre(std::pair<size_t, size_t>{0, 1}, std::pair<size_t, size_t>{4, 5}));
}

// GPT-OSS's pre-tokenizer pattern (o200k's: Unicode letter categories, case changes, contractions
// in either case) splits as Python's `regex` module splits it (o200k_splits.json, recorded by
// make_o200k_splits.py).
TEST(TokenizerRegexTest, GptOssPatternSplitsAsPythonRegexDoes) {
  std::ifstream in("tests/common/tokenizer/o200k_splits.json");
  std::stringstream ss;
  ss << in.rdbuf();
  const Json golden = Json::parse(ss.str());
  absl::StatusOr<std::unique_ptr<Regex>> re = Regex::Compile(golden["pattern"].get<std::string>());
  ASSERT_TRUE(re.ok()) << re.status();
  ASSERT_GE(golden["cases"].size(), 15u);
  for (const Json& c : golden["cases"]) {
    const std::string text = c["text"];
    SCOPED_TRACE(text);
    std::vector<std::pair<size_t, size_t>> matches;
    ASSERT_TRUE((*re)->FindAll(text, &matches).ok());
    std::vector<std::string> splits;
    for (const auto& [b, e] : matches) splits.push_back(text.substr(b, e - b));
    EXPECT_EQ(splits, c["splits"].get<std::vector<std::string>>());
  }
}

TEST(TokenizerRegexTest, BadPatternIsAnError) {
  absl::StatusOr<std::unique_ptr<Regex>> re = Regex::Compile("(unclosed");
  ASSERT_FALSE(re.ok());
  EXPECT_EQ(re.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerRegexTest, VeryLongWhitespaceRunMatches) {
  absl::StatusOr<std::unique_ptr<Regex>> re = Regex::Compile(R"(\s+(?!\S)|\s+)");
  ASSERT_TRUE(re.ok());
  const std::string text = std::string(2'000'000, ' ') + "x";
  std::vector<std::pair<size_t, size_t>> m;
  ASSERT_TRUE((*re)->FindAll(text, &m).ok());
  // All spaces but the last (the look-ahead leaves it), then the last one by the second branch.
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0], (std::pair<size_t, size_t>{0, text.size() - 2}));
  EXPECT_EQ(m[1], (std::pair<size_t, size_t>{text.size() - 2, text.size() - 1}));
}

// Expected values from tokenizers.pre_tokenizers.Split("ab", behavior, invert).pre_tokenize_str.
TEST(TokenizerPreTokenizerTest, SplitBehaviorsMatchTheLibrary) {
  EXPECT_THAT(PreTokenizeWith(SplitJson("ab", "MergedWithPrevious", false), "xabyabab"),
              ElementsAre("xab", "yab", "ab"));
  EXPECT_THAT(PreTokenizeWith(SplitJson("ab", "MergedWithNext", false), "xabyababz"),
              ElementsAre("x", "aby", "ab", "abz"));
  EXPECT_THAT(PreTokenizeWith(SplitJson("ab", "Contiguous", false), "xabyababz"),
              ElementsAre("x", "ab", "y", "abab", "z"));
  EXPECT_THAT(PreTokenizeWith(SplitJson("ab", "Removed", true), "xabyababz"), ElementsAre("ab", "ab", "ab"));
  EXPECT_THAT(PreTokenizeWith(SplitJson("ab", "Isolated", true), "xabyababz"),
              ElementsAre("x", "ab", "y", "ab", "ab", "z"));
}

TEST(TokenizerPreTokenizerTest, MetaspaceAndByteLevelMatchTheLibrary) {
  EXPECT_THAT(
      PreTokenizeWith(R"({"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true})", "  a  b "),
      ElementsAre("▁", "▁a", "▁", "▁b", "▁"));
  EXPECT_THAT(
      PreTokenizeWith(R"({"type":"Metaspace","replacement":"▁","prepend_scheme":"first","split":false})", " a b"),
      ElementsAre("▁a▁b"));
  // ByteLevel adds the prefix space to every piece; words stay raw bytes.
  EXPECT_THAT(PreTokenizeWith(R"({"type":"Sequence","pretokenizers":[)" + SplitJson(" ", "Isolated", false) +
                                  R"(,{"type":"ByteLevel","add_prefix_space":true,"use_regex":false}]})",
                              "a b"),
              ElementsAre(" a", " ", " b"));
  EXPECT_THAT(PreTokenizeWith(R"({"type":"Digits","individual_digits":false})", "ab123c4"),
              ElementsAre("ab", "123", "c", "4"));
}

std::string DecodeWith(const std::string& decoder_json, const std::vector<std::string>& tokens) {
  absl::StatusOr<std::unique_ptr<DecoderChain>> d =
      DecoderChain::FromJson(Json::parse(decoder_json), JsonWhere{"test.json", "decoder"});
  EXPECT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::string> text = (*d)->Decode(tokens);
  EXPECT_TRUE(text.ok());
  return text.ok() ? *text : "";
}

// Expected values from tokenizers.decoders.*.decode(tokens).
TEST(TokenizerDecoderTest, MatchesTheLibrary) {
  const std::string r(kUtf8Replacement);
  EXPECT_EQ(DecodeWith(R"({"type":"Metaspace","replacement":"▁","prepend_scheme":"always"})", {"▁a▁b", "▁c"}), "ab c");
  EXPECT_EQ(DecodeWith(R"({"type":"Metaspace","replacement":"▁","prepend_scheme":"never"})", {"▁a▁b", "▁c"}), " a b c");
  EXPECT_EQ(DecodeWith(R"({"type":"Strip","content":" ","start":2,"stop":0})", {"  a", "  b"}), "ab");
  EXPECT_EQ(DecodeWith(R"({"type":"ByteLevel"})", {"Ġhi", "<|x|>", "Ã", "é"}), " hi<|x|>" + r + r);
  EXPECT_EQ(DecodeWith(R"({"type":"Sequence","decoders":[{"type":"ByteFallback"},{"type":"Fuse"}]})",
                       {"<0xE4>", "<0xB8>", "<0xAD>", "a", "<0xE4>", "<0xB8>", "b", "<0xC3>", "<0xA9>", "<0xFF>"}),
            "中a" + r + r + "b" + r + r + r);
  EXPECT_EQ(DecodeWith("null", {"a", "b"}), "a b");
}

}  // namespace
}  // namespace shardserve::tokenizer_internal
