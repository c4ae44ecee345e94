#include "coordinator/http/openai_protocol.h"

#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/frontend/chat_prompt.h"
#include "coordinator/frontend/choices.h"
#include "coordinator/scheduler/sequence.h"

namespace shardserve::coordinator::http {
namespace {

using frontend::kMaxChoices;
using frontend::ParseToolDefinition;
using frontend::ToolChoice;
using frontend::ToolFunction;

using Json = nlohmann::ordered_json;

const char* TypeName(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "an integer";
    case Json::value_t::number_float: return "a number";
    case Json::value_t::string: return "a string";
    case Json::value_t::array: return "an array";
    case Json::value_t::object: return "an object";
    case Json::value_t::binary:
    case Json::value_t::discarded: break;
  }
  return "a value";
}

absl::Status WrongType(absl::string_view field, absl::string_view want, const Json& got) {
  return InvalidParam(field, absl::StrCat("'", field, "' must be ", want, ", got ", TypeName(got)));
}

absl::StatusOr<Json> ParseObject(absl::string_view body) {
  if (const size_t depth = frontend::JsonNestingDepth(body); depth > frontend::kMaxJsonDepth) {
    return InvalidParam("", absl::StrCat("request body nests ", depth, " levels of arrays and objects; at most ",
                                         frontend::kMaxJsonDepth, " are taken"));
  }
  Json j = Json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    // Parse again to learn where it broke (nlohmann reports it only through its exception).
    try {
      Json unused = Json::parse(body.begin(), body.end());
      (void)unused;
    } catch (const Json::parse_error& e) {
      return InvalidParam("", absl::StrCat("request body is not valid JSON (at byte ", e.byte, ")"));
    } catch (const Json::exception& e) {
      // A number out of double's range (1e400) is nlohmann's out_of_range, not a parse_error:
      // still the client's mistake (400), never a 500.
      return InvalidParam("", absl::StrCat("request body is not valid JSON: ", e.what()));
    }
    return InvalidParam("", "request body is not valid JSON");
  }
  if (!j.is_object()) return InvalidParam("", absl::StrCat("request body must be a JSON object, got ", TypeName(j)));
  return j;
}

absl::StatusOr<int64_t> GetInt(const Json& v, absl::string_view field) {
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return static_cast<int64_t>(u);
    return InvalidParam(field, absl::StrCat("'", field, "' is out of range"));
  }
  return WrongType(field, "an integer", v);
}

absl::StatusOr<double> GetNumber(const Json& v, absl::string_view field) {
  if (!v.is_number()) return WrongType(field, "a number", v);
  return v.get<double>();
}

absl::StatusOr<bool> GetBool(const Json& v, absl::string_view field) {
  if (!v.is_boolean()) return WrongType(field, "a boolean", v);
  return v.get<bool>();
}

// chat_template_kwargs: an object, or null for none.
absl::StatusOr<Json> GetTemplateKwargs(const Json& v, absl::string_view field) {
  if (!v.is_null() && !v.is_object()) return WrongType(field, "an object", v);
  return v;
}

// Handles a field both endpoints know. Returns false (with OK) when `key` is not one of them.
absl::StatusOr<bool> ParseSharedField(const std::string& key, const Json& v, SamplingFields* f) {
  if (key == "model") {
    if (!v.is_string()) return WrongType(key, "a string", v);
    f->model = v.get<std::string>();
  } else if (key == "max_tokens" || key == "max_completion_tokens") {
    if (v.is_null()) return true;
    absl::StatusOr<int64_t> n = GetInt(v, key);
    if (!n.ok()) return n.status();
    if (*n < 1) return InvalidParam(key, absl::StrCat("'", key, "' must be at least 1, got ", *n));
    f->max_tokens = *n;
  } else if (key == "temperature") {
    if (v.is_null()) return true;
    absl::StatusOr<double> t = GetNumber(v, key);
    if (!t.ok()) return t.status();
    if (!(*t >= 0 && *t <= 2)) return InvalidParam(key, absl::StrCat("'temperature' must be in [0, 2], got ", *t));
    f->temperature = *t;
  } else if (key == "top_p") {
    if (v.is_null()) return true;
    absl::StatusOr<double> p = GetNumber(v, key);
    if (!p.ok()) return p.status();
    if (!(*p > 0 && *p <= 1)) return InvalidParam(key, absl::StrCat("'top_p' must be in (0, 1], got ", *p));
    f->top_p = *p;
  } else if (key == "top_k") {
    if (v.is_null()) return true;
    absl::StatusOr<int64_t> k = GetInt(v, key);
    if (!k.ok()) return k.status();
    if (*k < 0 || *k > std::numeric_limits<int32_t>::max()) {
      return InvalidParam(key, absl::StrCat("'top_k' must be >= 0 (0 = no limit), got ", *k));
    }
    f->top_k = *k;
  } else if (key == "seed") {
    if (v.is_null()) return true;
    absl::StatusOr<int64_t> s = GetInt(v, key);
    if (!s.ok()) return s.status();
    f->seed = *s;
  } else if (key == "stop") {
    if (v.is_null()) return true;
    if (v.is_string()) {
      f->stop.push_back(v.get<std::string>());
    } else if (v.is_array()) {
      for (size_t i = 0; i < v.size(); ++i) {
        if (!v[i].is_string()) return WrongType(absl::StrCat("stop[", i, "]"), "a string", v[i]);
        f->stop.push_back(v[i].get<std::string>());
      }
    } else {
      return WrongType(key, "a string or an array of strings", v);
    }
  } else if (key == "bad_words") {
    if (v.is_null()) return true;
    if (!v.is_array()) return WrongType(key, "an array of strings", v);
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_string()) return WrongType(absl::StrCat("bad_words[", i, "]"), "a string", v[i]);
      f->bad_words.push_back(v[i].get<std::string>());
    }
  } else if (key == "stream") {
    if (v.is_null()) return true;
    absl::StatusOr<bool> b = GetBool(v, key);
    if (!b.ok()) return b.status();
    f->stream = *b;
  } else if (key == "stream_options") {
    if (v.is_null()) return true;
    if (!v.is_object()) return WrongType(key, "an object", v);
    for (const auto& [k, x] : v.items()) {
      if (k != "include_usage") return InvalidParam("stream_options", absl::StrCat("unknown field 'stream_options.", k, "'"));
      absl::StatusOr<bool> b = GetBool(x, "stream_options.include_usage");
      if (!b.ok()) return b.status();
      f->include_usage = *b;
    }
  } else if (key == "n" || key == "best_of") {
    if (v.is_null()) return true;
    absl::StatusOr<int64_t> n = GetInt(v, key);
    if (!n.ok()) return n.status();
    if (*n < 1 || *n > kMaxChoices) {
      return InvalidParam(key, absl::StrCat("'", key, "' must be in [1, ", kMaxChoices, "], got ", *n));
    }
    if (key == "n") {
      f->n = *n;
    } else {
      f->best_of = *n;
    }
  } else if (key == "presence_penalty" || key == "frequency_penalty") {
    if (v.is_null()) return true;
    absl::StatusOr<double> p = GetNumber(v, key);
    if (!p.ok()) return p.status();
    if (!(*p >= -2 && *p <= 2)) return InvalidParam(key, absl::StrCat("'", key, "' must be in [-2, 2], got ", *p));
    (key == "presence_penalty" ? f->presence_penalty : f->frequency_penalty) = *p;
  } else if (key == "repetition_penalty") {
    if (v.is_null()) return true;
    absl::StatusOr<double> p = GetNumber(v, key);
    if (!p.ok()) return p.status();
    if (!(*p > 0 && *p <= 2)) return InvalidParam(key, absl::StrCat("'repetition_penalty' must be in (0, 2], got ", *p));
    f->repetition_penalty = *p;
  } else if (key == "logit_bias") {
    if (v.is_null()) return true;
    if (!v.is_object()) return WrongType(key, "an object", v);
    for (const auto& [k, x] : v.items()) {
      int64_t id = -1;
      if (!absl::SimpleAtoi(k, &id) || id < 0) {
        return InvalidParam(key, absl::StrCat("'logit_bias' keys must be token ids (integers >= 0), got \"", k, "\""));
      }
      absl::StatusOr<double> b = GetNumber(x, absl::StrCat("logit_bias.", k));
      if (!b.ok()) return b.status();
      if (!(*b >= -100 && *b <= 100)) {
        return InvalidParam(key, absl::StrCat("'logit_bias' values must be in [-100, 100], got ", *b, " for token ", k));
      }
      f->logit_bias.emplace_back(id, *b);
    }
  } else if (key == "min_p") {
    if (v.is_null()) return true;
    absl::StatusOr<double> p = GetNumber(v, key);
    if (!p.ok()) return p.status();
    if (!(*p >= 0 && *p <= 1)) return InvalidParam(key, absl::StrCat("'min_p' must be in [0, 1], got ", *p));
    f->min_p = *p;
  } else if (key == "priority") {
    if (v.is_null()) return true;
    absl::StatusOr<int64_t> p = GetInt(v, key);
    if (!p.ok()) return p.status();
    if (*p < std::numeric_limits<int32_t>::min() || *p > std::numeric_limits<int32_t>::max()) {
      return InvalidParam(key, absl::StrCat("'priority' must fit in 32 bits, got ", *p));
    }
    f->priority = static_cast<int32_t>(*p);
  } else if (key == "truncate_prompt_tokens") {
    if (v.is_null()) return true;
    absl::StatusOr<int64_t> k = GetInt(v, key);
    if (!k.ok()) return k.status();
    if (*k == 0 || *k < -1) {
      return InvalidParam(key, absl::StrCat("'truncate_prompt_tokens' must be -1 (what fits the context) or >= 1, got ",
                                            *k));
    }
    f->truncate_prompt_tokens = *k;
  } else if (key == "min_tokens") {
    if (v.is_null()) return true;
    absl::StatusOr<int64_t> n = GetInt(v, key);
    if (!n.ok()) return n.status();
    if (*n < 0 || *n > std::numeric_limits<int32_t>::max()) {
      return InvalidParam(key, absl::StrCat("'min_tokens' must be >= 0, got ", *n));
    }
    f->min_tokens = *n;
  } else if (key == "allowed_token_ids") {
    if (v.is_null()) return true;
    if (!v.is_array()) return WrongType(key, "an array of integers", v);
    if (v.empty()) {
      return InvalidParam(key, "'allowed_token_ids' must not be empty (leave it out to allow every token)");
    }
    for (size_t i = 0; i < v.size(); ++i) {
      absl::StatusOr<int64_t> id = GetInt(v[i], absl::StrCat("allowed_token_ids[", i, "]"));
      if (!id.ok()) return id.status();
      f->allowed_token_ids.push_back(*id);
    }
  } else if (key == "stop_token_ids") {
    if (v.is_null()) return true;
    if (!v.is_array()) return WrongType(key, "an array of integers", v);
    for (size_t i = 0; i < v.size(); ++i) {
      absl::StatusOr<int64_t> id = GetInt(v[i], absl::StrCat("stop_token_ids[", i, "]"));
      if (!id.ok()) return id.status();
      f->stop_token_ids.push_back(*id);
    }
  } else if (key == "ignore_eos" || key == "include_stop_str_in_output" || key == "skip_special_tokens") {
    if (v.is_null()) return true;
    absl::StatusOr<bool> b = GetBool(v, key);
    if (!b.ok()) return b.status();
    (key == "ignore_eos" ? f->ignore_eos : key == "skip_special_tokens" ? f->skip_special_tokens
                                                                        : f->include_stop_str_in_output) = *b;
  } else if (key == "guided_json" || key == "guided_regex" || key == "guided_choice") {
    if (v.is_null()) return true;
    if (f->response_format != SamplingFields::ResponseFormat::kText) {
      return InvalidParam(key, absl::StrCat("'", key, "' cannot be combined with response_format or another guided_* field"));
    }
    if (key == "guided_json") {
      if (v.is_string()) {
        f->json_schema = v.get<std::string>();
      } else if (v.is_object() || v.is_boolean()) {
        f->json_schema = v.dump();
      } else {
        return WrongType(key, "a JSON Schema (an object, or its text)", v);
      }
      f->response_format = SamplingFields::ResponseFormat::kJsonSchema;
    } else if (key == "guided_regex") {
      if (!v.is_string()) return WrongType(key, "a string", v);
      f->regex = v.get<std::string>();
      f->response_format = SamplingFields::ResponseFormat::kRegex;
    } else {
      if (!v.is_array() || v.empty()) return WrongType(key, "a non-empty array of strings", v);
      for (size_t i = 0; i < v.size(); ++i) {
        if (!v[i].is_string() || v[i].get<std::string>().empty()) {
          return WrongType(absl::StrCat(key, "[", i, "]"), "a non-empty string", v[i]);
        }
        f->choices.push_back(v[i].get<std::string>());
      }
      f->response_format = SamplingFields::ResponseFormat::kChoice;
    }
    f->format_param = key;
  } else if (key == "response_format") {
    if (v.is_null()) return true;
    if (f->response_format != SamplingFields::ResponseFormat::kText) {
      return InvalidParam(key, "'response_format' cannot be combined with a guided_* field");
    }
    if (!v.is_object()) return WrongType(key, "an object", v);
    if (!v.contains("type") || !v["type"].is_string()) {
      return InvalidParam(key, "'response_format.type' is required: \"text\", \"json_object\" or \"json_schema\"");
    }
    const std::string type = v["type"].get<std::string>();
    for (const auto& [k, x] : v.items()) {
      if (k != "type" && !(k == "json_schema" && type == "json_schema")) {
        return InvalidParam(key, absl::StrCat("unknown field 'response_format.", k, "'"));
      }
    }
    if (type == "text") {
      f->response_format = SamplingFields::ResponseFormat::kText;
    } else if (type == "json_object") {
      f->response_format = SamplingFields::ResponseFormat::kJsonObject;
      f->format_param = key;
    } else if (type == "json_schema") {
      if (!v.contains("json_schema") || !v["json_schema"].is_object()) {
        return InvalidParam(key, "'response_format.json_schema' must be an object with 'name' and 'schema'");
      }
      const Json& js = v["json_schema"];
      for (const auto& [k, x] : js.items()) {
        if (k == "name" || k == "description") {
          if (!x.is_string()) return WrongType(absl::StrCat("response_format.json_schema.", k), "a string", x);
        } else if (k == "strict") {
          if (!x.is_boolean() && !x.is_null()) return WrongType("response_format.json_schema.strict", "a boolean", x);
        } else if (k != "schema") {
          return InvalidParam(key, absl::StrCat("unknown field 'response_format.json_schema.", k, "'"));
        }
      }
      if (!js.contains("schema") || !(js["schema"].is_object() || js["schema"].is_boolean())) {
        return InvalidParam(key, "'response_format.json_schema.schema' (a JSON Schema object) is required");
      }
      f->response_format = SamplingFields::ResponseFormat::kJsonSchema;
      f->json_schema = js["schema"].dump();
      f->format_param = key;
    } else {
      return InvalidParam(key, absl::StrCat("'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got \"",
                                            type, "\""));
    }
  } else if (key == "user") {
    if (!v.is_string() && !v.is_null()) return WrongType(key, "a string", v);
  } else if (key == "store") {
    // OpenAI keeps stored completions for its dashboard and evals; this server keeps none.
    if (v.is_null()) return true;
    absl::StatusOr<bool> b = GetBool(v, key);
    if (!b.ok()) return b.status();
    if (*b) return InvalidParam(key, "'store' must be false: this server does not store completions");
  } else if (key == "metadata") {
    // Tags of a stored completion (OpenAI: at most 16 string values); nothing is stored here.
    if (v.is_null()) return true;
    if (!v.is_object()) return WrongType(key, "an object of strings", v);
    for (const auto& [k, x] : v.items()) {
      if (!x.is_string()) return WrongType(absl::StrCat("metadata.", k), "a string", x);
    }
  } else if (key == "service_tier") {
    if (v.is_null()) return true;
    if (!v.is_string()) return WrongType(key, "a string", v);
    if (v != "auto" && v != "default") {
      return InvalidParam(key, absl::StrCat("'service_tier' must be \"auto\" or \"default\" (one tier here), got \"",
                                            v.get<std::string>(), "\""));
    }
  } else {
    return false;
  }
  return true;
}

// An assistant message's tool_calls: [{"id": str, "type": "function", "function": {"name": str,
// "arguments": str}}].
absl::Status ValidateToolCalls(const Json& v, const std::string& field) {
  if (!v.is_array()) return WrongType(field, "an array of tool calls", v);
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = absl::StrCat(field, "[", i, "]");
    const Json& c = v[i];
    if (!c.is_object()) return WrongType(at, "an object", c);
    for (const auto& [k, x] : c.items()) {
      if (k == "id") {
        if (!x.is_string()) return WrongType(at + ".id", "a string", x);
      } else if (k == "type") {
        if (x != "function") return InvalidParam(at + ".type", absl::StrCat("'", at, ".type' must be \"function\""));
      } else if (k == "function") {
        if (!x.is_object() || !x.contains("name") || !x["name"].is_string()) {
          return InvalidParam(at + ".function", absl::StrCat("'", at, ".function' must be {\"name\": ..., \"arguments\": ...}"));
        }
        for (const auto& [fk, fx] : x.items()) {
          if (fk == "arguments") {
            if (!fx.is_string()) return WrongType(at + ".function.arguments", "a string (JSON text)", fx);
          } else if (fk != "name") {
            return InvalidParam(at + ".function", absl::StrCat("unknown field '", at, ".function.", fk, "'"));
          }
        }
      } else {
        return InvalidParam(at, absl::StrCat("unknown field '", at, ".", k, "'"));
      }
    }
    if (!c.contains("function")) return InvalidParam(at + ".function", absl::StrCat("'", at, ".function' is required"));
  }
  return absl::OkStatus();
}

absl::Status UnknownField(const std::string& key) {
  return InvalidParam(key, absl::StrCat("unknown field '", key, "'"));
}

Json Base(const ResponseMeta& meta, absl::string_view object) {
  Json j;
  j["id"] = meta.id;
  j["object"] = std::string(object);
  j["created"] = meta.created;
  j["model"] = meta.model;
  return j;
}

Json FinishReason(absl::string_view reason) { return reason.empty() ? Json(nullptr) : Json(std::string(reason)); }

Json UsageJson(const Usage& u) {
  Json j;
  j["prompt_tokens"] = u.prompt_tokens;
  j["completion_tokens"] = u.completion_tokens;
  j["total_tokens"] = u.prompt_tokens + u.completion_tokens;
  j["prompt_tokens_details"] = {{"cached_tokens", u.cached_tokens}};
  return j;
}

}  // namespace

absl::Status WithParam(absl::Status status, absl::string_view param) {
  return WithRequestField(std::move(status), param);
}

absl::Status InvalidParam(absl::string_view param, absl::string_view message) {
  return InvalidRequestField(param, message);
}

std::string ParamOf(const absl::Status& status) { return RequestFieldOf(status); }

// Token ids, `v` an array; `where` names it in messages ("prompt", "prompt[2]").
absl::StatusOr<std::vector<int64_t>> PromptIds(const Json& v, const std::string& where) {
  std::vector<int64_t> ids;
  for (size_t i = 0; i < v.size(); ++i) {
    absl::StatusOr<int64_t> id = GetInt(v[i], absl::StrCat(where, "[", i, "]"));
    if (!id.ok()) return id.status();
    ids.push_back(*id);
  }
  if (ids.empty()) return InvalidParam("prompt", absl::StrCat("'", where, "' is empty"));
  return ids;
}

// "prompt": a string, token ids, or a list of either (every element of one kind).
absl::StatusOr<std::vector<CompletionPrompt>> ParsePrompts(const Json& v) {
  std::vector<CompletionPrompt> prompts;
  if (v.is_string()) {
    prompts.push_back({.text = v.get<std::string>()});
  } else if (!v.is_array()) {
    return WrongType("prompt", "a string, an array of token ids, or an array of either", v);
  } else if (v.empty()) {
    return InvalidParam("prompt", "'prompt' is empty");
  } else if (!v[0].is_string() && !v[0].is_array()) {
    absl::StatusOr<std::vector<int64_t>> ids = PromptIds(v, "prompt");
    if (!ids.ok()) return ids.status();
    prompts.push_back({.ids = *std::move(ids)});
  } else {
    if (v.size() > kMaxPrompts) {
      return InvalidParam("prompt", absl::StrCat("'prompt' holds ", v.size(), " prompts; at most ", kMaxPrompts,
                                                 " per request"));
    }
    const bool texts = v[0].is_string();
    for (size_t i = 0; i < v.size(); ++i) {
      const std::string where = absl::StrCat("prompt[", i, "]");
      if (texts ? !v[i].is_string() : !v[i].is_array()) {
        const char* want = texts ? "a string" : "an array of token ids";
        return InvalidParam("prompt",
                            absl::StrCat("'", where, "' must be ", want, " as 'prompt[0]' is, got ", TypeName(v[i])));
      }
      if (texts) {
        prompts.push_back({.text = v[i].get<std::string>()});
      } else {
        absl::StatusOr<std::vector<int64_t>> ids = PromptIds(v[i], where);
        if (!ids.ok()) return ids.status();
        prompts.push_back({.ids = *std::move(ids)});
      }
    }
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].text.has_value() && prompts[i].text->empty()) {
      return InvalidParam("prompt",
                          prompts.size() == 1 ? "'prompt' is empty" : absl::StrCat("'prompt[", i, "]' is empty"));
    }
  }
  return prompts;
}

absl::StatusOr<CompletionRequest> ParseCompletionRequest(absl::string_view body) {
  absl::StatusOr<Json> j = ParseObject(body);
  if (!j.ok()) return j.status();
  CompletionRequest r;
  bool has_prompt = false;
  for (const auto& [key, v] : j->items()) {
    absl::StatusOr<bool> shared = ParseSharedField(key, v, &r.fields);
    if (!shared.ok()) return shared.status();
    if (*shared) continue;
    if (key == "prompt") {
      has_prompt = true;
      absl::StatusOr<std::vector<CompletionPrompt>> prompts = ParsePrompts(v);
      if (!prompts.ok()) return prompts.status();
      r.prompts = *std::move(prompts);
    } else if (key == "echo") {
      if (v.is_null()) continue;
      absl::StatusOr<bool> b = GetBool(v, key);
      if (!b.ok()) return b.status();
      r.echo = *b;
    } else if (key == "logprobs") {
      if (v.is_null()) continue;
      absl::StatusOr<int64_t> n = GetInt(v, key);
      if (!n.ok()) return n.status();
      if (*n < 0 || *n > kMaxTopLogprobs) {
        return InvalidParam(key, absl::StrCat("'logprobs' must be in [0, ", kMaxTopLogprobs, "], got ", *n));
      }
      r.fields.logprobs = true;
      r.fields.top_logprobs = *n;
    } else if (key == "suffix") {
      if (!v.is_null()) return InvalidParam(key, "'suffix' is not supported");
    } else {
      return UnknownField(key);
    }
  }
  if (!has_prompt) return InvalidParam("prompt", "'prompt' is required");
  return r;
}

// "messages": OpenAI chat messages (text content only), each validated, naming what is wrong.
absl::StatusOr<std::vector<ChatMessage>> ParseMessages(const Json& v) {
  if (!v.is_array()) return WrongType("messages", "an array of messages", v);
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = absl::StrCat("messages[", i, "]");
    const Json& m = v[i];
    if (!m.is_object()) return WrongType(at, "an object", m);
    ChatMessage msg;
    bool has_role = false, has_content = false;
    for (const auto& [mk, mv] : m.items()) {
      const std::string field = absl::StrCat(at, ".", mk);
      if (mk == "role") {
        if (!mv.is_string()) return WrongType(field, "a string", mv);
        msg.role = mv.get<std::string>();
        if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool" &&
            msg.role != "developer") {
          return InvalidParam(field, absl::StrCat("'", field, "' must be system, user, assistant, tool or developer, got '",
                                                  msg.role, "'"));
        }
        has_role = true;
      } else if (mk == "content") {
        has_content = true;
        if (mv.is_null()) continue;
        if (mv.is_string()) {
          msg.content = mv.get<std::string>();
        } else if (mv.is_array()) {
          for (size_t p = 0; p < mv.size(); ++p) {
            const std::string part = absl::StrCat(field, "[", p, "]");
            const Json& pv = mv[p];
            if (!pv.is_object()) return WrongType(part, "an object", pv);
            if (!pv.contains("type") || pv["type"] != "text" || !pv.contains("text") || !pv["text"].is_string() ||
                pv.size() != 2) {
              return InvalidParam(part, absl::StrCat("'", part, "' must be {\"type\": \"text\", \"text\": \"...\"} (only text is supported)"));
            }
            msg.content += pv["text"].get<std::string>();
          }
        } else {
          return WrongType(field, "a string or an array of text parts", mv);
        }
      } else if (mk == "name") {
        if (!mv.is_string()) return WrongType(field, "a string", mv);
        msg.name = mv.get<std::string>();
      } else if (mk == "tool_call_id") {
        if (mv.is_null()) continue;
        if (!mv.is_string()) return WrongType(field, "a string", mv);
        msg.tool_call_id = mv.get<std::string>();
      } else if (mk == "tool_calls") {
        if (mv.is_null()) continue;
        if (absl::Status st = ValidateToolCalls(mv, field); !st.ok()) return st;
        if (!mv.empty()) msg.tool_calls = mv;
      } else if (mk == "reasoning_content" || mk == "reasoning") {
        if (mv.is_null()) continue;
        if (!mv.is_string()) return WrongType(field, "a string", mv);
        msg.reasoning = mv.get<std::string>();
      } else if (mk == "refusal" || mk == "annotations") {
        // What OpenAI's clients send back of an answer they were given: no meaning to a prompt.
        if (!mv.is_null() && !mv.is_string() && !mv.is_array()) return WrongType(field, "a string or an array", mv);
      } else if (mk == "audio" || mk == "function_call") {
        if (!mv.is_null()) {
          return InvalidParam(field, absl::StrCat("'", field, "' is not supported (", mk == "audio" ? "no audio" : "use tool_calls", ")"));
        }
      } else {
        return InvalidParam(field, absl::StrCat("unknown field '", field, "'"));
      }
    }
    if (!has_role) return InvalidParam(at + ".role", absl::StrCat("'", at, ".role' is required"));
    // An assistant message that calls tools may leave its content out.
    if (!has_content && msg.tool_calls.is_null()) {
      return InvalidParam(at + ".content", absl::StrCat("'", at, ".content' is required"));
    }
    if (!msg.tool_calls.is_null() && msg.role != "assistant") {
      return InvalidParam(at + ".tool_calls", absl::StrCat("'", at, ".tool_calls' is for assistant messages"));
    }
    messages.push_back(std::move(msg));
  }
  if (messages.empty()) return InvalidParam("messages", "'messages' is empty");
  return messages;
}

absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body) {
  absl::StatusOr<Json> j = ParseObject(body);
  if (!j.ok()) return j.status();
  TokenizeRequest r;
  bool has_generation_prompt = false;
  for (const auto& [key, v] : j->items()) {
    if (key == "model") {
      if (!v.is_string()) return WrongType(key, "a string", v);
      r.model = v.get<std::string>();
    } else if (key == "prompt") {
      if (!v.is_string()) return WrongType(key, "a string", v);
      r.prompt = v.get<std::string>();
    } else if (key == "messages") {
      absl::StatusOr<std::vector<ChatMessage>> messages = ParseMessages(v);
      if (!messages.ok()) return messages.status();
      r.messages = *std::move(messages);
    } else if (key == "add_special_tokens" || key == "add_generation_prompt" || key == "continue_final_message") {
      absl::StatusOr<bool> b = GetBool(v, key);
      if (!b.ok()) return b.status();
      if (key == "add_special_tokens") {
        r.add_special_tokens = *b;
      } else if (key == "add_generation_prompt") {
        r.add_generation_prompt = *b;
        has_generation_prompt = true;
      } else {
        r.continue_final_message = *b;
      }
    } else if (key == "chat_template_kwargs") {
      absl::StatusOr<Json> kwargs = GetTemplateKwargs(v, key);
      if (!kwargs.ok()) return kwargs.status();
      r.chat_template_kwargs = *std::move(kwargs);
    } else {
      return UnknownField(key);
    }
  }
  if (r.prompt.has_value() == r.messages.has_value()) {
    return InvalidParam(r.prompt.has_value() ? "messages" : "prompt",
                        "exactly one of 'prompt' and 'messages' is required");
  }
  if (has_generation_prompt && r.prompt.has_value()) {
    return InvalidParam("add_generation_prompt", "'add_generation_prompt' is for 'messages'");
  }
  if (r.continue_final_message && r.prompt.has_value()) {
    return InvalidParam("continue_final_message", "'continue_final_message' is for 'messages'");
  }
  if (!r.chat_template_kwargs.is_null() && r.prompt.has_value()) {
    return InvalidParam("chat_template_kwargs", "'chat_template_kwargs' is for 'messages'");
  }
  if (r.continue_final_message && r.add_generation_prompt) {
    return InvalidParam("continue_final_message", "'continue_final_message' needs 'add_generation_prompt': false");
  }
  return r;
}

absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(absl::string_view body) {
  absl::StatusOr<Json> j = ParseObject(body);
  if (!j.ok()) return j.status();
  DetokenizeRequest r;
  bool has_tokens = false;
  for (const auto& [key, v] : j->items()) {
    if (key == "model") {
      if (!v.is_string()) return WrongType(key, "a string", v);
      r.model = v.get<std::string>();
    } else if (key == "tokens") {
      if (!v.is_array()) return WrongType(key, "an array of token ids", v);
      for (size_t i = 0; i < v.size(); ++i) {
        absl::StatusOr<int64_t> id = GetInt(v[i], absl::StrCat("tokens[", i, "]"));
        if (!id.ok()) return id.status();
        r.tokens.push_back(*id);
      }
      has_tokens = true;
    } else {
      return UnknownField(key);
    }
  }
  if (!has_tokens) return InvalidParam("tokens", "'tokens' is required");
  return r;
}

absl::StatusOr<ChatRequest> ParseChatRequest(absl::string_view body) {
  absl::StatusOr<Json> j = ParseObject(body);
  if (!j.ok()) return j.status();
  ChatRequest r;
  bool has_messages = false;
  bool has_tool_choice = false;
  Json reasoning_effort;  // null: not given
  for (const auto& [key, v] : j->items()) {
    absl::StatusOr<bool> shared = ParseSharedField(key, v, &r.fields);
    if (!shared.ok()) return shared.status();
    if (*shared) continue;
    if (key == "messages") {
      has_messages = true;
      absl::StatusOr<std::vector<ChatMessage>> messages = ParseMessages(v);
      if (!messages.ok()) return messages.status();
      r.messages = *std::move(messages);
    } else if (key == "logprobs") {
      if (v.is_null()) continue;
      absl::StatusOr<bool> b = GetBool(v, key);
      if (!b.ok()) return b.status();
      r.fields.logprobs = *b;
    } else if (key == "tools") {
      if (v.is_null()) continue;
      if (!v.is_array()) return WrongType(key, "an array of tools", v);
      for (size_t i = 0; i < v.size(); ++i) {
        const std::string at = absl::StrCat("tools[", i, "]");
        absl::StatusOr<ToolFunction> f = ParseToolDefinition(v[i], at);
        if (!f.ok()) return WithParam(f.status(), at);
        r.tool_functions.push_back(*std::move(f));
      }
      if (!v.empty()) r.tools = v;
    } else if (key == "tool_choice") {
      if (v.is_null()) continue;
      has_tool_choice = true;
      if (v.is_string()) {
        const std::string c = v.get<std::string>();
        if (c == "none") {
          r.tool_choice = ToolChoice::kNone;
        } else if (c == "auto") {
          r.tool_choice = ToolChoice::kAuto;
        } else if (c == "required") {
          r.tool_choice = ToolChoice::kRequired;
        } else {
          return InvalidParam(key, absl::StrCat("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}, got \"", c, "\""));
        }
      } else if (v.is_object() && v.size() == 2 && v.contains("type") && v["type"] == "function" &&
                 v.contains("function") && v["function"].is_object() && v["function"].size() == 1 &&
                 v["function"].contains("name") && v["function"]["name"].is_string()) {
        r.tool_choice = ToolChoice::kNamed;
        r.tool_name = v["function"]["name"].get<std::string>();
      } else {
        return InvalidParam(key, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
      }
    } else if (key == "parallel_tool_calls") {
      if (v.is_null()) continue;
      absl::StatusOr<bool> b = GetBool(v, key);
      if (!b.ok()) return b.status();
      r.parallel_tool_calls = *b;
    } else if (key == "add_generation_prompt" || key == "continue_final_message") {
      if (v.is_null()) continue;
      absl::StatusOr<bool> b = GetBool(v, key);
      if (!b.ok()) return b.status();
      (key == "add_generation_prompt" ? r.add_generation_prompt : r.continue_final_message) = *b;
    } else if (key == "chat_template_kwargs") {
      absl::StatusOr<Json> kwargs = GetTemplateKwargs(v, key);
      if (!kwargs.ok()) return kwargs.status();
      r.chat_template_kwargs = *std::move(kwargs);
    } else if (key == "reasoning_effort") {
      if (v.is_null()) continue;
      if (!v.is_string() || (v != "low" && v != "medium" && v != "high")) {
        return InvalidParam(key, absl::StrCat("'reasoning_effort' must be \"low\", \"medium\" or \"high\", got ", v.dump()));
      }
      reasoning_effort = v;
    } else if (key == "top_logprobs") {
      if (v.is_null()) continue;
      absl::StatusOr<int64_t> n = GetInt(v, key);
      if (!n.ok()) return n.status();
      if (*n < 0 || *n > kMaxTopLogprobs) {
        return InvalidParam(key, absl::StrCat("'top_logprobs' must be in [0, ", kMaxTopLogprobs, "], got ", *n));
      }
      r.fields.top_logprobs = *n;
    } else {
      return UnknownField(key);
    }
  }
  if (r.fields.top_logprobs > 0 && !r.fields.logprobs) {
    return InvalidParam("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  }
  if (r.continue_final_message && r.add_generation_prompt) {
    return InvalidParam("continue_final_message",
                        "'continue_final_message' needs 'add_generation_prompt': false (the final message is "
                        "continued, no new one is started)");
  }
  // OpenAI's reasoning_effort is the chat template's variable of that name (GPT-OSS's template
  // writes it into the system message).
  if (!reasoning_effort.is_null()) {
    if (r.chat_template_kwargs.is_null()) r.chat_template_kwargs = Json::object();
    if (r.chat_template_kwargs.contains("reasoning_effort")) {
      return InvalidParam("reasoning_effort", "'reasoning_effort' is set twice: also in 'chat_template_kwargs'");
    }
    r.chat_template_kwargs["reasoning_effort"] = reasoning_effort;
  }
  // The tool choice against the tools and the constraint: frontend::Admission.
  if (!has_tool_choice) r.tool_choice = r.tools.is_null() ? ToolChoice::kNone : ToolChoice::kAuto;
  if (!has_messages) return InvalidParam("messages", "'messages' is required");
  if (r.messages.empty()) return InvalidParam("messages", "'messages' is empty");
  return r;
}

ApiError MakeError(int http_status, absl::string_view type, absl::string_view message, absl::string_view code) {
  ApiError e;
  e.http_status = http_status;
  Json err;
  err["message"] = std::string(message);
  err["type"] = std::string(type);
  err["param"] = nullptr;
  err["code"] = code.empty() ? Json(nullptr) : Json(std::string(code));
  e.body["error"] = std::move(err);
  return e;
}

ApiError ErrorFromStatus(const absl::Status& status) {
  ApiError e;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      e = MakeError(400, "invalid_request_error", status.message());
      break;
    case absl::StatusCode::kNotFound: e = MakeError(404, "invalid_request_error", status.message(), "not_found"); break;
    case absl::StatusCode::kUnauthenticated:
      e = MakeError(401, "invalid_request_error", status.message(), "invalid_api_key");
      break;
    case absl::StatusCode::kPermissionDenied:
      e = MakeError(403, "invalid_request_error", status.message(), "permission_denied");
      break;
    case absl::StatusCode::kResourceExhausted:
      e = MakeError(429, "rate_limit_error", status.message(), "queue_full");
      break;
    case absl::StatusCode::kUnavailable:
      e = MakeError(503, "service_unavailable_error", status.message(), "service_unavailable");
      break;
    default: e = MakeError(500, "server_error", status.message()); break;
  }
  if (const std::string param = ParamOf(status); !param.empty()) e.body["error"]["param"] = param;
  return e;
}

std::string SseEvent(absl::string_view data) { return absl::StrCat("data: ", data, "\n\n"); }
std::string SseDone() { return "data: [DONE]\n\n"; }

namespace {

Json Bytes(const std::string& s) {
  Json b = Json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

Json CompletionLogprobs(const std::vector<LogprobEntry>* entries, int64_t text_offset) {
  if (entries == nullptr) return nullptr;
  Json tokens = Json::array(), lps = Json::array(), tops = Json::array(), offsets = Json::array();
  for (const LogprobEntry& e : *entries) {
    tokens.push_back(e.token);
    offsets.push_back(text_offset);
    text_offset += e.text_chars;
    if (!e.has_logprob) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    lps.push_back(e.logprob);
    Json top = Json::object();
    for (const auto& [t, lp] : e.top) {
      if (!top.contains(t)) top[t] = lp;  // two ids may decode alike: the more likely one is kept
    }
    tops.push_back(std::move(top));
  }
  Json j;
  j["tokens"] = std::move(tokens);
  j["token_logprobs"] = std::move(lps);
  j["top_logprobs"] = std::move(tops);
  j["text_offset"] = std::move(offsets);
  return j;
}

Json ChatLogprobs(const std::vector<LogprobEntry>* entries) {
  if (entries == nullptr) return nullptr;
  Json content = Json::array();
  for (const LogprobEntry& e : *entries) {
    Json c;
    c["token"] = e.token;
    c["logprob"] = e.logprob;
    c["bytes"] = Bytes(e.token);
    Json top = Json::array();
    for (const auto& [t, lp] : e.top) {
      Json o;
      o["token"] = t;
      o["logprob"] = lp;
      o["bytes"] = Bytes(t);
      top.push_back(std::move(o));
    }
    c["top_logprobs"] = std::move(top);
    content.push_back(std::move(c));
  }
  Json j;
  j["content"] = std::move(content);
  return j;
}

}  // namespace

Json CompletionResponse(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices, const Usage& usage) {
  Json j = Base(meta, "text_completion");
  Json list = Json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    Json choice;
    choice["index"] = i;
    choice["text"] = choices[i].text;
    choice["logprobs"] = CompletionLogprobs(choices[i].logprobs, 0);
    choice["finish_reason"] = FinishReason(choices[i].finish_reason);
    list.push_back(std::move(choice));
  }
  j["choices"] = std::move(list);
  j["usage"] = UsageJson(usage);
  return j;
}

Json CompletionResponse(const ResponseMeta& meta, absl::string_view text, absl::string_view finish_reason,
                        const Usage& usage, const std::vector<LogprobEntry>* logprobs) {
  return CompletionResponse(
      meta, {ChoiceOutput{.text = std::string(text), .finish_reason = std::string(finish_reason), .logprobs = logprobs}},
      usage);
}

Json CompletionChunk(const ResponseMeta& meta, absl::string_view text, absl::string_view finish_reason,
                     const std::vector<LogprobEntry>* logprobs, int64_t text_offset, int index) {
  Json j = Base(meta, "text_completion");
  Json choice;
  choice["index"] = index;
  choice["text"] = std::string(text);
  choice["logprobs"] = CompletionLogprobs(logprobs, text_offset);
  choice["finish_reason"] = FinishReason(finish_reason);
  j["choices"] = Json::array({std::move(choice)});
  return j;
}

Json ChatResponse(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices, const Usage& usage) {
  Json j = Base(meta, "chat.completion");
  Json list = Json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    Json message;
    message["role"] = "assistant";
    const ChoiceOutput& c = choices[i];
    message["content"] = c.tool_calls.empty() || !c.text.empty() ? Json(c.text) : Json(nullptr);
    if (c.reasoning.has_value()) {
      message["reasoning_content"] = c.reasoning->empty() ? Json(nullptr) : Json(*c.reasoning);
    }
    if (!c.tool_calls.empty()) {
      Json calls = Json::array();
      for (size_t k = 0; k < c.tool_calls.size(); ++k) {
        Json call;
        call["id"] = k < c.tool_call_ids.size() ? c.tool_call_ids[k] : absl::StrCat("call_", k);
        call["type"] = "function";
        call["function"] = {{"name", c.tool_calls[k].name}, {"arguments", c.tool_calls[k].arguments}};
        calls.push_back(std::move(call));
      }
      message["tool_calls"] = std::move(calls);
    }
    Json choice;
    choice["index"] = i;
    choice["message"] = std::move(message);
    choice["logprobs"] = ChatLogprobs(choices[i].logprobs);
    choice["finish_reason"] = FinishReason(choices[i].finish_reason);
    list.push_back(std::move(choice));
  }
  j["choices"] = std::move(list);
  j["usage"] = UsageJson(usage);
  return j;
}

Json ChatResponse(const ResponseMeta& meta, absl::string_view content, absl::string_view finish_reason,
                  const Usage& usage, const std::vector<LogprobEntry>* logprobs) {
  return ChatResponse(
      meta, {ChoiceOutput{.text = std::string(content), .finish_reason = std::string(finish_reason), .logprobs = logprobs}},
      usage);
}

Json ChatChunk(const ResponseMeta& meta, absl::string_view role, const std::optional<std::string>& content,
               absl::string_view finish_reason, const std::vector<LogprobEntry>* logprobs, int index) {
  Json j = Base(meta, "chat.completion.chunk");
  Json delta = Json::object();
  if (!role.empty()) delta["role"] = std::string(role);
  if (content.has_value()) delta["content"] = *content;
  Json choice;
  choice["index"] = index;
  choice["delta"] = std::move(delta);
  choice["logprobs"] = ChatLogprobs(logprobs);
  choice["finish_reason"] = FinishReason(finish_reason);
  j["choices"] = Json::array({std::move(choice)});
  return j;
}

Json ReasoningChunk(const ResponseMeta& meta, absl::string_view reasoning, int index) {
  Json j = Base(meta, "chat.completion.chunk");
  Json choice;
  choice["index"] = index;
  choice["delta"] = {{"reasoning_content", std::string(reasoning)}};
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = nullptr;
  j["choices"] = Json::array({std::move(choice)});
  return j;
}

Json ToolCallChunk(const ResponseMeta& meta, int choice_index, int call_index, const std::string* id,
                   const std::string* name, absl::string_view arguments) {
  Json j = Base(meta, "chat.completion.chunk");
  Json call;
  call["index"] = call_index;
  if (id != nullptr) call["id"] = *id;
  if (name != nullptr) {
    call["type"] = "function";
    call["function"] = {{"name", *name}, {"arguments", std::string(arguments)}};
  } else {
    call["function"] = {{"arguments", std::string(arguments)}};
  }
  Json choice;
  choice["index"] = choice_index;
  choice["delta"] = {{"tool_calls", Json::array({std::move(call)})}};
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = nullptr;
  j["choices"] = Json::array({std::move(choice)});
  return j;
}

Json UsageChunk(const ResponseMeta& meta, absl::string_view object, const Usage& usage) {
  Json j = Base(meta, object);
  j["choices"] = Json::array();
  j["usage"] = UsageJson(usage);
  return j;
}

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace shardserve::coordinator::http
