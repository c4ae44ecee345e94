#include "tests/testing/golden.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace shardserve::testing {
namespace {

using json = nlohmann::json;

absl::StatusOr<json> ReadJson(const std::string& path) {
  const std::string text = ReadFileOrEmpty(path);
  if (text.empty()) return absl::NotFoundError(absl::StrCat(path, ": missing or empty"));
  json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not JSON"));
  return doc;
}

GoldenCase ParseCase(const json& c) {
  GoldenCase g;
  if (c.contains("prompt_text") && c["prompt_text"].is_string()) g.prompt_text = c["prompt_text"].get<std::string>();
  g.prompt_ids = c.at("prompt_ids").get<std::vector<int32_t>>();
  g.greedy_ids = c.at("greedy_ids").get<std::vector<int32_t>>();
  if (c.contains("logits")) g.logits = c["logits"].get<std::vector<std::vector<float>>>();
  if (c.contains("last_logits")) g.last_logits = c["last_logits"].get<std::vector<float>>();
  if (c.contains("text") && c["text"].is_string()) g.text = c["text"].get<std::string>();
  return g;
}

}  // namespace

void ExpectLogitsClose(const std::vector<float>& ref, const float* got, const std::string& where, float rtol) {
  float max_ref = 0.f, max_err = 0.f;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    max_err = std::max(max_err, std::fabs(ref[i] - got[i]));
  }
  EXPECT_LE(max_err, rtol * max_ref) << where << ": max |error| " << max_err << " vs max |logit| " << max_ref
                                     << " (relative " << max_err / max_ref << ", tolerance " << rtol << ")";
}

std::vector<std::string> GoldenModelNames() {
  return {"llama",           "llama_tied_llama3rope_bias", "mistral",          "qwen2",
          "mixtral",         "qwen2_moe",                  "llama_bf16_sharded", "llama_fp8_block",
          "llama_fp8_tensor", "qwen3",                     "qwen3_moe",        "phi3",
          "deepseek_v3",     "deepseek_v3_noqlora",        "gemma2",           "llama4",
          "llama4_multimodal", "phi3_partial_rotary", "phi3_longrope", "gemma3",
          "deepseek_v2_lite", "deepseek_v2", "granite", "granite_moe", "smollm3",
          "granite_moe_shared", "granite_swa", "granite_moe_swa", "gpt_oss", "gpt_oss_mxfp4", "qwen3_yarn", "glm4_moe", "glm4_moe_lite", "seed_oss", "glm4"};
}

absl::StatusOr<GoldenModel> LoadGoldenModel(const std::string& name) {
  GoldenModel m;
  m.name = name;
  m.dir = absl::StrCat("tests/golden/models/", name);
  auto doc = ReadJson(m.dir + "/reference.json");
  if (!doc.ok()) return doc.status();
  for (const auto& c : (*doc)["cases"]) m.cases.push_back(ParseCase(c));
  auto config = ReadJson(m.dir + "/config.json");
  if (!config.ok()) return config.status();
  if (config->contains("quantization_config")) m.logits_rtol = kFp8GoldenLogitsRtol;
  return m;
}

std::string Stories260KDir() { return "../shared/models/stories260K"; }

absl::StatusOr<GoldenModel> LoadStories260K() {
  GoldenModel m;
  m.name = "stories260K";
  m.dir = Stories260KDir();
  auto doc = ReadJson("tests/golden/stories260K_reference.json");
  if (!doc.ok()) return doc.status();
  for (const auto& c : (*doc)["cases"]) m.cases.push_back(ParseCase(c));
  return m;
}

}  // namespace shardserve::testing
