#include "coordinator/structured/byte_dfa.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::structured {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

ByteDfa MustCompile(const std::string& pattern) {
  absl::StatusOr<ByteDfa> d = ByteDfa::Compile(pattern);
  EXPECT_TRUE(d.ok()) << pattern << ": " << d.status();
  return *std::move(d);
}

TEST(ByteDfaTest, LiteralsAndAlternation) {
  const ByteDfa d = MustCompile("cat|dog|(?:bird)s?");
  for (const char* ok : {"cat", "dog", "bird", "birds"}) EXPECT_TRUE(d.FullMatch(ok)) << ok;
  for (const char* bad : {"", "ca", "cats", "birdss", "Dog", " cat"}) EXPECT_FALSE(d.FullMatch(bad)) << bad;
}

TEST(ByteDfaTest, CountedRepetition) {
  const ByteDfa d = MustCompile(R"(\d{4}-\d{2}-\d{2})");
  EXPECT_TRUE(d.FullMatch("2024-01-31"));
  EXPECT_FALSE(d.FullMatch("2024-1-31"));
  EXPECT_FALSE(d.FullMatch("20245-01-31"));
  const ByteDfa r = MustCompile("a{2,}b{0,2}c{3}");
  EXPECT_TRUE(r.FullMatch("aaccc"));
  EXPECT_TRUE(r.FullMatch("aaaaabbccc"));
  EXPECT_FALSE(r.FullMatch("accc"));
  EXPECT_FALSE(r.FullMatch("aabbbccc"));
}

TEST(ByteDfaTest, ClassesAndEscapes) {
  const ByteDfa d = MustCompile(R"([A-Za-z_][\w-]*\.[^\s.]+)");
  EXPECT_TRUE(d.FullMatch("file_1-x.txt"));
  EXPECT_FALSE(d.FullMatch("1file.txt"));
  EXPECT_FALSE(d.FullMatch("a.b c"));
  EXPECT_TRUE(MustCompile(R"(\x41\u00e9\n)").FullMatch("A\xC3\xA9\n"));
  EXPECT_TRUE(MustCompile(R"(^\{\}\[\]\(\)\.\*$)").FullMatch("{}[]().*"));
}

TEST(ByteDfaTest, NegatedClassesMatchWholeUtf8CharactersOnly) {
  const ByteDfa d = MustCompile("[^a]");
  EXPECT_TRUE(d.FullMatch("b"));
  EXPECT_TRUE(d.FullMatch("\xC3\xA9"));          // é
  EXPECT_TRUE(d.FullMatch("\xE2\x82\xAC"));      // €
  EXPECT_TRUE(d.FullMatch("\xF0\x9F\x98\x80"));  // 😀
  EXPECT_FALSE(d.FullMatch("a"));
  EXPECT_FALSE(d.FullMatch("\xC3"));              // half a character
  EXPECT_FALSE(d.FullMatch("\xED\xA0\x80"));      // a surrogate
  EXPECT_FALSE(d.FullMatch("\xC0\x80"));          // overlong
  // A prefix of a character is a live state; its continuation completes the match.
  const int32_t s = d.Walk(d.start(), "\xE2\x82");
  ASSERT_GE(s, 0);
  EXPECT_FALSE(d.IsAccepting(s));
  EXPECT_TRUE(d.IsAccepting(d.Next(s, 0xAC)));
}

TEST(ByteDfaTest, UnicodeRangeInClass) {
  const ByteDfa d = MustCompile("[α-ω]+");
  EXPECT_TRUE(d.FullMatch("αβγω"));
  EXPECT_FALSE(d.FullMatch("αa"));
  EXPECT_FALSE(d.FullMatch("Ω"));
}

TEST(ByteDfaTest, DeadEndsArePruned) {
  // "ab" can only be followed by "c": every state still on a transition can reach a match.
  const ByteDfa d = MustCompile("abc|abd|x");
  const int32_t s = d.Walk(d.start(), "ab");
  ASSERT_GE(s, 0);
  EXPECT_EQ(d.Next(s, 'e'), -1);
  EXPECT_GE(d.Next(s, 'c'), 0);
  EXPECT_EQ(d.Walk(d.start(), "y"), -1);
  for (int32_t st = 0; st < d.num_states(); ++st) EXPECT_TRUE(d.IsAccepting(st) || d.HasTransitions(st));
}

TEST(ByteDfaTest, StatesThatCannotAcceptAreDropped) {
  // [^\d\D] matches nothing, so "a" leads nowhere: the DFA keeps only the states of "c" (found by
  // the fuzzer: the state after "a" stayed in the table with no transitions and no match).
  // The second is the fuzzer's input (tests/fuzz/regressions/structured_schema), NUL byte included.
  const std::string fuzzed("\x01[^\\do\0ne{.\x1e+@[a\\DDDD3]om|(g)", 29);
  for (const std::string& pattern : {std::string("a[^\\d\\D]b|c"), fuzzed}) {
    SCOPED_TRACE(pattern);
    const ByteDfa d = MustCompile(pattern);
    EXPECT_EQ(d.num_states(), 2);
    for (int32_t st = 0; st < d.num_states(); ++st) EXPECT_TRUE(d.IsAccepting(st) || d.HasTransitions(st));
    EXPECT_EQ(d.Next(d.start(), static_cast<uint8_t>(pattern[0])), -1);
  }
  const ByteDfa d = MustCompile("a[^\\d\\D]b|c");
  EXPECT_TRUE(d.FullMatch("c"));
  EXPECT_FALSE(d.FullMatch("a"));
  EXPECT_THAT(ByteDfa::Compile("[^\\d\\D]").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("matches no text")));
}

TEST(ByteDfaTest, RejectsUnsupportedSyntaxNamingIt) {
  EXPECT_THAT(ByteDfa::Compile(R"((a)\1)"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("backreference")));
  EXPECT_THAT(ByteDfa::Compile("(?=a)"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lookaround")));
  EXPECT_THAT(ByteDfa::Compile("(ab"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unbalanced")));
  EXPECT_THAT(ByteDfa::Compile("ab)"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unbalanced")));
  EXPECT_THAT(ByteDfa::Compile("*a"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("quantifier")));
  EXPECT_THAT(ByteDfa::Compile("[abc"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unterminated")));
  EXPECT_THAT(ByteDfa::Compile("a{3,2}"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n < m")));
  EXPECT_THAT(ByteDfa::Compile("a{5000}"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("repetition count")));
  EXPECT_THAT(ByteDfa::Compile("[^\\x00-\\x{10}]"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hex")));
  EXPECT_THAT(ByteDfa::Compile("a^b"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("anchor")));
}

TEST(ByteDfaTest, LimitsAreErrorsNotCrashes) {
  EXPECT_THAT(ByteDfa::Compile("(a{1000}){1000}"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too complex")));
  DfaLimits small{.max_dfa_states = 10};
  EXPECT_THAT(ByteDfa::Compile("[ab]*a[ab]{8}", small), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("DFA")));
  EXPECT_THAT(ByteDfa::Compile("[^\\x00-\\x{7f}\\x80-\\xff]"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST(ByteDfaTest, EmptyPatternMatchesOnlyEmptyText) {
  const ByteDfa d = MustCompile("");
  EXPECT_TRUE(d.FullMatch(""));
  EXPECT_FALSE(d.FullMatch("a"));
  EXPECT_FALSE(d.HasTransitions(d.start()));
}

}  // namespace
}  // namespace shardserve::structured
