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
  if (!(repetition_penalty > 0.0f && repetition_penalty <= 2.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("repetition_penalty must be in (0, 2], got ", repetition_penalty));
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("frequency_penalty must be in [-2, 2], got ", frequency_penalty));
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("presence_penalty must be in [-2, 2], got ", presence_penalty));
  }
  if (history_ids.size() != history_counts.size()) {
    return absl::InvalidArgumentError(absl::StrCat("penalty history has ", history_ids.size(), " ids but ",
                                                   history_counts.size(), " counts"));
  }
  for (size_t i = 0; i < history_ids.size(); ++i) {
    if (history_ids[i] < 0 || (i > 0 && history_ids[i] <= history_ids[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("penalty history ids must be distinct, ascending and >= 0; entry ", i, " is ", history_ids[i]));
    }
    if (history_counts[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("penalty history count of token ", history_ids[i], " is negative: ", history_counts[i]));
    }
  }
  return absl::OkStatus();
}

namespace {

bool NeedsAdjusting(const SamplingParams& params) {
  return !params.logit_bias.empty() || !params.suppress_ids.empty() ||
         (params.HasPenalties() && !params.history_ids.empty()) || !params.allowed_token_mask.empty();
}

void Adjust(const SamplingParams& params, std::vector<float>& row) {
  const int32_t n = static_cast<int32_t>(row.size());
  for (const auto& [id, bias] : params.logit_bias) {
    if (id >= 0 && id < n) row[static_cast<size_t>(id)] += bias;
  }
  for (int32_t id : params.suppress_ids) {
    if (id >= 0 && id < n) row[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
  }
  if (params.HasPenalties()) {
    const float rep = params.repetition_penalty;
    for (size_t i = 0; i < params.history_ids.size(); ++i) {
      const int32_t id = params.history_ids[i];
      if (id < 0 || id >= n) continue;
      float& l = row[static_cast<size_t>(id)];
      if (rep != 1.0f) l = l > 0.0f ? l / rep : l * rep;
      const int32_t count = params.history_counts[i];
      if (count > 0) l -= params.frequency_penalty * static_cast<float>(count) + params.presence_penalty;
    }
  }
  if (!params.allowed_token_mask.empty()) ApplyMask(params.allowed_token_mask, row);
}

}  // namespace

std::vector<float> AdjustedLogits(absl::Span<const float> logits, const SamplingParams& params) {
  std::vector<float> row(logits.begin(), logits.end());
  Adjust(params, row);
  return row;
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
  if (NeedsAdjusting(params)) {
    adjusted_.assign(raw.begin(), raw.end());
    Adjust(params, adjusted_);
    logits = adjusted_;
  }
  if (params.temperature == 0.0f || params.top_k == 1) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  // The candidates are the tokens in descending logit order (ties: lower id first), cut to top_k;
  // top_p, min_p and the draw then walk that order from the top. Only the prefix the walk reaches
  // is sorted (a partition, then a sort, of a window that doubles as needed): in an LLM's
  // distribution that is tens to hundreds of tokens, not the vocabulary.
  order_.resize(static_cast<size_t>(n));
  std::iota(order_.begin(), order_.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  const int32_t keep_all = (params.top_k > 0 && params.top_k < n) ? params.top_k : n;
  int32_t sorted = 0;  // order_[0, sorted) are the `sorted` first candidates, in order
  auto sort_prefix = [&](int32_t want) {
    want = std::min(want, keep_all);
    if (want <= sorted) return;
    // Within the candidates: with top_k they are order_[0, keep_all) already.
    if (want < keep_all) {
      std::nth_element(order_.begin() + sorted, order_.begin() + want, order_.begin() + keep_all, by_logit);
    }
    std::sort(order_.begin() + sorted, order_.begin() + want, by_logit);
    sorted = want;
  };
  if (keep_all < n) {
    // The top_k candidates first (in any order), so that the sums below cover them only.
    std::nth_element(order_.begin(), order_.begin() + keep_all, order_.end(), by_logit);
  }
  sort_prefix(1);
  const double max_logit = logits[order_[0]];
  if (std::isinf(max_logit)) return order_[0];  // every token suppressed: nothing to weigh
  const double inv_t = 1.0 / params.temperature;
  auto weight = [&](int32_t i) {  // unnormalized probability of the i-th candidate
    return std::exp((static_cast<double>(logits[order_[static_cast<size_t>(i)]]) - max_logit) * inv_t);
  };
  // Softmax of logits / temperature over the candidates.
  double total = 0.0;
  for (int32_t i = 0; i < keep_all; ++i) total += weight(i);
  int32_t keep = keep_all;
  // Walks the candidates from the top while `go(i, weight, cumulative before i)` holds, sorting
  // more of them as needed; returns how many it passed.
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
  // Top-p: the smallest prefix whose probability reaches top_p (at least one token).
  if (params.top_p < 1.0f) {
    const double target = static_cast<double>(params.top_p) * total;
    double kept = 0.0;
    const int32_t passed = walk(keep, [&](int32_t, double w, double cum) {
      kept = cum + w;
      return cum + w < target;  // stop once this token reaches the target: it is kept
    });
    keep = std::min(keep, passed + 1);
    total = kept;
  }
  // Min-p: candidates less likely than min_p times the most likely one (a prefix) are dropped.
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
    chosen = keep - 1;  // rounding left u past the last one
  }
  return order_[static_cast<size_t>(chosen)];
}

}  // namespace shardserve::engine
