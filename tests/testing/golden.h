// Reading the committed Hugging Face reference outputs under tests/golden/ (see its README).
#ifndef SHARDSERVE_TESTS_TESTING_GOLDEN_H_
#define SHARDSERVE_TESTS_TESTING_GOLDEN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve::testing {

struct GoldenCase {
  std::string prompt_text;                   // empty when the case is given as ids
  std::vector<int32_t> prompt_ids;
  std::vector<std::vector<float>> logits;    // [prompt position][vocab]; may be empty
  std::vector<float> last_logits;            // stories260K: logits of the last prompt position
  std::vector<int32_t> greedy_ids;
  std::string text;                          // stories260K: decoded prompt + continuation
};

struct GoldenModel {
  std::string name;
  std::string dir;  // model directory (config.json + weights)
  std::vector<GoldenCase> cases;
};

// The golden tolerance: max |logit error| <= 1e-4 * max |reference logit| over one position's
// logits. `got` points at vocab = ref.size() values. Adds a gtest failure naming `where`.
void ExpectLogitsClose(const std::vector<float>& ref, const float* got, const std::string& where);

// Names of the tiny random-weight models under tests/golden/models.
std::vector<std::string> GoldenModelNames();
// Loads tests/golden/models/<name>/reference.json (paths relative to the repository root, where
// ctest runs the tests).
absl::StatusOr<GoldenModel> LoadGoldenModel(const std::string& name);

// The trained stories260K model beside the repository (../shared/models/stories260K) and its
// reference (tests/golden/stories260K_reference.json).
std::string Stories260KDir();
absl::StatusOr<GoldenModel> LoadStories260K();

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_GOLDEN_H_
