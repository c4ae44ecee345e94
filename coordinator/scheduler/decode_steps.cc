#include "coordinator/scheduler/decode_steps.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log/log.h"

namespace shardserve::coordinator {

namespace {

// The smallest k >= 1 with overhead <= share * k * compute (compute > 0), uncapped, as a double
// (it may be huge); the epsilon keeps an exact boundary (0.2 ms against 0.1 ms: k = 8) from
// rounding up to the next k.
double StepsForOverhead(absl::Duration overhead, absl::Duration compute_per_step) {
  const double ratio = absl::FDivDuration(std::max(overhead, absl::ZeroDuration()), compute_per_step) / kOverheadShare;
  return std::max(1.0, std::ceil(ratio - 1e-9));
}

// The most steps whose compute fits in kMaxCallCompute (compute > 0), at least 1.
int64_t StepsForCallCompute(absl::Duration compute_per_step) {
  absl::Duration rest;
  return std::max<int64_t>(1, absl::IDivDuration(kMaxCallCompute, compute_per_step, &rest));
}

}  // namespace

int32_t AutoDecodeSteps(absl::Duration overhead, absl::Duration compute_per_step) {
  if (compute_per_step <= absl::ZeroDuration()) return 1;
  const double wanted = std::min<double>(StepsForOverhead(overhead, compute_per_step), kMaxAutoDecodeSteps);
  return static_cast<int32_t>(std::min<int64_t>(static_cast<int64_t>(wanted), StepsForCallCompute(compute_per_step)));
}

DecodeStepsTuner::DecodeStepsTuner(int32_t fixed) : fixed_(fixed), steps_(fixed >= 1 ? fixed : 1) {
  CHECK_GE(fixed, 0) << "decode steps per call";
}

void DecodeStepsTuner::Observe(absl::Duration call, absl::Duration compute, int32_t steps) {
  if (compute <= absl::ZeroDuration() || steps < 1) return;
  const double overhead = absl::ToDoubleMicroseconds(std::max(call - compute, absl::ZeroDuration()));
  const double per_step = absl::ToDoubleMicroseconds(compute) / steps;
  if (timed_calls_ == 0) {
    overhead_us_ = overhead;
    compute_us_ = per_step;
  } else {
    overhead_us_ += kEwmaWeight * (overhead - overhead_us_);
    compute_us_ += kEwmaWeight * (per_step - compute_us_);
  }
  ++timed_calls_;
  if (fixed_ != 0 || timed_calls_ < kMinTimedCalls) return;
  auto rule = [&](double overhead_scale, double compute_scale) {
    return AutoDecodeSteps(absl::Microseconds(overhead_us_ * overhead_scale),
                           absl::Microseconds(compute_us_ * compute_scale));
  };
  // Up only when even less overhead and more compute ask for more; down only when even more
  // overhead and less compute ask for fewer. Then to what the averages themselves give.
  const int32_t low = rule(1 - kHysteresis, 1 + kHysteresis);
  const int32_t high = rule(1 + kHysteresis, 1 - kHysteresis);
  if (steps_ < low || steps_ > high) steps_ = rule(1, 1);
}

std::string DecodeStepsTuner::Describe() const {
  const std::string measured =
      timed_calls_ == 0 ? std::string()
                        : absl::StrFormat("serving overhead %.2f ms per call against %.2f ms of compute per step",
                                          overhead_us_ / 1000, compute_us_ / 1000);
  if (fixed_ != 0) {
    return absl::StrCat(steps_, " (fixed by --decode_steps_per_call", measured.empty() ? "" : "; ", measured, ")");
  }
  if (timed_calls_ < kMinTimedCalls) {
    return absl::StrCat(steps_, " (auto: measuring, ", timed_calls_, " of ", kMinTimedCalls,
                        " decode calls timed so far)");
  }
  std::string why = absl::StrCat(steps_, " (auto: ", measured);
  const absl::Duration overhead = overhead_per_call(), compute = compute_per_step();
  const int32_t now = AutoDecodeSteps(overhead, compute);
  const double wanted = compute > absl::ZeroDuration() ? StepsForOverhead(overhead, compute) : 1;
  if (now != steps_) {
    absl::StrAppend(&why, "; the rule gives ", now, " now, within the ", static_cast<int>(kHysteresis * 100),
                    "% margin kept before a change");
  } else if (compute > absl::ZeroDuration() && steps_ == StepsForCallCompute(compute) && wanted > steps_) {
    absl::StrAppend(&why, "; at most ", absl::FormatDuration(kMaxCallCompute), " of compute per call");
  } else if (steps_ == kMaxAutoDecodeSteps && wanted > steps_) {
    absl::StrAppend(&why, "; at most ", kMaxAutoDecodeSteps, " steps per call");
  }
  return absl::StrCat(why, ")");
}

}  // namespace shardserve::coordinator
