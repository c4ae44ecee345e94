// The MoE combine's shared math (kernels/shared/moe_math.h: FindGroupedRow, TokenGroupedRows,
// CombineElement), which the CUDA MoeCombine kernel runs, against the CPU backend's ScatterAddRows
// run once per expert (the engine's path it replaces): bit for bit, on routings MoeRoute lays out.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "tests/testing/status_matchers.h"
#include "tests/worker/kernels/random_routing.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/registry.h"
#include "worker/kernels/shared/moe_math.h"

namespace shardserve::kernels {
namespace {

using ::shardserve::testing::IsOk;

TEST(FindGroupedRowTest, FindsTheTokensRowOrNone) {
  // Expert 0: tokens {1, 3}; expert 1: none; expert 2: tokens {0, 2, 3, 7}.
  const std::vector<int32_t> rows = {1, 3, 0, 2, 3, 7};
  const GroupRange e0{0, 2}, e1{2, 0}, e2{2, 4};
  EXPECT_EQ(FindGroupedRow(rows.data(), e0, 1), 0);
  EXPECT_EQ(FindGroupedRow(rows.data(), e0, 3), 1);
  EXPECT_EQ(FindGroupedRow(rows.data(), e0, 0), -1);
  EXPECT_EQ(FindGroupedRow(rows.data(), e0, 2), -1);
  EXPECT_EQ(FindGroupedRow(rows.data(), e0, 9), -1);
  EXPECT_EQ(FindGroupedRow(rows.data(), e1, 0), -1);
  EXPECT_EQ(FindGroupedRow(rows.data(), e2, 0), 2);
  EXPECT_EQ(FindGroupedRow(rows.data(), e2, 7), 5);
  EXPECT_EQ(FindGroupedRow(rows.data(), e2, 5), -1);
  const GroupRange groups[] = {e0, e1, e2};
  int32_t found[3] = {-9, -9, -9};
  ASSERT_EQ(TokenGroupedRows(rows.data(), groups, 3, 3, found), 2);
  EXPECT_EQ(found[0], 1);  // expert 0 first: the scatters' order
  EXPECT_EQ(found[1], 4);
  EXPECT_EQ(TokenGroupedRows(rows.data(), groups, 3, 5, found), 0);
}

TEST(MoeCombineMathTest, EqualsAScatterAddRowsPerExpertBitForBit) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu, CreateBackend({}));
  std::mt19937 rng(16);
  std::normal_distribution<float> value(0.0f, 3.0f);
  for (int trial = 0; trial < 40; ++trial) {
    const int tokens = 1 + static_cast<int>(rng() % 50), k = 1 + static_cast<int>(rng() % 6);
    const int num_experts = k + static_cast<int>(rng() % 12);
    const int64_t width = 1 + static_cast<int64_t>(rng() % 37);
    const bool unit_scales = trial % 4 == 3;  // Llama-4: weights applied to the inputs
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " tokens " << tokens << " k " << k << " experts "
                                      << num_experts << " width " << width);
    const Routing r = RandomRouting(rng, tokens, k, num_experts);
    const int64_t count = int64_t{tokens} * k;
    std::vector<float> src(static_cast<size_t>(count * width)), dst(static_cast<size_t>(tokens * width));
    for (float& v : src) v = value(rng);
    for (float& v : dst) v = value(rng);
    // This rank's experts: every one but those = 1 mod 3 (another rank's or a remote worker's).
    std::vector<GroupRange> local;
    for (int e = 0; e < num_experts; ++e) {
      if (e % 3 != 1) local.push_back({r.offsets[static_cast<size_t>(e)], r.offsets[static_cast<size_t>(e + 1)] -
                                                                             r.offsets[static_cast<size_t>(e)]});
    }
    const std::vector<float> ones(static_cast<size_t>(count), 1.0f);
    std::vector<float> want = dst;
    for (const GroupRange& g : local) {
      if (g.count == 0) continue;
      ASSERT_THAT(cpu->ScatterAddRows({.src = src.data() + int64_t{g.begin} * width,
                                     .rows = r.rows.data() + g.begin,
                                     .scales = unit_scales ? ones.data() : r.scales.data() + g.begin,
                                     .dst = want.data(),
                                     .count = g.count,
                                     .dst_rows = tokens,
                                     .width = width}),
                  IsOk());
    }
    std::vector<float> got = dst;
    std::vector<int32_t> found(local.size());
    int most = 0;
    for (int t = 0; t < tokens; ++t) {
      const int n = TokenGroupedRows(r.rows.data(), local.data(), static_cast<int>(local.size()), t, found.data());
      most = std::max(most, n);
      ASSERT_LE(n, k);
      for (int64_t e = 0; e < width; ++e) {
        float& d = got[static_cast<size_t>(t * width + e)];
        d = CombineElement(d, src.data(), unit_scales ? nullptr : r.scales.data(), found.data(), n, width, e);
      }
    }
    EXPECT_GT(most, 0);
    ASSERT_EQ(got, want);  // exact: the same products and sums in the same order
  }
}

TEST(MoeCombineMathTest, GemvTilesCoverAGroupOnce) {
  for (int32_t count = 0; count <= 40; ++count) {
    int32_t covered = 0;
    for (int32_t t = 0; t < GemvTiles(count, 8); ++t) {
      const int32_t rows = GemvTileRows(count, 8, t);
      EXPECT_GE(rows, 1);
      EXPECT_LE(rows, 8);
      covered += rows;
    }
    EXPECT_EQ(covered, count);
  }
}

TEST(MoeCombineParamsTest, ValidateNamesTheBadGroup) {
  float src = 0, dst = 0;
  int32_t rows = 0;
  const GroupedLinearParams::Group groups[] = {{.begin = 0, .count = 1}, {.begin = 0, .count = 1}};
  MoeCombineParams p{.src = &src, .rows = &rows, .dst = &dst, .groups = groups, .num_groups = 1, .count = 1,
                     .tokens = 1, .width = 1};
  EXPECT_THAT(p.Validate(), IsOk());
  p.num_groups = 2;
  EXPECT_EQ(p.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.Validate().message().find("group 1"), absl::string_view::npos) << p.Validate();
  p.num_groups = 1;
  p.count = 0;
  EXPECT_NE(p.Validate().message().find("outside"), absl::string_view::npos) << p.Validate();
  p.count = 1;
  p.dst = &src;
  EXPECT_EQ(p.Validate().code(), absl::StatusCode::kInvalidArgument);
  // The CPU backend leaves the combine to the engine's scatters, but runs it when asked.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu, CreateBackend({}));
  EXPECT_FALSE(cpu->SupportsOp(Op::kMoeCombine, DType::kF32));
  p.dst = &dst;
  src = 2.0f;
  EXPECT_THAT(cpu->MoeCombine(p), IsOk());
  EXPECT_EQ(dst, 2.0f);  // 0 + 1 x 2 (scales null: weight 1)
}

}  // namespace
}  // namespace shardserve::kernels
