#include "tests/testing/random_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/tensor/dtype.h"
#include "nlohmann/json.hpp"

namespace shardserve::testing {
namespace {

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  bool norm;          // ones instead of random
  bool fp8 = false;   // a projection stored as F8_E4M3 codes + block scales (RandomLlamaShape::fp8)
};

uint64_t Next(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Block-wise e4m3 quantization of the [rows, cols] matrix `w` with square blocks of `block`:
// `scales` [ceil(rows / block), ceil(cols / block)] = max|w| / 448 of each block (1 when the block
// is all zeros, which no scale could describe better), `codes` = FloatToE4M3(w / scale).
void QuantizeBlockwise(const std::vector<float>& w, int64_t rows, int64_t cols, int64_t block,
                       std::vector<uint8_t>& codes, std::vector<float>& scales) {
  const int64_t grid_cols = CeilDiv(cols, block);
  scales.assign(static_cast<size_t>(CeilDiv(rows, block) * grid_cols), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = scales.data() + (r / block) * grid_cols;
    const float* wrow = w.data() + r * cols;
    for (int64_t c = 0; c < cols; ++c) srow[c / block] = std::max(srow[c / block], std::fabs(wrow[c]));
  }
  for (float& s : scales) s = s > 0 ? s / 448.0f : 1.0f;
  codes.resize(w.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scales.data() + (r / block) * grid_cols;
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      codes[i] = FloatToE4M3(w[i] / srow[c / block]);
    }
  }
}

std::string ScaleName(const std::string& weight) { return weight + "_scale_inv"; }

}  // namespace

absl::Status WriteRandomLlama(const std::string& dir, const RandomLlamaShape& m, uint64_t seed) {
  namespace fs = std::filesystem;
  const bool moe = m.experts > 0;
  if (moe && (m.experts_per_tok < 1 || m.experts_per_tok > m.experts)) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts_per_tok must be in [1, ", m.experts, "], got ", m.experts_per_tok));
  }
  if (m.bf16 && m.f16) return absl::InvalidArgumentError("a random model is bf16 or f16, not both");
  if (m.fp8 && m.fp8_block < 1) {
    return absl::InvalidArgumentError(absl::StrCat("fp8_block must be >= 1, got ", m.fp8_block));
  }
  const bool half = m.bf16 || m.f16;
  const char* dtype = m.bf16 ? "BF16" : m.f16 ? "F16" : "F32";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": ", ec.message()));
  const int64_t d = m.hidden / m.heads;
  std::vector<Spec> specs = {{"model.embed_tokens.weight", {m.vocab, m.hidden}, false}};
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    specs.push_back({p + "input_layernorm.weight", {m.hidden}, true});
    specs.push_back({p + "self_attn.q_proj.weight", {m.heads * d, m.hidden}, false, m.fp8});
    specs.push_back({p + "self_attn.k_proj.weight", {m.kv_heads * d, m.hidden}, false, m.fp8});
    specs.push_back({p + "self_attn.v_proj.weight", {m.kv_heads * d, m.hidden}, false, m.fp8});
    specs.push_back({p + "self_attn.o_proj.weight", {m.hidden, m.heads * d}, false, m.fp8});
    specs.push_back({p + "post_attention_layernorm.weight", {m.hidden}, true});
    if (moe) {
      specs.push_back({p + "block_sparse_moe.gate.weight", {m.experts, m.hidden}, false});
      for (int64_t e = 0; e < m.experts; ++e) {
        const std::string ep = absl::StrCat(p, "block_sparse_moe.experts.", e, ".");
        specs.push_back({ep + "w1.weight", {m.intermediate, m.hidden}, false, m.fp8});
        specs.push_back({ep + "w2.weight", {m.hidden, m.intermediate}, false, m.fp8});
        specs.push_back({ep + "w3.weight", {m.intermediate, m.hidden}, false, m.fp8});
      }
    } else {
      specs.push_back({p + "mlp.gate_proj.weight", {m.intermediate, m.hidden}, false, m.fp8});
      specs.push_back({p + "mlp.up_proj.weight", {m.intermediate, m.hidden}, false, m.fp8});
      specs.push_back({p + "mlp.down_proj.weight", {m.hidden, m.intermediate}, false, m.fp8});
    }
  }
  specs.push_back({"model.norm.weight", {m.hidden}, true});
  if (!m.tied) specs.push_back({"lm_head.weight", {m.vocab, m.hidden}, false});

  nlohmann::json header = nlohmann::json::object();
  const uint64_t elem = half ? 2 : 4;
  uint64_t offset = 0;
  for (const Spec& s : specs) {
    uint64_t n = 1;
    for (int64_t x : s.shape) n *= static_cast<uint64_t>(x);
    const uint64_t bytes = (s.fp8 ? 1 : elem) * n;
    header[s.name] = {{"dtype", s.fp8 ? "F8_E4M3" : dtype}, {"shape", s.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    if (s.fp8) {  // its scales follow it in the file
      const std::vector<int64_t> grid = {CeilDiv(s.shape[0], m.fp8_block), CeilDiv(s.shape[1], m.fp8_block)};
      const uint64_t scale_bytes = 4 * static_cast<uint64_t>(grid[0] * grid[1]);
      header[ScaleName(s.name)] = {{"dtype", "F32"}, {"shape", grid}, {"data_offsets", {offset, offset + scale_bytes}}};
      offset += scale_bytes;
    }
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');
  std::ofstream out(fs::path(dir) / "model.safetensors", std::ios::binary);
  const uint64_t hlen = h.size();
  out.write(reinterpret_cast<const char*>(&hlen), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  std::vector<float> buf, scales;
  std::vector<uint8_t> codes;
  for (const Spec& s : specs) {
    uint64_t n = 1;
    for (int64_t x : s.shape) n *= static_cast<uint64_t>(x);
    buf.resize(n);
    const float scale = 0.5f / std::sqrt(static_cast<float>(s.shape.back()));
    for (float& v : buf) {
      v = s.norm ? 1.0f : scale * (static_cast<float>(Next(state) >> 40) * 0x1.0p-23f - 1.0f);
    }
    if (s.fp8) {
      QuantizeBlockwise(buf, s.shape[0], s.shape[1], m.fp8_block, codes, scales);
      out.write(reinterpret_cast<const char*>(codes.data()), static_cast<std::streamsize>(n));
      out.write(reinterpret_cast<const char*>(scales.data()), static_cast<std::streamsize>(scales.size() * 4));
    } else if (half) {
      std::vector<uint16_t> bits(n);
      for (uint64_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, &buf[i], sizeof(u));
        // bf16 by truncation: the values are random anyway.
        bits[i] = m.f16 ? FloatToHalf(buf[i]) : static_cast<uint16_t>(u >> 16);
      }
      out.write(reinterpret_cast<const char*>(bits.data()), static_cast<std::streamsize>(n * 2));
    } else {
      out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(n * 4));
    }
  }
  if (!out) return absl::InternalError(absl::StrCat(dir, "/model.safetensors: write failed"));
  nlohmann::json config = {{"architectures", {moe ? "MixtralForCausalLM" : "LlamaForCausalLM"}},
                           {"model_type", moe ? "mixtral" : "llama"},
                           {"vocab_size", m.vocab},
                           {"hidden_size", m.hidden},
                           {"intermediate_size", m.intermediate},
                           {"num_hidden_layers", m.layers},
                           {"num_attention_heads", m.heads},
                           {"num_key_value_heads", m.kv_heads},
                           {"max_position_embeddings", m.max_positions},
                           {"rms_norm_eps", 1e-5},
                           {"rope_theta", 10000.0},
                           {"hidden_act", "silu"},
                           {"tie_word_embeddings", m.tied},
                           {"bos_token_id", 1},
                           {"eos_token_id", 2},
                           {"torch_dtype", m.bf16 ? "bfloat16" : m.f16 ? "float16" : "float32"}};
  if (moe) {
    config["num_local_experts"] = m.experts;
    config["num_experts_per_tok"] = m.experts_per_tok;
  }
  if (m.fp8) {
    config["quantization_config"] = {{"quant_method", "fp8"},
                                     {"fmt", "e4m3"},
                                     {"activation_scheme", "dynamic"},
                                     {"weight_block_size", {m.fp8_block, m.fp8_block}},
                                     {"modules_to_not_convert", {"lm_head"}}};
  }
  std::ofstream cfg(fs::path(dir) / "config.json");
  cfg << config.dump(2) << "\n";
  if (!cfg) return absl::InternalError(absl::StrCat(dir, "/config.json: write failed"));
  return absl::OkStatus();
}

}  // namespace shardserve::testing
