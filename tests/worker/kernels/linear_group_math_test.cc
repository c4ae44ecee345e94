// LocateGroupRow (kernels/shared/linear_group_math.h), the row lookup of CUDA's group GEMVs: every
// index of the joint row space maps to the part and row an enumeration of the parts' rows gives,
// parts of 0 rows included.
#include "worker/kernels/shared/linear_group_math.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace shardserve::kernels {
namespace {

// (part, row) of every row of the group, part after part.
std::vector<std::pair<int, int64_t>> Enumerate(const std::vector<int64_t>& out) {
  std::vector<std::pair<int, int64_t>> rows;
  for (size_t p = 0; p < out.size(); ++p) {
    for (int64_t r = 0; r < out[p]; ++r) rows.emplace_back(static_cast<int>(p), r);
  }
  return rows;
}

void ExpectLocatesEveryRow(const std::vector<int64_t>& out) {
  const std::vector<std::pair<int, int64_t>> expected = Enumerate(out);
  for (size_t i = 0; i < expected.size(); ++i) {
    const GroupRow got = LocateGroupRow(out.data(), static_cast<int>(out.size()), static_cast<int64_t>(i));
    EXPECT_EQ(got.part, expected[i].first) << "index " << i;
    EXPECT_EQ(got.row, expected[i].second) << "index " << i;
  }
}

TEST(LinearGroupMathTest, OnePartIsTheIdentity) { ExpectLocatesEveryRow({37}); }

TEST(LinearGroupMathTest, QkvLikePartsOfDifferentSizes) { ExpectLocatesEveryRow({300, 65, 65}); }

TEST(LinearGroupMathTest, PartsOfNoRowsHoldNoIndex) {
  ExpectLocatesEveryRow({0, 5, 0, 3});
  ExpectLocatesEveryRow({4, 0, 0, 1});
  ExpectLocatesEveryRow({2, 1, 3, 0});
}

TEST(LinearGroupMathTest, FourPartsOfOneRowEach) { ExpectLocatesEveryRow({1, 1, 1, 1}); }

}  // namespace
}  // namespace shardserve::kernels
