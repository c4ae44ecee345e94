#include "worker/engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/kernels/shared/sampling_math.h"

namespace shardserve::engine {
namespace {

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

double SamplingUniform(uint64_t seed, uint64_t step) { return kernels::SamplingUniformOf(seed, step); }

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
  absl::Span<const float> logits = raw;
  if (NeedsAdjusting(params)) {
    adjusted_.assign(raw.begin(), raw.end());
    Adjust(params, adjusted_);
    logits = adjusted_;
  }
  return row_sampler_.Sample(logits.data(), static_cast<int64_t>(logits.size()), params.temperature, params.top_k,
                             params.top_p, params.min_p, SamplingUniform(params.seed, step));
}

}  // namespace shardserve::engine
