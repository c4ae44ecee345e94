#include "common/tokenizer/utf8.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;

const std::string kR(kUtf8Replacement);

TEST(ValidateUtf8Test, AcceptsWellFormedText) {
  for (const char* s : {"", "plain ascii", "caf\xC3\xA9", "\xE4\xB8\xAD\xE6\x96\x87", "\xF0\x9F\x98\x80",
                        "\xF4\x8F\xBF\xBF" /* U+10FFFF */, "\xEE\x80\x80" /* U+E000 */, "\x00\x7F"}) {
    EXPECT_TRUE(ValidateUtf8(s).ok()) << s;
  }
}

TEST(ValidateUtf8Test, RejectsMalformedTextNamingTheOffset) {
  const struct {
    std::string text;
    const char* expected;
  } cases[] = {
      {"ab\x80", "byte 0x80 at byte offset 2 cannot start a character"},    // lone continuation byte
      {"\xC0\x80", "byte 0xC0 at byte offset 0 cannot start a character"},  // overlong NUL
      {"\xE0\x80\x80", "starting at byte offset 0 (0xE0) is broken by byte 0x80 at byte offset 1"},      // overlong
      {"\xED\xA0\x80", "starting at byte offset 0 (0xED) is broken by byte 0xA0 at byte offset 1"},      // surrogate
      {"\xF4\x90\x80\x80", "starting at byte offset 0 (0xF4) is broken by byte 0x90 at byte offset 1"},  // > U+10FFFF
      {"\xF5\x80\x80\x80", "byte 0xF5 at byte offset 0 cannot start a character"},
      {"x\xE4\xB8", "starting at byte offset 1 (0xE4) is truncated by the end of the text"},
      {"\xE4\xB8x", "starting at byte offset 0 (0xE4) is broken by byte 0x78 at byte offset 2"},
  };
  for (const auto& c : cases) {
    absl::Status st = ValidateUtf8(c.text);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr(c.expected));
  }
}

TEST(Utf8LossyTest, ReplacesMaximalSubparts) {
  // The examples of Unicode's "U+FFFD substitution of maximal subparts" (as Python's
  // bytes.decode("utf-8", "replace") and Rust's String::from_utf8_lossy do).
  EXPECT_EQ(Utf8Lossy("a\xE4\xB8z"), "a" + kR + "z");
  EXPECT_EQ(Utf8Lossy("\xC0\xAF"), kR + kR);
  EXPECT_EQ(Utf8Lossy("\xED\xA0\x80"), kR + kR + kR);
  EXPECT_EQ(Utf8Lossy("\xF0\x9F\x98"), kR);
  EXPECT_EQ(Utf8Lossy("\xF0\x9F\x98\x80\xFF"), "\xF0\x9F\x98\x80" + kR);
}

TEST(Utf8StreamAssemblerTest, HoldsIncompleteCharacters) {
  Utf8StreamAssembler a(InvalidUtf8Policy::kMaximalSubpart);
  std::string out;
  a.Append("x\xF0\x9F", &out);
  EXPECT_EQ(out, "x");
  EXPECT_TRUE(a.has_pending());
  a.Append("\x98", &out);
  EXPECT_EQ(out, "x");
  a.Append("\x80y", &out);
  EXPECT_EQ(out, "x\xF0\x9F\x98\x80y");
  EXPECT_FALSE(a.has_pending());
}

TEST(Utf8StreamAssemblerTest, PoliciesDifferOnTruncatedSequences) {
  std::string per_byte;
  Utf8StreamAssembler a(InvalidUtf8Policy::kPerByte);
  a.Append("\xE4\xB8", &per_byte);
  a.Append("z", &per_byte);
  EXPECT_EQ(per_byte, kR + kR + "z");

  std::string subpart;
  Utf8StreamAssembler b(InvalidUtf8Policy::kMaximalSubpart);
  b.Append("\xE4\xB8", &subpart);
  b.Append("z", &subpart);
  EXPECT_EQ(subpart, kR + "z");
}

TEST(Utf8StreamAssemblerTest, BreakEndsARun) {
  std::string out;
  Utf8StreamAssembler a(InvalidUtf8Policy::kPerByte);
  a.Append("\xE4", &out);
  a.Break(&out);
  a.Append("\xB8\xAD", &out);  // would have completed U+4E2D without the break
  EXPECT_EQ(out, kR + kR + kR);
}

}  // namespace
}  // namespace shardserve
