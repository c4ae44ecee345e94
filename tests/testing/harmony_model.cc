#include "tests/testing/harmony_model.h"

#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace shardserve::testing {

std::string HarmonyTokenizerJson() {
  nlohmann::ordered_json t =
      nlohmann::ordered_json::parse(ReadFileOrEmpty("tests/golden/models/qwen2/tokenizer.json"), nullptr, false);
  if (!t.is_object()) return "";
  int id = 256;
  for (const char* s : {"<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                        "<|constrain|>", "<|endoftext|>"}) {
    t["added_tokens"].push_back({{"id", id++},
                                 {"content", s},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", true}});
  }
  return t.dump();
}

std::string HarmonyChatTemplate() {
  const nlohmann::ordered_json golden = nlohmann::ordered_json::parse(
      ReadFileOrEmpty("tests/coordinator/http/jinja_golden.json"), nullptr, false);
  if (!golden.is_object()) return "";
  for (const auto& c : golden["cases"]) {
    if (c["name"] == "harmony_style_plain") return c["template"].get<std::string>();
  }
  return "";
}

}  // namespace shardserve::testing
