#include "common/flags/parse.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace shardserve {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(FlagParseTest, ByteSizes) {
  EXPECT_EQ(*ParseByteSize("1000"), 1000);
  EXPECT_EQ(*ParseByteSize("512MiB"), 512ll << 20);
  EXPECT_EQ(*ParseByteSize("8GiB"), 8ll << 30);
  EXPECT_EQ(*ParseByteSize("80GB"), 80'000'000'000ll);
  EXPECT_EQ(*ParseByteSize("1.5KiB"), 1536);
  EXPECT_THAT(ParseByteSize("GiB"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a size")));
  EXPECT_THAT(ParseByteSize("8XB"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown unit")));
  EXPECT_THAT(ParseByteSize("99999999TiB"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too large")));
}

TEST(FlagParseTest, TokenIdLists) {
  EXPECT_THAT(*ParseTokenIdList(" 1, 2,3 ", "--ids"), ElementsAre(1, 2, 3));
  EXPECT_THAT(ParseTokenIdList("", "--ids"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--ids is empty")));
  EXPECT_THAT(ParseTokenIdList("4,-1", "--ids"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--ids element 1")));
}

}  // namespace
}  // namespace shardserve
