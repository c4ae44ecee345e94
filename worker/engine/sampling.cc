#include "worker/engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace shardserve::engine {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Sets the logits of the tokens `mask` does not allow to -inf, unless it allows none of the row.
void ApplyMask(const std::string& mask, std::vector<float>& row) {
  const size_t n = row.size();
  const size_t bytes = std::min(mask.size(), (n + 7) / 8);
  bool any = false;
  for (size_t j = 0; j < bytes && !any; ++j) any = mask[j] != 0;
  if (!any) return;
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  for (size_t j = 0; j < bytes; ++j) {
    const auto bits = static_cast<uint8_t>(mask[j]);
    if (bits == 0xFF) continue;
    const size_t end = std::min(n, j * 8 + 8);
    for (size_t i = j * 8; i < end; ++i) {
      if (!((bits >> (i % 8)) & 1)) row[i] = kMasked;
    }
  }
  for (size_t i = bytes * 8; i < n; ++i) row[i] = kMasked;
}

}  // namespace

absl::Status SamplingParams::Validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be a finite number >= 0, got ", temperature));
  }
  if (top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", top_k));
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", top_p));
  }
  if (!(min_p >= 0.0f && min_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], got ", min_p));
  }
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0) return absl::InvalidArgumentError(absl::StrCat("logit_bias token id must be >= 0, got ", id));
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias for token ", id, " must be in [-100, 100], got ", bias));
    }
  }
  for (int32_t id : suppress_ids) {
    if (id < 0) return absl::InvalidArgumentError(absl::StrCat("suppressed token id must be >= 0, got ", id));
  }
  return absl::OkStatus();
}

double SamplingUniform(uint64_t seed, uint64_t step) {
  const uint64_t r = SplitMix64(SplitMix64(seed) ^ (step * 0xd1b54a32d192ed03ull));
  return static_cast<double>(r >> 11) * 0x1.0p-53;
}

TokenLogprobs ComputeLogprobs(absl::Span<const float> logits, int32_t chosen, int32_t top_n) {
  const size_t n = logits.size();
  const double mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - mx);
  const double log_z = mx + std::log(sum);
  TokenLogprobs out;
  out.logprob = static_cast<float>(static_cast<double>(logits[static_cast<size_t>(chosen)]) - log_z);
  const size_t k = std::min<size_t>(static_cast<size_t>(std::clamp(top_n, 0, kMaxTopLogprobs)), n);
  if (k == 0) return out;
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), [&](int32_t a, int32_t b) {
    return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] ||
           (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
  });
  for (size_t i = 0; i < k; ++i) {
    out.top_ids.push_back(ids[i]);
    out.top_logprobs.push_back(static_cast<float>(static_cast<double>(logits[static_cast<size_t>(ids[i])]) - log_z));
  }
  return out;
}

int32_t Sampler::Sample(absl::Span<const float> raw, const SamplingParams& params, uint64_t step) {
  const int32_t n = static_cast<int32_t>(raw.size());
  absl::Span<const float> logits = raw;
  if (!params.logit_bias.empty() || !params.suppress_ids.empty() || !params.allowed_token_mask.empty()) {
    adjusted_.assign(raw.begin(), raw.end());
    for (const auto& [id, bias] : params.logit_bias) {
      if (id >= 0 && id < n) adjusted_[static_cast<size_t>(id)] += bias;
    }
    for (int32_t id : params.suppress_ids) {
      if (id >= 0 && id < n) adjusted_[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
    }
    if (!params.allowed_token_mask.empty()) ApplyMask(params.allowed_token_mask, adjusted_);
    logits = adjusted_;
  }
  if (params.temperature == 0.0f || params.top_k == 1) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  // Candidates sorted by logit, descending (ties: lower id first), cut to top_k.
  order_.resize(static_cast<size_t>(n));
  std::iota(order_.begin(), order_.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  int32_t keep = n;
  if (params.top_k > 0 && params.top_k < n) {
    keep = params.top_k;
    std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), by_logit);
  } else {
    std::sort(order_.begin(), order_.end(), by_logit);
  }
  // Softmax of logits / temperature over the candidates.
  probs_.resize(static_cast<size_t>(keep));
  const double inv_t = 1.0 / params.temperature;
  const double max_logit = logits[order_[0]];
  if (std::isinf(max_logit)) return order_[0];  // every token suppressed: nothing to weigh
  double total = 0.0;
  for (int32_t i = 0; i < keep; ++i) {
    const double p = std::exp((logits[order_[i]] - max_logit) * inv_t);
    probs_[static_cast<size_t>(i)] = static_cast<float>(p);
    total += p;
  }
  // Top-p: the smallest prefix whose probability reaches top_p (at least one token).
  if (params.top_p < 1.0f) {
    double cum = 0.0;
    int32_t cut = keep;
    for (int32_t i = 0; i < keep; ++i) {
      cum += probs_[static_cast<size_t>(i)] / total;
      if (cum >= params.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    total = 0.0;
    for (int32_t i = 0; i < keep; ++i) total += probs_[static_cast<size_t>(i)];
  }
  // Min-p: candidates are sorted most likely first, so those kept are a prefix.
  if (params.min_p > 0.0f) {
    const double floor = static_cast<double>(params.min_p) * probs_[0];
    int32_t cut = 1;
    while (cut < keep && probs_[static_cast<size_t>(cut)] >= floor) ++cut;
    keep = cut;
    total = 0.0;
    for (int32_t i = 0; i < keep; ++i) total += probs_[static_cast<size_t>(i)];
  }
  const double u = SamplingUniform(params.seed, step) * total;
  double cum = 0.0;
  for (int32_t i = 0; i < keep; ++i) {
    cum += probs_[static_cast<size_t>(i)];
    if (u < cum) return order_[static_cast<size_t>(i)];
  }
  return order_[static_cast<size_t>(keep - 1)];
}

}  // namespace shardserve::engine
