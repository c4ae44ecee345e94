#include "common/tokenizer/tokenizer_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"
#include "common/tokenizer/internal/string_view.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

using tokenizer_internal::AbslView;

using json = nlohmann::json;

absl::Status FieldError(std::string_view label, std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(AbslView(label), ": field \"", AbslView(field), "\" ", AbslView(what)));
}

absl::StatusOr<json> ParseObject(std::string_view text, std::string_view label) {
  json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(AbslView(label), ": not valid JSON"));
  if (!doc.is_object()) return absl::InvalidArgumentError(absl::StrCat(AbslView(label), ": not a JSON object"));
  return doc;
}

// A token field: null, a string, or an AddedToken object with a string "content".
absl::StatusOr<std::optional<std::string>> TokenField(const json& doc, const char* key, std::string_view label) {
  auto it = doc.find(key);
  if (it == doc.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) {
      return std::optional<std::string>(content->get<std::string>());
    }
  }
  return FieldError(label, key, "is neither a string nor an object with a string \"content\"");
}

absl::StatusOr<std::optional<bool>> BoolField(const json& doc, const char* key, std::string_view label) {
  auto it = doc.find(key);
  if (it == doc.end() || it->is_null()) return std::optional<bool>();
  if (!it->is_boolean()) return FieldError(label, key, "is not true or false");
  return std::optional<bool>(it->get<bool>());
}

absl::StatusOr<std::optional<std::string>> ChatTemplateField(const json& doc, std::string_view label) {
  auto it = doc.find("chat_template");
  if (it == doc.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_array()) {
    for (const json& entry : *it) {
      if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() || !entry.contains("template") ||
          !entry["template"].is_string()) {
        return FieldError(label, "chat_template", "has an entry that is not {\"name\": ..., \"template\": ...}");
      }
      if (entry["name"].get<std::string>() == "default") {
        return std::optional<std::string>(entry["template"].get<std::string>());
      }
    }
    return std::optional<std::string>();  // named templates only; none is the default
  }
  return FieldError(label, "chat_template", "is neither a string nor a list of named templates");
}

bool FileExists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

}  // namespace

absl::StatusOr<std::string> ReadTokenizerFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return ss.str();
}

absl::Status ParseTokenizerConfigJson(std::string_view text, std::string_view label, bool fill_missing_only,
                                      TokenizerConfig* config) {
  ASSIGN_OR_RETURN(json doc, ParseObject(text, label));
  ASSIGN_OR_RETURN(std::optional<std::string> bos, TokenField(doc, "bos_token", label));
  ASSIGN_OR_RETURN(std::optional<std::string> eos, TokenField(doc, "eos_token", label));
  if (!fill_missing_only || !config->bos_token) config->bos_token = std::move(bos);
  if (!fill_missing_only || !config->eos_token) config->eos_token = std::move(eos);
  if (fill_missing_only) return absl::OkStatus();
  ASSIGN_OR_RETURN(config->add_bos_token, BoolField(doc, "add_bos_token", label));
  ASSIGN_OR_RETURN(config->add_eos_token, BoolField(doc, "add_eos_token", label));
  ASSIGN_OR_RETURN(config->chat_template, ChatTemplateField(doc, label));
  return absl::OkStatus();
}

absl::Status ParseGenerationConfigEos(std::string_view text, std::string_view label, TokenizerConfig* config) {
  ASSIGN_OR_RETURN(json doc, ParseObject(text, label));
  config->generation_eos_ids.clear();
  auto it = doc.find("eos_token_id");
  if (it == doc.end() || it->is_null()) return absl::OkStatus();
  auto add = [&](const json& v) -> absl::Status {
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > (uint64_t{1} << 31)) ||
        v.get<int64_t>() < 0) {
      return FieldError(label, "eos_token_id", absl::StrCat("has ", v.dump(), ", not a non-negative integer id"));
    }
    config->generation_eos_ids.push_back(v.get<int64_t>());
    return absl::OkStatus();
  };
  if (it->is_array()) {
    for (const json& v : *it) RETURN_IF_ERROR(add(v));
  } else {
    RETURN_IF_ERROR(add(*it));
  }
  return absl::OkStatus();
}

absl::StatusOr<TokenizerConfig> LoadTokenizerConfig(const std::string& model_dir) {
  namespace fs = std::filesystem;
  TokenizerConfig config;
  const std::string config_path = (fs::path(model_dir) / "tokenizer_config.json").string();
  if (FileExists(config_path)) {
    ASSIGN_OR_RETURN(std::string text, ReadTokenizerFile(config_path));
    RETURN_IF_ERROR(ParseTokenizerConfigJson(text, config_path, /*fill_missing_only=*/false, &config));
    config.tokens_source = config_path;
  }
  const std::string map_path = (fs::path(model_dir) / "special_tokens_map.json").string();
  if (FileExists(map_path)) {
    ASSIGN_OR_RETURN(std::string text, ReadTokenizerFile(map_path));
    const bool had_tokens = config.bos_token || config.eos_token;
    RETURN_IF_ERROR(ParseTokenizerConfigJson(text, map_path, /*fill_missing_only=*/true, &config));
    if (config.tokens_source.empty() || !had_tokens) config.tokens_source = map_path;
  }
  const std::string jinja_path = (fs::path(model_dir) / "chat_template.jinja").string();
  if (FileExists(jinja_path)) {
    ASSIGN_OR_RETURN(std::string text, ReadTokenizerFile(jinja_path));
    config.chat_template = std::move(text);
  }
  const std::string gen_path = (fs::path(model_dir) / "generation_config.json").string();
  if (FileExists(gen_path)) {
    ASSIGN_OR_RETURN(std::string text, ReadTokenizerFile(gen_path));
    RETURN_IF_ERROR(ParseGenerationConfigEos(text, gen_path, &config));
    config.generation_source = gen_path;
  }
  return config;
}

absl::StatusOr<SpecialTokenIds> ResolveSpecialTokenIds(
    const TokenizerConfig& config, const std::function<std::optional<int32_t>(std::string_view)>& piece_to_id,
    int32_t vocab_size, std::optional<int32_t> model_bos, std::optional<int32_t> model_eos) {
  auto resolve = [&](const std::optional<std::string>& token, const char* field,
                     std::optional<int32_t> fallback) -> absl::StatusOr<std::optional<int32_t>> {
    if (!token) return fallback;
    std::optional<int32_t> id = piece_to_id(*token);
    if (!id) {
      return absl::InvalidArgumentError(
          absl::StrCat(config.tokens_source, ": ", field, " \"", *token, "\" is not in the tokenizer's vocabulary"));
    }
    return id;
  };
  SpecialTokenIds ids;
  ASSIGN_OR_RETURN(ids.bos, resolve(config.bos_token, "bos_token", model_bos));
  ASSIGN_OR_RETURN(std::optional<int32_t> eos, resolve(config.eos_token, "eos_token", model_eos));
  if (eos) ids.eos.push_back(*eos);
  for (int64_t id : config.generation_eos_ids) {
    if (id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(config.generation_source, ": eos_token_id ", id,
                                                     " is outside the tokenizer's vocabulary (size ", vocab_size, ")"));
    }
    if (std::find(ids.eos.begin(), ids.eos.end(), id) == ids.eos.end()) ids.eos.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

}  // namespace shardserve
