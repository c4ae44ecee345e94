// The CPU backend's MoeRoute against the host routing the engine ran before the op existed: each
// token routed by the rule's own function (RouteTopK, RouteSigmoidTopK, RouteSigmoidGrouped,
// RouteSoftmaxGroupLimited, called directly here, not through RouteToken), then GroupByExpert. The
// same code on the same host must give bit-identical offsets, rows and weights.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "tests/testing/status_matchers.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/registry.h"
#include "worker/kernels/shared/moe_math.h"
#include "worker/kernels/shared/row_math.h"

namespace shardserve::kernels {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::_;

struct Routed {
  std::vector<int32_t> offsets, rows;
  std::vector<float> scales;
};

// The engine's former Model::Moe routing loop, one scoring rule at a time.
Routed HostRouting(const std::vector<float>& logits, const std::vector<float>& bias, int tokens, const MoeRouting& r) {
  const int e_count = r.num_experts, k = r.top_k;
  std::vector<float> probs(static_cast<size_t>(e_count + r.n_group));
  std::vector<int32_t> topk(static_cast<size_t>(tokens * k));
  std::vector<float> topw(topk.size());
  for (int t = 0; t < tokens; ++t) {
    const float* row = logits.data() + t * e_count;
    int* experts = topk.data() + t * k;
    float* weights = topw.data() + t * k;
    switch (r.scoring) {
      case MoeRouteScoring::kSoftmaxTopK:
        RouteTopK(row, probs.data(), e_count, k, r.renormalize, experts, weights);
        break;
      case MoeRouteScoring::kSigmoidTopK:
        RouteSigmoidTopK(row, e_count, k, experts, weights);
        break;
      case MoeRouteScoring::kSigmoidGrouped:
        RouteSigmoidGrouped(row, bias.empty() ? nullptr : bias.data(), probs.data(), e_count, k, r.n_group,
                            r.topk_group, r.renormalize, r.scaling, experts, weights);
        break;
      case MoeRouteScoring::kSoftmaxGroupLimited:
        RouteSoftmaxGroupLimited(row, probs.data(), e_count, k, r.n_group, r.topk_group, r.scaling, experts, weights);
        break;
    }
  }
  Routed out;
  out.offsets.resize(static_cast<size_t>(e_count + 1));
  out.rows.resize(topk.size());
  out.scales.resize(topk.size());
  std::vector<int32_t> fill(static_cast<size_t>(e_count));
  GroupByExpert(topk.data(), topw.data(), tokens, k, e_count, out.offsets.data(), out.rows.data(), out.scales.data(),
                fill.data());
  return out;
}

struct RouteCase {
  std::string name;
  MoeRouting routing;
  int tokens = 0;
  bool bias = false;
  bool ties = false;  // logits from {-1, 0, 0.5, 1}: many equal scores within and across tokens
};

void PrintTo(const RouteCase& c, std::ostream* os) { *os << c.name; }

std::vector<RouteCase> Cases() {
  using S = MoeRouteScoring;
  std::vector<RouteCase> cases;
  for (const int tokens : {0, 1, 5, 67}) {
    for (const bool ties : {false, true}) {
      const std::string suffix = "_t" + std::to_string(tokens) + (ties ? "_ties" : "");
      cases.push_back({"mixtral" + suffix, {.scoring = S::kSoftmaxTopK, .num_experts = 8, .top_k = 2}, tokens, false,
                       ties});
      cases.push_back({"qwen_no_norm" + suffix,
                       {.scoring = S::kSoftmaxTopK, .num_experts = 60, .top_k = 4, .renormalize = false},
                       tokens, false, ties});
      cases.push_back({"llama4" + suffix, {.scoring = S::kSigmoidTopK, .num_experts = 16, .top_k = 1}, tokens, false,
                       ties});
      cases.push_back({"llama4_top3" + suffix, {.scoring = S::kSigmoidTopK, .num_experts = 16, .top_k = 3}, tokens,
                       false, ties});
      cases.push_back({"dsv3" + suffix,
                       {.scoring = S::kSigmoidGrouped, .num_experts = 64, .top_k = 6, .n_group = 8, .topk_group = 3,
                        .renormalize = true, .scaling = 2.5f},
                       tokens, true, ties});
      cases.push_back({"dsv3_nobias_nonorm" + suffix,
                       {.scoring = S::kSigmoidGrouped, .num_experts = 16, .top_k = 4, .n_group = 4, .topk_group = 2,
                        .renormalize = false, .scaling = 1.0f},
                       tokens, false, ties});
      cases.push_back({"dsv3_one_group" + suffix,
                       {.scoring = S::kSigmoidGrouped, .num_experts = 8, .top_k = 2, .n_group = 1, .topk_group = 1},
                       tokens, true, ties});
      cases.push_back({"dsv2_grouped" + suffix,
                       {.scoring = S::kSoftmaxGroupLimited, .num_experts = 32, .top_k = 6, .n_group = 8,
                        .topk_group = 3, .scaling = 16.0f},
                       tokens, false, ties});
      cases.push_back({"dsv2_greedy" + suffix,
                       {.scoring = S::kSoftmaxGroupLimited, .num_experts = 64, .top_k = 6, .n_group = 1,
                        .topk_group = 1, .scaling = 1.0f},
                       tokens, false, ties});
    }
  }
  return cases;
}

class MoeRouteTest : public ::testing::TestWithParam<RouteCase> {
 protected:
  void SetUp() override { ASSERT_OK_AND_ASSIGN(b_, CreateBackend({})); }
  std::unique_ptr<Backend> b_;
};

TEST_P(MoeRouteTest, EqualsTheHostRouting) {
  const RouteCase& c = GetParam();
  const MoeRouting& r = c.routing;
  std::mt19937 rng(static_cast<uint32_t>(c.tokens * 131 + r.num_experts));
  std::normal_distribution<float> normal(0.f, 2.f);
  const float tie_values[] = {-1.f, 0.f, 0.5f, 1.f};
  std::vector<float> logits(static_cast<size_t>(c.tokens * r.num_experts));
  for (float& x : logits) x = c.ties ? tie_values[rng() % 4] : normal(rng);
  std::vector<float> bias;
  if (c.bias) {
    for (int e = 0; e < r.num_experts; ++e) bias.push_back(c.ties ? 0.25f * static_cast<float>(e % 2) : 0.1f * normal(rng));
  }
  const Routed want = HostRouting(logits, bias, c.tokens, r);

  const size_t n = static_cast<size_t>(c.tokens * r.top_k);
  // Poisoned outputs: the op must write every element.
  std::vector<int32_t> offsets(static_cast<size_t>(r.num_experts + 1), -7), host_offsets(offsets.size(), -7);
  std::vector<int32_t> rows(std::max<size_t>(n, 1), -7);
  std::vector<float> scales(rows.size(), NAN);
  ASSERT_THAT(b_->MoeRoute({.logits = logits.empty() ? scales.data() : logits.data(),
                          .score_bias = bias.empty() ? nullptr : bias.data(),
                          .offsets = offsets.data(),
                          .rows = rows.data(),
                          .scales = scales.data(),
                          .host_offsets = host_offsets.data(),
                          .tokens = c.tokens,
                          .routing = r}),
              IsOk());
  rows.resize(n);
  scales.resize(n);
  EXPECT_EQ(offsets, want.offsets);
  EXPECT_EQ(host_offsets, want.offsets);
  EXPECT_EQ(rows, want.rows);
  ASSERT_EQ(scales.size(), want.scales.size());
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(scales[i], want.scales[i]) << "row " << i;  // bit for bit

  // What the engine relies on, checked without the reference: every token appears top_k times under
  // distinct experts, each expert's rows ascend, and the offsets cover every row.
  EXPECT_EQ(offsets.front(), 0);
  EXPECT_EQ(offsets.back(), static_cast<int32_t>(n));
  std::vector<std::set<int>> experts_of(static_cast<size_t>(c.tokens));
  for (int e = 0; e < r.num_experts; ++e) {
    ASSERT_LE(offsets[e], offsets[e + 1]);
    for (int32_t i = offsets[e]; i < offsets[e + 1]; ++i) {
      ASSERT_GE(rows[i], 0);
      ASSERT_LT(rows[i], c.tokens);
      if (i > offsets[e]) {
        EXPECT_LT(rows[i - 1], rows[i]) << "expert " << e;
      }
      EXPECT_TRUE(experts_of[static_cast<size_t>(rows[i])].insert(e).second);
    }
  }
  for (const auto& chosen : experts_of) EXPECT_EQ(chosen.size(), static_cast<size_t>(r.top_k));

}

// Without a host copy (the device path): the same offsets, rows and weights, bit for bit.
TEST_P(MoeRouteTest, WithoutAHostCopyGroupsAlike) {
  const RouteCase& c = GetParam();
  const MoeRouting& r = c.routing;
  std::mt19937 rng(static_cast<uint32_t>(c.tokens * 7 + r.num_experts));
  std::normal_distribution<float> normal(0.f, 2.f);
  std::vector<float> logits(static_cast<size_t>(c.tokens * r.num_experts) + 1);
  for (float& x : logits) x = normal(rng);
  std::vector<float> bias(static_cast<size_t>(r.num_experts));
  for (float& x : bias) x = 0.1f * normal(rng);
  const size_t n = static_cast<size_t>(c.tokens * r.top_k) + 1;
  struct Out {
    std::vector<int32_t> offsets, rows;
    std::vector<float> scales;
  };
  auto route = [&](bool host_copy, Out& out) {
    out.offsets.assign(static_cast<size_t>(r.num_experts + 1), -7);
    out.rows.assign(n, -7);
    out.scales.assign(n, -7.f);
    std::vector<int32_t> host(out.offsets.size(), -7);
    ASSERT_THAT(b_->MoeRoute({.logits = logits.data(),
                              .score_bias = c.bias ? bias.data() : nullptr,
                              .offsets = out.offsets.data(),
                              .rows = out.rows.data(),
                              .scales = out.scales.data(),
                              .host_offsets = host_copy ? host.data() : nullptr,
                              .tokens = c.tokens,
                              .routing = r}),
                IsOk());
    if (host_copy) {
      EXPECT_EQ(host, out.offsets);
    }
  };
  Out with_copy, without;
  route(true, with_copy);
  route(false, without);
  EXPECT_EQ(without.offsets, with_copy.offsets);
  EXPECT_EQ(without.rows, with_copy.rows);
  EXPECT_EQ(without.scales, with_copy.scales);  // exact
}

INSTANTIATE_TEST_SUITE_P(Scorings, MoeRouteTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<RouteCase>& param) { return param.param.name; });

// The rule of the spec reaches the routing: the same logits route differently under each.
TEST(MoeRouteDispatchTest, RouteTokenFollowsTheScoring) {
  const float logits[8] = {3.0f, -3.0f, 1.0f, 0.5f, -1.0f, -1.0f, 0.8f, 0.7f};
  const float bias[8] = {0.f, 0.f, -0.5f, 0.2f, 0.f, 0.f, 0.3f, 0.3f};
  float scratch[16];
  int experts[2];
  float weights[2];
  RouteToken({.scoring = MoeRouteScoring::kSigmoidGrouped, .num_experts = 8, .top_k = 2, .n_group = 4,
              .topk_group = 2, .renormalize = false},
             logits, bias, scratch, experts, weights);
  EXPECT_EQ(experts[0], 6);  // moe_math_test's grouped case: the bias moves the choice
  EXPECT_EQ(experts[1], 7);
  RouteToken({.scoring = MoeRouteScoring::kSoftmaxTopK, .num_experts = 8, .top_k = 2}, logits, bias, scratch, experts,
             weights);
  EXPECT_EQ(experts[0], 0);  // the bias is not read
  EXPECT_EQ(experts[1], 2);
  EXPECT_NEAR(weights[0] + weights[1], 1.0f, 1e-6f);
  RouteToken({.scoring = MoeRouteScoring::kSigmoidTopK, .num_experts = 8, .top_k = 1}, logits, bias, scratch, experts,
             weights);
  EXPECT_EQ(experts[0], 0);
  EXPECT_FLOAT_EQ(weights[0], 1.0f / (1.0f + std::exp(-3.0f)));
}

TEST(MoeRouteValidateTest, NamesWhatIsWrong) {
  float logits[16] = {};
  float scales[8];
  int32_t offsets[9], host[9], rows[8];
  auto params = [&](MoeRouting r) {
    return MoeRouteParams{.logits = logits, .offsets = offsets, .rows = rows, .scales = scales, .host_offsets = host,
                          .tokens = 2, .routing = r};
  };
  using S = MoeRouteScoring;
  EXPECT_THAT(params({.scoring = S::kSoftmaxTopK, .num_experts = 8, .top_k = 4}).Validate(), IsOk());
  MoeRouteParams p = params({.scoring = S::kSoftmaxTopK, .num_experts = 8, .top_k = 4});
  p.host_offsets = nullptr;  // the device path: no host copy
  EXPECT_THAT(p.Validate(), IsOk());
  p.rows = nullptr;
  EXPECT_THAT(p.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("null pointer")));
  p.rows = rows;
  p.offsets = nullptr;
  EXPECT_THAT(p.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("null pointer")));
  EXPECT_THAT(params({.scoring = S::kSoftmaxTopK, .num_experts = 8, .top_k = 9}).Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("top_k")));
  EXPECT_THAT(params({.scoring = S::kSigmoidGrouped, .num_experts = 8, .top_k = 2, .n_group = 3}).Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("n_group 3 must divide")));
  EXPECT_THAT(params({.scoring = S::kSoftmaxGroupLimited, .num_experts = 8, .top_k = 2, .n_group = 4, .topk_group = 5})
                  .Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("topk_group")));
  EXPECT_THAT(params({.scoring = S::kSoftmaxGroupLimited, .num_experts = 8, .top_k = 3, .n_group = 4, .topk_group = 1})
                  .Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("kept groups")));
  EXPECT_THAT(params({.scoring = S::kSigmoidGrouped, .num_experts = 8, .top_k = 2, .n_group = 8, .topk_group = 2})
                  .Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr(">= 2 experts per group")));
  EXPECT_THAT(params({.scoring = S::kSoftmaxTopK, .num_experts = 8, .top_k = 2, .scaling = INFINITY}).Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("finite")));
  // The backend refuses before touching memory.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> b, CreateBackend({}));
  EXPECT_TRUE(b->SupportsOp(Op::kMoeRoute, DType::kF32));
  EXPECT_THAT(b->MoeRoute(params({.scoring = S::kSoftmaxTopK, .num_experts = 8, .top_k = 9})),
              StatusIs(absl::StatusCode::kInvalidArgument, _));
}

TEST(GroupedLinearValidateTest, NamesTheBadGroup) {
  float x[8] = {}, y[8] = {}, w[4] = {};
  const uint16_t w16[4] = {};
  using Group = GroupedLinearParams::Group;
  auto params = [&](const std::vector<Group>& groups) {
    return GroupedLinearParams{.x = x, .y = y, .groups = groups.data(), .num_groups = static_cast<int64_t>(groups.size()),
                               .rows = 4, .in = 2, .out = 2};
  };
  const std::vector<Group> good = {{.w = w, .begin = 0, .count = 1}, {.w = w, .begin = 1, .count = 0},
                                   {.w = w, .begin = 2, .count = 2}};
  EXPECT_THAT(params(good).Validate(), IsOk());
  EXPECT_THAT(params({{.w = w, .begin = 3, .count = 2}}).Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("group 0 rows [3, 5) outside [0, 4)")));
  EXPECT_THAT(params({{.w = w, .begin = 0, .count = 2}, {.w = w, .begin = 1, .count = 1}}).Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("group 1 overlaps")));
  EXPECT_THAT(params({{.w = w, .begin = 0, .count = 1}, {.w = WeightView::Bf16(w16), .begin = 1, .count = 1}}).Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("group 1 has BF16 weights")));
  EXPECT_THAT(params({{.w = WeightView(), .begin = 0, .count = 1}}).Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("group 0 has null weights")));
  GroupedLinearParams alias = params(good);
  alias.y = x;
  EXPECT_THAT(alias.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("aliases")));
}

// What a step's products hold at once (CUDA reserves twice this many bytes for their 16-bit
// rounding): an MoE model's grouped rows (tokens x top_k) take only the grouped products' inputs,
// not the dense or shared-expert width. Qwen2-57B-A14B's shape at 8192 tokens: hidden 3584, expert
// width 2560, shared expert 20480, top 8.
TEST(MaxProductActivationsTest, GroupedRowsTakeTheGroupedInputsOnly) {
  StepLimits limits{.max_tokens = 8192, .max_linear_in = 20480, .max_grouped_in = 3584};
  EXPECT_EQ(MaxProductActivations(limits), int64_t{8192} * 20480);  // dense: no routing
  limits.moe_routing = {.num_experts = 64, .top_k = 8};
  EXPECT_EQ(MaxProductActivations(limits), int64_t{8192} * 8 * 3584);  // 470 MB of bf16, not 2.7 GB
  limits.max_grouped_in = 0;  // not given: the widest Linear input
  EXPECT_EQ(MaxProductActivations(limits), int64_t{8192} * 8 * 20480);
  // The dense products dominate where the grouped rows are few.
  limits = {.max_tokens = 16, .max_linear_in = 20480, .max_grouped_in = 64};
  limits.moe_routing = {.num_experts = 4, .top_k = 2};
  EXPECT_EQ(MaxProductActivations(limits), 16 * 20480);
  limits.moe_routing.top_k = 1;  // one row per token: as a dense product
  EXPECT_EQ(MaxProductActivations(limits), 16 * 20480);
}

}  // namespace
}  // namespace shardserve::kernels
