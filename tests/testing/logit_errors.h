// How far a reduced-precision run (int8 weights, an FP8 KV cache) lands from a reference: the
// logits error relative to each position's max|logit|, and how many leading greedy tokens agree.
#ifndef SHARDSERVE_TESTS_TESTING_LOGIT_ERRORS_H_
#define SHARDSERVE_TESTS_TESTING_LOGIT_ERRORS_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace shardserve::testing {

// The largest and the mean absolute error of each position's logits, each over that position's
// max|logit| of the reference, accumulated over positions.
struct LogitErrors {
  double max_rel = 0, sum_rel = 0;
  int64_t positions = 0;
  // Adds one position: `got` holds ref.size() logits.
  void Add(const std::vector<float>& ref, const float* got) {
    double ref_max = 0, err_max = 0, err_sum = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      ref_max = std::max(ref_max, std::fabs(static_cast<double>(ref[i])));
      const double e = std::fabs(static_cast<double>(got[i]) - ref[i]);
      err_max = std::max(err_max, e);
      err_sum += e;
    }
    max_rel = std::max(max_rel, err_max / ref_max);
    sum_rel += err_sum / static_cast<double>(ref.size()) / ref_max;
    ++positions;
  }
  double mean_rel() const { return positions > 0 ? sum_rel / static_cast<double>(positions) : 0; }
};

// Leading tokens of `got` equal to `want`.
inline size_t LeadingAgreement(const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  size_t n = 0;
  while (n < got.size() && n < want.size() && got[n] == want[n]) ++n;
  return n;
}

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_LOGIT_ERRORS_H_
