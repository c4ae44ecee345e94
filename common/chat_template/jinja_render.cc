// Evaluation of the Jinja subset: scopes, statements, operators, filters, tests and methods.
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/chat_template/internal/jinja_ast.h"

namespace shardserve::jinja {
namespace {

constexpr size_t kMaxOutputBytes = kMaxStringBytes;
constexpr int64_t kMaxRange = 1 << 20;
// Rendering is bounded in work (statements run and expressions evaluated, up to RenderProgram's
// max_steps: a template that loops a million times a million times ends with an error, not never)
// and in depth (the statements and expressions being evaluated at once, across nested macro calls:
// the recursion stops well before the stack does).
constexpr int64_t kStepsPerIteration = 10;
constexpr int kMaxRenderDepth = 512;

absl::Status Error(int line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("chat template line ", line, ": ", what));
}

std::string TypeName(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "undefined";
    case Value::Kind::kNone: return "none";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return "string";
    case Value::Kind::kList: return "list";
    case Value::Kind::kDict: return "dict";
    case Value::Kind::kFunction: return "function";
  }
  return "?";
}

// UTF-8 characters of `s` (Python indexes strings by code point).
std::vector<std::string> Chars(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = 1;
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0xF0) n = 4;
    else if (c >= 0xE0) n = 3;
    else if (c >= 0xC0) n = 2;
    n = std::min(n, s.size() - i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

double AsDouble(const Value& v) {
  if (v.kind == Value::Kind::kFloat) return v.f;
  if (v.kind == Value::Kind::kBool) return v.b;
  return static_cast<double>(v.i);
}
int64_t AsInt(const Value& v) { return v.kind == Value::Kind::kBool ? v.b : v.i; }

// Items of an iterable: a list, a dict's keys, a string's characters.
absl::StatusOr<Value::List> Iterate(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::kList: return *v.list;
    case Value::Kind::kDict: {
      Value::List keys;
      for (const auto& [k, unused] : *v.dict) keys.push_back(Value::Str(k));
      return keys;
    }
    case Value::Kind::kString: {
      size_t count = 0;  // characters: bytes that do not continue one
      for (char c : v.s) count += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
      if (count > kMaxListItems) return Error(line, "a string of over a million characters taken apart");
      Value::List chars;
      for (std::string& c : Chars(v.s)) chars.push_back(Value::Str(std::move(c)));
      return chars;
    }
    case Value::Kind::kUndefined: return Value::List{};
    case Value::Kind::kNone:
    case Value::Kind::kBool:
    case Value::Kind::kInt:
    case Value::Kind::kFloat:
    case Value::Kind::kFunction: break;
  }
  return Error(line, absl::StrCat("cannot iterate over a ", TypeName(v)));
}

absl::StatusOr<int> Compare(const Value& a, const Value& b, int line) {
  if (a.is_number() && b.is_number()) {
    const double x = AsDouble(a), y = AsDouble(b);
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.kind == Value::Kind::kString && b.kind == Value::Kind::kString) return a.s < b.s ? -1 : (a.s > b.s ? 1 : 0);
  return Error(line, absl::StrCat("cannot order a ", TypeName(a), " and a ", TypeName(b)));
}

class Renderer {
 public:
  // Namespaces are the only values that change after they are made, so the only ones that can hold
  // themselves (set ns.me = ns): emptied when the render ends, they free what they hold.
  ~Renderer() {
    for (const std::shared_ptr<Value::Dict>& ns : namespaces_) ns->clear();
  }
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;

  Renderer(const nlohmann::ordered_json& context, absl::Time now, absl::TimeZone zone, int64_t max_steps)
      : now_(now), zone_(zone), max_steps_(max_steps) {
    scopes_.emplace_back();
    if (context.is_object()) {
      for (const auto& [k, v] : context.items()) scopes_.back()[k] = FromJson(v);
    }
  }

  // Runs `body`'s nodes in order; stops early (without error) after a break or continue, which
  // flow_ then carries to the loop around it.
  absl::Status Render(const Body& body) {
    for (const auto& node : body) {
      if (absl::Status st = Exec(*node); !st.ok()) return st;
      if (flow_ != Flow::kNormal) break;
    }
    return absl::OkStatus();
  }

  std::string& out() { return out_; }

 private:
  using Scope = std::map<std::string, Value, std::less<>>;
  enum class Flow { kNormal, kBreak, kContinue };

  // Renders `body` into a string of its own (a macro's result, a block assignment).
  absl::StatusOr<std::string> Capture(const Body& body) {
    std::string saved;
    saved.swap(out_);
    absl::Status st = Render(body);
    saved.swap(out_);
    if (!st.ok()) return st;
    return saved;
  }

  absl::Status Emit(int line, absl::string_view s) {
    if (out_.size() + s.size() > kMaxOutputBytes) return Error(line, "output exceeds 4 MiB");
    out_.append(s.data(), s.size());
    return absl::OkStatus();
  }

  // Looks in the scopes from the innermost down to frame_base_ (inside a macro: its closure), then
  // in the top level, then among the globals.
  Value Lookup(absl::string_view name) const {
    for (size_t i = scopes_.size(); i-- > frame_base_;) {
      auto found = scopes_[i].find(name);
      if (found != scopes_[i].end()) return found->second;
    }
    if (auto found = scopes_[0].find(name); found != scopes_[0].end()) return found->second;
    if (name == "raise_exception" || name == "namespace" || name == "range" || name == "dict" ||
        name == "strftime_now") {
      return Value::Function(std::string(name));
    }
    return Value();
  }

  // Counts one step of work and one level of depth (undone by the returned cleanup); an error past
  // max_steps_ or kMaxRenderDepth.
  absl::Status Enter(int line) {
    ++depth_;
    if (absl::Status st = Spend(1, line); !st.ok()) return st;
    if (depth_ > kMaxRenderDepth) return Error(line, "the template nests too deeply (macro calls within macro calls)");
    return absl::OkStatus();
  }

  // Counts `steps` of work; an error past max_steps_.
  absl::Status Spend(int64_t steps, int line) {
    steps_ += steps;
    if (steps_ > max_steps_) {
      return Error(line, absl::StrCat("the template does too much work (over ", max_steps_, " steps)"));
    }
    return absl::OkStatus();
  }

  // Like Eval: a dispatcher, with each statement kind out of line.
  absl::Status Exec(const Node& n) {
    const absl::Cleanup leave = [this] { --depth_; };
    if (absl::Status st = Enter(n.line); !st.ok()) return st;
    switch (n.kind) {
      case Node::Kind::kText: return Emit(n.line, n.text);
      case Node::Kind::kOutput: return ExecOutput(n);
      case Node::Kind::kIf: return ExecIf(n);
      case Node::Kind::kFor: return ExecFor(n);
      case Node::Kind::kBreak: flow_ = Flow::kBreak; return absl::OkStatus();
      case Node::Kind::kContinue: flow_ = Flow::kContinue; return absl::OkStatus();
      case Node::Kind::kMacro: return DefineMacro(n);
      case Node::Kind::kSet: return ExecSet(n);
    }
    return absl::OkStatus();
  }

  [[gnu::noinline]] absl::Status ExecOutput(const Node& n) {
    absl::StatusOr<Value> v = Eval(*n.expr);
    if (!v.ok()) return v.status();
    return Emit(n.line, ToString(*v));
  }

  [[gnu::noinline]] absl::Status ExecIf(const Node& n) {
    for (size_t i = 0; i < n.bodies.size(); ++i) {
      if (i < n.conditions.size()) {
        absl::StatusOr<Value> c = Eval(*n.conditions[i]);
        if (!c.ok()) return c.status();
        if (!Truthy(*c)) continue;
      }
      return Render(n.bodies[i]);
    }
    return absl::OkStatus();
  }

  // Jinja2 closes a macro over the variables around its definition (a loop's, say); those of the
  // top level it reads when called.
  [[gnu::noinline]] absl::Status DefineMacro(const Node& n) {
    Value closure = Value::NewDict();
    for (size_t i = frame_base_; i < scopes_.size(); ++i) {
      for (const auto& [k, v] : scopes_[i]) closure.Set(k, v);
    }
    Value macro = Value::Function(n.text, std::make_shared<Value>(std::move(closure)));
    macro.macro = &n;
    scopes_.back()[n.text] = std::move(macro);
    return absl::OkStatus();
  }

  [[gnu::noinline]] absl::Status ExecSet(const Node& n) {
    absl::StatusOr<Value> v;
    if (n.expr == nullptr) {
      absl::StatusOr<std::string> text = Capture(n.bodies[0]);
      if (!text.ok()) return text.status();
      v = Value::Str(*std::move(text));
    } else {
      v = Eval(*n.expr);
    }
    if (!v.ok()) return v.status();
    if (!n.attribute.empty()) {
      Value target = Lookup(n.targets[0]);
      if (target.kind != Value::Kind::kDict || !target.is_namespace) {
        return Error(n.line, absl::StrCat("cannot set an attribute of '", n.targets[0], "' (not a namespace)"));
      }
      target.Set(n.attribute, *std::move(v));
      return absl::OkStatus();
    }
    if (n.targets.size() == 1) {
      scopes_.back()[n.targets[0]] = *std::move(v);
      return absl::OkStatus();
    }
    absl::StatusOr<Value::List> items = Iterate(*v, n.line);
    if (!items.ok()) return items.status();
    if (items->size() != n.targets.size()) return Error(n.line, "wrong number of values to unpack");
    for (size_t i = 0; i < n.targets.size(); ++i) scopes_.back()[n.targets[i]] = (*items)[i];
    return absl::OkStatus();
  }

  absl::Status Bind(const Node& n, const Value& item) {
    if (n.targets.size() == 1) {
      scopes_.back()[n.targets[0]] = item;
      return absl::OkStatus();
    }
    absl::StatusOr<Value::List> parts = Iterate(item, n.line);
    if (!parts.ok()) return parts.status();
    if (parts->size() != n.targets.size()) {
      return Error(n.line, absl::StrCat("cannot unpack ", parts->size(), " values into ", n.targets.size(), " names"));
    }
    for (size_t i = 0; i < n.targets.size(); ++i) scopes_.back()[n.targets[i]] = (*parts)[i];
    return absl::OkStatus();
  }

  [[gnu::noinline]] absl::Status ExecFor(const Node& n) {
    absl::StatusOr<Value> iterable = Eval(*n.expr);
    if (!iterable.ok()) return iterable.status();
    absl::StatusOr<Value::List> all = Iterate(*iterable, n.line);
    if (!all.ok()) return all.status();
    scopes_.emplace_back();
    Value::List items;
    if (n.filter != nullptr) {
      for (const Value& item : *all) {
        if (absl::Status st = Bind(n, item); !st.ok()) return st;
        absl::StatusOr<Value> keep = Eval(*n.filter);
        if (!keep.ok()) return keep.status();
        if (Truthy(*keep)) items.push_back(item);
      }
    } else {
      items = *std::move(all);
    }
    absl::Status st;
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < len && st.ok(); ++i) {
      // An iteration is work even with an empty body (and its `loop` costs about ten steps).
      st = Spend(kStepsPerIteration, n.line);
      if (!st.ok()) break;
      scopes_.back().clear();
      Value loop = Value::NewDict();
      loop.Set("index", Value::Int(i + 1));
      loop.Set("index0", Value::Int(i));
      loop.Set("revindex", Value::Int(len - i));
      loop.Set("revindex0", Value::Int(len - i - 1));
      loop.Set("first", Value::Bool(i == 0));
      loop.Set("last", Value::Bool(i == len - 1));
      loop.Set("length", Value::Int(len));
      loop.Set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value());
      loop.Set("nextitem", i + 1 < len ? items[static_cast<size_t>(i + 1)] : Value());
      scopes_.back()["loop"] = loop;
      st = Bind(n, items[static_cast<size_t>(i)]);
      if (st.ok()) st = Render(n.bodies[0]);
      const Flow flow = std::exchange(flow_, Flow::kNormal);
      if (flow == Flow::kBreak) break;
    }
    scopes_.pop_back();
    if (st.ok() && items.empty() && n.bodies.size() > 1) st = Render(n.bodies[1]);
    return st;
  }

  // Every value a render makes is bounded: strings to kMaxStringBytes, lists to kMaxListItems
  // (growing one by doubling, as a loop may, ends in an error, not in all the memory).
  absl::StatusOr<Value> Eval(const Expr& e) {
    const absl::Cleanup leave = [this] { --depth_; };
    if (absl::Status st = Enter(e.line); !st.ok()) return st;
    absl::StatusOr<Value> v = Dispatch(e);
    if (v.ok() && v->kind == Value::Kind::kString && v->s.size() > kMaxStringBytes) {
      return Error(e.line, "a string over 4 MiB");
    }
    if (v.ok() && v->kind == Value::Kind::kList && v->list->size() > kMaxListItems) {
      return Error(e.line, "a list of over a million items");
    }
    return v;
  }

  // A thin dispatcher: each kind is evaluated by a function of its own, kept out of line so that a
  // level of nesting costs only the frames of the kinds on its path (under ASan an inlined
  // everything-frame took 22 KB).
  absl::StatusOr<Value> Dispatch(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::kLiteral: return e.value;
      case Expr::Kind::kName: return Lookup(e.name);
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: return EvalSequence(e);
      case Expr::Kind::kDict: return EvalDict(e);
      case Expr::Kind::kGetAttr:
      case Expr::Kind::kGetItem: return EvalSubscript(e);
      case Expr::Kind::kSlice: return EvalSlice(e);
      case Expr::Kind::kCall: return EvalCall(e);
      case Expr::Kind::kFilter: return EvalFilter(e);
      case Expr::Kind::kTest: return EvalTestValue(e);
      case Expr::Kind::kUnary: return EvalUnary(e);
      case Expr::Kind::kBinary: return EvalBinary(e);
      case Expr::Kind::kCondition: return EvalCondition(e);
    }
    return Value();
  }

  [[gnu::noinline]] absl::StatusOr<Value> EvalSequence(const Expr& e) {
    Value::List items;
    for (const auto& item : e.items) {
      absl::StatusOr<Value> v = Eval(*item);
      if (!v.ok()) return v.status();
      items.push_back(*std::move(v));
    }
    Value list = Value::NewList(std::move(items));
    list.is_tuple = e.kind == Expr::Kind::kTuple;
    return list;
  }

  [[gnu::noinline]] absl::StatusOr<Value> EvalDict(const Expr& e) {
    Value d = Value::NewDict();
    for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
      absl::StatusOr<Value> k = Eval(*e.items[i]);
      if (!k.ok()) return k.status();
      absl::StatusOr<Value> v = Eval(*e.items[i + 1]);
      if (!v.ok()) return v.status();
      if (k->kind != Value::Kind::kString) return Error(e.line, "dict keys must be strings");
      d.Set(k->s, *std::move(v));
    }
    return d;
  }

  [[gnu::noinline]] absl::StatusOr<Value> EvalSubscript(const Expr& e) {
    absl::StatusOr<Value> obj = Eval(*e.a);
    if (!obj.ok()) return obj.status();
    if (e.kind == Expr::Kind::kGetAttr) return GetAttr(*obj, e.name);
    absl::StatusOr<Value> key = Eval(*e.b);
    if (!key.ok()) return key.status();
    return GetItem(*obj, *key);
  }

  [[gnu::noinline]] absl::StatusOr<Value> EvalTestValue(const Expr& e) {
    absl::StatusOr<bool> r = EvalTest(e);
    if (!r.ok()) return r.status();
    return Value::Bool(*r != e.negated);
  }

  [[gnu::noinline]] absl::StatusOr<Value> EvalUnary(const Expr& e) {
    absl::StatusOr<Value> v = Eval(*e.a);
    if (!v.ok()) return v.status();
    if (e.name == "not") return Value::Bool(!Truthy(*v));
    if (!v->is_number()) return Error(e.line, absl::StrCat("bad operand for unary ", e.name, ": ", TypeName(*v)));
    if (e.name == "+") return *v;
    if (v->kind == Value::Kind::kFloat) return Value::Float(-v->f);
    if (AsInt(*v) == INT64_MIN) return Error(e.line, "integer overflow");
    return Value::Int(-AsInt(*v));
  }

  [[gnu::noinline]] absl::StatusOr<Value> EvalCondition(const Expr& e) {
    absl::StatusOr<Value> c = Eval(*e.b);
    if (!c.ok()) return c.status();
    if (Truthy(*c)) return Eval(*e.a);
    if (e.c == nullptr) return Value();
    return Eval(*e.c);
  }

  absl::StatusOr<Value> GetAttr(const Value& obj, const std::string& name) {
    if (obj.kind == Value::Kind::kDict) {
      if (const Value* v = obj.Find(name)) return *v;
      if (name == "items" || name == "keys" || name == "values" || name == "get") {
        return Value::Function("dict." + name, std::make_shared<Value>(obj));
      }
      return Value();
    }
    if (obj.kind == Value::Kind::kString) {
      static constexpr absl::string_view kMethods[] = {"strip", "lstrip", "rstrip", "split", "startswith", "endswith",
                                                       "upper", "lower", "replace", "title", "capitalize"};
      for (absl::string_view m : kMethods) {
        if (name == m) return Value::Function("str." + name, std::make_shared<Value>(obj));
      }
    }
    return Value();
  }

  absl::StatusOr<Value> GetItem(const Value& obj, const Value& key) {
    if (obj.kind == Value::Kind::kDict) {
      if (key.kind != Value::Kind::kString) return Value();
      const Value* v = obj.Find(key.s);
      return v != nullptr ? *v : Value();
    }
    if ((obj.kind == Value::Kind::kList || obj.kind == Value::Kind::kString) && key.kind == Value::Kind::kInt) {
      std::vector<std::string> chars;
      if (obj.kind == Value::Kind::kString) chars = Chars(obj.s);
      const int64_t n = obj.kind == Value::Kind::kList ? static_cast<int64_t>(obj.list->size())
                                                       : static_cast<int64_t>(chars.size());
      int64_t i = key.i < 0 ? key.i + n : key.i;
      if (i < 0 || i >= n) return Value();
      if (obj.kind == Value::Kind::kList) return (*obj.list)[static_cast<size_t>(i)];
      return Value::Str(chars[static_cast<size_t>(i)]);
    }
    if (key.kind == Value::Kind::kString) return GetAttr(obj, key.s);
    return Value();
  }

  [[gnu::noinline]] absl::StatusOr<Value> EvalSlice(const Expr& e) {
    absl::StatusOr<Value> obj = Eval(*e.a);
    if (!obj.ok()) return obj.status();
    std::optional<int64_t> bounds[3];
    for (int k = 0; k < 3; ++k) {
      if (e.items[static_cast<size_t>(k)] == nullptr) continue;
      absl::StatusOr<Value> v = Eval(*e.items[static_cast<size_t>(k)]);
      if (!v.ok()) return v.status();
      if (v->kind == Value::Kind::kNone) continue;
      if (v->kind != Value::Kind::kInt) return Error(e.line, "slice indices must be integers");
      bounds[k] = v->i;
    }
    const int64_t step = bounds[2].value_or(1);
    if (step == 0) return Error(e.line, "slice step cannot be zero");
    std::vector<Value> src;
    if (obj->kind == Value::Kind::kList) {
      src = *obj->list;
    } else if (obj->kind == Value::Kind::kString) {
      for (std::string& c : Chars(obj->s)) src.push_back(Value::Str(std::move(c)));
    } else {
      return Error(e.line, absl::StrCat("cannot slice a ", TypeName(*obj)));
    }
    // Python's slice.indices().
    const int64_t n = static_cast<int64_t>(src.size());
    auto clamp = [&](std::optional<int64_t> b, int64_t dflt) {
      if (!b.has_value()) return dflt;
      int64_t x = *b < 0 ? std::max<int64_t>(*b + n, step < 0 ? -1 : 0) : *b;
      return std::min(x, step < 0 ? n - 1 : n);
    };
    const int64_t start = clamp(bounds[0], step < 0 ? n - 1 : 0);
    const int64_t stop = clamp(bounds[1], step < 0 ? -1 : n);
    std::vector<Value> out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(src[static_cast<size_t>(i)]);
    if (obj->kind == Value::Kind::kList) return Value::NewList(std::move(out));
    std::string s;
    for (const Value& c : out) s += c.s;
    return Value::Str(std::move(s));
  }

  absl::StatusOr<std::vector<Value>> EvalArgs(const Expr& e) {
    std::vector<Value> args;
    for (const auto& a : e.items) {
      absl::StatusOr<Value> v = Eval(*a);
      if (!v.ok()) return v.status();
      args.push_back(*std::move(v));
    }
    return args;
  }

  absl::StatusOr<Value> Kwarg(const Expr& e, absl::string_view name) {
    for (const auto& [k, v] : e.kwargs) {
      if (k == name) return Eval(*v);
    }
    return Value();
  }

  [[gnu::noinline]] absl::StatusOr<Value> EvalCall(const Expr& e) {
    absl::StatusOr<Value> fn = Eval(*e.a);
    if (!fn.ok()) return fn.status();
    if (fn->kind != Value::Kind::kFunction) {
      return Error(e.line, absl::StrCat("cannot call a ", TypeName(*fn), e.a->kind == Expr::Kind::kName ? " ('" : "",
                                        e.a->kind == Expr::Kind::kName ? e.a->name + "')" : ""));
    }
    absl::StatusOr<std::vector<Value>> args = EvalArgs(e);
    if (!args.ok()) return args.status();
    if (fn->macro != nullptr) return CallMacro(e, *fn, *std::move(args));
    const std::string& name = fn->s;
    if (name == "strftime_now") {
      if (args->size() != 1 || (*args)[0].kind != Value::Kind::kString) {
        return Error(e.line, "strftime_now() takes one format string");
      }
      return StrftimeNow(e.line, (*args)[0].s);
    }
    if (name == "raise_exception") {
      return absl::InvalidArgumentError(
          absl::StrCat("chat template error: ", args->empty() ? "" : ToString((*args)[0])));
    }
    if (name == "namespace" || name == "dict") {
      Value ns = Value::NewDict();
      ns.is_namespace = name == "namespace";
      if (ns.is_namespace) namespaces_.push_back(ns.dict);
      for (const auto& [k, v] : e.kwargs) {
        absl::StatusOr<Value> val = Eval(*v);
        if (!val.ok()) return val.status();
        ns.Set(k, *std::move(val));
      }
      return ns;
    }
    if (name == "range") {
      if (args->empty() || args->size() > 3) return Error(e.line, "range() takes 1 to 3 arguments");
      for (const Value& a : *args) {
        if (a.kind != Value::Kind::kInt) return Error(e.line, "range() arguments must be integers");
      }
      int64_t start = 0, stop = 0, step = 1;
      if (args->size() == 1) {
        stop = (*args)[0].i;
      } else {
        start = (*args)[0].i;
        stop = (*args)[1].i;
        if (args->size() == 3) step = (*args)[2].i;
      }
      if (step == 0) return Error(e.line, "range() step must not be zero");
      Value::List items;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (static_cast<int64_t>(items.size()) >= kMaxRange) return Error(e.line, "range() too long");
        items.push_back(Value::Int(i));
      }
      return Value::NewList(std::move(items));
    }
    return CallMethod(e, *fn->self, name, *args);
  }

  // Binds a call's arguments to the macro's parameters (Jinja2's rules: positional, then by name;
  // a parameter given neither is its default or Undefined; extra ones only where the body reads
  // varargs or kwargs), then renders its body in a frame that sees its closure and the top level.
  [[gnu::noinline]] absl::StatusOr<Value> CallMacro(const Expr& e, const Value& fn, std::vector<Value> args) {
    const Node& m = *fn.macro;
    if (macro_depth_ >= kMaxMacroDepth) {
      return Error(e.line, absl::StrCat("macro calls nested more than ", kMaxMacroDepth, " deep (in '", m.text, "')"));
    }
    const size_t params = m.targets.size();
    if (args.size() > params && !m.takes_varargs) {
      return Error(e.line, absl::StrCat("macro '", m.text, "' takes not more than ", params, " argument(s)"));
    }
    Scope locals;
    std::vector<bool> given(params, false);
    Value varargs = Value::NewList();
    varargs.is_tuple = true;
    for (size_t i = 0; i < args.size(); ++i) {
      if (i < params) {
        locals[m.targets[i]] = std::move(args[i]);
        given[i] = true;
      } else {
        varargs.list->push_back(std::move(args[i]));
      }
    }
    Value kwargs = Value::NewDict();
    for (const auto& [key, expr] : e.kwargs) {
      absl::StatusOr<Value> v = Eval(*expr);
      if (!v.ok()) return v.status();
      auto param = std::find(m.targets.begin(), m.targets.end(), key);
      if (param != m.targets.end()) {
        const size_t i = static_cast<size_t>(param - m.targets.begin());
        if (given[i]) {
          return Error(e.line, absl::StrCat("macro '", m.text, "' takes no keyword argument '", key,
                                            "' (it is given by position)"));
        }
        locals[key] = *std::move(v);
        given[i] = true;
      } else if (m.takes_kwargs) {
        kwargs.Set(key, *std::move(v));
      } else {
        return Error(e.line, absl::StrCat("macro '", m.text, "' takes no keyword argument '", key, "'"));
      }
    }
    if (m.takes_varargs) locals["varargs"] = std::move(varargs);
    if (m.takes_kwargs) locals["kwargs"] = std::move(kwargs);

    // The macro's frame: its closure, then its locals; the caller's scopes are out of sight.
    const size_t saved_base = frame_base_;
    const size_t saved_size = scopes_.size();
    scopes_.emplace_back();
    if (fn.self != nullptr && fn.self->kind == Value::Kind::kDict) {
      for (const auto& [k, v] : *fn.self->dict) scopes_.back()[k] = v;
    }
    frame_base_ = saved_size;
    scopes_.push_back(std::move(locals));
    ++macro_depth_;
    absl::Status st;
    // Defaults are evaluated at the call, in order, and may read the parameters before them.
    for (size_t i = 0; i < params && st.ok(); ++i) {
      if (given[i]) continue;
      if (m.defaults[i] == nullptr) {
        scopes_.back()[m.targets[i]] = Value();
        continue;
      }
      absl::StatusOr<Value> v = Eval(*m.defaults[i]);
      if (v.ok()) scopes_.back()[m.targets[i]] = *std::move(v);
      else st = v.status();
    }
    absl::StatusOr<std::string> text = st.ok() ? Capture(m.bodies[0]) : absl::StatusOr<std::string>(st);
    --macro_depth_;
    scopes_.resize(saved_size);
    frame_base_ = saved_base;
    flow_ = Flow::kNormal;
    if (!text.ok()) return text.status();
    return Value::Str(*std::move(text));
  }

  // Python's datetime.now().strftime(format) over the render's time (absl::FormatTime hands the
  // standard conversions to C's strftime, as CPython does).
  absl::StatusOr<Value> StrftimeNow(int line, const std::string& format) {
    if (format.size() > 256) return Error(line, "strftime_now() format longer than 256 bytes");
    return Value::Str(absl::FormatTime(format, now_, zone_));
  }

  absl::StatusOr<Value> CallMethod(const Expr& e, const Value& self, const std::string& name,
                                   const std::vector<Value>& args) {
    auto str_arg = [&](size_t i) -> std::optional<std::string> {
      if (i < args.size() && args[i].kind == Value::Kind::kString) return args[i].s;
      return std::nullopt;
    };
    if (name == "dict.items" || name == "dict.keys" || name == "dict.values") {
      Value::List out;
      for (const auto& [k, v] : *self.dict) {
        if (name == "dict.items") out.push_back(Value::NewList({Value::Str(k), v}));
        else if (name == "dict.keys") out.push_back(Value::Str(k));
        else out.push_back(v);
      }
      return Value::NewList(std::move(out));
    }
    if (name == "dict.get") {
      std::optional<std::string> key = str_arg(0);
      const Value* v = key.has_value() ? self.Find(*key) : nullptr;
      if (v != nullptr) return *v;
      return args.size() > 1 ? args[1] : Value::None();
    }
    const std::string& s = self.s;
    if (name == "str.strip" || name == "str.lstrip" || name == "str.rstrip") {
      const std::string chars = str_arg(0).value_or(" \t\n\r\f\v");
      size_t b = 0, en = s.size();
      if (name != "str.rstrip") while (b < en && chars.find(s[b]) != std::string::npos) ++b;
      if (name != "str.lstrip") while (en > b && chars.find(s[en - 1]) != std::string::npos) --en;
      return Value::Str(s.substr(b, en - b));
    }
    if (name == "str.startswith" || name == "str.endswith") {
      std::optional<std::string> x = str_arg(0);
      if (!x.has_value()) return Error(e.line, absl::StrCat(name, "() needs a string argument"));
      return Value::Bool(name == "str.startswith" ? absl::StartsWith(s, *x) : absl::EndsWith(s, *x));
    }
    if (name == "str.upper") return Value::Str(absl::AsciiStrToUpper(s));
    if (name == "str.lower") return Value::Str(absl::AsciiStrToLower(s));
    if (name == "str.title" || name == "str.capitalize") return Value::Str(Title(s, name == "str.title"));
    if (name == "str.replace") {
      std::optional<std::string> from = str_arg(0), to = str_arg(1);
      if (!from.has_value() || !to.has_value()) return Error(e.line, "replace() needs two strings");
      return Replace(e.line, s, *from, *to);
    }
    if (name == "str.split") {
      Value::List parts;
      if (std::optional<std::string> sep = str_arg(0); sep.has_value() && !sep->empty()) {
        for (absl::string_view p : absl::StrSplit(s, *sep)) parts.push_back(Value::Str(std::string(p)));
      } else {
        for (absl::string_view p : absl::StrSplit(s, absl::ByAnyChar(" \t\n\r\f\v"), absl::SkipEmpty())) {
          parts.push_back(Value::Str(std::string(p)));
        }
      }
      return Value::NewList(std::move(parts));
    }
    return Error(e.line, absl::StrCat("unknown function ", name));
  }

  // str.replace, refused when the result would be over kMaxStringBytes.
  static absl::StatusOr<Value> Replace(int line, const std::string& s, const std::string& from, const std::string& to) {
    if (!from.empty() && to.size() > from.size()) {
      size_t count = 0;
      for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + from.size())) ++count;
      if (s.size() + count * (to.size() - from.size()) > kMaxStringBytes) return Error(line, "replace makes a string over 4 MiB");
    }
    return Value::Str(absl::StrReplaceAll(s, {{from, to}}));
  }

  static std::string Title(const std::string& s, bool every_word) {
    std::string out = absl::AsciiStrToLower(s);
    bool start = true;
    for (char& c : out) {
      if (start && absl::ascii_isalpha(static_cast<unsigned char>(c))) c = absl::ascii_toupper(static_cast<unsigned char>(c));
      if (every_word) {
        start = !absl::ascii_isalnum(static_cast<unsigned char>(c));
      } else {
        start = false;
      }
    }
    return out;
  }

  [[gnu::noinline]] absl::StatusOr<Value> EvalFilter(const Expr& e) {
    absl::StatusOr<Value> in = Eval(*e.a);
    if (!in.ok()) return in.status();
    absl::StatusOr<std::vector<Value>> args = EvalArgs(e);
    if (!args.ok()) return args.status();
    const Value& v = *in;
    const std::string& f = e.name;
    if (f == "trim") {
      return Value::Str(std::string(absl::StripAsciiWhitespace(ToString(v))));
    }
    if (f == "length" || f == "count") {
      if (v.kind == Value::Kind::kString) return Value::Int(static_cast<int64_t>(Chars(v.s).size()));
      if (v.kind == Value::Kind::kList) return Value::Int(static_cast<int64_t>(v.list->size()));
      if (v.kind == Value::Kind::kDict) return Value::Int(static_cast<int64_t>(v.dict->size()));
      if (v.kind == Value::Kind::kUndefined) return Value::Int(0);
      return Error(e.line, absl::StrCat("a ", TypeName(v), " has no length"));
    }
    if (f == "tojson") {
      absl::StatusOr<Value> indent = Kwarg(e, "indent");
      if (!indent.ok()) return indent.status();
      int n = -1;
      if (indent->kind == Value::Kind::kInt) n = static_cast<int>(std::clamp<int64_t>(indent->i, 0, 64));
      if (!args->empty() && (*args)[0].kind == Value::Kind::kInt) n = static_cast<int>(std::clamp<int64_t>((*args)[0].i, 0, 64));
      return Value::Str(ToJson(v, n));
    }
    if (f == "upper") return Value::Str(absl::AsciiStrToUpper(ToString(v)));
    if (f == "lower") return Value::Str(absl::AsciiStrToLower(ToString(v)));
    if (f == "capitalize") return Value::Str(Title(ToString(v), false));
    if (f == "title") return Value::Str(Title(ToString(v), true));
    if (f == "string") return Value::Str(ToString(v));
    if (f == "safe" || f == "e" || f == "escape") {
      if (f != "safe") return Error(e.line, "the escape filter is not supported");
      return v;
    }
    if (f == "default" || f == "d") {
      const bool boolean = args->size() > 1 && Truthy((*args)[1]);
      if (!v.defined() || (boolean && !Truthy(v))) return args->empty() ? Value::Str("") : (*args)[0];
      return v;
    }
    if (f == "join") {
      absl::StatusOr<Value::List> items = Iterate(v, e.line);
      if (!items.ok()) return items.status();
      const std::string sep = !args->empty() ? ToString((*args)[0]) : "";
      std::vector<std::string> parts;
      size_t bytes = 0;
      for (const Value& x : *items) {
        parts.push_back(ToString(x));
        bytes += parts.back().size() + sep.size();
        if (bytes > kMaxStringBytes) return Error(e.line, "join makes a string over 4 MiB");
      }
      return Value::Str(absl::StrJoin(parts, sep));
    }
    if (f == "first" || f == "last") {
      absl::StatusOr<Value::List> items = Iterate(v, e.line);
      if (!items.ok()) return items.status();
      if (items->empty()) return Value();
      return f == "first" ? items->front() : items->back();
    }
    if (f == "list") {
      absl::StatusOr<Value::List> items = Iterate(v, e.line);
      if (!items.ok()) return items.status();
      return Value::NewList(*std::move(items));
    }
    if (f == "reverse") {
      if (v.kind == Value::Kind::kString) {
        std::vector<std::string> chars = Chars(v.s);
        std::reverse(chars.begin(), chars.end());
        return Value::Str(absl::StrJoin(chars, ""));
      }
      absl::StatusOr<Value::List> items = Iterate(v, e.line);
      if (!items.ok()) return items.status();
      std::reverse(items->begin(), items->end());
      return Value::NewList(*std::move(items));
    }
    if (f == "items") {
      if (v.kind != Value::Kind::kDict) return Error(e.line, "items needs a dict");
      Value::List out;
      for (const auto& [k, x] : *v.dict) out.push_back(Value::NewList({Value::Str(k), x}));
      return Value::NewList(std::move(out));
    }
    if (f == "int") {
      if (v.kind == Value::Kind::kFloat) return Value::Int(static_cast<int64_t>(v.f));
      if (v.is_number()) return Value::Int(AsInt(v));
      if (v.kind == Value::Kind::kString) {
        int64_t x = 0;
        if (absl::SimpleAtoi(absl::StripAsciiWhitespace(v.s), &x)) return Value::Int(x);
      }
      return Value::Int(0);
    }
    if (f == "float") {
      if (v.is_number()) return Value::Float(AsDouble(v));
      double x = 0;
      if (v.kind == Value::Kind::kString && absl::SimpleAtod(v.s, &x)) return Value::Float(x);
      return Value::Float(0);
    }
    if (f == "abs") {
      if (v.kind == Value::Kind::kFloat) return Value::Float(std::fabs(v.f));
      if (v.is_number() && AsInt(v) != INT64_MIN) return Value::Int(std::abs(AsInt(v)));
      return Error(e.line, "abs needs a number");
    }
    if (f == "round") {
      if (!v.is_number()) return Error(e.line, "round needs a number");
      return Value::Float(std::round(AsDouble(v)));
    }
    if (f == "replace") {
      if (args->size() < 2) return Error(e.line, "replace needs two arguments");
      return Replace(e.line, ToString(v), ToString((*args)[0]), ToString((*args)[1]));
    }
    if (f == "selectattr" || f == "rejectattr" || f == "map" || f == "sort") {
      return FilterSequence(e, v, *args);
    }
    return Error(e.line, absl::StrCat("unknown filter '", f, "'"));
  }

  absl::StatusOr<Value> FilterSequence(const Expr& e, const Value& v, const std::vector<Value>& args) {
    absl::StatusOr<Value::List> items = Iterate(v, e.line);
    if (!items.ok()) return items.status();
    const std::string& f = e.name;
    if (f == "map" || f == "sort") {
      absl::StatusOr<Value> attribute = Kwarg(e, "attribute");
      if (!attribute.ok()) return attribute.status();
      auto key = [&](const Value& x) -> Value {
        if (attribute->kind != Value::Kind::kString) return x;
        const Value* found = x.Find(attribute->s);
        return found != nullptr ? *found : Value();
      };
      if (f == "map") {
        if (attribute->kind != Value::Kind::kString) return Error(e.line, "map is supported with attribute= only");
        Value::List out;
        for (const Value& x : *items) out.push_back(key(x));
        return Value::NewList(std::move(out));
      }
      absl::Status st;
      std::stable_sort(items->begin(), items->end(), [&](const Value& a, const Value& b) {
        absl::StatusOr<int> c = Compare(key(a), key(b), e.line);
        if (!c.ok()) {
          st = c.status();
          return false;
        }
        return *c < 0;
      });
      if (!st.ok()) return st;
      return Value::NewList(*std::move(items));
    }
    if (args.empty() || args[0].kind != Value::Kind::kString) return Error(e.line, absl::StrCat(f, " needs an attribute name"));
    Value::List out;
    for (const Value& x : *items) {
      const Value* attr = x.Find(args[0].s);
      const Value a = attr != nullptr ? *attr : Value();
      bool pass = Truthy(a);
      if (args.size() > 1) {
        absl::StatusOr<bool> t = ApplyTest(e.line, ToString(args[1]), a, {args.begin() + 2, args.end()});
        if (!t.ok()) return t.status();
        pass = *t;
      }
      if (pass == (f == "selectattr")) out.push_back(x);
    }
    return Value::NewList(std::move(out));
  }

  [[gnu::noinline]] absl::StatusOr<bool> EvalTest(const Expr& e) {
    absl::StatusOr<Value> v = Eval(*e.a);
    if (!v.ok()) return v.status();
    absl::StatusOr<std::vector<Value>> args = EvalArgs(e);
    if (!args.ok()) return args.status();
    return ApplyTest(e.line, e.name, *v, *args);
  }

  absl::StatusOr<bool> ApplyTest(int line, const std::string& t, const Value& v, const std::vector<Value>& args) {
    using K = Value::Kind;
    if (t == "defined") return v.defined();
    if (t == "undefined") return !v.defined();
    if (t == "none") return v.kind == K::kNone;
    if (t == "string") return v.kind == K::kString;
    if (t == "number") return v.kind == K::kInt || v.kind == K::kFloat;
    if (t == "integer") return v.kind == K::kInt;
    if (t == "float") return v.kind == K::kFloat;
    if (t == "boolean") return v.kind == K::kBool;
    if (t == "true") return v.kind == K::kBool && v.b;
    if (t == "false") return v.kind == K::kBool && !v.b;
    if (t == "mapping") return v.kind == K::kDict;
    if (t == "iterable") return v.kind == K::kList || v.kind == K::kDict || v.kind == K::kString;
    if (t == "sequence") return v.kind == K::kList || v.kind == K::kDict || v.kind == K::kString;
    if (t == "callable") return v.kind == K::kFunction;
    if (t == "odd" || t == "even") {
      if (v.kind != K::kInt) return Error(line, absl::StrCat("the ", t, " test needs an integer"));
      return (v.i % 2 != 0) == (t == "odd");
    }
    if (args.empty()) return Error(line, absl::StrCat("unknown test '", t, "' or missing argument"));
    const Value& x = args[0];
    if (t == "equalto" || t == "eq" || t == "==" || t == "sameas") return Equal(v, x);
    if (t == "ne" || t == "!=") return !Equal(v, x);
    if (t == "divisibleby") {
      if (v.kind != K::kInt || x.kind != K::kInt || x.i == 0) return Error(line, "divisibleby needs non-zero integers");
      return v.i % x.i == 0;
    }
    if (t == "in") return Contains(x, v, line);
    return Error(line, absl::StrCat("unknown test '", t, "'"));
  }

  absl::StatusOr<bool> Contains(const Value& container, const Value& item, int line) {
    switch (container.kind) {
      case Value::Kind::kString:
        if (item.kind != Value::Kind::kString) return Error(line, "'in <string>' needs a string on the left");
        return container.s.find(item.s) != std::string::npos;
      case Value::Kind::kList:
        for (const Value& x : *container.list) {
          if (Equal(x, item)) return true;
        }
        return false;
      case Value::Kind::kDict: return item.kind == Value::Kind::kString && container.Find(item.s) != nullptr;
      case Value::Kind::kUndefined: return false;
      case Value::Kind::kNone:
      case Value::Kind::kBool:
      case Value::Kind::kInt:
      case Value::Kind::kFloat:
      case Value::Kind::kFunction: break;
    }
    return Error(line, absl::StrCat("'in' needs a string, list or dict on the right, not a ", TypeName(container)));
  }

  [[gnu::noinline]] absl::StatusOr<Value> EvalBinary(const Expr& e) {
    const std::string& op = e.name;
    absl::StatusOr<Value> a = Eval(*e.a);
    if (!a.ok()) return a.status();
    if (op == "and") return Truthy(*a) ? Eval(*e.b) : *a;
    if (op == "or") return Truthy(*a) ? *a : Eval(*e.b);
    absl::StatusOr<Value> b = Eval(*e.b);
    if (!b.ok()) return b.status();
    if (op == "==") return Value::Bool(Equal(*a, *b));
    if (op == "!=") return Value::Bool(!Equal(*a, *b));
    if (op == "<" || op == "<=" || op == ">" || op == ">=") {
      absl::StatusOr<int> c = Compare(*a, *b, e.line);
      if (!c.ok()) return c.status();
      if (op == "<") return Value::Bool(*c < 0);
      if (op == "<=") return Value::Bool(*c <= 0);
      if (op == ">") return Value::Bool(*c > 0);
      return Value::Bool(*c >= 0);
    }
    if (op == "in" || op == "not in") {
      absl::StatusOr<bool> in = Contains(*b, *a, e.line);
      if (!in.ok()) return in.status();
      return Value::Bool(*in == (op == "in"));
    }
    if (op == "~") return Value::Str(ToString(*a) + ToString(*b));
    if (op == "+") {
      if (a->kind == Value::Kind::kString && b->kind == Value::Kind::kString) return Value::Str(a->s + b->s);
      if (a->kind == Value::Kind::kList && b->kind == Value::Kind::kList) {
        if (a->list->size() + b->list->size() > kMaxListItems) return Error(e.line, "a list of over a million items");
        Value::List items = *a->list;
        items.insert(items.end(), b->list->begin(), b->list->end());
        return Value::NewList(std::move(items));
      }
    }
    if (op == "*" && a->kind == Value::Kind::kString && b->kind == Value::Kind::kInt) {
      if (b->i > 0 && a->s.size() * static_cast<uint64_t>(b->i) > kMaxOutputBytes) return Error(e.line, "string too long");
      std::string out;
      for (int64_t i = 0; i < b->i; ++i) out += a->s;
      return Value::Str(std::move(out));
    }
    if (!a->is_number() || !b->is_number()) {
      return Error(e.line, absl::StrCat("unsupported operand types for ", op, ": ", TypeName(*a), " and ", TypeName(*b)));
    }
    const bool floats = a->kind == Value::Kind::kFloat || b->kind == Value::Kind::kFloat;
    if (op == "/") {
      if (AsDouble(*b) == 0) return Error(e.line, "division by zero");
      return Value::Float(AsDouble(*a) / AsDouble(*b));
    }
    if (floats) {
      const double x = AsDouble(*a), y = AsDouble(*b);
      if (op == "+") return Value::Float(x + y);
      if (op == "-") return Value::Float(x - y);
      if (op == "*") return Value::Float(x * y);
      if (op == "**") return Value::Float(std::pow(x, y));
      if (y == 0) return Error(e.line, "division by zero");
      if (op == "//") return Value::Float(std::floor(x / y));
      return Value::Float(x - std::floor(x / y) * y);
    }
    const int64_t x = AsInt(*a), y = AsInt(*b);
    int64_t r = 0;
    bool overflow = false;
    if (op == "+") overflow = __builtin_add_overflow(x, y, &r);
    else if (op == "-") overflow = __builtin_sub_overflow(x, y, &r);
    else if (op == "*") overflow = __builtin_mul_overflow(x, y, &r);
    else if (op == "**") {
      if (y < 0) return Value::Float(std::pow(static_cast<double>(x), static_cast<double>(y)));
      r = 1;
      if (x == 0 || x == 1) {
        r = y == 0 ? 1 : x;
      } else if (x == -1) {
        r = y % 2 == 0 ? 1 : -1;
      } else {
        for (int64_t i = 0; i < y && !overflow; ++i) overflow = __builtin_mul_overflow(r, x, &r);  // |x| >= 2: <= 63 rounds
      }
    } else {
      if (y == 0) return Error(e.line, "division by zero");
      if (x == INT64_MIN && y == -1) return Error(e.line, "integer overflow");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {  // Python floors
        q -= 1;
        m += y;
      }
      r = op == "//" ? q : m;
    }
    if (overflow) return Error(e.line, "integer overflow");
    return Value::Int(r);
  }

  std::vector<Scope> scopes_;
  // Lookup's innermost scopes stop here before the top level: 1 outside macros, the closure's
  // index inside one.
  size_t frame_base_ = 1;
  int macro_depth_ = 0;
  int depth_ = 0;      // Exec and Eval calls under way
  int64_t steps_ = 0;  // Exec and Eval calls so far, and kStepsPerIteration per loop iteration
  Flow flow_ = Flow::kNormal;
  absl::Time now_;
  absl::TimeZone zone_;
  int64_t max_steps_;
  std::vector<std::shared_ptr<Value::Dict>> namespaces_;  // every namespace() made
  std::string out_;
};

}  // namespace

absl::StatusOr<std::string> RenderProgram(const Program& program, const nlohmann::ordered_json& context,
                                          absl::Time now, absl::TimeZone zone, int64_t max_steps) {
  Renderer r(context, now, zone, max_steps);
  if (absl::Status st = r.Render(program.body); !st.ok()) return st;
  return std::move(r.out());
}

}  // namespace shardserve::jinja
