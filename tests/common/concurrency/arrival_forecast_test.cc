#include "common/concurrency/arrival_forecast.h"

#include <gtest/gtest.h>

#include <vector>

namespace shardserve {
namespace {

using absl::Microseconds;
using absl::Milliseconds;

ArrivalForecast::Options Polling(absl::Duration max_poll) {
  return {.max_poll = max_poll, .margin = Microseconds(100), .min_wait = Microseconds(300), .max_fraction = 0.25};
}

TEST(ArrivalForecastTest, NoPlanUntilEnoughWaitsAreSeen) {
  ArrivalForecast f(Polling(Milliseconds(1)));
  for (int i = 0; i < ArrivalForecast::kMinSamples - 1; ++i) {
    f.Record(Milliseconds(5));
    EXPECT_EQ(f.Next().poll, absl::ZeroDuration()) << "after " << i + 1 << " waits";
  }
  f.Record(Milliseconds(5));
  EXPECT_GT(f.Next().poll, absl::ZeroDuration());
}

TEST(ArrivalForecastTest, ZeroMaxPollNeverPolls) {
  ArrivalForecast f(Polling(absl::ZeroDuration()));
  for (int i = 0; i < 20; ++i) f.Record(Milliseconds(5));
  EXPECT_EQ(f.Next().poll, absl::ZeroDuration());
  EXPECT_EQ(f.Next().sleep, absl::ZeroDuration());
}

TEST(ArrivalForecastTest, SteadyWaitsArePolledAroundTheirEnd) {
  ArrivalForecast f(Polling(Milliseconds(1)));
  // 16 waits between 4.9 and 5.2 ms: the 10th percentile is 4.92 ms, the 90th 5.18 ms.
  for (int i = 0; i < 16; ++i) f.Record(Microseconds(4900 + 20 * i));
  const ArrivalForecast::Plan p = f.Next();
  EXPECT_EQ(p.sleep, Microseconds(4920 - 100));
  EXPECT_EQ(p.sleep + p.poll, Microseconds(5180 + 100));
}

TEST(ArrivalForecastTest, WideSpreadIsNarrowedToTheBudgetAroundTheMedian) {
  ArrivalForecast f(Polling(Milliseconds(1)));
  // Waits from 2 to 9.5 ms: [lo - margin, hi + margin] is far wider than the 1 ms budget.
  for (int i = 0; i < 16; ++i) f.Record(Microseconds(2000 + 500 * i));
  const ArrivalForecast::Plan p = f.Next();
  EXPECT_EQ(p.poll, Milliseconds(1));
  const absl::Duration median = Microseconds(2000 + 500 * 8);
  EXPECT_EQ(p.sleep, median - Microseconds(500));
}

TEST(ArrivalForecastTest, PollIsAtMostAFractionOfTheMedianWait) {
  ArrivalForecast f(Polling(Milliseconds(10)));
  for (int i = 0; i < 16; ++i) f.Record(Microseconds(i % 2 == 0 ? 1000 : 3000));
  const ArrivalForecast::Plan p = f.Next();
  EXPECT_EQ(p.poll, Microseconds(750));  // a quarter of the 3 ms median
  EXPECT_GE(p.sleep, Microseconds(900));  // not before the earliest likely arrival less the margin
  EXPECT_LE(p.sleep + p.poll, Microseconds(3100));
}

TEST(ArrivalForecastTest, ShortWaitsAreNotPolledFor) {
  ArrivalForecast f(Polling(Milliseconds(1)));
  for (int i = 0; i < 16; ++i) f.Record(Microseconds(150));
  EXPECT_EQ(f.Next().poll, absl::ZeroDuration());
  // One short wait among long ones is below the 10th percentile of 16 only if it is the shortest
  // two; two of them pull the low end down past min_wait.
  for (int i = 0; i < 16; ++i) f.Record(i < 2 ? Microseconds(100) : Milliseconds(5));
  EXPECT_EQ(f.Next().poll, absl::ZeroDuration());
}

TEST(ArrivalForecastTest, OnlyTheLastWaitsCount) {
  ArrivalForecast f(Polling(Milliseconds(1)));
  for (int i = 0; i < 16; ++i) f.Record(Microseconds(100));
  EXPECT_EQ(f.Next().poll, absl::ZeroDuration());
  for (int i = 0; i < ArrivalForecast::kHistory; ++i) f.Record(Milliseconds(8));
  const ArrivalForecast::Plan p = f.Next();
  EXPECT_EQ(p.sleep, Microseconds(7900));
  EXPECT_EQ(p.poll, Microseconds(200));
}

TEST(ArrivalForecastTest, NegativeWaitsCountAsZero) {
  ArrivalForecast f(Polling(Milliseconds(1)));
  for (int i = 0; i < 15; ++i) f.Record(Milliseconds(5));
  f.Record(-Milliseconds(3));
  // The zero is the shortest of 16: index 1 of the sorted waits (the 10th percentile) is 5 ms.
  EXPECT_EQ(f.Next().sleep, Microseconds(4900));
  f.Record(-Milliseconds(3));
  EXPECT_EQ(f.Next().poll, absl::ZeroDuration());  // two zeros: the low end is below min_wait
}

TEST(SleepThenPollTest, APlanWithoutAPollNeitherSleepsNorPolls) {
  int sleeps = 0, polls = 0;
  SleepThenPoll(ArrivalForecast::Plan{}, absl::Now(), absl::InfiniteFuture(), [&](absl::Time) { ++sleeps; },
                [&] { return ++polls > 0; });
  EXPECT_EQ(sleeps, 0);
  EXPECT_EQ(polls, 0);
}

TEST(SleepThenPollTest, SleepsUntilThePollIsDueThenPollsUntilReady) {
  const absl::Time start = absl::Now();
  std::vector<absl::Time> slept_until;
  int polls = 0;
  SleepThenPoll({.sleep = Milliseconds(5), .poll = absl::Seconds(60)}, start, absl::InfiniteFuture(),
                [&](absl::Time t) { slept_until.push_back(t); }, [&] { return ++polls == 3; });
  ASSERT_EQ(slept_until.size(), 1u);
  EXPECT_EQ(slept_until[0], start + Milliseconds(5));
  EXPECT_EQ(polls, 3);  // returned as soon as ready() said so, not after the minute's poll
}

TEST(SleepThenPollTest, NeitherPhaseGoesPastTheLimit) {
  const absl::Time start = absl::Now() - Milliseconds(10);
  std::vector<absl::Time> slept_until;
  int polls = 0;
  // The whole wait's deadline came before the poll was due: sleep to the deadline, poll once.
  SleepThenPoll({.sleep = absl::Seconds(60), .poll = absl::Seconds(60)}, start, start + Milliseconds(1),
                [&](absl::Time t) { slept_until.push_back(t); }, [&] { return ++polls < 0; });
  ASSERT_EQ(slept_until.size(), 1u);
  EXPECT_EQ(slept_until[0], start + Milliseconds(1));
  EXPECT_EQ(polls, 1);
}

}  // namespace
}  // namespace shardserve
