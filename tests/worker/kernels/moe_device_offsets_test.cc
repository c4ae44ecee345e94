// The device-offsets form of GroupedLinear and MoeCombine (the groups read from MoeRoute's offsets
// where they lie, for the held experts only) against their host-groups form on the CPU backend,
// bit for bit: random routings with empty experts and experts this rank does not hold; the host
// form itself against a Linear and a ScatterAddRows per expert. And the checks the CPU backend
// makes of what a device backend must trust.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "common/tensor/dtype.h"
#include "tests/testing/status_matchers.h"
#include "tests/worker/kernels/random_routing.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/registry.h"
#include "worker/kernels/shared/moe_math.h"

namespace shardserve::kernels {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;

// One trial's shapes and data: x [rows, in], the experts' [out, in] matrices (f32 or bf16), the
// held experts (every one but those = 1 mod 3, and a random few more left out).
struct Trial {
  int tokens = 0, k = 0, num_experts = 0;
  int64_t in = 0, out = 0, rows = 0;
  Routing routing;
  std::vector<float> x, y0;
  std::vector<float> w32;
  std::vector<uint16_t> w16;
  std::vector<int32_t> held;
};

Trial MakeTrial(std::mt19937& rng, int trial) {
  Trial t;
  t.tokens = 1 + static_cast<int>(rng() % 33);
  t.k = 1 + static_cast<int>(rng() % 4);
  t.num_experts = t.k + 1 + static_cast<int>(rng() % 10);
  const int used = t.k + static_cast<int>(rng() % static_cast<uint32_t>(t.num_experts - t.k + 1));
  t.in = 1 + static_cast<int64_t>(rng() % 40);
  t.out = 1 + static_cast<int64_t>(rng() % 24);
  t.routing = RandomRouting(rng, t.tokens, t.k, t.num_experts, used);
  t.rows = int64_t{t.tokens} * t.k;
  std::normal_distribution<float> value(0.0f, 1.0f);
  t.x.resize(static_cast<size_t>(t.rows * t.in));
  for (float& v : t.x) v = value(rng);
  t.y0.resize(static_cast<size_t>(t.rows * t.out));
  for (float& v : t.y0) v = value(rng);
  t.w32.resize(static_cast<size_t>(t.num_experts * t.out * t.in));
  for (float& v : t.w32) v = value(rng);
  for (float v : t.w32) t.w16.push_back(FloatToBFloat16(v));
  for (int e = 0; e < t.num_experts; ++e) {
    if (e % 3 != 1 && (trial % 2 == 0 || rng() % 4 != 0)) t.held.push_back(e);
  }
  return t;
}

WeightView ExpertWeights(const Trial& t, int e, DType dtype) {
  const int64_t at = int64_t{e} * t.out * t.in;
  return dtype == DType::kF32 ? WeightView(t.w32.data() + at) : WeightView::Bf16(t.w16.data() + at);
}

TEST(GroupedLinearDeviceOffsetsTest, EqualsTheHostGroupsBitForBit) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu, CreateBackend({}));
  std::mt19937 rng(21);
  for (int trial = 0; trial < 60; ++trial) {
    const Trial t = MakeTrial(rng, trial);
    const DType dtype = trial % 2 == 0 ? DType::kF32 : DType::kBF16;
    const bool accumulate = trial % 3 == 2;
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " tokens " << t.tokens << " k " << t.k << " experts "
                                      << t.num_experts << " held " << t.held.size() << " " << DTypeName(dtype));
    ASSERT_EQ(cpu->MaxDeviceGroupRows(dtype) >= t.tokens, true);
    // The host form: the held experts with rows.
    std::vector<GroupedLinearParams::Group> groups;
    std::vector<WeightView> weights;
    std::vector<const void*> table;
    for (int32_t e : t.held) {
      const int32_t begin = t.routing.offsets[static_cast<size_t>(e)];
      const int32_t count = t.routing.offsets[static_cast<size_t>(e + 1)] - begin;
      weights.push_back(ExpertWeights(t, e, dtype));
      table.push_back(weights.back().data);
      if (count > 0) groups.push_back({.w = weights.back(), .begin = begin, .count = count});
    }
    std::vector<float> host_y = t.y0;
    ASSERT_THAT(cpu->GroupedLinear({.x = t.x.data(), .y = host_y.data(), .groups = groups.data(),
                                    .num_groups = static_cast<int64_t>(groups.size()), .rows = t.rows, .in = t.in,
                                    .out = t.out, .accumulate = accumulate}),
                IsOk());
    // The host form is a Linear per group (the engine's per-expert loop).
    std::vector<float> loop_y = t.y0;
    for (const GroupedLinearParams::Group& g : groups) {
      ASSERT_THAT(cpu->Linear({.x = t.x.data() + g.begin * t.in, .w = g.w, .y = loop_y.data() + g.begin * t.out,
                               .tokens = g.count, .in = t.in, .out = t.out, .accumulate = accumulate}),
                  IsOk());
    }
    ASSERT_EQ(host_y, loop_y);
    // The device form over the same offsets.
    std::vector<float> device_y = t.y0;
    const GroupedLinearParams p{.x = t.x.data(),
                                .y = device_y.data(),
                                .rows = t.rows,
                                .in = t.in,
                                .out = t.out,
                                .accumulate = accumulate,
                                .device = {.offsets = t.routing.offsets.data(),
                                           .host_ids = t.held.data(),
                                           .ids = t.held.data(),
                                           .num_experts = t.num_experts,
                                           .num_held = static_cast<int64_t>(t.held.size()),
                                           .max_rows_per_group = t.tokens},
                                .host_weights = weights.data(),
                                .weights = table.data()};
    ASSERT_THAT(cpu->GroupedLinear(p), IsOk());
    ASSERT_EQ(device_y, host_y);  // exact, rows of no held expert untouched included
  }
}

TEST(MoeCombineDeviceOffsetsTest, EqualsTheHostGroupsAndTheScattersBitForBit) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu, CreateBackend({}));
  std::mt19937 rng(22);
  std::normal_distribution<float> value(0.0f, 3.0f);
  for (int trial = 0; trial < 60; ++trial) {
    const Trial t = MakeTrial(rng, trial);
    const int64_t width = t.out;
    const bool unit_scales = trial % 4 == 3;  // Llama-4: the weights scaled the inputs
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " tokens " << t.tokens << " k " << t.k << " experts "
                                      << t.num_experts << " held " << t.held.size());
    std::vector<float> src(static_cast<size_t>(t.rows * width)), dst(static_cast<size_t>(t.tokens * width));
    for (float& v : src) v = value(rng);
    for (float& v : dst) v = value(rng);
    const std::vector<int32_t>& off = t.routing.offsets;
    std::vector<GroupedLinearParams::Group> groups;
    for (int32_t e : t.held) {
      groups.push_back({.begin = off[static_cast<size_t>(e)],
                        .count = off[static_cast<size_t>(e + 1)] - off[static_cast<size_t>(e)]});
    }
    // The independent reference: a ScatterAddRows per held expert.
    const std::vector<float> ones(static_cast<size_t>(t.rows), 1.0f);
    std::vector<float> want = dst;
    for (const GroupedLinearParams::Group& g : groups) {
      if (g.count == 0) continue;
      ASSERT_THAT(cpu->ScatterAddRows({.src = src.data() + g.begin * width,
                                       .rows = t.routing.rows.data() + g.begin,
                                       .scales = unit_scales ? ones.data() : t.routing.scales.data() + g.begin,
                                       .dst = want.data(),
                                       .count = g.count,
                                       .dst_rows = t.tokens,
                                       .width = width}),
                  IsOk());
    }
    const MoeCombineParams base{.src = src.data(), .rows = t.routing.rows.data(),
                                .scales = unit_scales ? nullptr : t.routing.scales.data(), .count = t.rows,
                                .tokens = t.tokens, .width = width};
    std::vector<float> host_dst = dst;
    MoeCombineParams host = base;
    host.dst = host_dst.data();
    host.groups = groups.data();
    host.num_groups = static_cast<int64_t>(groups.size());
    ASSERT_THAT(cpu->MoeCombine(host), IsOk());
    ASSERT_EQ(host_dst, want);
    std::vector<float> device_dst = dst;
    MoeCombineParams device = base;
    device.dst = device_dst.data();
    device.device = {.offsets = off.data(), .host_ids = t.held.data(), .ids = t.held.data(),
                     .num_experts = t.num_experts, .num_held = static_cast<int64_t>(t.held.size()),
                     .max_rows_per_group = t.tokens};
    ASSERT_THAT(cpu->MoeCombine(device), IsOk());
    ASSERT_EQ(device_dst, want);
  }
}

// Two experts over three rows: expert 0 rows [0, 2), expert 1 row [2, 3).
struct Small {
  float x[6] = {1, 2, 3, 4, 5, 6};  // [3, 2]
  float y[3] = {};
  float w0[2] = {1, 1}, w1[2] = {1, -1};
  int32_t offsets[3] = {0, 2, 3};
  int32_t ids[2] = {0, 1};
  WeightView weights[2] = {WeightView(w0), WeightView(w1)};
  const void* table[2] = {w0, w1};
  GroupedLinearParams Params() {
    return {.x = x, .y = y, .rows = 3, .in = 2, .out = 1,
            .device = {.offsets = offsets, .host_ids = ids, .ids = ids, .num_experts = 2, .num_held = 2,
                       .max_rows_per_group = 2},
            .host_weights = weights, .weights = table};
  }
};

TEST(GroupedLinearDeviceOffsetsTest, ComputesTheGroupsItReads) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu, CreateBackend({}));
  Small s;
  ASSERT_THAT(cpu->GroupedLinear(s.Params()), IsOk());
  EXPECT_EQ(s.y[0], 3.0f);   // 1 + 2
  EXPECT_EQ(s.y[1], 7.0f);   // 3 + 4
  EXPECT_EQ(s.y[2], -1.0f);  // 5 - 6
}

TEST(GroupedLinearDeviceOffsetsTest, ValidateNamesWhatIsWrong) {
  auto invalid = [](const GroupedLinearParams& p, const char* what) {
    EXPECT_THAT(p.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr(what)));
  };
  Small s;
  EXPECT_THAT(s.Params().Validate(), IsOk());
  GroupedLinearParams p = s.Params();
  p.device.ids = nullptr;
  invalid(p, "null expert offsets or ids");
  p = s.Params();
  p.weights = nullptr;
  invalid(p, "null expert weights");
  p = s.Params();
  int32_t unsorted[2] = {1, 0};
  p.device.host_ids = unsorted;
  invalid(p, "must ascend");
  p = s.Params();
  p.device.num_held = 3;
  invalid(p, "num_held 3");
  p = s.Params();
  p.device.max_rows_per_group = 4;
  invalid(p, "max_rows_per_group 4");
  p = s.Params();
  const GroupedLinearParams::Group group{.w = s.w0, .begin = 0, .count = 1};
  p.groups = &group;
  p.num_groups = 1;
  invalid(p, "host groups given with device offsets");
  const uint16_t narrow[2] = {0, 0};
  s.weights[1] = WeightView::Bf16(narrow);
  invalid(s.Params(), "expert 1 has BF16 weights");
}

// What a device backend must trust, the CPU backend checks (its "device" memory is host memory).
TEST(GroupedLinearDeviceOffsetsTest, TheCpuBackendChecksTheOffsetsAndTables) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu, CreateBackend({}));
  auto invalid = [&](const GroupedLinearParams& p, const char* what) {
    EXPECT_THAT(cpu->GroupedLinear(p), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr(what)));
  };
  Small s;
  GroupedLinearParams p = s.Params();
  p.device.max_rows_per_group = 1;  // expert 0 has 2 rows
  invalid(p, "above max_rows_per_group 1");
  Small decreasing;
  decreasing.offsets[2] = 4;
  invalid(decreasing.Params(), "outside [0, 3]");
  decreasing.offsets[1] = 3;
  decreasing.offsets[2] = 2;
  invalid(decreasing.Params(), "decrease after expert 1");
  Small swapped;
  swapped.table[0] = swapped.w1;
  invalid(swapped.Params(), "device weight table of expert 0");
  Small ids;
  int32_t other[2] = {0, 0};
  GroupedLinearParams q = ids.Params();
  q.device.ids = other;
  invalid(q, "device expert id 1 is 0, not 1");
}

TEST(MoeCombineDeviceOffsetsTest, ValidateNamesWhatIsWrong) {
  float src[2] = {1, 2}, dst[2] = {};
  int32_t rows[2] = {0, 1}, offsets[3] = {0, 1, 2}, ids[1] = {1};
  MoeCombineParams p{.src = src, .rows = rows, .dst = dst, .count = 2, .tokens = 2, .width = 1,
                     .device = {.offsets = offsets, .host_ids = ids, .ids = ids, .num_experts = 2, .num_held = 1,
                                .max_rows_per_group = 1}};
  EXPECT_THAT(p.Validate(), IsOk());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> cpu, CreateBackend({}));
  ASSERT_THAT(cpu->MoeCombine(p), IsOk());
  EXPECT_EQ(dst[0], 0.0f);  // expert 0 is not held
  EXPECT_EQ(dst[1], 2.0f);
  p.device.num_experts = 0;
  EXPECT_THAT(p.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("num_experts")));
  p.device.num_experts = 2;
  p.device.host_ids = nullptr;
  EXPECT_THAT(p.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("null expert")));
}

}  // namespace
}  // namespace shardserve::kernels
