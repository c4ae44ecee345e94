// "The 100M model" of ARCHITECTURE.md as a ModelSpec, shared by the planner tests: a f32 Llama
// with 134M parameters (536.4 MB of weights) and 73,728 KV bytes per token over its 12 layers.
#ifndef SHARDSERVE_TESTS_COORDINATOR_PLANNER_MODEL_100M_H_
#define SHARDSERVE_TESTS_COORDINATOR_PLANNER_MODEL_100M_H_

#include <cstdint>

#include "common/model_spec/model_spec.h"

namespace shardserve::testing {

inline ModelSpec Model100M() {
  ModelSpec s;
  s.arch = Architecture::kLlama;
  s.vocab_size = 32000;
  s.hidden_size = 768;
  s.intermediate_size = 2048;
  s.num_layers = 12;
  s.num_heads = 12;
  s.num_kv_heads = 12;
  s.head_dim = 64;
  s.max_position_embeddings = 1024;
  return s;
}
inline constexpr int64_t k100MWeightBytes = 134'105'856 * 4;
inline constexpr int64_t k100MKvBytesPerToken = 2 * 12 * 768 * 4;  // all 12 layers

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_COORDINATOR_PLANNER_MODEL_100M_H_
