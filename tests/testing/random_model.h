// Writes Llama-family checkpoints with random weights from a fixed seed (config.json +
// model.safetensors), for benchmarks and layout tests that need shapes larger than the committed
// golden models. "The 100M model" of the benchmarks is HundredMModel().
#ifndef SHARDSERVE_TESTS_TESTING_RANDOM_MODEL_H_
#define SHARDSERVE_TESTS_TESTING_RANDOM_MODEL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace shardserve::testing {

struct RandomLlamaShape {
  int64_t vocab = 32000;
  int64_t hidden = 768;
  int64_t intermediate = 2048;
  int64_t layers = 12;
  int64_t heads = 12;
  int64_t kv_heads = 12;
  int64_t max_positions = 1024;
  bool tied = false;
  bool bf16 = false;  // store every tensor as BF16 (as Hugging Face checkpoints usually are), else F32
};

// The benchmark model of ARCHITECTURE.md: 134M parameters, f32 (or bf16), untied.
inline RandomLlamaShape HundredMModel(bool bf16 = false) {
  RandomLlamaShape s;
  s.bf16 = bf16;
  return s;
}

// Writes `dir`/config.json and `dir`/model.safetensors (creating `dir`). Weights are uniform in
// +-0.5/sqrt(fan_in) (norms are 1), so activations stay O(1) through the layers.
absl::Status WriteRandomLlama(const std::string& dir, const RandomLlamaShape& shape, uint64_t seed);

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_RANDOM_MODEL_H_
