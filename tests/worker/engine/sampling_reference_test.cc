// The Sampler after its arithmetic moved to kernels/shared/sampling_math.h, and the CPU backend's
// SampleRows, against the Sampler as it was before (kept below, verbatim but for names, as the
// reference): the same ids on many random rows and parameter sets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "absl/types/span.h"
#include "worker/engine/sampling.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/registry.h"

namespace shardserve::engine {
namespace {

// Sampler::Sample before issue 16, after the adjustments (the caller passes AdjustedLogits).
int32_t ReferenceSample(absl::Span<const float> logits, const SamplingParams& params, uint64_t step) {
  const int32_t n = static_cast<int32_t>(logits.size());
  if (params.temperature == 0.0f || params.top_k == 1) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  const int32_t keep_all = (params.top_k > 0 && params.top_k < n) ? params.top_k : n;
  int32_t sorted = 0;
  auto sort_prefix = [&](int32_t want) {
    want = std::min(want, keep_all);
    if (want <= sorted) return;
    if (want < keep_all) {
      std::nth_element(order.begin() + sorted, order.begin() + want, order.begin() + keep_all, by_logit);
    }
    std::sort(order.begin() + sorted, order.begin() + want, by_logit);
    sorted = want;
  };
  if (keep_all < n) std::nth_element(order.begin(), order.begin() + keep_all, order.end(), by_logit);
  sort_prefix(1);
  const double max_logit = logits[order[0]];
  if (std::isinf(max_logit)) return order[0];
  const double inv_t = 1.0 / params.temperature;
  auto weight = [&](int32_t i) {
    return std::exp((static_cast<double>(logits[order[static_cast<size_t>(i)]]) - max_logit) * inv_t);
  };
  double total = 0.0;
  for (int32_t i = 0; i < keep_all; ++i) total += weight(i);
  int32_t keep = keep_all;
  auto walk = [&](int32_t limit, auto&& go) {
    double cum = 0.0;
    int32_t i = 0;
    for (int32_t window = 64; i < limit; window *= 2) {
      sort_prefix(std::min(limit, std::max(window, i + 1)));
      for (; i < sorted && i < limit; ++i) {
        const double w = weight(i);
        if (!go(i, w, cum)) return i;
        cum += w;
      }
    }
    return i;
  };
  if (params.top_p < 1.0f) {
    const double target = static_cast<double>(params.top_p) * total;
    double kept = 0.0;
    const int32_t passed = walk(keep, [&](int32_t, double w, double cum) {
      kept = cum + w;
      return cum + w < target;
    });
    keep = std::min(keep, passed + 1);
    total = kept;
  }
  if (params.min_p > 0.0f) {
    const double floor = static_cast<double>(params.min_p) * weight(0);
    double kept = 0.0;
    keep = std::max<int32_t>(1, walk(keep, [&](int32_t i, double w, double cum) {
                                   if (i > 0 && w < floor) return false;
                                   kept = cum + w;
                                   return true;
                                 }));
    total = kept;
  }
  const double u = SamplingUniform(params.seed, step) * total;
  int32_t chosen = -1;
  walk(keep, [&](int32_t i, double w, double cum) {
    if (u < cum + w) {
      chosen = i;
      return false;
    }
    return true;
  });
  if (chosen < 0) {
    sort_prefix(keep);
    chosen = keep - 1;
  }
  return order[static_cast<size_t>(chosen)];
}

// A random row of `n` logits of one of several shapes: spread, peaked, with ties (values on a
// coarse grid), with -inf entries, or all -inf but a few.
std::vector<float> RandomRow(std::mt19937& rng, int n, int shape) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> row(static_cast<size_t>(n));
  for (float& x : row) x = normal(rng);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  switch (shape) {
    case 0:  // an LLM-like spread
      for (float& x : row) x *= 3.0f;
      break;
    case 1:  // peaked: one clear winner
      row[static_cast<size_t>(rng() % n)] += 12.0f;
      break;
    case 2:  // many ties
      for (float& x : row) x = std::round(x * 2.0f) / 2.0f;
      break;
    case 3:  // some tokens suppressed
      for (float& x : row) {
        if (rng() % 3 == 0) x = -kInf;
      }
      break;
    default:  // all suppressed but a few
      for (float& x : row) x = -kInf;
      for (int i = 0; i < 3; ++i) row[static_cast<size_t>(rng() % n)] = normal(rng);
      break;
  }
  return row;
}

SamplingParams RandomParams(std::mt19937& rng, int n) {
  static constexpr float kTemperatures[] = {0.0f, 1e-30f, 0.05f, 0.7f, 1.0f, 1.5f, 4.0f};
  static constexpr float kTopP[] = {1.0f, 0.999f, 0.9f, 0.5f, 0.1f, 1e-6f};
  static constexpr float kMinP[] = {0.0f, 0.0f, 0.01f, 0.1f, 0.5f, 1.0f};
  const int32_t top_ks[] = {0, 0, 1, 2, 5, 40, n - 1, n, n + 7};
  SamplingParams p;
  p.temperature = kTemperatures[rng() % std::size(kTemperatures)];
  p.top_k = top_ks[rng() % std::size(top_ks)];
  p.top_p = kTopP[rng() % std::size(kTopP)];
  p.min_p = kMinP[rng() % std::size(kMinP)];
  p.seed = rng();
  return p;
}

TEST(SamplingReferenceTest, SamplerDrawsWhatTheFormerSamplerDrew) {
  std::mt19937 rng(20261127);
  Sampler sampler;
  int sampled = 0;  // rows that were not argmax rows
  for (int trial = 0; trial < 6000; ++trial) {
    const int n = trial % 5 == 0 ? 1 + static_cast<int>(rng() % 8) : 50 + static_cast<int>(rng() % 3000);
    const std::vector<float> row = RandomRow(rng, n, trial % 5);
    SamplingParams p = RandomParams(rng, n);
    if (trial % 7 == 0) {  // the host-side adjustments too
      p.logit_bias = {{static_cast<int32_t>(rng() % n), 3.0f}};
      p.suppress_ids = {static_cast<int32_t>(rng() % n)};
      p.repetition_penalty = 1.3f;
      p.history_ids = {0};
      p.history_counts = {2};
      p.frequency_penalty = 0.5f;
    }
    ASSERT_TRUE(p.Validate().ok()) << p.Validate();
    const uint64_t step = rng() % 1000;
    const std::vector<float> adjusted = AdjustedLogits(row, p);
    ASSERT_EQ(sampler.Sample(row, p, step), ReferenceSample(adjusted, p, step))
        << "trial " << trial << " n " << n << " temperature " << p.temperature << " top_k " << p.top_k << " top_p "
        << p.top_p << " min_p " << p.min_p;
    sampled += !(p.temperature == 0.0f || p.top_k == 1);
  }
  EXPECT_GT(sampled, 4000);  // the draws, not only argmaxes, were compared
}

TEST(SamplingReferenceTest, CpuBackendSampleRowsDrawsWhatTheSamplerDraws) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend({});
  ASSERT_TRUE(backend.ok()) << backend.status();
  kernels::Backend& b = **backend;
  ASSERT_TRUE(b.SupportsOp(kernels::Op::kSampleRows, DType::kF32));
  std::mt19937 rng(7);
  Sampler sampler;
  for (int batch = 0; batch < 60; ++batch) {
    const int rows = 1 + static_cast<int>(rng() % 9);
    const int width = 20 + static_cast<int>(rng() % 2000);
    const int stride = width + static_cast<int>(rng() % 5);
    std::vector<float> x(static_cast<size_t>(rows * stride), std::nanf(""));  // padding is never read
    std::vector<kernels::RowSamplingParams> params(static_cast<size_t>(rows));
    std::vector<SamplingParams> engine_params(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      const std::vector<float> row = RandomRow(rng, width, static_cast<int>(rng() % 5));
      std::copy(row.begin(), row.end(), x.begin() + r * stride);
      SamplingParams& p = engine_params[static_cast<size_t>(r)];
      p = RandomParams(rng, width);
      params[static_cast<size_t>(r)] = {.temperature = p.temperature, .top_k = p.top_k, .top_p = p.top_p,
                                        .min_p = p.min_p, .seed = p.seed, .step = rng() % 500};
    }
    std::vector<int32_t> out(static_cast<size_t>(rows), -1);
    ASSERT_TRUE(b.SampleRows({.x = x.data(), .params = params.data(), .host_params = params.data(), .out = out.data(),
                              .rows = rows, .width = width, .stride = stride})
                    .ok());
    for (int r = 0; r < rows; ++r) {
      const absl::Span<const float> row(x.data() + r * stride, static_cast<size_t>(width));
      EXPECT_EQ(out[static_cast<size_t>(r)],
                sampler.Sample(row, engine_params[static_cast<size_t>(r)], params[static_cast<size_t>(r)].step))
          << "batch " << batch << " row " << r;
    }
  }
}

TEST(SamplingReferenceTest, PlainParametersAreThoseTheDeviceCanSampleAlone) {
  EXPECT_TRUE((SamplingParams{.temperature = 0.9f, .top_k = 5, .top_p = 0.8f, .seed = 3, .min_p = 0.1f}).IsPlain());
  EXPECT_FALSE((SamplingParams{.temperature = 0.9f, .logit_bias = {{1, 2.0f}}}).IsPlain());
  EXPECT_FALSE((SamplingParams{.temperature = 0.9f, .suppress_ids = {2}}).IsPlain());
  EXPECT_FALSE((SamplingParams{.temperature = 0.9f, .presence_penalty = 0.5f}).IsPlain());
  EXPECT_FALSE((SamplingParams{.temperature = 0.9f, .allowed_token_mask = "\x01"}).IsPlain());
  EXPECT_TRUE(SamplingParams{}.IsGreedy());
  EXPECT_FALSE((SamplingParams{.suppress_ids = {2}}).IsGreedy());  // greedy only when plain too
}

TEST(SamplingReferenceTest, SampleRowsRejectsBadParametersNamingTheRow) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend({});
  ASSERT_TRUE(backend.ok()) << backend.status();
  const std::vector<float> x = {1.0f, 2.0f, 3.0f, 4.0f};
  std::vector<kernels::RowSamplingParams> params(2);
  params[1].top_p = 0.0f;
  int32_t out[2] = {-1, -1};
  const absl::Status st = (*backend)->SampleRows(
      {.x = x.data(), .params = params.data(), .host_params = params.data(), .out = out, .rows = 2, .width = 2, .stride = 2});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("row 1: top_p"), absl::string_view::npos) << st;
  EXPECT_EQ(out[0], -1);  // nothing written
  params[1].top_p = 1.0f;
  params[0].temperature = -1.0f;
  EXPECT_EQ((*backend)
                ->SampleRows({.x = x.data(), .params = params.data(), .host_params = params.data(), .out = out, .rows = 2,
                              .width = 3, .stride = 2})
                .code(),
            absl::StatusCode::kInvalidArgument);  // width > stride
}

}  // namespace
}  // namespace shardserve::engine
