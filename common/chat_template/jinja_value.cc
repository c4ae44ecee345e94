// Value semantics of the Jinja subset: Python's truthiness, str(), repr(), ==, and json.dumps.
#include <charconv>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/chat_template/internal/jinja_ast.h"

namespace shardserve::jinja {
namespace {

std::string FloatRepr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[64];
  // Python's repr: the shortest round-trip digits; scientific below 1e-4 and from 1e16.
  const double a = std::fabs(f);
  std::to_chars_result r = (a != 0 && (a < 1e-4 || a >= 1e16))
                               ? std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific)
                               : std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::fixed);
  std::string s(buf, r.ptr);
  const size_t e = s.find('e');
  if (e != std::string::npos) {
    // C++ writes 1e+16 and 1e-05; Python writes 1e+16 and 1e-05 too (two exponent digits minimum).
    return s;
  }
  if (s.find('.') == std::string::npos) s += ".0";
  return s;
}

void JsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out->append(buf);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

void Json(const Value& v, int indent, int level, std::string* out) {
  // A namespace may hold itself, and anything may be too large: past kMaxValueDepth levels, or
  // once the text is over kMaxStringBytes (the caller refuses it), nothing more is written.
  if (level > kMaxValueDepth || out->size() > kMaxStringBytes) return;
  auto newline = [&](int lvl) {
    if (indent < 0) return;
    out->push_back('\n');
    out->append(static_cast<size_t>(indent) * static_cast<size_t>(lvl), ' ');
  };
  const char* item_sep = indent < 0 ? ", " : ",";
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
    case Value::Kind::kFunction: out->append("null"); return;
    case Value::Kind::kBool: out->append(v.b ? "true" : "false"); return;
    case Value::Kind::kInt: out->append(absl::StrCat(v.i)); return;
    case Value::Kind::kFloat: {
      if (std::isnan(v.f)) { out->append("NaN"); return; }
      if (std::isinf(v.f)) { out->append(v.f > 0 ? "Infinity" : "-Infinity"); return; }
      out->append(FloatRepr(v.f));
      return;
    }
    case Value::Kind::kString: JsonString(v.s, out); return;
    case Value::Kind::kList: {
      if (v.list->empty()) { out->append("[]"); return; }
      out->push_back('[');
      for (size_t i = 0; i < v.list->size(); ++i) {
        if (i > 0) out->append(item_sep);
        newline(level + 1);
        Json((*v.list)[i], indent, level + 1, out);
      }
      newline(level);
      out->push_back(']');
      return;
    }
    case Value::Kind::kDict: {
      if (v.dict->empty()) { out->append("{}"); return; }
      out->push_back('{');
      for (size_t i = 0; i < v.dict->size(); ++i) {
        if (i > 0) out->append(item_sep);
        newline(level + 1);
        JsonString((*v.dict)[i].first, out);
        out->append(": ");
        Json((*v.dict)[i].second, indent, level + 1, out);
      }
      newline(level);
      out->push_back('}');
      return;
    }
  }
}

std::string StrRepr(const std::string& s) {
  // Python prefers single quotes unless the string has one and no double quote.
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(q)) { out.push_back('\\'); out.push_back(q); }
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else out.push_back(static_cast<char>(c));
  }
  out.push_back(q);
  return out;
}

}  // namespace

const Value* Value::Find(absl::string_view key) const {
  if (kind != Kind::kDict) return nullptr;
  for (const auto& [k, v] : *dict) {
    if (k == key) return &v;
  }
  return nullptr;
}

Value* Value::FindMutable(absl::string_view key) { return const_cast<Value*>(Find(key)); }

void Value::Set(const std::string& key, Value value) {
  if (Value* v = FindMutable(key)) {
    *v = std::move(value);
  } else {
    dict->emplace_back(key, std::move(value));
  }
}

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool: return v.b;
    case Value::Kind::kInt: return v.i != 0;
    case Value::Kind::kFloat: return v.f != 0;
    case Value::Kind::kString: return !v.s.empty();
    case Value::Kind::kList: return !v.list->empty();
    case Value::Kind::kDict: return !v.dict->empty();
    case Value::Kind::kFunction: return true;
  }
  return false;
}

std::string ToString(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kString: return v.s;
    case Value::Kind::kNone:
    case Value::Kind::kBool:
    case Value::Kind::kInt:
    case Value::Kind::kFloat:
    case Value::Kind::kList:
    case Value::Kind::kDict:
    case Value::Kind::kFunction: return Repr(v);
  }
  return "";
}

namespace {

// Python's repr, written into `out`: a value nested past kMaxValueDepth levels (a namespace that
// holds itself, say) is written "[...]", as Python writes a list that holds itself, and nothing
// more is written once `out` is over kMaxStringBytes (the caller refuses it).
void AppendRepr(const Value& v, int depth, std::string* out) {
  if (out->size() > kMaxStringBytes) return;
  if (depth > kMaxValueDepth) {
    out->append("[...]");
    return;
  }
  switch (v.kind) {
    case Value::Kind::kList: {
      out->append(v.is_tuple ? "(" : "[");
      for (size_t i = 0; i < v.list->size() && out->size() <= kMaxStringBytes; ++i) {
        if (i > 0) out->append(", ");
        AppendRepr((*v.list)[i], depth + 1, out);
      }
      out->append(!v.is_tuple ? "]" : v.list->size() == 1 ? ",)" : ")");
      return;
    }
    case Value::Kind::kDict: {
      if (v.is_namespace) {
        out->append("<Namespace>");
        return;
      }
      out->push_back('{');
      for (size_t i = 0; i < v.dict->size() && out->size() <= kMaxStringBytes; ++i) {
        if (i > 0) out->append(", ");
        absl::StrAppend(out, StrRepr((*v.dict)[i].first), ": ");
        AppendRepr((*v.dict)[i].second, depth + 1, out);
      }
      out->push_back('}');
      return;
    }
    case Value::Kind::kUndefined: return;
    case Value::Kind::kNone: out->append("None"); return;
    case Value::Kind::kBool: out->append(v.b ? "True" : "False"); return;
    case Value::Kind::kInt: absl::StrAppend(out, v.i); return;
    case Value::Kind::kFloat: out->append(FloatRepr(v.f)); return;
    case Value::Kind::kString: out->append(StrRepr(v.s)); return;
    case Value::Kind::kFunction: absl::StrAppend(out, "<function ", v.s, ">"); return;
  }
}

}  // namespace

std::string Repr(const Value& v) {
  std::string out;
  AppendRepr(v, 0, &out);
  return out;
}

std::string ToJson(const Value& v, int indent) {
  std::string out;
  Json(v, indent, 0, &out);
  return out;
}

Value FromJson(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
    case nlohmann::ordered_json::value_t::discarded: return Value::None();
    case nlohmann::ordered_json::value_t::boolean: return Value::Bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::Int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      return u > static_cast<uint64_t>(INT64_MAX) ? Value::Float(static_cast<double>(u))
                                                   : Value::Int(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value::Float(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::Str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::binary: return Value::None();
    case nlohmann::ordered_json::value_t::array: {
      Value::List items;
      for (const auto& e : j) items.push_back(FromJson(e));
      return Value::NewList(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value::Dict items;
      for (const auto& [k, e] : j.items()) items.emplace_back(k, FromJson(e));
      return Value::NewDict(std::move(items));
    }
  }
  return Value::None();
}

bool Equal(const Value& a, const Value& b) { return Equal(a, b, 0); }

bool Equal(const Value& a, const Value& b, int depth) {
  // Past kMaxValueDepth (a namespace that holds itself): equal when they are the same object.
  if (depth > kMaxValueDepth) return a.kind == b.kind && a.list == b.list && a.dict == b.dict;
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::kFloat || b.kind == Value::Kind::kFloat) {
      const double x = a.kind == Value::Kind::kFloat ? a.f : static_cast<double>(a.kind == Value::Kind::kBool ? a.b : a.i);
      const double y = b.kind == Value::Kind::kFloat ? b.f : static_cast<double>(b.kind == Value::Kind::kBool ? b.b : b.i);
      return x == y;
    }
    const int64_t x = a.kind == Value::Kind::kBool ? a.b : a.i;
    const int64_t y = b.kind == Value::Kind::kBool ? b.b : b.i;
    return x == y;
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return true;
    case Value::Kind::kString: return a.s == b.s;
    case Value::Kind::kList: {
      if (a.list->size() != b.list->size()) return false;
      for (size_t i = 0; i < a.list->size(); ++i) {
        if (!Equal((*a.list)[i], (*b.list)[i], depth + 1)) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* o = b.Find(k);
        if (o == nullptr || !Equal(v, *o, depth + 1)) return false;
      }
      return true;
    }
    case Value::Kind::kFunction: return a.s == b.s && a.self == b.self;
    case Value::Kind::kBool:
    case Value::Kind::kInt:
    case Value::Kind::kFloat: return false;  // handled above
  }
  return false;
}

}  // namespace shardserve::jinja
