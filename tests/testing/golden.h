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

// The golden tolerance: max |logit error| <= kGoldenLogitsRtol * max |reference logit| over one
// position's logits, for checkpoints the engine holds exactly (f32, or bf16 with a reference
// computed from the same bf16 values): only f32 arithmetic differs.
inline constexpr float kGoldenLogitsRtol = 1e-4f;

// The tolerance for the FP8 golden models (tests/golden/make_fp8_golden.py). Their reference is
// computed from the exactly dequantized weights (fp8 value x f32 scale), while the engine holds
// those weights rounded to bf16 (relative error <= 2^-9 each), as it does for every FP8
// checkpoint. That rounding, not the arithmetic, sets the error. Measured at the prompt positions:
// the engine (CPU, TP=1/2/4) is off by at most 0.0138 (5.6e-3 of max |logit|; 4.6e-3 for
// llama_fp8_block), which is what a float64 NumPy forward pass with the same bf16-rounded weights
// gives too (to 4 digits). 1e-2 leaves ~1.8x headroom while a misapplied scale stands out: using a
// neighbouring block's scales (or another tensor's scale) for one projection moves the logits by
// 5-10% of max |logit|. Greedy tokens must still match exactly: the generator chose prompts whose
// every top1 - top2 gap exceeds 4x the logit change that the bf16 rounding causes at that step.
inline constexpr float kFp8GoldenLogitsRtol = 1e-2f;

struct GoldenModel {
  std::string name;
  std::string dir;  // model directory (config.json + weights)
  std::vector<GoldenCase> cases;
  // The logits tolerance for this model: kFp8GoldenLogitsRtol when its config.json has a
  // quantization_config (the FP8 models), else kGoldenLogitsRtol.
  float logits_rtol = kGoldenLogitsRtol;
};

// Expects max |logit error| <= rtol * max |reference logit| over one position's logits. `got`
// points at vocab = ref.size() values. Adds a gtest failure naming `where`, with the error found.
void ExpectLogitsClose(const std::vector<float>& ref, const float* got, const std::string& where,
                       float rtol = kGoldenLogitsRtol);

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
