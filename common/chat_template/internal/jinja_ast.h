// The values and the syntax tree of the Jinja subset (see ../jinja.h). Internal to common/chat_template.
#ifndef SHARDSERVE_COMMON_CHAT_TEMPLATE_INTERNAL_JINJA_AST_H_
#define SHARDSERVE_COMMON_CHAT_TEMPLATE_INTERNAL_JINJA_AST_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/chat_template/jinja.h"

namespace shardserve::jinja {

struct Node;

// A template value, with Python's semantics. Lists and dicts are shared by reference, as in
// Python (a namespace is a dict whose attributes may be assigned).
struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kFunction };
  using List = std::vector<Value>;
  using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python's dict

  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                     // kString; the function's name for kFunction
  std::shared_ptr<List> list;        // kList
  std::shared_ptr<Dict> dict;        // kDict
  bool is_namespace = false;         // kDict made by namespace(): attributes may be set
  bool is_tuple = false;             // kList written as a tuple: prints as (a, b)
  std::shared_ptr<Value> self;       // kFunction: the object of a bound method, or a macro's closure
  const Node* macro = nullptr;       // kFunction: a macro's definition (it outlives every render)

  static Value None() { Value v; v.kind = Kind::kNone; return v; }
  static Value Bool(bool x) { Value v; v.kind = Kind::kBool; v.b = x; return v; }
  static Value Int(int64_t x) { Value v; v.kind = Kind::kInt; v.i = x; return v; }
  static Value Float(double x) { Value v; v.kind = Kind::kFloat; v.f = x; return v; }
  static Value Str(std::string x) { Value v; v.kind = Kind::kString; v.s = std::move(x); return v; }
  static Value NewList(List items = {}) {
    Value v; v.kind = Kind::kList; v.list = std::make_shared<List>(std::move(items)); return v;
  }
  static Value NewDict(Dict items = {}) {
    Value v; v.kind = Kind::kDict; v.dict = std::make_shared<Dict>(std::move(items)); return v;
  }
  static Value Function(std::string name, std::shared_ptr<Value> self = nullptr) {
    Value v; v.kind = Kind::kFunction; v.s = std::move(name); v.self = std::move(self); return v;
  }

  bool defined() const { return kind != Kind::kUndefined; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  // The dict entry for `key`, or null.
  const Value* Find(absl::string_view key) const;
  Value* FindMutable(absl::string_view key);
  // Sets (or adds) a dict entry.
  void Set(const std::string& key, Value value);
};

// The largest string (and the output) a render makes, the longest list, and how deeply the text
// and comparison functions below follow nested values.
inline constexpr size_t kMaxStringBytes = 4 << 20;
inline constexpr size_t kMaxListItems = 1 << 20;
inline constexpr int kMaxValueDepth = 128;

bool Truthy(const Value& v);
// Python's str(): strings as they are, True/None, 1.0, ['a', 1], {'k': 'v'}; Undefined is "".
// Lists and dicts are written only up to a little over kMaxStringBytes (the caller refuses longer
// text), and "[...]" past kMaxValueDepth levels.
std::string ToString(const Value& v);
// Python's repr() (strings quoted), bounded as ToString.
std::string Repr(const Value& v);
// json.dumps(v, ensure_ascii=False, indent=indent (< 0: none), sort_keys=false), bounded as
// ToString (nothing is written past kMaxValueDepth levels).
std::string ToJson(const Value& v, int indent);
Value FromJson(const nlohmann::ordered_json& j);
// Python's ==; past kMaxValueDepth levels, whether they are the same list or dict.
bool Equal(const Value& a, const Value& b);
bool Equal(const Value& a, const Value& b, int depth);

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

// The deepest an expression tree may be (nested operators, filters, attributes, brackets): the
// parser refuses deeper ones, so evaluating and freeing a tree recurse at most this deep.
inline constexpr int kMaxExprDepth = 128;
// The deepest blocks (if, for, macro, set) may nest.
inline constexpr int kMaxBlockDepth = 64;

struct Expr {
  enum class Kind {
    kLiteral,   // value
    kName,      // name
    kList,      // items
    kTuple,     // items
    kDict,      // items: key, value, key, value...
    kGetAttr,   // a.name
    kGetItem,   // a[b]
    kSlice,     // a[items[0]:items[1]:items[2]] (null items are absent)
    kCall,      // a(items, kwargs)
    kFilter,    // a | name(items, kwargs)
    kTest,      // a is [negated] name(items)
    kUnary,     // op a   (op: "not", "-", "+")
    kBinary,    // a op b (op: or and == != < <= > >= in "not in" + - * / // % ** ~)
    kCondition, // a if b else c (c may be null: Undefined)
  };
  Kind kind = Kind::kLiteral;
  int line = 0;
  int depth = 1;  // 1 + its deepest child's
  Value value;
  std::string name;  // kName, kGetAttr, kFilter, kTest; the operator for kUnary/kBinary
  bool negated = false;
  ExprPtr a, b, c;
  std::vector<ExprPtr> items;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind { kText, kOutput, kIf, kFor, kSet, kMacro, kBreak, kContinue };
  Kind kind = Kind::kText;
  int line = 0;
  std::string text;                 // kText
  ExprPtr expr;                     // kOutput; kFor: the iterable; kSet: the value
  // kIf: conditions[i] guards bodies[i]; a trailing else is bodies.back() when it has one more.
  std::vector<ExprPtr> conditions;
  std::vector<Body> bodies;
  // kFor: loop variables; filter (may be null); bodies[0] the body, bodies[1] (optional) the else.
  // kSet: targets (one name, a tuple of names, or "ns" + attribute in `attribute`); a block set
  // ({% set x %}...{% endset %}) has no expr and its content in bodies[0].
  // kMacro: its name in `text`, its parameters in targets, their defaults (null: none) in
  // `defaults`, its body in bodies[0].
  std::vector<std::string> targets;
  std::string attribute;
  ExprPtr filter;
  std::vector<ExprPtr> defaults;
  bool takes_varargs = false;  // kMacro: the body reads `varargs` (extra positional arguments)
  bool takes_kwargs = false;   // kMacro: the body reads `kwargs` (extra keyword arguments)
};

struct Program {
  Body body;
};

// Parser (jinja_parse.cc).
absl::StatusOr<std::shared_ptr<const Program>> ParseProgram(absl::string_view source);
// Renderer (jinja_render.cc): JinjaTemplate::Render's.
absl::StatusOr<std::string> RenderProgram(const Program& program, const nlohmann::ordered_json& context,
                                          absl::Time now, absl::TimeZone zone, int64_t max_steps);

}  // namespace shardserve::jinja

#endif  // SHARDSERVE_COMMON_CHAT_TEMPLATE_INTERNAL_JINJA_AST_H_
