// CUDA vs CPU parity of the MoE ops: MoeRoute's experts, grouped rows and offsets (exactly) and
// weights (to expf's rounding) over every scoring rule, and GroupedLinear against a Linear per
// group. Skips without a device (label gpu).
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "tests/worker/kernels/cuda/cuda_parity_fixture.h"
#include "worker/kernels/backend.h"

namespace shardserve::kernels {
namespace {

struct MoeRouteCase {
  const char* name;
  MoeRouting routing;
  bool bias;
};

// Random logits and a batch of each size (none, decode, a prefill chunk, a long prefill) through
// both backends; then a batch of tied logits (values from {-1, 0, 0.5, 1}), where only the tie rule
// (lower expert first) separates the choices.
TEST_F(CudaParityTest, MoeRouteGroupsTheCpuChoices) {
  EXPECT_TRUE(backend(kGpu).SupportsOp(Op::kMoeRoute, DType::kF32));
  using S = MoeRouteScoring;
  const MoeRouteCase cases[] = {
      {"mixtral", {.scoring = S::kSoftmaxTopK, .num_experts = 8, .top_k = 2}, false},
      {"qwen3_moe", {.scoring = S::kSoftmaxTopK, .num_experts = 128, .top_k = 8, .renormalize = false}, false},
      {"llama4", {.scoring = S::kSigmoidTopK, .num_experts = 16, .top_k = 1}, false},
      {"deepseek_v3",
       {.scoring = S::kSigmoidGrouped, .num_experts = 256, .top_k = 8, .n_group = 8, .topk_group = 4,
        .renormalize = true, .scaling = 2.5f},
       true},
      {"deepseek_v2",
       {.scoring = S::kSoftmaxGroupLimited, .num_experts = 160, .top_k = 6, .n_group = 8, .topk_group = 3,
        .scaling = 16.0f},
       false},
      {"deepseek_v2_lite",
       {.scoring = S::kSoftmaxGroupLimited, .num_experts = 64, .top_k = 6, .n_group = 1, .topk_group = 1}, false},
  };
  const float tie_values[] = {-1.f, 0.f, 0.5f, 1.f};
  for (const MoeRouteCase& c : cases) {
    const MoeRouting& r = c.routing;
    for (const int64_t tokens : {int64_t{0}, int64_t{1}, int64_t{37}, int64_t{2048}}) {
      for (const bool ties : {false, true}) {
        SCOPED_TRACE(std::string(c.name) + " tokens " + std::to_string(tokens) + (ties ? " ties" : ""));
        std::vector<float> logits = RandomFloats(static_cast<size_t>(tokens * r.num_experts),
                                                 static_cast<uint32_t>(tokens + r.num_experts), -4.0f, 4.0f);
        for (size_t i = 0; i < logits.size(); ++i) {
          // On a grid of 1/64: distinct logits are far apart beyond expf's rounding (which differs
          // between the backends by an ulp or two), so only equal logits tie, on both alike.
          logits[i] = ties ? tie_values[(i * 7 + i / 3) % 4] : std::round(logits[i] * 64.0f) / 64.0f;
        }
        auto dlogits = Mirror(logits);
        auto dbias = Mirror(RandomFloats(static_cast<size_t>(r.num_experts), 5, -0.1f, 0.1f));
        const size_t n = static_cast<size_t>(tokens * r.top_k);
        auto offsets = Mirror(std::vector<int32_t>(static_cast<size_t>(r.num_experts + 1), -7));
        auto rows = Mirror(std::vector<int32_t>(n, -7));
        auto scales = Mirror(std::vector<float>(n, NAN));
        std::vector<int32_t> host_offsets[kSides];
        RunBoth([&](Backend& b, int s) {
          host_offsets[s].assign(static_cast<size_t>(r.num_experts + 1), -7);
          return b.MoeRoute({.logits = dlogits.at(s),
                             .score_bias = c.bias ? dbias.at(s) : nullptr,
                             .offsets = offsets.at(s),
                             .rows = rows.at(s),
                             .scales = scales.at(s),
                             .host_offsets = host_offsets[s].data(),
                             .tokens = tokens,
                             .routing = r});
        });
        const std::vector<int32_t> want_offsets = Read(offsets, kRef);
        EXPECT_EQ(want_offsets.back(), static_cast<int32_t>(n));
        EXPECT_EQ(Read(offsets, kGpu), want_offsets);
        EXPECT_EQ(host_offsets[kGpu], want_offsets);
        EXPECT_EQ(host_offsets[kRef], want_offsets);
        EXPECT_EQ(Read(rows, kGpu), Read(rows, kRef));
        if (n > 0) ExpectMirrorsClose(scales, 1e-5f, 1e-10);
      }
    }
  }
}

// GroupedLinear (one cublasGemmGroupedBatchedEx) against a Linear per group on the CPU: experts of
// uneven row counts, an empty one, rows in no group (left alone), with and without accumulate, at a
// decode-like and a prefill-like row count.
TEST_F(CudaParityTest, GroupedLinearMatchesALinearPerGroup) {
  EXPECT_TRUE(backend(kGpu).SupportsOp(Op::kGroupedLinear, DType::kF32));
  EXPECT_FALSE(backend(kGpu).SupportsOp(Op::kGroupedLinear, DType::kBF16));  // see SupportsOp
  const int64_t in = 96, out = 80, experts = 5;
  auto weights = Mirror(RandomFloats(static_cast<size_t>(experts * out * in), 40));
  for (const int64_t scale : {int64_t{1}, int64_t{23}}) {
    // Rows [0, 2s) expert 0, [2s, 2s) expert 1 (empty), [2s, 5s) expert 3, [5s, 6s) no group,
    // [6s, 9s) expert 4.
    const int64_t rows = 9 * scale;
    const std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> layout = {
        {0, {0, 2 * scale}}, {1, {2 * scale, 0}}, {3, {2 * scale, 3 * scale}}, {4, {6 * scale, 3 * scale}}};
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + (accumulate ? " accumulate" : ""));
      auto x = Mirror(RandomFloats(static_cast<size_t>(rows * in), 41));
      auto y = Mirror(RandomFloats(static_cast<size_t>(rows * out), 42));  // nonzero: accumulate and untouched rows
      std::vector<GroupedLinearParams::Group> groups;
      for (const auto& [expert, range] : layout) {
        groups.push_back({.w = weights.at(kGpu) + expert * out * in, .begin = range.first, .count = range.second});
      }
      RunBoth([&](Backend& b, int s) {
        if (s == kGpu) {
          return b.GroupedLinear({.x = x.at(s), .y = y.at(s), .groups = groups.data(),
                                  .num_groups = static_cast<int64_t>(groups.size()), .rows = rows, .in = in,
                                  .out = out, .accumulate = accumulate});
        }
        for (const auto& [expert, range] : layout) {
          if (range.second == 0) continue;
          absl::Status st = b.Linear({.x = x.at(s) + range.first * in, .w = weights.at(s) + expert * out * in,
                                      .y = y.at(s) + range.first * out, .tokens = range.second, .in = in, .out = out,
                                      .accumulate = accumulate});
          if (!st.ok()) return st;
        }
        return absl::OkStatus();
      });
      ExpectMirrorsClose(y);
    }
  }
}

TEST_F(CudaParityTest, MoeRouteRejectsBadParameters) {
  auto logits = Mirror(std::vector<float>(16, 0.0f));
  auto offsets = Mirror(std::vector<int32_t>(9, 0));
  auto rows = Mirror(std::vector<int32_t>(8, 0));
  auto scales = Mirror(std::vector<float>(8, 0.0f));
  std::vector<int32_t> host(9);
  const absl::Status st = backend(kGpu).MoeRoute(
      {.logits = logits.at(kGpu), .offsets = offsets.at(kGpu), .rows = rows.at(kGpu), .scales = scales.at(kGpu),
       .host_offsets = host.data(), .tokens = 2,
       .routing = {.scoring = MoeRouteScoring::kSigmoidGrouped, .num_experts = 8, .top_k = 2, .n_group = 3}});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(backend(kGpu).Synchronize().ok());  // still healthy
}

}  // namespace
}  // namespace shardserve::kernels
