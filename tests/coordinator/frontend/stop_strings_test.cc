#include "coordinator/frontend/stop_strings.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::coordinator::frontend {
namespace {

using ::testing::HasSubstr;

// Feeds `pieces` and returns everything emitted (Finish included when no stop matched).
std::string FeedAll(std::vector<std::string> stops, const std::vector<std::string>& pieces, bool* stopped) {
  StopStringMatcher m(std::move(stops));
  std::string out;
  *stopped = false;
  for (const std::string& p : pieces) {
    StopStringMatcher::Result r = m.Feed(p);
    out += r.text;
    if (r.stopped) {
      *stopped = true;
      return out;
    }
  }
  return out + m.Finish();
}

TEST(StopStringsTest, NoStopsPassesEverythingThrough) {
  StopStringMatcher m({});
  EXPECT_EQ(m.Feed("abc").text, "abc");
  EXPECT_FALSE(m.Feed("def").stopped);
  EXPECT_EQ(m.Finish(), "");
}

TEST(StopStringsTest, MatchInsideOnePieceTruncates) {
  bool stopped = false;
  EXPECT_EQ(FeedAll({"END"}, {"hello END world"}, &stopped), "hello ");
  EXPECT_TRUE(stopped);
}

TEST(StopStringsTest, MatchAcrossPieceBoundaries) {
  bool stopped = false;
  EXPECT_EQ(FeedAll({"\n\nUser:"}, {"Hi", " there.\n", "\nUs", "er", ": next"}, &stopped), "Hi there.");
  EXPECT_TRUE(stopped);
}

TEST(StopStringsTest, HoldsBackOnlyAPossiblePrefix) {
  StopStringMatcher m({"abc"});
  StopStringMatcher::Result r = m.Feed("xxab");
  EXPECT_EQ(r.text, "xx");  // "ab" may become "abc"
  EXPECT_FALSE(r.stopped);
  r = m.Feed("d");
  EXPECT_EQ(r.text, "abd");  // it did not
  EXPECT_EQ(m.Finish(), "");
}

TEST(StopStringsTest, UnfinishedPrefixIsReleasedByFinish) {
  bool stopped = false;
  EXPECT_EQ(FeedAll({"STOP"}, {"go ST", "O"}, &stopped), "go STO");
  EXPECT_FALSE(stopped);
}

TEST(StopStringsTest, EarliestMatchWinsOverListOrder) {
  bool stopped = false;
  EXPECT_EQ(FeedAll({"world", "lo"}, {"hello world"}, &stopped), "hel");
  EXPECT_TRUE(stopped);
}

TEST(StopStringsTest, OverlappingPrefixesAreFound) {
  // "aab" inside "aaab": the first candidate start fails, a later one matches.
  bool stopped = false;
  EXPECT_EQ(FeedAll({"aab"}, {"a", "a", "a", "b", "c"}, &stopped), "a");
  EXPECT_TRUE(stopped);
}

TEST(StopStringsTest, MultiByteCharactersStayWhole) {
  StopStringMatcher m({"é!"});
  StopStringMatcher::Result r = m.Feed("café");  // "é" may start "é!"
  EXPECT_EQ(r.text, "caf");
  r = m.Feed("?");
  EXPECT_EQ(r.text, "é?");
}

TEST(StopStringsTest, NothingAfterAMatch) {
  StopStringMatcher m({"x"});
  EXPECT_TRUE(m.Feed("ax").stopped);
  StopStringMatcher::Result r = m.Feed("more");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "");
  EXPECT_EQ(m.Finish(), "");
}

TEST(StopStringsTest, IncludingTheStopEndsTheTextWithIt) {
  // Across pieces, with a possible prefix held back first.
  StopStringMatcher m({"\n\nUser:"}, /*include_stop=*/true);
  std::string out = m.Feed("Hi there.\n").text;
  EXPECT_EQ(out, "Hi there.");
  out += m.Feed("\nUs").text;
  StopStringMatcher::Result r = m.Feed("er: next");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(out + r.text, "Hi there.\n\nUser:");
  EXPECT_TRUE(m.Feed("more").text.empty());
  // The earliest match; of two at the same place, the one given first.
  StopStringMatcher earliest({"world", "lo"}, true);
  EXPECT_EQ(earliest.Feed("hello world").text, "hello");
  StopStringMatcher first({"ab", "abc"}, true);
  EXPECT_EQ(first.Feed("xxabcd").text, "xxab");
  StopStringMatcher longer({"abc", "ab"}, true);
  EXPECT_EQ(longer.Feed("xxabcd").text, "xxabc");
}

TEST(StopStringsTest, Validation) {
  EXPECT_TRUE(ValidateStopStrings({"a", "bc"}, "stop").ok());
  EXPECT_TRUE(ValidateStopStrings({}, "stop").ok());
  absl::Status empty = ValidateStopStrings({"a", ""}, "stop");
  EXPECT_THAT(empty.message(), HasSubstr("stop[1] is empty"));
  absl::Status longer = ValidateStopStrings({std::string(kMaxStopStringBytes + 1, 'x')}, "stop");
  EXPECT_THAT(longer.message(), HasSubstr("stop[0] has 257 bytes"));
  absl::Status many = ValidateStopStrings(std::vector<std::string>(kMaxStopStrings + 1, "s"), "stop");
  EXPECT_THAT(many.message(), HasSubstr("at most 16"));
}

}  // namespace
}  // namespace shardserve::coordinator::frontend
