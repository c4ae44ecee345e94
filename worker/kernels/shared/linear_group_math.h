// The joint row index space of a group of Linear products (LinearGroupParams' parts, one launch of
// a group GEMV): part 0's rows first, then part 1's, and so on. SHARDSERVE_HD, allocates nothing
// and has no failure mode; the CPU test (tests/worker/kernels/linear_group_math_test.cc) checks it
// against an enumeration of the parts' rows.
#ifndef SHARDSERVE_WORKER_KERNELS_SHARED_LINEAR_GROUP_MATH_H_
#define SHARDSERVE_WORKER_KERNELS_SHARED_LINEAR_GROUP_MATH_H_

#include <cstdint>

#include "worker/kernels/shared/row_math.h"  // SHARDSERVE_HD

namespace shardserve::kernels {

// A row of one part of a group.
struct GroupRow {
  int part = 0;
  int64_t row = 0;  // within the part, in [0, out[part])
};

// The part and the row within it of row r of the joint index space of `parts` (>= 1) parts of
// out[0..parts) rows. Parts of 0 rows hold no index. r must lie in [0, sum of out): rows past the
// end are counted in the last part.
SHARDSERVE_HD GroupRow LocateGroupRow(const int64_t* out, int parts, int64_t r) {
  int p = 0;
  while (p + 1 < parts && r >= out[p]) r -= out[p++];
  return {p, r};
}

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_SHARED_LINEAR_GROUP_MATH_H_
