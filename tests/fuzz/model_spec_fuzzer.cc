// libFuzzer target: config.json parsing. Any input must produce a ModelSpec that satisfies the
// invariants the engine relies on, or an error status — never a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "common/model_spec/model_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto spec = shardserve::ParseModelSpec(text, "fuzz");
  if (spec.ok()) {
    const auto& s = *spec;
    if (s.hidden_size < 1 || s.num_layers < 1 || s.num_heads < 1 || s.num_kv_heads < 1) std::abort();
    if (s.num_heads % s.num_kv_heads != 0 || s.head_dim % 2 != 0) std::abort();
    if (s.IsMoe() && (s.moe.top_k < 1 || s.moe.top_k > s.moe.num_experts ||
                      s.moe.sparse_layers.size() != static_cast<size_t>(s.num_layers))) {
      std::abort();
    }
    for (int64_t id : s.eos_token_ids) {
      if (id < 0 || id >= s.vocab_size) std::abort();
    }
    (void)s.NumParameters();
  }
  return 0;
}
