// CUDA vs CPU parity of the MoE ops: MoeRoute's experts, grouped rows and offsets (exactly) and
// weights (to expf's rounding) over every scoring rule, GroupedLinear (f32, bf16, f16) against a
// Linear per group, and MoeCombine against a ScatterAddRows per expert (exactly); their
// device-offsets forms likewise, and MoeRoute without a host copy. Skips without a
// device (label gpu).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "tests/worker/kernels/cuda/cuda_parity_fixture.h"
#include "tests/worker/kernels/random_routing.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/shared/moe_math.h"

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
  EXPECT_TRUE(backend(kGpu).SupportsOp(Op::kGroupedLinear, DType::kBF16));
  EXPECT_TRUE(backend(kGpu).SupportsOp(Op::kGroupedLinear, DType::kF16));
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

// A routing of `tokens` x `k` distinct experts of `num_experts` (random, seeded), grouped as
// MoeRoute lays it out (GroupRouting): offsets [num_experts + 1], rows and scales [tokens * k].
// `skewed`: most tokens pick among a few experts, so that some groups are large and some empty.
using GroupedRouting = Routing;
GroupedRouting RandomGroupedRouting(int64_t tokens, int k, int num_experts, uint32_t seed, bool skewed = true) {
  std::mt19937 rng(seed);
  std::vector<int32_t> experts(static_cast<size_t>(tokens * k)), all(static_cast<size_t>(num_experts));
  std::vector<float> weights(experts.size());
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.begin() + std::min(num_experts, 2 * k + 1), rng);
    if (!skewed || t % 5 == 4) std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < k; ++j) {
      experts[static_cast<size_t>(t * k + j)] = all[static_cast<size_t>(j)];
      weights[static_cast<size_t>(t * k + j)] = weight(rng);
    }
  }
  return GroupRouting(experts, weights, static_cast<int>(tokens), k, num_experts);
}

// This rank's groups of a routing: every expert but those = 2 mod 5 (another rank's or a remote
// worker's: their rows must be left alone).
std::vector<GroupedLinearParams::Group> LocalGroups(const GroupedRouting& r, const void* w, DType dtype,
                                                    int64_t matrix_elements, int64_t element_bytes) {
  std::vector<GroupedLinearParams::Group> groups;
  for (size_t e = 0; e + 1 < r.offsets.size(); ++e) {
    if (e % 5 == 2) continue;
    const void* we = static_cast<const char*>(w) + static_cast<int64_t>(e) * matrix_elements * element_bytes;
    groups.push_back({.w = WeightView(dtype, we), .begin = r.offsets[e], .count = r.offsets[e + 1] - r.offsets[e]});
  }
  return groups;
}

struct Grouped16Case {
  DType dtype;
  int64_t tokens;
  int k, experts;
  int64_t in, out;
  bool skewed = true;
};

void PrintTo(const Grouped16Case& c, std::ostream* os) {
  *os << DTypeName(c.dtype) << "_t" << c.tokens << "_k" << c.k << "_e" << c.experts << "_in" << c.in << "_out"
      << c.out << (c.skewed ? "_skewed" : "");
}

class CudaGrouped16ParityTest : public CudaParityTest, public ::testing::WithParamInterface<Grouped16Case> {};

// GroupedLinear with 16-bit experts (the grouped GEMV for groups of <= 32 rows, else rounded
// activations and a GEMM per group) against a Linear per group on the CPU with the widened
// weights, with and without accumulate; rows of no group keep their values.
TEST_P(CudaGrouped16ParityTest, MatchesALinearPerGroup) {
  const Grouped16Case c = GetParam();
  ASSERT_TRUE(backend(kGpu).SupportsOp(Op::kGroupedLinear, c.dtype));
  const GroupedRouting r =
      RandomGroupedRouting(c.tokens, c.k, c.experts, static_cast<uint32_t>(c.tokens + 3), c.skewed);
  const int64_t rows = c.tokens * c.k, matrix = c.out * c.in;
  const std::vector<uint16_t> w16 = Narrow(c.dtype, RandomFloats(static_cast<size_t>(c.experts * matrix), 50));
  auto w_wide = Mirror(Widen(c.dtype, w16));
  auto w_narrow = Mirror(w16);
  const std::vector<GroupedLinearParams::Group> groups = LocalGroups(r, w_narrow.at(kGpu), c.dtype, matrix, 2);
  int64_t largest = 0;
  for (const auto& g : groups) largest = std::max(largest, g.count);
  if (!c.skewed) {
    EXPECT_LE(largest, 32) << "the case meant for the grouped GEMV has a GEMM-sized group";
  }
  for (const bool accumulate : {false, true}) {
    SCOPED_TRACE(std::string("largest group ") + std::to_string(largest) + (accumulate ? " accumulate" : ""));
    auto x = Mirror(RandomFloats(static_cast<size_t>(rows * c.in), 51));
    auto y = Mirror(RandomFloats(static_cast<size_t>(rows * c.out), 52));
    RunBoth([&](Backend& b, int s) {
      if (s == kGpu) {
        return b.GroupedLinear({.x = x.at(s), .y = y.at(s), .groups = groups.data(),
                                .num_groups = static_cast<int64_t>(groups.size()), .rows = rows, .in = c.in,
                                .out = c.out, .accumulate = accumulate});
      }
      for (size_t e = 0, g = 0; e + 1 < r.offsets.size(); ++e) {
        if (e % 5 == 2) continue;
        const GroupedLinearParams::Group& group = groups[g++];
        if (group.count == 0) continue;
        absl::Status st = b.Linear({.x = x.at(s) + group.begin * c.in, .w = w_wide.at(s) + e * matrix,
                                    .y = y.at(s) + group.begin * c.out, .tokens = group.count, .in = c.in,
                                    .out = c.out, .accumulate = accumulate});
        if (!st.ok()) return st;
      }
      return absl::OkStatus();
    });
    if (largest <= 32) {
      ExpectMirrorsClose(y);  // f32 activations and sums: rounding only
    } else {
      ExpectMirrorsClose(y, 2e-2f, 1e-5);  // activations rounded to 16 bits for the tensor cores
    }
  }
}

// The device-offsets form (the groups read from the offsets on the device, the weights from a
// device table; experts = 2 mod 5 not held) of the same products, for the cases whose groups fit
// the grouped GEMV, against the same Linear per group on the CPU.
TEST_P(CudaGrouped16ParityTest, DeviceOffsetsMatchALinearPerGroup) {
  const Grouped16Case c = GetParam();
  const GroupedRouting r =
      RandomGroupedRouting(c.tokens, c.k, c.experts, static_cast<uint32_t>(c.tokens + 3), c.skewed);
  int64_t largest = 0;
  for (size_t e = 0; e + 1 < r.offsets.size(); ++e) {
    largest = std::max<int64_t>(largest, r.offsets[e + 1] - r.offsets[e]);
  }
  if (largest > backend(kGpu).MaxDeviceGroupRows(c.dtype)) GTEST_SKIP() << "groups beyond the grouped GEMV";
  const int64_t rows = c.tokens * c.k, matrix = c.out * c.in;
  const std::vector<uint16_t> w16 = Narrow(c.dtype, RandomFloats(static_cast<size_t>(c.experts * matrix), 50));
  auto w_wide = Mirror(Widen(c.dtype, w16));
  auto w_narrow = Mirror(w16);
  std::vector<int32_t> held;
  std::vector<WeightView> host_weights;
  std::vector<const void*> table;
  for (int e = 0; e < c.experts; ++e) {
    if (e % 5 == 2) continue;
    held.push_back(e);
    host_weights.push_back(WeightView(c.dtype, w_narrow.at(kGpu) + e * matrix));
    table.push_back(host_weights.back().data);
  }
  auto offsets = Mirror(r.offsets);
  auto ids = Mirror(held);
  auto weights = Mirror(table);
  for (const bool accumulate : {false, true}) {
    SCOPED_TRACE(std::string("largest group ") + std::to_string(largest) + (accumulate ? " accumulate" : ""));
    auto x = Mirror(RandomFloats(static_cast<size_t>(rows * c.in), 53));
    auto y = Mirror(RandomFloats(static_cast<size_t>(rows * c.out), 54));
    RunBoth([&](Backend& b, int s) {
      if (s == kGpu) {
        return b.GroupedLinear({.x = x.at(s), .y = y.at(s), .rows = rows, .in = c.in, .out = c.out,
                                .accumulate = accumulate,
                                .device = {.offsets = offsets.at(s), .host_ids = held.data(), .ids = ids.at(s),
                                           .num_experts = c.experts, .num_held = static_cast<int64_t>(held.size()),
                                           .max_rows_per_group = largest},
                                .host_weights = host_weights.data(), .weights = weights.at(s)});
      }
      for (const int32_t e : held) {
        const int64_t begin = r.offsets[static_cast<size_t>(e)];
        const int64_t count = r.offsets[static_cast<size_t>(e + 1)] - begin;
        if (count == 0) continue;
        absl::Status st = b.Linear({.x = x.at(s) + begin * c.in, .w = w_wide.at(s) + e * matrix,
                                    .y = y.at(s) + begin * c.out, .tokens = count, .in = c.in, .out = c.out,
                                    .accumulate = accumulate});
        if (!st.ok()) return st;
      }
      return absl::OkStatus();
    });
    ExpectMirrorsClose(y);  // f32 activations and sums: rounding only
  }
}

// Decode (1, 3, 7 tokens; 3 tokens over 64 experts: fewer rows than held experts, so the device
// form's block rows find their experts among 52 held ones), a prefill chunk spread thin (64 tokens
// over 160 experts: two launches of the grouped GEMV's 128-group tables), prefill groups of 33+
// rows (512, 2048 tokens); in = 256 takes the GEMV's 16-byte loads, in = 100 its scalar path; no
// tokens at all.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaGrouped16ParityTest,
                         ::testing::Values(Grouped16Case{DType::kBF16, 0, 2, 8, 256, 96},
                                           Grouped16Case{DType::kBF16, 1, 2, 8, 256, 96},
                                           Grouped16Case{DType::kF16, 7, 4, 16, 100, 40},
                                           Grouped16Case{DType::kF16, 3, 4, 64, 256, 64, false},
                                           Grouped16Case{DType::kBF16, 64, 6, 160, 256, 64, false},
                                           Grouped16Case{DType::kF16, 64, 6, 160, 256, 64, false},
                                           Grouped16Case{DType::kBF16, 512, 2, 8, 256, 96},
                                           Grouped16Case{DType::kF16, 2048, 2, 8, 100, 48},
                                           Grouped16Case{DType::kBF16, 2048, 8, 64, 256, 96}),
                         ::testing::PrintToStringParamName());

// GroupedLinear with f32 experts over more groups than one pointer-table launch holds (160
// experts): the device-built pointer arrays of the grouped GEMM cover every group.
// Reserve sizes the scratch for a MoE layer's grouped rows (every token's top_k choices), so a
// grouped GEMM of that many rows (groups above the GEMV's 32 rows: the activations rounded into
// the scratch) allocates nothing: it records into a graph, whose replay gives a Linear per group.
TEST_F(CudaParityTest, GroupedGemmOfReservedRowsIsRecordable) {
  const int64_t tokens = 96, in = 256, out = 64;
  const int k = 2, experts = 4;
  kernels::MoeRouting routing;
  routing.num_experts = experts;
  routing.top_k = k;
  ASSERT_TRUE(backend(kGpu).Reserve({.max_tokens = tokens, .max_linear_in = in, .moe_routing = routing}).ok());
  const GroupedRouting r = RandomGroupedRouting(tokens, k, experts, 7, /*skewed=*/false);
  const int64_t rows = tokens * k, matrix = out * in;
  const std::vector<uint16_t> w16 = Narrow(DType::kBF16, RandomFloats(static_cast<size_t>(experts * matrix), 8));
  auto w_wide = Mirror(Widen(DType::kBF16, w16));
  auto w_narrow = Mirror(w16);
  std::vector<GroupedLinearParams::Group> groups;
  for (int e = 0; e < experts; ++e) {
    groups.push_back({.w = WeightView(DType::kBF16, w_narrow.at(kGpu) + e * matrix), .begin = r.offsets[e],
                      .count = r.offsets[e + 1] - r.offsets[e]});
  }
  int64_t largest = 0;
  for (const auto& g : groups) largest = std::max(largest, g.count);
  ASSERT_GT(largest, 32) << "the case is meant for the GEMM path";
  auto x = Mirror(RandomFloats(static_cast<size_t>(rows * in), 9));
  auto y = Mirror(std::vector<float>(static_cast<size_t>(rows * out)));
  for (int e = 0; e < experts; ++e) {
    const GroupedLinearParams::Group& g = groups[static_cast<size_t>(e)];
    if (g.count == 0) continue;
    ASSERT_TRUE(backend(kRef)
                    .Linear({.x = x.at(kRef) + g.begin * in, .w = w_wide.at(kRef) + e * matrix,
                             .y = y.at(kRef) + g.begin * out, .tokens = g.count, .in = in, .out = out})
                    .ok());
  }
  auto graph = backend(kGpu).Capture([&] {
    return backend(kGpu).GroupedLinear({.x = x.at(kGpu), .y = y.at(kGpu), .groups = groups.data(),
                                        .num_groups = static_cast<int64_t>(groups.size()), .rows = rows, .in = in,
                                        .out = out});
  });
  ASSERT_TRUE(graph.ok()) << graph.status();
  ASSERT_TRUE((*graph)->Replay().ok());
  ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  ExpectMirrorsClose(y, 2e-2f, 1e-5);  // activations rounded to 16 bits for the tensor cores
}

TEST_F(CudaParityTest, GroupedLinearF32BuildsEveryGroupsPointers) {
  const int64_t tokens = 300, in = 64, out = 48, matrix = in * out;
  const int k = 6, experts = 160;
  const GroupedRouting r = RandomGroupedRouting(tokens, k, experts, 60);
  const int64_t rows = tokens * k;
  auto w = Mirror(RandomFloats(static_cast<size_t>(experts * matrix), 61));
  auto x = Mirror(RandomFloats(static_cast<size_t>(rows * in), 62));
  auto y = Mirror(RandomFloats(static_cast<size_t>(rows * out), 63));
  const std::vector<GroupedLinearParams::Group> groups = LocalGroups(r, w.at(kGpu), DType::kF32, matrix, 4);
  RunBoth([&](Backend& b, int s) {
    if (s == kGpu) {
      return b.GroupedLinear({.x = x.at(s), .y = y.at(s), .groups = groups.data(),
                              .num_groups = static_cast<int64_t>(groups.size()), .rows = rows, .in = in, .out = out});
    }
    for (size_t e = 0, g = 0; e + 1 < r.offsets.size(); ++e) {
      if (e % 5 == 2) continue;
      const GroupedLinearParams::Group& group = groups[g++];
      if (group.count == 0) continue;
      absl::Status st = b.Linear({.x = x.at(s) + group.begin * in, .w = w.at(s) + e * matrix,
                                  .y = y.at(s) + group.begin * out, .tokens = group.count, .in = in, .out = out});
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  });
  ExpectMirrorsClose(y);
}

// MoeCombine (one pass, each token's rows found by binary search and added in group order) against
// the host combine: the CPU backend's ScatterAddRows per expert. Bit for bit: both add each term
// with one fused multiply-add, in the same order. Weighted and unit scales; 8 to 160 experts (two
// launches); 1 to 2048 tokens.
TEST_F(CudaParityTest, MoeCombineEqualsAScatterPerExpert) {
  EXPECT_TRUE(backend(kGpu).SupportsOp(Op::kMoeCombine, DType::kF32));
  struct Case {
    int64_t tokens;
    int k, experts;
    int64_t width;
    bool unit_scales;
  };
  for (const Case c : {Case{1, 2, 8, 4096, false}, Case{37, 4, 16, 300, true}, Case{64, 6, 160, 512, false},
                       Case{2048, 8, 64, 1024, false}, Case{2048, 1, 16, 64, true}}) {
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + " k " + std::to_string(c.k) + " experts " +
                 std::to_string(c.experts));
    const GroupedRouting r = RandomGroupedRouting(c.tokens, c.k, c.experts, static_cast<uint32_t>(c.tokens * 7));
    const int64_t count = c.tokens * c.k;
    auto src = Mirror(RandomFloats(static_cast<size_t>(count * c.width), 70, -3.0f, 3.0f));
    auto dst = Mirror(RandomFloats(static_cast<size_t>(c.tokens * c.width), 71, -3.0f, 3.0f));
    auto rows = Mirror(r.rows);
    auto scales = Mirror(r.scales);
    auto ones = Mirror(std::vector<float>(static_cast<size_t>(count), 1.0f));
    float unused = 0;
    const std::vector<GroupedLinearParams::Group> groups = LocalGroups(r, &unused, DType::kF32, 0, 4);
    RunBoth([&](Backend& b, int s) {
      if (s == kGpu) {
        return b.MoeCombine({.src = src.at(s), .rows = rows.at(s), .scales = c.unit_scales ? nullptr : scales.at(s),
                             .dst = dst.at(s), .groups = groups.data(),
                             .num_groups = static_cast<int64_t>(groups.size()), .count = count,
                             .tokens = c.tokens, .width = c.width});
      }
      for (const GroupedLinearParams::Group& g : groups) {
        if (g.count == 0) continue;
        absl::Status st = b.ScatterAddRows({.src = src.at(s) + g.begin * c.width, .rows = rows.at(s) + g.begin,
                                            .scales = (c.unit_scales ? ones.at(s) : scales.at(s)) + g.begin,
                                            .dst = dst.at(s), .count = g.count, .dst_rows = c.tokens,
                                            .width = c.width});
        if (!st.ok()) return st;
      }
      return absl::OkStatus();
    });
    EXPECT_EQ(Read(dst, kGpu), Read(dst, kRef));
  }
}

// MoeCombine over the device offsets (the held experts searched on the device, 256 at a time)
// against a ScatterAddRows per held expert on the CPU, bit for bit; up to 400 experts (320 held:
// two passes of the search).
TEST_F(CudaParityTest, MoeCombineOverDeviceOffsetsEqualsAScatterPerExpert) {
  struct Case {
    int64_t tokens;
    int k, experts;
    int64_t width;
    bool unit_scales;
  };
  for (const Case c : {Case{1, 2, 8, 4096, false}, Case{7, 4, 16, 300, true}, Case{32, 8, 400, 512, false},
                       Case{256, 8, 64, 1024, false}}) {
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + " k " + std::to_string(c.k) + " experts " +
                 std::to_string(c.experts));
    const GroupedRouting r = RandomGroupedRouting(c.tokens, c.k, c.experts, static_cast<uint32_t>(c.tokens * 11));
    const int64_t count = c.tokens * c.k;
    auto src = Mirror(RandomFloats(static_cast<size_t>(count * c.width), 72, -3.0f, 3.0f));
    auto dst = Mirror(RandomFloats(static_cast<size_t>(c.tokens * c.width), 73, -3.0f, 3.0f));
    auto rows = Mirror(r.rows);
    auto scales = Mirror(r.scales);
    auto ones = Mirror(std::vector<float>(static_cast<size_t>(count), 1.0f));
    std::vector<int32_t> held;
    for (int e = 0; e < c.experts; ++e) {
      if (e % 5 != 2) held.push_back(e);
    }
    auto offsets = Mirror(r.offsets);
    auto ids = Mirror(held);
    RunBoth([&](Backend& b, int s) {
      if (s == kGpu) {
        return b.MoeCombine({.src = src.at(s), .rows = rows.at(s), .scales = c.unit_scales ? nullptr : scales.at(s),
                             .dst = dst.at(s), .count = count, .tokens = c.tokens, .width = c.width,
                             .device = {.offsets = offsets.at(s), .host_ids = held.data(), .ids = ids.at(s),
                                        .num_experts = c.experts, .num_held = static_cast<int64_t>(held.size()),
                                        .max_rows_per_group = c.tokens}});
      }
      for (const int32_t e : held) {
        const int64_t begin = r.offsets[static_cast<size_t>(e)];
        const int64_t n = r.offsets[static_cast<size_t>(e + 1)] - begin;
        if (n == 0) continue;
        absl::Status st = b.ScatterAddRows({.src = src.at(s) + begin * c.width, .rows = rows.at(s) + begin,
                                            .scales = (c.unit_scales ? ones.at(s) : scales.at(s)) + begin,
                                            .dst = dst.at(s), .count = n, .dst_rows = c.tokens, .width = c.width});
        if (!st.ok()) return st;
      }
      return absl::OkStatus();
    });
    EXPECT_EQ(Read(dst, kGpu), Read(dst, kRef));
  }
}

// MoeRoute without a host copy leaves the same offsets on the device as with one.
TEST_F(CudaParityTest, MoeRouteWithoutAHostCopyLeavesTheOffsetsOnTheDevice) {
  const MoeRouting routing{.scoring = MoeRouteScoring::kSoftmaxTopK, .num_experts = 16, .top_k = 4};
  const int64_t tokens = 9;
  auto logits = Mirror(RandomFloats(static_cast<size_t>(tokens * routing.num_experts), 80));
  auto offsets = Mirror(std::vector<int32_t>(static_cast<size_t>(routing.num_experts + 1), -7));
  auto rows = Mirror(std::vector<int32_t>(static_cast<size_t>(tokens * routing.top_k), -7));
  auto scales = Mirror(std::vector<float>(static_cast<size_t>(tokens * routing.top_k), -7.f));
  std::vector<int32_t> host(static_cast<size_t>(routing.num_experts + 1), -7);
  RunBoth([&](Backend& b, int s) {
    return b.MoeRoute({.logits = logits.at(s), .offsets = offsets.at(s), .rows = rows.at(s), .scales = scales.at(s),
                       .host_offsets = s == kRef ? host.data() : nullptr, .tokens = tokens, .routing = routing});
  });
  EXPECT_EQ(Read(offsets, kGpu), host);
  EXPECT_EQ(Read(rows, kGpu), Read(rows, kRef));
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
