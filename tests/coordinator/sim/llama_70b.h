// A Llama-2/3 70B shape (bf16, GQA with 8 KV heads, 80 layers) as a ModelSpec, for the simulator
// tests that place it on two 8 x H100 nodes.
#ifndef SHARDSERVE_TESTS_COORDINATOR_SIM_LLAMA_70B_H_
#define SHARDSERVE_TESTS_COORDINATOR_SIM_LLAMA_70B_H_

#include "absl/status/statusor.h"
#include "common/log/log.h"
#include "common/model_spec/model_spec.h"

namespace shardserve::testing {

inline ModelSpec Llama70B() {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "hidden_act": "silu"})",
                                                  "70b");
  CHECK(spec.ok()) << spec.status();
  return *spec;
}

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_COORDINATOR_SIM_LLAMA_70B_H_
