// The CPU backend against straightforward double-precision references.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/status_matchers.h"
#include "worker/kernels/cpu/gemv.h"
#include "worker/kernels/registry.h"

namespace shardserve::kernels {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void ExpectClose(const std::vector<float>& ref, const std::vector<float>& got, float rel, const std::string& what) {
  ASSERT_EQ(ref.size(), got.size());
  float max_ref = 1e-6f, max_err = 0.f;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    max_err = std::max(max_err, std::fabs(ref[i] - got[i]));
  }
  EXPECT_LE(max_err, rel * max_ref) << what;
}

class CpuBackendTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_OK_AND_ASSIGN(b_, CreateBackend({})); }
  std::unique_ptr<Backend> b_;
};

struct LinearShape {
  int64_t tokens, in, out;
};

class LinearTest : public CpuBackendTest, public ::testing::WithParamInterface<LinearShape> {};

TEST_P(LinearTest, MatchesReferenceWithBiasAndAccumulate) {
  const auto [tokens, in, out] = GetParam();
  const auto x = Random(static_cast<size_t>(tokens * in), 1);
  const auto w = Random(static_cast<size_t>(out * in), 2);
  const auto bias = Random(static_cast<size_t>(out), 3);
  const auto y0 = Random(static_cast<size_t>(tokens * out), 4);
  for (bool accumulate : {false, true}) {
    for (bool with_bias : {false, true}) {
      std::vector<float> ref = y0, got = y0;
      cpu::ReferenceLinear(x.data(), w.data(), with_bias ? bias.data() : nullptr, ref.data(), tokens, in, out,
                           accumulate);
      ASSERT_TRUE(b_->Linear({.x = x.data(), .w = w.data(), .bias = with_bias ? bias.data() : nullptr,
                              .y = got.data(), .tokens = tokens, .in = in, .out = out, .accumulate = accumulate})
                      .ok());
      ExpectClose(ref, got, 1e-5f, absl::StrCat("tokens ", tokens, " in ", in, " out ", out, " acc ", accumulate,
                                                " bias ", with_bias));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearTest,
                         ::testing::Values(LinearShape{1, 64, 64}, LinearShape{1, 37, 13}, LinearShape{3, 768, 35},
                                           LinearShape{8, 100, 7}, LinearShape{9, 64, 33}, LinearShape{40, 172, 64},
                                           LinearShape{1, 5, 1}));

TEST_F(CpuBackendTest, AttentionMatchesNaiveReferenceWithSlidingWindowAndGqa) {
  // Two sequences: one prefilling 5 tokens from position 3, one decoding at position 9.
  const int64_t kv_heads = 2, q_heads = 4, d = 8, max_len = 16, slots = 2;
  const int64_t row = kv_heads * d;
  auto k_cache = Random(static_cast<size_t>(slots * max_len * row), 5);
  auto v_cache = Random(static_cast<size_t>(slots * max_len * row), 6);
  const std::vector<AttnSeq> seqs = {{.q_begin = 0, .q_len = 5, .pos_begin = 3, .slot = 1},
                                     {.q_begin = 5, .q_len = 1, .pos_begin = 9, .slot = 0}};
  const int64_t tokens = 6;
  const auto q = Random(static_cast<size_t>(tokens * q_heads * d), 7);
  for (int64_t window : {int64_t{0}, int64_t{4}}) {
    std::vector<float> out(q.size());
    const KvLayerView cache{k_cache.data(), v_cache.data(), slots, max_len, kv_heads, d};
    ASSERT_TRUE(b_->Attention({.q = q.data(), .out = out.data(), .seqs = seqs.data(), .host_seqs = seqs.data(),
                               .num_seqs = 2, .tokens = tokens, .q_heads = q_heads, .cache = cache, .scale = 0.35f,
                               .sliding_window = window})
                    .ok());
    std::vector<float> ref(q.size());
    for (const AttnSeq& s : seqs) {
      for (int64_t i = 0; i < s.q_len; ++i) {
        const int64_t t = s.q_begin + i, pos = s.pos_begin + i;
        for (int64_t h = 0; h < q_heads; ++h) {
          const int64_t g = h / (q_heads / kv_heads);
          std::vector<double> sc;
          double m = -1e300;
          std::vector<int64_t> keys;
          for (int64_t j = 0; j <= pos; ++j) {
            if (window > 0 && pos - j >= window) continue;
            double dot = 0;
            for (int64_t e = 0; e < d; ++e) {
              dot += double{q[static_cast<size_t>((t * q_heads + h) * d + e)]} *
                     k_cache[static_cast<size_t>((s.slot * max_len + j) * row + g * d + e)];
            }
            sc.push_back(dot * 0.35);
            m = std::max(m, dot * 0.35);
            keys.push_back(j);
          }
          double sum = 0;
          for (double& x : sc) sum += (x = std::exp(x - m));
          for (int64_t e = 0; e < d; ++e) {
            double acc = 0;
            for (size_t j = 0; j < keys.size(); ++j) {
              acc += sc[j] / sum * v_cache[static_cast<size_t>((s.slot * max_len + keys[j]) * row + g * d + e)];
            }
            ref[static_cast<size_t>((t * q_heads + h) * d + e)] = static_cast<float>(acc);
          }
        }
      }
    }
    ExpectClose(ref, out, 1e-5f, absl::StrCat("window ", window));
  }
}

TEST_F(CpuBackendTest, KvWriteStoresRowsAtSlotAndPosition) {
  const int64_t kv_heads = 1, d = 2, max_len = 4, slots = 2;
  std::vector<float> kc(static_cast<size_t>(slots * max_len * d)), vc(kc.size());
  const std::vector<float> k = {1, 2, 3, 4}, v = {5, 6, 7, 8};
  const std::vector<AttnSeq> seqs = {{.q_begin = 0, .q_len = 2, .pos_begin = 1, .slot = 1}};
  ASSERT_TRUE(b_->KvWrite({.k = k.data(), .v = v.data(), .seqs = seqs.data(), .host_seqs = seqs.data(),
                           .num_seqs = 1, .tokens = 2,
                           .cache = {kc.data(), vc.data(), slots, max_len, kv_heads, d}})
                  .ok());
  EXPECT_EQ(kc[static_cast<size_t>((1 * max_len + 1) * d)], 1.f);
  EXPECT_EQ(kc[static_cast<size_t>((1 * max_len + 2) * d + 1)], 4.f);
  EXPECT_EQ(vc[static_cast<size_t>((1 * max_len + 2) * d)], 7.f);
  EXPECT_EQ(kc[0], 0.f);
}

TEST_F(CpuBackendTest, RopeUsesFloatAnglesOfPositionTimesInvFreq) {
  std::vector<float> q = {1, 0, 0, 0}, k = {0, 1, 0, 0};
  const std::vector<int32_t> pos = {3};
  const std::vector<float> inv = {0.5f, 0.25f};
  ASSERT_TRUE(b_->Rope({.q = q.data(), .k = k.data(), .positions = pos.data(), .inv_freq = inv.data(), .tokens = 1,
                        .q_heads = 1, .kv_heads = 1, .head_dim = 4})
                  .ok());
  EXPECT_NEAR(q[0], std::cos(1.5f), 1e-6);
  EXPECT_NEAR(q[2], std::sin(1.5f), 1e-6);
  EXPECT_NEAR(k[1], std::cos(0.75f), 1e-6);
  EXPECT_NEAR(k[3], std::sin(0.75f), 1e-6);
}

TEST_F(CpuBackendTest, GatherScatterAndSigmoidScale) {
  const std::vector<float> src = {1, 2, 3, 4, 5, 6};  // 3 rows x 2
  const std::vector<int32_t> rows = {2, 0};
  std::vector<float> g(4);
  ASSERT_TRUE(b_->GatherRows({.src = src.data(), .rows = rows.data(), .dst = g.data(), .count = 2, .src_rows = 3,
                              .width = 2})
                  .ok());
  EXPECT_EQ(g, (std::vector<float>{5, 6, 1, 2}));
  std::vector<float> dst(6, 1.f);
  const std::vector<float> scales = {2.f, 0.5f};
  ASSERT_TRUE(b_->ScatterAddRows({.src = g.data(), .rows = rows.data(), .scales = scales.data(), .dst = dst.data(),
                                  .count = 2, .dst_rows = 3, .width = 2})
                  .ok());
  EXPECT_EQ(dst, (std::vector<float>{1.5f, 2.f, 1.f, 1.f, 11.f, 13.f}));
  std::vector<float> x = {2, 4};
  const std::vector<float> gate = {0.f};
  ASSERT_TRUE(b_->SigmoidScaleRows({.x = x.data(), .gate = gate.data(), .tokens = 1, .width = 2}).ok());
  EXPECT_EQ(x, (std::vector<float>{1, 2}));
}

TEST_F(CpuBackendTest, OpsRejectInvalidParamsWithoutTouchingMemory) {
  EXPECT_THAT(b_->Linear({}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Linear: null pointer")));
  float buf[4] = {};
  EXPECT_THAT(b_->Linear({.x = buf, .w = buf, .y = buf, .tokens = 1, .in = 1, .out = 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aliases")));
  EXPECT_THAT(b_->Rope({.q = buf, .k = buf, .positions = reinterpret_cast<int32_t*>(buf), .inv_freq = buf,
                        .head_dim = 3}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim must be even")));
  const AttnSeq bad = {.q_begin = 0, .q_len = 1, .pos_begin = 4, .slot = 0};
  EXPECT_THAT(b_->KvWrite({.k = buf, .v = buf, .seqs = &bad, .host_seqs = &bad, .num_seqs = 1, .tokens = 1,
                           .cache = {buf, buf, 1, 4, 1, 1}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceed the cache length")));
}

}  // namespace
}  // namespace shardserve::kernels
