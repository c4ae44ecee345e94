#include "common/concurrency/arrival_forecast.h"

#include <algorithm>

namespace shardserve {

ArrivalForecast::Plan ArrivalForecast::Next() const {
  if (options_.max_poll <= absl::ZeroDuration() || count_ < kMinSamples) return {};
  const int n = static_cast<int>(std::min<int64_t>(count_, kHistory));
  std::array<int64_t, kHistory> sorted = waits_ns_;
  std::sort(sorted.begin(), sorted.begin() + n);
  const absl::Duration lo = absl::Nanoseconds(sorted[n / 10]);
  const absl::Duration median = absl::Nanoseconds(sorted[n / 2]);
  const absl::Duration hi = absl::Nanoseconds(sorted[n - 1 - n / 10]);
  if (lo < options_.min_wait) return {};
  const absl::Duration budget = std::min(options_.max_poll, median * std::clamp(options_.max_fraction, 0.0, 1.0));
  if (budget <= absl::ZeroDuration()) return {};
  absl::Duration begin = std::max(absl::ZeroDuration(), lo - options_.margin);
  absl::Duration end = hi + options_.margin;
  if (end - begin > budget) {
    // Too wide for the budget: the budget's window, around the median, inside [begin, end).
    begin = std::clamp(median - budget / 2, begin, end - budget);
    end = begin + budget;
  }
  return {.sleep = begin, .poll = end - begin};
}

void ArrivalForecast::Record(absl::Duration waited) {
  waits_ns_[static_cast<size_t>(count_ % kHistory)] = std::max<int64_t>(0, absl::ToInt64Nanoseconds(waited));
  ++count_;
}

}  // namespace shardserve
