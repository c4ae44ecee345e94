// Lexer and recursive-descent parser for the Jinja subset, following Jinja2's grammar
// (jinja2/parser.py): or > and > not > comparisons > + - > ~ > * / // % > ** > unary > postfix,
// filters and tests.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/chat_template/internal/jinja_ast.h"

namespace shardserve::jinja {
namespace {

struct Token {
  enum class Type { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };
  Type type = Type::kEof;
  std::string text;
  int line = 1;
};

absl::Status SyntaxError(int line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("chat template line ", line, ": ", what));
}

// Splits the source into text and tag tokens, applying whitespace control, trim_blocks and
// lstrip_blocks.
class Lexer {
 public:
  explicit Lexer(absl::string_view src) : src_(src) {}

  absl::StatusOr<std::vector<Token>> Run() {
    bool strip_next = false;  // a "-" closed the previous tag: drop leading whitespace
    bool trim_newline = false;  // a block tag closed: drop one newline (trim_blocks)
    while (pos_ < src_.size()) {
      size_t open = FindTagStart(pos_);
      absl::string_view text = src_.substr(pos_, open == absl::string_view::npos ? absl::string_view::npos : open - pos_);
      pos_ = open == absl::string_view::npos ? src_.size() : open;
      std::string t(text);
      if (strip_next) {
        t = std::string(absl::StripLeadingAsciiWhitespace(t));
      } else if (trim_newline && !t.empty() && t[0] == '\n') {
        t.erase(0, 1);
      } else if (trim_newline && t.size() >= 2 && t[0] == '\r' && t[1] == '\n') {
        t.erase(0, 2);
      }
      strip_next = trim_newline = false;
      if (open != absl::string_view::npos) {
        const char kind = src_[open + 1];
        const bool minus = open + 2 < src_.size() && src_[open + 2] == '-';
        const bool plus = open + 2 < src_.size() && src_[open + 2] == '+';
        if (minus) {
          t = std::string(absl::StripTrailingAsciiWhitespace(t));
        } else if ((kind == '%' || kind == '#') && !plus) {
          // lstrip_blocks: spaces and tabs between the start of a line (in the source) and a block
          // tag go.
          size_t ws = 0;
          while (ws < text.size() && (text[text.size() - 1 - ws] == ' ' || text[text.size() - 1 - ws] == '\t')) ++ws;
          const size_t line_begin = open - ws;
          if ((line_begin == 0 || src_[line_begin - 1] == '\n') && ws > 0) t.resize(t.size() - std::min(ws, t.size()));
        }
      }
      line_ += CountNewlines(text);
      if (!t.empty()) tokens_.push_back({Token::Type::kText, std::move(t), line_});
      if (open == absl::string_view::npos) break;
      const char kind = src_[open + 1];
      pos_ = open + 2;
      if (pos_ < src_.size() && (src_[pos_] == '-' || src_[pos_] == '+')) ++pos_;
      if (kind == '#') {
        const size_t close = src_.find("#}", pos_);
        if (close == absl::string_view::npos) return SyntaxError(line_, "unclosed comment");
        line_ += CountNewlines(src_.substr(pos_, close - pos_));
        strip_next = close > pos_ && src_[close - 1] == '-';
        trim_newline = !strip_next;
        pos_ = close + 2;
        continue;
      }
      tokens_.push_back({kind == '{' ? Token::Type::kVarBegin : Token::Type::kBlockBegin, "", line_});
      bool closed = false;
      if (absl::Status st = LexTag(kind == '{' ? '}' : '%', &closed, &strip_next); !st.ok()) return st;
      if (!closed) return SyntaxError(line_, "unclosed tag");
      tokens_.push_back({kind == '{' ? Token::Type::kVarEnd : Token::Type::kBlockEnd, "", line_});
      trim_newline = kind == '%' && !strip_next;
    }
    tokens_.push_back({Token::Type::kEof, "", line_});
    return std::move(tokens_);
  }

 private:
  static int CountNewlines(absl::string_view s) {
    int n = 0;
    for (char c : s) n += c == '\n';
    return n;
  }

  size_t FindTagStart(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return absl::string_view::npos;
  }

  // Lexes the inside of a tag up to its closing `close`} (or -`close`}).
  absl::Status LexTag(char close, bool* closed, bool* strip_next) {
    int depth = 0;  // open brackets: a "}" inside a dict literal does not end the tag
    while (pos_ < src_.size()) {
      const char c = src_[pos_];
      if (c == '\n') ++line_;
      if (std::isspace(static_cast<unsigned char>(c))) {
        ++pos_;
        continue;
      }
      if (depth == 0) {
        if (c == '-' && pos_ + 2 < src_.size() && src_[pos_ + 1] == close && src_[pos_ + 2] == '}') {
          *strip_next = true;
          *closed = true;
          pos_ += 3;
          return absl::OkStatus();
        }
        if (c == close && pos_ + 1 < src_.size() && src_[pos_ + 1] == '}') {
          *strip_next = false;
          *closed = true;
          pos_ += 2;
          return absl::OkStatus();
        }
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        tokens_.push_back({Token::Type::kName, std::string(src_.substr(pos_, e - pos_)), line_});
        pos_ = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = pos_;
        bool is_float = false;
        while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true;
          ++e;
          while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
        }
        std::string digits;
        for (char d : src_.substr(pos_, e - pos_)) {
          if (d != '_') digits.push_back(d);
        }
        tokens_.push_back({is_float ? Token::Type::kFloat : Token::Type::kInt, digits, line_});
        pos_ = e;
      } else if (c == '\'' || c == '"') {
        std::string s;
        size_t e = pos_ + 1;
        for (; e < src_.size() && src_[e] != c; ++e) {
          if (src_[e] == '\n') ++line_;
          if (src_[e] != '\\' || e + 1 >= src_.size()) {
            s.push_back(src_[e]);
            continue;
          }
          const char x = src_[++e];
          switch (x) {
            case 'n': s.push_back('\n'); break;
            case 't': s.push_back('\t'); break;
            case 'r': s.push_back('\r'); break;
            case '\\': s.push_back('\\'); break;
            case '\'': s.push_back('\''); break;
            case '"': s.push_back('"'); break;
            default: s.push_back('\\'); s.push_back(x); break;
          }
        }
        if (e >= src_.size()) return SyntaxError(line_, "unterminated string literal");
        tokens_.push_back({Token::Type::kString, std::move(s), line_});
        pos_ = e + 1;
      } else {
        static constexpr absl::string_view kTwo[] = {"==", "!=", "<=", ">=", "//", "**"};
        std::string op(1, c);
        for (absl::string_view two : kTwo) {
          if (src_.substr(pos_, 2) == two) op = std::string(two);
        }
        if (op.size() == 1 && std::string_view("+-*/%~|.,:()[]{}<>=").find(c) == std::string_view::npos) {
          return SyntaxError(line_, absl::StrCat("unexpected character '", std::string(1, c), "'"));
        }
        if (c == '(' || c == '[' || c == '{') ++depth;
        if ((c == ')' || c == ']' || c == '}') && depth > 0) --depth;
        tokens_.push_back({Token::Type::kOp, op, line_});
        pos_ += op.size();
      }
    }
    return absl::OkStatus();
  }

  absl::string_view src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  absl::StatusOr<std::shared_ptr<const Program>> Run() {
    auto program = std::make_shared<Program>();
    std::string end;
    absl::Status st = ParseBody(&program->body, {}, &end);
    if (!st.ok()) return st;
    return std::shared_ptr<const Program>(std::move(program));
  }

 private:
  using Type = Token::Type;
  const Token& Peek(size_t ahead = 0) const { return t_[std::min(i_ + ahead, t_.size() - 1)]; }
  const Token& Next() { return t_[i_ < t_.size() - 1 ? i_++ : i_]; }
  bool IsOp(absl::string_view op, size_t ahead = 0) const {
    return Peek(ahead).type == Type::kOp && Peek(ahead).text == op;
  }
  bool IsName(absl::string_view name, size_t ahead = 0) const {
    return Peek(ahead).type == Type::kName && Peek(ahead).text == name;
  }
  absl::Status Expect(absl::string_view op) {
    if (!IsOp(op)) return SyntaxError(Peek().line, absl::StrCat("expected '", op, "', got ", Describe(Peek())));
    Next();
    return absl::OkStatus();
  }
  absl::Status ExpectBlockEnd() {
    if (Peek().type != Type::kBlockEnd) {
      return SyntaxError(Peek().line, absl::StrCat("expected the end of the tag, got ", Describe(Peek())));
    }
    Next();
    return absl::OkStatus();
  }
  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Type::kText: return "text";
      case Type::kVarBegin: return "'{{'";
      case Type::kVarEnd: return "'}}'";
      case Type::kBlockBegin: return "'{%'";
      case Type::kBlockEnd: return "'%}'";
      case Type::kEof: return "the end of the template";
      case Type::kName:
      case Type::kString:
      case Type::kInt:
      case Type::kFloat:
      case Type::kOp: return absl::StrCat("'", t.text, "'");
    }
    return "?";
  }

  // Parses nodes until a block tag whose keyword is in `ends` (consumed up to the keyword; the
  // keyword is returned in `end`), or the end of input when `ends` is empty.
  absl::Status ParseBody(Body* body, std::vector<absl::string_view> ends, std::string* end) {
    while (true) {
      const Token& tok = Peek();
      if (tok.type == Type::kEof) {
        if (ends.empty()) return absl::OkStatus();
        return SyntaxError(tok.line, absl::StrCat("missing {% ", ends.back(), " %}"));
      }
      if (tok.type == Type::kText) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kText;
        n->line = tok.line;
        n->text = Next().text;
        body->push_back(std::move(n));
        continue;
      }
      if (tok.type == Type::kVarBegin) {
        Next();
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kOutput;
        n->line = tok.line;
        absl::StatusOr<ExprPtr> e = ParseExpression();
        if (!e.ok()) return e.status();
        n->expr = *std::move(e);
        if (Peek().type != Type::kVarEnd) return SyntaxError(Peek().line, absl::StrCat("expected '}}', got ", Describe(Peek())));
        Next();
        body->push_back(std::move(n));
        continue;
      }
      if (tok.type != Type::kBlockBegin) return SyntaxError(tok.line, absl::StrCat("unexpected ", Describe(tok)));
      const Token& kw = Peek(1);
      if (kw.type != Type::kName) return SyntaxError(kw.line, "expected a statement keyword");
      for (absl::string_view e : ends) {
        if (kw.text == e) {
          Next();
          Next();
          *end = kw.text;
          return absl::OkStatus();
        }
      }
      Next();
      Next();
      // A statement's body is parsed (and rendered) by recursion: blocks nest at most kMaxBlockDepth deep.
      ++block_depth_;
      const absl::Cleanup unnest = [this] { --block_depth_; };
      if (block_depth_ > kMaxBlockDepth) return SyntaxError(kw.line, "blocks nested too deeply");
      absl::Status st;
      if (kw.text == "if") {
        st = ParseIf(body, kw.line);
      } else if (kw.text == "for") {
        st = ParseFor(body, kw.line);
      } else if (kw.text == "set") {
        st = ParseSet(body, kw.line);
      } else if (kw.text == "macro") {
        st = ParseMacro(body, kw.line);
      } else if (kw.text == "break" || kw.text == "continue") {
        if (loop_depth_ == 0) return SyntaxError(kw.line, absl::StrCat("'", kw.text, "' outside a loop"));
        auto n = std::make_unique<Node>();
        n->kind = kw.text == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
        n->line = kw.line;
        body->push_back(std::move(n));
        st = ExpectBlockEnd();
      } else if (kw.text == "generation") {
        // transformers' assistant-mask marker: its content renders as usual.
        st = ExpectBlockEnd();
        std::string e;
        if (st.ok()) st = ParseBody(body, {"endgeneration"}, &e);
        if (st.ok()) st = ExpectBlockEnd();
      } else {
        return SyntaxError(kw.line, absl::StrCat("unsupported or unexpected tag {% ", kw.text, " %}"));
      }
      if (!st.ok()) return st;
    }
  }

  absl::Status ParseIf(Body* body, int line) {
    auto n = std::make_unique<Node>();
    n->kind = Node::Kind::kIf;
    n->line = line;
    while (true) {
      absl::StatusOr<ExprPtr> cond = ParseExpression();
      if (!cond.ok()) return cond.status();
      n->conditions.push_back(*std::move(cond));
      if (absl::Status st = ExpectBlockEnd(); !st.ok()) return st;
      n->bodies.emplace_back();
      std::string end;
      if (absl::Status st = ParseBody(&n->bodies.back(), {"elif", "else", "endif"}, &end); !st.ok()) return st;
      if (end == "elif") continue;
      if (end == "else") {
        if (absl::Status st = ExpectBlockEnd(); !st.ok()) return st;
        n->bodies.emplace_back();
        if (absl::Status st = ParseBody(&n->bodies.back(), {"endif"}, &end); !st.ok()) return st;
      }
      if (absl::Status st = ExpectBlockEnd(); !st.ok()) return st;
      break;
    }
    body->push_back(std::move(n));
    return absl::OkStatus();
  }

  absl::Status ParseFor(Body* body, int line) {
    auto n = std::make_unique<Node>();
    n->kind = Node::Kind::kFor;
    n->line = line;
    do {
      if (Peek().type != Type::kName) return SyntaxError(Peek().line, "expected a loop variable name");
      n->targets.push_back(Next().text);
    } while (IsOp(",") && (Next(), true));
    if (!IsName("in")) return SyntaxError(Peek().line, "expected 'in' in the for loop");
    Next();
    absl::StatusOr<ExprPtr> iter = ParseOr(/*allow_condition=*/false);
    if (!iter.ok()) return iter.status();
    n->expr = *std::move(iter);
    if (IsName("if")) {
      Next();
      absl::StatusOr<ExprPtr> f = ParseOr(false);
      if (!f.ok()) return f.status();
      n->filter = *std::move(f);
    }
    if (IsName("recursive")) return SyntaxError(Peek().line, "recursive loops are not supported");
    if (absl::Status st = ExpectBlockEnd(); !st.ok()) return st;
    n->bodies.emplace_back();
    std::string end;
    ++loop_depth_;
    absl::Status body_status = ParseBody(&n->bodies.back(), {"else", "endfor"}, &end);
    --loop_depth_;
    if (!body_status.ok()) return body_status;
    if (end == "else") {
      if (absl::Status st = ExpectBlockEnd(); !st.ok()) return st;
      n->bodies.emplace_back();
      if (absl::Status st = ParseBody(&n->bodies.back(), {"endfor"}, &end); !st.ok()) return st;
    }
    if (absl::Status st = ExpectBlockEnd(); !st.ok()) return st;
    body->push_back(std::move(n));
    return absl::OkStatus();
  }

  absl::Status ParseSet(Body* body, int line) {
    auto n = std::make_unique<Node>();
    n->kind = Node::Kind::kSet;
    n->line = line;
    if (Peek().type != Type::kName) return SyntaxError(Peek().line, "expected a name after set");
    n->targets.push_back(Next().text);
    if (IsOp(".")) {
      Next();
      if (Peek().type != Type::kName) return SyntaxError(Peek().line, "expected an attribute name");
      n->attribute = Next().text;
    } else {
      while (IsOp(",")) {
        Next();
        if (Peek().type != Type::kName) return SyntaxError(Peek().line, "expected a name");
        n->targets.push_back(Next().text);
      }
    }
    if (Peek().type == Type::kBlockEnd) {  // {% set x %}...{% endset %}
      if (n->targets.size() != 1) return SyntaxError(line, "a block assignment sets one name");
      Next();
      n->bodies.emplace_back();
      std::string end;
      if (absl::Status st = ParseBody(&n->bodies.back(), {"endset"}, &end); !st.ok()) return st;
      if (absl::Status st = ExpectBlockEnd(); !st.ok()) return st;
      body->push_back(std::move(n));
      return absl::OkStatus();
    }
    if (IsOp("|")) return SyntaxError(line, "filters on a block assignment are not supported");
    if (absl::Status st = Expect("="); !st.ok()) return st;
    absl::StatusOr<ExprPtr> value = ParseTupleOrExpression();
    if (!value.ok()) return value.status();
    n->expr = *std::move(value);
    if (absl::Status st = ExpectBlockEnd(); !st.ok()) return st;
    body->push_back(std::move(n));
    return absl::OkStatus();
  }

  // {% macro name(a, b=default, ...) %}body{% endmacro %}
  absl::Status ParseMacro(Body* body, int line) {
    auto n = std::make_unique<Node>();
    n->kind = Node::Kind::kMacro;
    n->line = line;
    if (Peek().type != Type::kName) return SyntaxError(Peek().line, "expected the macro's name");
    n->text = Next().text;
    if (absl::Status st = Expect("("); !st.ok()) return st;
    while (!IsOp(")")) {
      if (Peek().type != Type::kName) return SyntaxError(Peek().line, "expected a parameter name");
      const std::string param = Next().text;
      for (const std::string& earlier : n->targets) {
        if (earlier == param) return SyntaxError(line, absl::StrCat("macro '", n->text, "' repeats parameter '", param, "'"));
      }
      n->targets.push_back(param);
      ExprPtr dflt;
      if (IsOp("=")) {
        Next();
        absl::StatusOr<ExprPtr> v = ParseExpression();
        if (!v.ok()) return v.status();
        dflt = *std::move(v);
      } else if (!n->defaults.empty() && n->defaults.back() != nullptr) {
        return SyntaxError(line, absl::StrCat("macro '", n->text, "': parameter '", param,
                                              "' without a default follows one with a default"));
      }
      n->defaults.push_back(std::move(dflt));
      if (!IsOp(",")) break;
      Next();
    }
    if (absl::Status st = Expect(")"); !st.ok()) return st;
    if (absl::Status st = ExpectBlockEnd(); !st.ok()) return st;
    n->bodies.emplace_back();
    const int loops = loop_depth_;
    loop_depth_ = 0;  // a loop around the definition is not a loop around the body
    std::string end;
    absl::Status st = ParseBody(&n->bodies.back(), {"endmacro"}, &end);
    loop_depth_ = loops;
    if (!st.ok()) return st;
    if (absl::Status e = ExpectBlockEnd(); !e.ok()) return e;
    n->takes_varargs = Reads(n->bodies[0], "varargs");
    n->takes_kwargs = Reads(n->bodies[0], "kwargs");
    body->push_back(std::move(n));
    return absl::OkStatus();
  }

  // Whether any expression in `body` names the variable `name`.
  static bool Reads(const Body& body, absl::string_view name) {
    for (const auto& node : body) {
      if (Reads(node->expr.get(), name) || Reads(node->filter.get(), name)) return true;
      for (const ExprPtr& c : node->conditions) {
        if (Reads(c.get(), name)) return true;
      }
      for (const ExprPtr& d : node->defaults) {
        if (Reads(d.get(), name)) return true;
      }
      for (const Body& b : node->bodies) {
        if (Reads(b, name)) return true;
      }
    }
    return false;
  }
  static bool Reads(const Expr* e, absl::string_view name) {
    if (e == nullptr) return false;
    if (e->kind == Expr::Kind::kName && e->name == name) return true;
    if (Reads(e->a.get(), name) || Reads(e->b.get(), name) || Reads(e->c.get(), name)) return true;
    for (const ExprPtr& item : e->items) {
      if (Reads(item.get(), name)) return true;
    }
    for (const auto& [unused, v] : e->kwargs) {
      if (Reads(v.get(), name)) return true;
    }
    return false;
  }

  ExprPtr Make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // `a, b` without parentheses (the right side of set).
  absl::StatusOr<ExprPtr> ParseTupleOrExpression() {
    const int line = Peek().line;
    absl::StatusOr<ExprPtr> first = ParseExpression();
    if (!first.ok() || !IsOp(",")) return first;
    ExprPtr t = Make(Expr::Kind::kTuple, line);
    t->items.push_back(*std::move(first));
    while (IsOp(",")) {
      Next();
      absl::StatusOr<ExprPtr> e = ParseExpression();
      if (!e.ok()) return e.status();
      t->items.push_back(*std::move(e));
    }
    return Sealed(std::move(t));
  }

  absl::StatusOr<ExprPtr> ParseExpression() { return ParseOr(/*allow_condition=*/true); }

  absl::StatusOr<ExprPtr> ParseOr(bool allow_condition) {
    const Nesting nesting(this);
    if (depth_ > kMaxExprDepth) return SyntaxError(Peek().line, "expression nested too deeply");
    absl::StatusOr<ExprPtr> left = ParseAnd();
    while (left.ok() && IsName("or")) {
      const int line = Next().line;
      absl::StatusOr<ExprPtr> right = ParseAnd();
      if (!right.ok()) return right.status();
      left = Binary("or", *std::move(left), *std::move(right), line);
    }
    if (left.ok() && allow_condition && IsName("if")) {
      const int line = Next().line;
      ExprPtr c = Make(Expr::Kind::kCondition, line);
      c->a = *std::move(left);
      absl::StatusOr<ExprPtr> cond = ParseOr(false);
      if (!cond.ok()) return cond.status();
      c->b = *std::move(cond);
      if (IsName("else")) {
        Next();
        absl::StatusOr<ExprPtr> other = ParseOr(true);
        if (!other.ok()) return other.status();
        c->c = *std::move(other);
      }
      left = Sealed(std::move(c));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> Binary(absl::string_view op, ExprPtr a, ExprPtr b, int line) {
    ExprPtr e = Make(Expr::Kind::kBinary, line);
    e->name = std::string(op);
    e->a = std::move(a);
    e->b = std::move(b);
    return Sealed(std::move(e));
  }

  // The parser's recursion (one per nested expression, unary operator or block): it stops at
  // kMaxExprDepth, before the stack could.
  struct Nesting {
    explicit Nesting(Parser* p) : parser(p) { ++parser->depth_; }
    ~Nesting() { --parser->depth_; }
    Nesting(const Nesting&) = delete;
    Nesting& operator=(const Nesting&) = delete;
    Parser* parser;
  };

  // `e` with its depth set from its children's: an error past kMaxExprDepth. Chains the parser
  // builds by iteration (a + b + c, x | f | g, a.b.c, f(x)(y)) nest as deep as they are long, and
  // rendering and freeing them recurse that deep.
  absl::StatusOr<ExprPtr> Sealed(ExprPtr e) {
    int deepest = 0;
    for (const Expr* child : {e->a.get(), e->b.get(), e->c.get()}) {
      if (child != nullptr) deepest = std::max(deepest, child->depth);
    }
    for (const ExprPtr& item : e->items) {
      if (item != nullptr) deepest = std::max(deepest, item->depth);
    }
    for (const auto& [unused, v] : e->kwargs) deepest = std::max(deepest, v->depth);
    e->depth = deepest + 1;
    if (e->depth > kMaxExprDepth) return SyntaxError(e->line, "expression nested too deeply");
    return e;
  }

  absl::StatusOr<ExprPtr> ParseAnd() {
    absl::StatusOr<ExprPtr> left = ParseNot();
    while (left.ok() && IsName("and")) {
      const int line = Next().line;
      absl::StatusOr<ExprPtr> right = ParseNot();
      if (!right.ok()) return right.status();
      left = Binary("and", *std::move(left), *std::move(right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName("not")) {
      const Nesting nesting(this);
      if (depth_ > kMaxExprDepth) return SyntaxError(Peek().line, "expression nested too deeply");
      const int line = Next().line;
      absl::StatusOr<ExprPtr> inner = ParseNot();
      if (!inner.ok()) return inner.status();
      ExprPtr e = Make(Expr::Kind::kUnary, line);
      e->name = "not";
      e->a = *std::move(inner);
      return Sealed(std::move(e));
    }
    return ParseCompare();
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    absl::StatusOr<ExprPtr> left = ParseMath1();
    while (left.ok()) {
      std::string op;
      if (Peek().type == Type::kOp &&
          (Peek().text == "==" || Peek().text == "!=" || Peek().text == "<" || Peek().text == "<=" ||
           Peek().text == ">" || Peek().text == ">=")) {
        op = Peek().text;
        Next();
      } else if (IsName("in")) {
        op = "in";
        Next();
      } else if (IsName("not") && IsName("in", 1)) {
        op = "not in";
        Next();
        Next();
      } else {
        break;
      }
      const int line = Peek().line;
      absl::StatusOr<ExprPtr> right = ParseMath1();
      if (!right.ok()) return right.status();
      left = Binary(op, *std::move(left), *std::move(right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseMath1() {
    absl::StatusOr<ExprPtr> left = ParseConcat();
    while (left.ok() && (IsOp("+") || IsOp("-"))) {
      const Token& op = Next();
      absl::StatusOr<ExprPtr> right = ParseConcat();
      if (!right.ok()) return right.status();
      left = Binary(op.text, *std::move(left), *std::move(right), op.line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseConcat() {
    absl::StatusOr<ExprPtr> left = ParseMath2();
    while (left.ok() && IsOp("~")) {
      const int line = Next().line;
      absl::StatusOr<ExprPtr> right = ParseMath2();
      if (!right.ok()) return right.status();
      left = Binary("~", *std::move(left), *std::move(right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseMath2() {
    absl::StatusOr<ExprPtr> left = ParsePow();
    while (left.ok() && (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%"))) {
      const Token& op = Next();
      absl::StatusOr<ExprPtr> right = ParsePow();
      if (!right.ok()) return right.status();
      left = Binary(op.text, *std::move(left), *std::move(right), op.line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParsePow() {
    absl::StatusOr<ExprPtr> left = ParseUnary();
    while (left.ok() && IsOp("**")) {
      const int line = Next().line;
      absl::StatusOr<ExprPtr> right = ParseUnary();
      if (!right.ok()) return right.status();
      left = Binary("**", *std::move(left), *std::move(right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseUnary() {
    if (IsOp("-") || IsOp("+")) {
      const Nesting nesting(this);
      if (depth_ > kMaxExprDepth) return SyntaxError(Peek().line, "expression nested too deeply");
      const Token& op = Next();
      absl::StatusOr<ExprPtr> inner = ParseUnary();
      if (!inner.ok()) return inner.status();
      ExprPtr e = Make(Expr::Kind::kUnary, op.line);
      e->name = op.text;
      e->a = *std::move(inner);
      absl::StatusOr<ExprPtr> sealed = Sealed(std::move(e));
      if (!sealed.ok()) return sealed.status();
      return ParseFiltersAndTests(*std::move(sealed));
    }
    absl::StatusOr<ExprPtr> primary = ParsePrimary();
    if (!primary.ok()) return primary.status();
    absl::StatusOr<ExprPtr> post = ParsePostfix(*std::move(primary));
    if (!post.ok()) return post.status();
    return ParseFiltersAndTests(*std::move(post));
  }

  // Arguments of a call, filter or test: `(a, b, key=c)`; the "(" is the next token.
  absl::Status ParseArgs(Expr* e) {
    if (absl::Status st = Expect("("); !st.ok()) return st;
    while (!IsOp(")")) {
      if (Peek().type == Type::kName && IsOp("=", 1)) {
        std::string key = Next().text;
        Next();
        absl::StatusOr<ExprPtr> v = ParseExpression();
        if (!v.ok()) return v.status();
        e->kwargs.emplace_back(std::move(key), *std::move(v));
      } else {
        absl::StatusOr<ExprPtr> v = ParseExpression();
        if (!v.ok()) return v.status();
        e->items.push_back(*std::move(v));
      }
      if (!IsOp(",")) break;
      Next();
    }
    return Expect(")");
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr e) {
    while (true) {
      if (IsOp(".")) {
        const int line = Next().line;
        if (Peek().type != Type::kName && Peek().type != Type::kInt) {
          return SyntaxError(Peek().line, "expected an attribute name after '.'");
        }
        ExprPtr g = Make(Expr::Kind::kGetAttr, line);
        g->name = Next().text;
        g->a = std::move(e);
        absl::StatusOr<ExprPtr> sealed = Sealed(std::move(g));
        if (!sealed.ok()) return sealed.status();
        e = *std::move(sealed);
      } else if (IsOp("[")) {
        const int line = Next().line;
        ExprPtr parts[3];
        int colons = 0;
        while (!IsOp("]")) {
          if (IsOp(":")) {
            if (++colons > 2) return SyntaxError(Peek().line, "too many ':' in a slice");
            Next();
            continue;
          }
          absl::StatusOr<ExprPtr> v = ParseExpression();
          if (!v.ok()) return v.status();
          if (parts[colons] != nullptr) return SyntaxError(Peek().line, "expected ']'");
          parts[colons] = *std::move(v);
        }
        Next();
        if (colons == 0) {
          if (parts[0] == nullptr) return SyntaxError(line, "empty subscript");
          ExprPtr g = Make(Expr::Kind::kGetItem, line);
          g->a = std::move(e);
          g->b = std::move(parts[0]);
          absl::StatusOr<ExprPtr> sealed = Sealed(std::move(g));
          if (!sealed.ok()) return sealed.status();
          e = *std::move(sealed);
        } else {
          ExprPtr s = Make(Expr::Kind::kSlice, line);
          s->a = std::move(e);
          for (ExprPtr& p : parts) s->items.push_back(std::move(p));
          absl::StatusOr<ExprPtr> sealed = Sealed(std::move(s));
          if (!sealed.ok()) return sealed.status();
          e = *std::move(sealed);
        }
      } else if (IsOp("(")) {
        ExprPtr call = Make(Expr::Kind::kCall, Peek().line);
        call->a = std::move(e);
        if (absl::Status st = ParseArgs(call.get()); !st.ok()) return st;
        absl::StatusOr<ExprPtr> sealed = Sealed(std::move(call));
        if (!sealed.ok()) return sealed.status();
        e = *std::move(sealed);
      } else {
        return e;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseFiltersAndTests(ExprPtr e) {
    while (true) {
      if (IsOp("|")) {
        const int line = Next().line;
        if (Peek().type != Type::kName) return SyntaxError(Peek().line, "expected a filter name after '|'");
        ExprPtr f = Make(Expr::Kind::kFilter, line);
        f->name = Next().text;
        f->a = std::move(e);
        if (IsOp("(")) {
          if (absl::Status st = ParseArgs(f.get()); !st.ok()) return st;
        }
        absl::StatusOr<ExprPtr> sealed = Sealed(std::move(f));
        if (!sealed.ok()) return sealed.status();
        e = *std::move(sealed);
      } else if (IsName("is")) {
        const int line = Next().line;
        ExprPtr t = Make(Expr::Kind::kTest, line);
        if (IsName("not")) {
          Next();
          t->negated = true;
        }
        if (Peek().type != Type::kName && !(Peek().type == Type::kOp && (Peek().text == "==" || Peek().text == "!="))) {
          return SyntaxError(Peek().line, "expected a test name after 'is'");
        }
        t->name = Next().text;
        t->a = std::move(e);
        if (IsOp("(")) {
          if (absl::Status st = ParseArgs(t.get()); !st.ok()) return st;
        } else if (Peek().type == Type::kString || Peek().type == Type::kInt || Peek().type == Type::kFloat ||
                   (Peek().type == Type::kName && Peek().text != "and" && Peek().text != "or" &&
                    Peek().text != "else" && Peek().text != "if")) {
          // `x is divisibleby 3`, `x is sameas none`: one argument without parentheses.
          absl::StatusOr<ExprPtr> arg = ParsePrimary();
          if (!arg.ok()) return arg.status();
          t->items.push_back(*std::move(arg));
        }
        absl::StatusOr<ExprPtr> sealed = Sealed(std::move(t));
        if (!sealed.ok()) return sealed.status();
        e = *std::move(sealed);
      } else {
        return e;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token& tok = Peek();
    switch (tok.type) {
      case Type::kString: {
        ExprPtr e = Make(Expr::Kind::kLiteral, tok.line);
        std::string s = Next().text;
        while (Peek().type == Type::kString) s += Next().text;  // adjacent literals join, as in Python
        e->value = Value::Str(std::move(s));
        return e;
      }
      case Type::kInt: {
        ExprPtr e = Make(Expr::Kind::kLiteral, tok.line);
        char* end = nullptr;
        errno = 0;
        const long long v = std::strtoll(tok.text.c_str(), &end, 10);
        if (errno != 0) return SyntaxError(tok.line, absl::StrCat("integer literal out of range: ", tok.text));
        e->value = Value::Int(v);
        Next();
        return e;
      }
      case Type::kFloat: {
        ExprPtr e = Make(Expr::Kind::kLiteral, tok.line);
        e->value = Value::Float(std::strtod(tok.text.c_str(), nullptr));
        Next();
        return e;
      }
      case Type::kName: {
        ExprPtr e = Make(Expr::Kind::kLiteral, tok.line);
        const std::string& n = tok.text;
        if (n == "true" || n == "True") {
          e->value = Value::Bool(true);
        } else if (n == "false" || n == "False") {
          e->value = Value::Bool(false);
        } else if (n == "none" || n == "None") {
          e->value = Value::None();
        } else {
          e->kind = Expr::Kind::kName;
          e->name = n;
        }
        Next();
        return e;
      }
      case Type::kOp: {
        if (tok.text == "(") {
          const int line = Next().line;
          if (IsOp(")")) {
            Next();
            return Make(Expr::Kind::kTuple, line);
          }
          absl::StatusOr<ExprPtr> first = ParseExpression();
          if (!first.ok()) return first.status();
          if (IsOp(")")) {
            Next();
            return first;
          }
          ExprPtr t = Make(Expr::Kind::kTuple, line);
          t->items.push_back(*std::move(first));
          while (IsOp(",")) {
            Next();
            if (IsOp(")")) break;
            absl::StatusOr<ExprPtr> v = ParseExpression();
            if (!v.ok()) return v.status();
            t->items.push_back(*std::move(v));
          }
          if (absl::Status st = Expect(")"); !st.ok()) return st;
          return Sealed(std::move(t));
        }
        if (tok.text == "[") {
          ExprPtr l = Make(Expr::Kind::kList, Next().line);
          while (!IsOp("]")) {
            absl::StatusOr<ExprPtr> v = ParseExpression();
            if (!v.ok()) return v.status();
            l->items.push_back(*std::move(v));
            if (!IsOp(",")) break;
            Next();
          }
          if (absl::Status st = Expect("]"); !st.ok()) return st;
          return Sealed(std::move(l));
        }
        if (tok.text == "{") {
          ExprPtr d = Make(Expr::Kind::kDict, Next().line);
          while (!IsOp("}")) {
            absl::StatusOr<ExprPtr> k = ParseExpression();
            if (!k.ok()) return k.status();
            if (absl::Status st = Expect(":"); !st.ok()) return st;
            absl::StatusOr<ExprPtr> v = ParseExpression();
            if (!v.ok()) return v.status();
            d->items.push_back(*std::move(k));
            d->items.push_back(*std::move(v));
            if (!IsOp(",")) break;
            Next();
          }
          if (absl::Status st = Expect("}"); !st.ok()) return st;
          return Sealed(std::move(d));
        }
        break;
      }
      case Type::kText:
      case Type::kVarBegin:
      case Type::kVarEnd:
      case Type::kBlockBegin:
      case Type::kBlockEnd:
      case Type::kEof: break;
    }
    return SyntaxError(tok.line, absl::StrCat("unexpected ", Describe(tok), " in an expression"));
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;  // for-loop bodies around the tag being parsed (within the current macro)
  int block_depth_ = 0;  // statements around the tag being parsed
};

}  // namespace

absl::StatusOr<std::shared_ptr<const Program>> ParseProgram(absl::string_view source) {
  absl::StatusOr<std::vector<Token>> tokens = Lexer(source).Run();
  if (!tokens.ok()) return tokens.status();
  return Parser(*std::move(tokens)).Run();
}

absl::StatusOr<JinjaTemplate> JinjaTemplate::Parse(absl::string_view source) {
  absl::StatusOr<std::shared_ptr<const Program>> program = ParseProgram(source);
  if (!program.ok()) return program.status();
  return JinjaTemplate(*std::move(program));
}

absl::StatusOr<std::string> JinjaTemplate::Render(const nlohmann::ordered_json& context) const {
  return RenderProgram(*program_, context, absl::Now(), absl::LocalTimeZone(), kMaxRenderSteps);
}

absl::StatusOr<std::string> JinjaTemplate::Render(const nlohmann::ordered_json& context, absl::Time now,
                                                  absl::TimeZone zone, int64_t max_steps) const {
  return RenderProgram(*program_, context, now, zone, max_steps);
}

}  // namespace shardserve::jinja
