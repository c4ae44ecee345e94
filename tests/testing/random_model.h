// Writes Llama-family checkpoints with random weights from a fixed seed (config.json +
// model.safetensors), for benchmarks and layout tests that need shapes larger than the committed
// golden models: dense Llama, or Mixtral-style MoE when `experts` > 0. "The 100M model" of the
// benchmarks is HundredMModel().
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
  bool f16 = false;   // store every tensor as F16 (not with bf16)
  // Mixture of experts: 0 = a dense LlamaForCausalLM. Otherwise a MixtralForCausalLM whose every
  // layer has `experts` expert MLPs of width `intermediate` (block_sparse_moe.experts.N.w1/w3
  // [intermediate, hidden], w2 [hidden, intermediate]) and a router block_sparse_moe.gate
  // [experts, hidden]; each token uses `experts_per_tok` of them.
  int64_t experts = 0;
  int64_t experts_per_tok = 2;
  // FP8, the layout of DeepSeek-V3 and Qwen3-*-FP8 (Hugging Face's fine-grained FP8): every linear
  // projection (q/k/v/o, gate/up/down, expert w1/w2/w3) stored as F8_E4M3 codes with an F32
  // `<name>_scale_inv` [ceil(out / fp8_block), ceil(in / fp8_block)], and config.json's
  // quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  // "weight_block_size": [fp8_block, fp8_block], "modules_to_not_convert": ["lm_head"]}. The
  // embedding, norms, router and lm_head keep the dtype above. The weights are those of the same
  // shape and seed without fp8, quantized per block: scale = max|w| / 448 (1 for an all-zero
  // block), code = FloatToE4M3(w / scale) (common/tensor/dtype.h: nearest, ties to even).
  bool fp8 = false;
  int64_t fp8_block = 128;
};

// The benchmark model of ARCHITECTURE.md: 134M parameters, f32 (or bf16), untied.
inline RandomLlamaShape HundredMModel(bool bf16 = false) {
  RandomLlamaShape s;
  s.bf16 = bf16;
  return s;
}

// Writes `dir`/config.json and `dir`/model.safetensors (creating `dir`). Weights are uniform in
// +-0.5/sqrt(fan_in) (norms are 1), so activations stay O(1) through the layers. The file is
// written tensor by tensor (memory stays at one tensor). InvalidArgument when experts_per_tok is
// not in [1, experts] for an MoE shape, both bf16 and f16 are set, or fp8 is set with fp8_block < 1;
// Internal when a file cannot be written.
absl::Status WriteRandomLlama(const std::string& dir, const RandomLlamaShape& shape, uint64_t seed);

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_RANDOM_MODEL_H_
