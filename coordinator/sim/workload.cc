#include "coordinator/sim/workload.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardserve::sim {
namespace {

absl::Status CheckRange(const LengthRange& r, const char* name) {
  if (r.min < 1 || r.max < r.min) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be a range of lengths >= 1 with min <= max, got ",
                                                   r.min, ":", r.max));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<SimRequest>> MakePoissonWorkload(const PoissonOptions& o) {
  if (!(o.rate > 0) || !std::isfinite(o.rate)) {
    return absl::InvalidArgumentError(absl::StrCat("rate must be > 0, got ", o.rate));
  }
  if (o.requests <= 0 && !(o.duration_s > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("duration_s must be > 0, got ", o.duration_s));
  }
  if (absl::Status st = CheckRange(o.prompt_tokens, "prompt_tokens"); !st.ok()) return st;
  if (absl::Status st = CheckRange(o.output_tokens, "output_tokens"); !st.ok()) return st;
  // std::mt19937_64 and our own draws (not std::*_distribution, whose results differ between
  // standard libraries) keep a seed's workload the same everywhere.
  std::mt19937_64 rng(o.seed);
  auto uniform01 = [&rng] { return static_cast<double>(rng() >> 11) * 0x1.0p-53; };
  auto length = [&](const LengthRange& r) {
    return r.min + static_cast<int32_t>(rng() % static_cast<uint64_t>(r.max - r.min + 1));
  };
  std::vector<SimRequest> out;
  double t = 0;
  while (true) {
    t += -std::log1p(-uniform01()) / o.rate;
    if (o.requests > 0 ? std::ssize(out) >= o.requests : t >= o.duration_s) break;
    SimRequest r{.arrival_s = t};
    r.prompt_tokens = length(o.prompt_tokens);
    r.output_tokens = length(o.output_tokens);
    out.push_back(r);
  }
  return out;
}

absl::StatusOr<std::vector<SimRequest>> ParseTrace(absl::string_view text) {
  std::vector<SimRequest> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::ByAnyChar(" \t,"), absl::SkipEmpty());
    SimRequest r;
    double arrival = 0;
    if (f.size() != 3 || !absl::SimpleAtod(f[0], &arrival) || !absl::SimpleAtoi(f[1], &r.prompt_tokens) ||
        !absl::SimpleAtoi(f[2], &r.output_tokens) || !(arrival >= 0) || !std::isfinite(arrival) ||
        r.prompt_tokens < 1 || r.output_tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "trace line ", line_no, ": \"", line,
          "\" is not ARRIVAL_SECONDS PROMPT_TOKENS OUTPUT_TOKENS (time >= 0, lengths >= 1)"));
    }
    r.arrival_s = arrival;
    out.push_back(r);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const SimRequest& a, const SimRequest& b) { return a.arrival_s < b.arrival_s; });
  return out;
}

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  const size_t rank = static_cast<size_t>(std::ceil(std::clamp(q, 0.0, 1.0) * static_cast<double>(n)));
  return values[std::clamp<size_t>(rank, 1, n) - 1];
}

}  // namespace shardserve::sim
