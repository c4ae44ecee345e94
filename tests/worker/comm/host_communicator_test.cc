#include "worker/comm/host/host_communicator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "tests/testing/status_matchers.h"

namespace shardserve::comm {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

// Runs fn(rank, comm) on one thread per rank and joins them.
template <typename F>
void OnRanks(std::vector<std::unique_ptr<Communicator>>& comms, F fn) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r) threads.emplace_back([&, r] { fn(static_cast<int>(r), *comms[r]); });
  for (auto& t : threads) t.join();
}

class HostCommTest : public ::testing::TestWithParam<int> {};

TEST_P(HostCommTest, AllReduceSumsInRankOrderAndEveryRankGetsTheSameBits) {
  const int n = GetParam();
  ASSERT_OK_AND_ASSIGN(auto comms, CreateHostGroup(n));
  const size_t count = 1003;  // not a multiple of the rank count
  std::vector<std::vector<float>> data(static_cast<size_t>(n), std::vector<float>(count));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) data[static_cast<size_t>(r)][i] = 0.1f * static_cast<float>(r + 1) + 1e-7f * i;
  }
  std::vector<float> expected(count, 0.f);
  for (size_t i = 0; i < count; ++i) {
    for (int r = 0; r < n; ++r) expected[i] += data[static_cast<size_t>(r)][i];  // rank order
  }
  for (int round = 0; round < 50; ++round) {
    auto local = data;
    OnRanks(comms, [&](int r, Communicator& c) { ASSERT_TRUE(c.AllReduceSum(local[static_cast<size_t>(r)].data(), count).ok()); });
    for (int r = 0; r < n; ++r) ASSERT_EQ(local[static_cast<size_t>(r)], expected) << "round " << round << " rank " << r;
  }
}

TEST_P(HostCommTest, AllGatherReduceScatterBroadcastBarrier) {
  const int n = GetParam();
  ASSERT_OK_AND_ASSIGN(auto comms, CreateHostGroup(n));
  const size_t count = 7;
  std::vector<std::vector<float>> gathered(static_cast<size_t>(n)), scattered(static_cast<size_t>(n)),
      bcast(static_cast<size_t>(n));
  OnRanks(comms, [&](int r, Communicator& c) {
    std::vector<float> mine(count, static_cast<float>(r));
    auto& g = gathered[static_cast<size_t>(r)];
    g.resize(count * static_cast<size_t>(n));
    ASSERT_TRUE(c.AllGather(mine.data(), g.data(), count).ok());
    std::vector<float> send(count * static_cast<size_t>(n));
    for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>(i);
    auto& s = scattered[static_cast<size_t>(r)];
    s.resize(count);
    ASSERT_TRUE(c.ReduceScatterSum(send.data(), s.data(), count).ok());
    auto& b = bcast[static_cast<size_t>(r)];
    b.assign(count, static_cast<float>(r * 10));
    ASSERT_TRUE(c.Broadcast(b.data(), count, n - 1).ok());
    ASSERT_TRUE(c.Barrier().ok());
  });
  for (int r = 0; r < n; ++r) {
    for (int k = 0; k < n; ++k) {
      for (size_t i = 0; i < count; ++i) {
        EXPECT_EQ(gathered[static_cast<size_t>(r)][static_cast<size_t>(k) * count + i], static_cast<float>(k));
      }
    }
    for (size_t i = 0; i < count; ++i) {
      EXPECT_EQ(scattered[static_cast<size_t>(r)][i], static_cast<float>(n * (static_cast<size_t>(r) * count + i)));
      EXPECT_EQ(bcast[static_cast<size_t>(r)][i], static_cast<float>((n - 1) * 10));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, HostCommTest, ::testing::Values(1, 2, 3, 4));

TEST(HostCommAbortTest, AbortReleasesRanksWaitingForAPeer) {
  ASSERT_OK_AND_ASSIGN(auto comms, CreateHostGroup(3));
  std::vector<absl::Status> results(2);
  std::vector<std::thread> waiting;
  for (int r = 0; r < 2; ++r) {
    waiting.emplace_back([&, r] {
      std::vector<float> x(4, 1.f);
      results[static_cast<size_t>(r)] = comms[static_cast<size_t>(r)]->AllReduceSum(x.data(), x.size());
    });
  }
  // Rank 2 fails instead of joining the collective.
  comms[2]->Abort(absl::InternalError("rank 2 ran out of memory"));
  for (auto& t : waiting) t.join();
  for (const auto& st : results) {
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kAborted, HasSubstr("rank 2 ran out of memory")));
  }
  std::vector<float> x(4);
  EXPECT_THAT(comms[0]->AllReduceSum(x.data(), x.size()), StatusIs(absl::StatusCode::kAborted, HasSubstr("rank 2")));
}

TEST(HostCommTest, RejectsBadSizesAndRoots) {
  EXPECT_THAT(CreateHostGroup(0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("group size")));
  ASSERT_OK_AND_ASSIGN(auto comms, CreateHostGroup(1));
  float x = 1.f;
  EXPECT_THAT(comms[0]->Broadcast(&x, 1, 3), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("root 3")));
}

}  // namespace
}  // namespace shardserve::comm
