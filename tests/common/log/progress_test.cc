#include "common/log/progress.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(ProgressTest, LineShowsCountsPercentRateAndEta) {
  const Progress::Options o{.what = "loading weights", .unit = "layers", .total = 80, .bytes = true};
  const std::string line = Progress::Line(o, 20, 2'000'000'000, absl::Seconds(10));
  EXPECT_THAT(line, HasSubstr("loading weights  20/80 layers"));
  EXPECT_THAT(line, HasSubstr(" 25%"));
  EXPECT_THAT(line, HasSubstr("2.00 GB"));
  EXPECT_THAT(line, HasSubstr("200.0 MB/s"));
  EXPECT_THAT(line, HasSubstr("ETA 0:30"));  // 60 layers left at 2 layers/s
  EXPECT_THAT(Progress::Line(o, 80, 8'000'000'000, absl::Seconds(65)), HasSubstr("in 1:05"));
  const Progress::Options r{.what = "bench", .unit = "requests"};  // no total: no percentage or ETA
  const std::string open = Progress::Line(r, 30, 0, absl::Seconds(3));
  EXPECT_THAT(open, HasSubstr("bench  30 requests  10.0 requests/s"));
  EXPECT_THAT(open, Not(HasSubstr("ETA")));
}

std::string Printed(bool tty, int updates) {
  char* buf = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&buf, &size);
  {
    Progress p({.what = "x", .unit = "u", .total = updates, .out = out, .tty = tty ? 1 : 0,
                .plain_interval = absl::Hours(1)});
    for (int i = 1; i <= updates; ++i) p.Update(i);
  }  // the destructor prints the final line
  std::fclose(out);
  std::string s(buf, size);
  std::free(buf);
  return s;
}

TEST(ProgressTest, TerminalsGetOneLineRewrittenOthersPlainLines) {
  const std::string tty = Printed(true, 1000);
  EXPECT_EQ(tty.front(), '\r');
  EXPECT_EQ(tty.back(), '\n');
  EXPECT_EQ(std::count(tty.begin(), tty.end(), '\n'), 1);  // one line, rewritten
  EXPECT_THAT(tty, HasSubstr("1000/1000 u"));
  // Not a terminal: the first update and the end, each on its own line (the interval is long).
  const std::string plain = Printed(false, 1000);
  EXPECT_EQ(plain.find('\r'), std::string::npos);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), '\n'), 2);
  EXPECT_THAT(plain, HasSubstr("x  1/1000 u"));
  EXPECT_THAT(plain, HasSubstr("x  1000/1000 u"));
  // One update that completes the whole: one line, not the same line again at the end.
  const std::string whole = Printed(false, 1);
  EXPECT_EQ(std::count(whole.begin(), whole.end(), '\n'), 1) << whole;
  EXPECT_THAT(whole, HasSubstr("x  1/1 u"));
}

}  // namespace
}  // namespace shardserve
