// CUDA vs CPU parity of the MoE ops: MoeRoute's experts, grouped rows and offsets (exactly) and
// weights (to expf's rounding) over every scoring rule. Skips without a device (label gpu).
#include <cmath>
#include <cstdint>
#include <string>
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
