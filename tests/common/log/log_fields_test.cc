// LogValue (common/log/fields.h): values that go on a structured log line as is, and those that
// are quoted so that they cannot break the line or fake another field.
#include "common/log/fields.h"

#include <gtest/gtest.h>

#include <string>

namespace shardserve {
namespace {

TEST(LogValueTest, PlainValuesAreWrittenAsIs) {
  EXPECT_EQ(LogValue("req-42"), "req-42");
  EXPECT_EQ(LogValue("plan-1/r0/s1/w-2"), "plan-1/r0/s1/w-2");
  EXPECT_EQ(LogValue("a.b_c:d@e+f"), "a.b_c:d@e+f");
}

TEST(LogValueTest, OtherValuesAreQuotedAndEscaped) {
  EXPECT_EQ(LogValue(""), "\"\"");
  EXPECT_EQ(LogValue("two words"), "\"two words\"");
  EXPECT_EQ(LogValue("x status=OK"), "\"x status=OK\"");
  EXPECT_EQ(LogValue("line\nbreak"), "\"line\\nbreak\"");
  EXPECT_EQ(LogValue("say \"hi\""), "\"say \\\"hi\\\"\"");
}

TEST(LogValueTest, LongValuesAreCut) {
  const std::string long_id(300, 'a');
  EXPECT_EQ(LogValue(long_id), std::string(kMaxLogValueBytes, 'a') + "...");
  const std::string long_text(300, ' ');
  EXPECT_EQ(LogValue(long_text), "\"" + std::string(kMaxLogValueBytes, ' ') + "...\"");
}

}  // namespace
}  // namespace shardserve
