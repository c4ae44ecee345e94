#include "coordinator/structured/byte_dfa.h"

#include <algorithm>
#include <bitset>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardserve::structured {
namespace {

// ---- The syntax tree ----------------------------------------------------------------------------

struct Node {
  enum class Kind { kBytes, kConcat, kAlt, kRepeat };
  Kind kind = Kind::kConcat;  // an empty concatenation matches the empty text
  std::bitset<256> bytes;     // kBytes
  std::vector<Node> kids;     // kConcat, kAlt; kRepeat has one
  int32_t min = 0, max = 0;   // kRepeat; max -1 = unbounded
};

Node ByteNode(uint8_t lo, uint8_t hi) {
  Node n{.kind = Node::Kind::kBytes};
  for (int b = lo; b <= hi; ++b) n.bytes.set(static_cast<size_t>(b));
  return n;
}

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;  // inclusive code point ranges
constexpr uint32_t kMaxCodePoint = 0x10FFFF;

Ranges Normalize(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, hi);
    } else {
      out.push_back({lo, hi});
    }
  }
  return out;
}

Ranges Complement(const Ranges& r) {
  Ranges out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : Normalize(r)) {
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return out;
}

int Utf8Length(uint32_t c) { return c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4; }

void EncodeUtf8(uint32_t c, uint8_t* out) {
  switch (Utf8Length(c)) {
    case 1: out[0] = static_cast<uint8_t>(c); break;
    case 2:
      out[0] = static_cast<uint8_t>(0xC0 | (c >> 6));
      out[1] = static_cast<uint8_t>(0x80 | (c & 0x3F));
      break;
    case 3:
      out[0] = static_cast<uint8_t>(0xE0 | (c >> 12));
      out[1] = static_cast<uint8_t>(0x80 | ((c >> 6) & 0x3F));
      out[2] = static_cast<uint8_t>(0x80 | (c & 0x3F));
      break;
    default:
      out[0] = static_cast<uint8_t>(0xF0 | (c >> 18));
      out[1] = static_cast<uint8_t>(0x80 | ((c >> 12) & 0x3F));
      out[2] = static_cast<uint8_t>(0x80 | ((c >> 6) & 0x3F));
      out[3] = static_cast<uint8_t>(0x80 | (c & 0x3F));
      break;
  }
}

// Appends to `alt` byte-sequence alternatives matching exactly the UTF-8 encodings of [lo, hi]:
// the range is split until, for each piece, every byte position ranges independently.
void AddUtf8Range(uint32_t lo, uint32_t hi, Node* alt) {
  static constexpr uint32_t kLengthEnds[] = {0x7F, 0x7FF, 0xFFFF, kMaxCodePoint};
  for (uint32_t end : kLengthEnds) {  // pieces of one encoded length
    if (lo <= end && hi > end) {
      AddUtf8Range(lo, end, alt);
      AddUtf8Range(end + 1, hi, alt);
      return;
    }
  }
  if (lo <= 0xDFFF && hi >= 0xD800) {  // surrogates are not characters
    if (lo < 0xD800) AddUtf8Range(lo, 0xD7FF, alt);
    if (hi > 0xDFFF) AddUtf8Range(0xE000, hi, alt);
    return;
  }
  const int n = Utf8Length(lo);
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        AddUtf8Range(lo, lo | m, alt);
        AddUtf8Range((lo | m) + 1, hi, alt);
        return;
      }
      if ((hi & m) != m) {
        AddUtf8Range(lo, (hi & ~m) - 1, alt);
        AddUtf8Range(hi & ~m, hi, alt);
        return;
      }
    }
  }
  uint8_t a[4], b[4];
  EncodeUtf8(lo, a);
  EncodeUtf8(hi, b);
  Node seq{.kind = Node::Kind::kConcat};
  for (int i = 0; i < n; ++i) seq.kids.push_back(ByteNode(a[i], b[i]));
  alt->kids.push_back(std::move(seq));
}

Node RangesNode(const Ranges& ranges) {
  // The ASCII part is one byte set, first; the rest are UTF-8 byte sequences.
  Node alt{.kind = Node::Kind::kAlt};
  alt.kids.push_back(Node{.kind = Node::Kind::kBytes});
  for (const auto& [lo, hi] : Normalize(ranges)) {
    uint32_t l = lo;
    for (; l <= hi && l < 0x80; ++l) alt.kids.front().bytes.set(l);
    if (l <= hi) AddUtf8Range(l, hi, &alt);
  }
  return alt;  // an empty byte set alone matches nothing
}

const Ranges kDigit = {{'0', '9'}};
const Ranges kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
const Ranges kSpace = {{'\t', '\r'}, {' ', ' '}};

class Parser {
 public:
  Parser(absl::string_view p, const DfaLimits& limits) : p_(p), limits_(limits) {}

  absl::StatusOr<Node> Parse() {
    size_t end = p_.size();
    if (!p_.empty() && p_[0] == '^') pos_ = 1;
    if (end > pos_ && p_[end - 1] == '$' && (end < 2 || p_[end - 2] != '\\')) p_ = p_.substr(0, end - 1);
    Node n = ParseAlt();
    if (error_.empty() && pos_ < p_.size()) Fail(p_[pos_] == ')' ? "unbalanced ')'" : "unexpected character");
    if (!error_.empty()) return absl::InvalidArgumentError(error_);
    return n;
  }

 private:
  bool AtEnd() const { return pos_ >= p_.size() || !error_.empty(); }
  char Peek() const { return p_[pos_]; }
  void Fail(absl::string_view what) {
    if (error_.empty()) error_ = absl::StrCat("regex: ", what, " at offset ", pos_);
  }

  Node ParseAlt() {
    Node first = ParseConcat();
    if (AtEnd() || Peek() != '|') return first;
    Node alt{.kind = Node::Kind::kAlt};
    alt.kids.push_back(std::move(first));
    while (!AtEnd() && Peek() == '|') {
      ++pos_;
      alt.kids.push_back(ParseConcat());
    }
    return alt;
  }

  Node ParseConcat() {
    Node seq{.kind = Node::Kind::kConcat};
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      if (++depth_guard_ > 100000) {
        Fail("pattern too long");
        break;
      }
      seq.kids.push_back(ParseRepeat());
    }
    if (seq.kids.size() == 1) return std::move(seq.kids[0]);
    return seq;
  }

  bool ParseInt(int32_t* out) {
    size_t start = pos_;
    int64_t v = 0;
    while (!AtEnd() && Peek() >= '0' && Peek() <= '9') {
      v = std::min<int64_t>(v * 10 + (Peek() - '0'), int64_t{1} << 30);
      ++pos_;
    }
    *out = static_cast<int32_t>(v);
    return pos_ > start;
  }

  Node ParseRepeat() {
    Node atom = ParseAtom();
    int stacked = 0;
    while (!AtEnd()) {
      if (++stacked > 8) {
        Fail("more than 8 quantifiers on one operand");
        return atom;
      }
      int32_t lo = 0, hi = 0;
      const char c = Peek();
      if (c == '*') {
        lo = 0, hi = -1, ++pos_;
      } else if (c == '+') {
        lo = 1, hi = -1, ++pos_;
      } else if (c == '?') {
        lo = 0, hi = 1, ++pos_;
      } else if (c == '{') {
        const size_t save = pos_;
        ++pos_;
        if (!ParseInt(&lo)) {
          pos_ = save;
          Fail("'{' that does not start a repetition {m,n} (escape it as \\{)");
          return atom;
        }
        hi = lo;
        if (!AtEnd() && Peek() == ',') {
          ++pos_;
          if (!ParseInt(&hi)) hi = -1;
        }
        if (AtEnd() || Peek() != '}') {
          Fail("unterminated repetition {m,n}");
          return atom;
        }
        ++pos_;
        if ((hi != -1 && hi < lo)) {
          Fail("repetition {m,n} with n < m");
          return atom;
        }
        if (lo > limits_.max_repeat || hi > limits_.max_repeat) {
          Fail(absl::StrCat("repetition count above ", limits_.max_repeat));
          return atom;
        }
      } else {
        break;
      }
      if (!AtEnd() && Peek() == '?') ++pos_;  // lazy: the same language under full match
      if (!AtEnd() && Peek() == '+') {
        Fail("possessive quantifier");
        return atom;
      }
      Node r{.kind = Node::Kind::kRepeat, .min = lo, .max = hi};
      r.kids.push_back(std::move(atom));
      atom = std::move(r);
    }
    return atom;
  }

  // Reads one UTF-8 character of the pattern (the pattern must be valid UTF-8).
  uint32_t ReadChar() {
    const uint8_t b = static_cast<uint8_t>(p_[pos_]);
    int len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (len == 0 || pos_ + static_cast<size_t>(len) > p_.size()) {
      Fail("invalid UTF-8");
      ++pos_;
      return 0;
    }
    uint32_t c = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
    for (int i = 1; i < len; ++i) {
      const uint8_t k = static_cast<uint8_t>(p_[pos_ + static_cast<size_t>(i)]);
      if ((k & 0xC0) != 0x80) {
        Fail("invalid UTF-8");
        ++pos_;
        return 0;
      }
      c = (c << 6) | (k & 0x3F);
    }
    pos_ += static_cast<size_t>(len);
    if (c > kMaxCodePoint || (c >= 0xD800 && c <= 0xDFFF)) Fail("invalid UTF-8");
    return c;
  }

  uint32_t ReadHex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      if (AtEnd()) {
        Fail("truncated hex escape");
        return 0;
      }
      const char c = Peek();
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) {
        Fail("bad hex escape");
        return 0;
      }
      v = v * 16 + static_cast<uint32_t>(d);
      ++pos_;
    }
    return v;
  }

  // After a backslash: the set it stands for. `in_class`: inside [...].
  Ranges ParseEscape() {
    if (AtEnd()) {
      Fail("trailing backslash");
      return {};
    }
    const char c = Peek();
    ++pos_;
    switch (c) {
      case 'd': return kDigit;
      case 'D': return Complement(kDigit);
      case 'w': return kWord;
      case 'W': return Complement(kWord);
      case 's': return kSpace;
      case 'S': return Complement(kSpace);
      case 'n': return {{'\n', '\n'}};
      case 'r': return {{'\r', '\r'}};
      case 't': return {{'\t', '\t'}};
      case 'f': return {{'\f', '\f'}};
      case 'v': return {{'\v', '\v'}};
      case '0': return {{0, 0}};
      case 'x': {
        const uint32_t v = ReadHex(2);
        return {{v, v}};
      }
      case 'u': {
        const uint32_t v = ReadHex(4);
        if (v >= 0xD800 && v <= 0xDFFF) Fail("surrogate code point in \\u escape");
        return {{v, v}};
      }
      default:
        break;
    }
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))) {
      return {{u, u}};  // escaped punctuation
    }
    --pos_;
    Fail(absl::StrFormat("unsupported escape \\%c", c));
    ++pos_;
    return {};
  }

  Node ParseClass() {
    ++pos_;  // '['
    bool negate = false;
    if (!AtEnd() && Peek() == '^') {
      negate = true;
      ++pos_;
    }
    Ranges r;
    bool first = true;
    while (true) {
      if (AtEnd()) {
        Fail("unterminated character class");
        return Node{};
      }
      if (Peek() == ']' && !first) break;
      first = false;
      Ranges item;
      bool single = false;
      if (Peek() == '\\') {
        ++pos_;
        item = ParseEscape();
        single = item.size() == 1 && item[0].first == item[0].second;
      } else if (Peek() == '[' && pos_ + 1 < p_.size() && p_[pos_ + 1] == ':') {
        Fail("POSIX character classes");
        return Node{};
      } else {
        const uint32_t c = ReadChar();
        item = {{c, c}};
        single = true;
      }
      if (single && pos_ + 1 < p_.size() && Peek() == '-' && p_[pos_ + 1] != ']') {
        ++pos_;
        uint32_t hi = 0;
        if (Peek() == '\\') {
          ++pos_;
          Ranges h = ParseEscape();
          if (h.size() != 1 || h[0].first != h[0].second) {
            Fail("class range ending in a set");
            return Node{};
          }
          hi = h[0].first;
        } else {
          hi = ReadChar();
        }
        if (hi < item[0].first) {
          Fail("class range out of order");
          return Node{};
        }
        item[0].second = hi;
      }
      r.insert(r.end(), item.begin(), item.end());
    }
    ++pos_;  // ']'
    return RangesNode(negate ? Complement(r) : r);
  }

  Node ParseAtom() {
    const char c = Peek();
    switch (c) {
      case '(': {
        ++pos_;
        if (!AtEnd() && Peek() == '?') {
          if (pos_ + 1 < p_.size() && p_[pos_ + 1] == ':') {
            pos_ += 2;
          } else {
            Fail("group flags, lookaround or named groups");
            return Node{};
          }
        }
        if (++nesting_ > 200) {
          Fail("groups nested too deeply");
          return Node{};
        }
        Node inner = ParseAlt();
        --nesting_;
        if (AtEnd() || Peek() != ')') {
          Fail("unbalanced '('");
          return Node{};
        }
        ++pos_;
        return inner;
      }
      case '[':
        return ParseClass();
      case '.':
        ++pos_;
        return RangesNode(Complement({{'\n', '\n'}}));
      case '\\': {
        ++pos_;
        if (!AtEnd() && Peek() >= '1' && Peek() <= '9') {
          Fail("backreference");
          return Node{};
        }
        if (!AtEnd() && (Peek() == 'b' || Peek() == 'B' || Peek() == 'A' || Peek() == 'Z' || Peek() == 'z')) {
          Fail("anchor escape");
          return Node{};
        }
        return RangesNode(ParseEscape());
      }
      case '*':
      case '+':
      case '?':
        Fail("quantifier without an operand");
        return Node{};
      case '^':
      case '$':
        Fail("anchor inside the pattern");
        return Node{};
      default: {
        uint8_t buf[4];
        const uint32_t ch = ReadChar();
        const int n = Utf8Length(ch);
        EncodeUtf8(ch, buf);
        if (n == 1) return ByteNode(buf[0], buf[0]);
        Node seq{.kind = Node::Kind::kConcat};
        for (int i = 0; i < n; ++i) seq.kids.push_back(ByteNode(buf[i], buf[i]));
        return seq;
      }
    }
  }

  absl::string_view p_;
  const DfaLimits& limits_;
  size_t pos_ = 0;
  int nesting_ = 0;
  int64_t depth_guard_ = 0;
  std::string error_;
};

// ---- Thompson NFA -------------------------------------------------------------------------------

struct Nfa {
  struct Edge {
    uint8_t lo, hi;
    int32_t to;
  };
  struct State {
    std::vector<Edge> edges;
    std::vector<int32_t> eps;
  };
  std::vector<State> states;
  int32_t max_states = 0;
  bool overflow = false;

  int32_t Add() {
    if (static_cast<int32_t>(states.size()) >= max_states) {
      overflow = true;
      return 0;
    }
    states.emplace_back();
    return static_cast<int32_t>(states.size()) - 1;
  }
  void Eps(int32_t from, int32_t to) {
    if (!overflow) states[static_cast<size_t>(from)].eps.push_back(to);
  }

  // Builds `n` between fresh states; returns (start, end).
  std::pair<int32_t, int32_t> Build(const Node& n) {
    if (overflow) return {0, 0};
    switch (n.kind) {
      case Node::Kind::kBytes: {
        const int32_t s = Add(), e = Add();
        if (overflow) return {0, 0};
        for (int b = 0; b < 256;) {
          if (!n.bytes.test(static_cast<size_t>(b))) {
            ++b;
            continue;
          }
          int h = b;
          while (h + 1 < 256 && n.bytes.test(static_cast<size_t>(h + 1))) ++h;
          states[static_cast<size_t>(s)].edges.push_back({static_cast<uint8_t>(b), static_cast<uint8_t>(h), e});
          b = h + 1;
        }
        return {s, e};
      }
      case Node::Kind::kConcat: {
        const int32_t s = Add();
        int32_t cur = s;
        for (const Node& k : n.kids) {
          auto [ks, ke] = Build(k);
          Eps(cur, ks);
          cur = ke;
        }
        return {s, cur};
      }
      case Node::Kind::kAlt: {
        const int32_t s = Add(), e = Add();
        for (const Node& k : n.kids) {
          auto [ks, ke] = Build(k);
          Eps(s, ks);
          Eps(ke, e);
        }
        return {s, e};
      }
      case Node::Kind::kRepeat: {
        const Node& k = n.kids[0];
        const int32_t s = Add();
        int32_t cur = s;
        for (int32_t i = 0; i < n.min && !overflow; ++i) {
          auto [ks, ke] = Build(k);
          Eps(cur, ks);
          cur = ke;
        }
        if (n.max == -1) {
          auto [ks, ke] = Build(k);
          const int32_t e = Add();
          Eps(cur, ks);
          Eps(ke, ks);
          Eps(cur, e);
          Eps(ke, e);
          return {s, e};
        }
        const int32_t e = Add();
        for (int32_t i = n.min; i < n.max && !overflow; ++i) {
          Eps(cur, e);
          auto [ks, ke] = Build(k);
          Eps(cur, ks);
          cur = ke;
        }
        Eps(cur, e);
        return {s, e};
      }
    }
    return {0, 0};
  }
};

void Closure(const Nfa& nfa, std::vector<int32_t>* set, std::vector<uint32_t>* mark, uint32_t stamp) {
  std::vector<int32_t> stack(set->begin(), set->end());
  for (int32_t s : *set) (*mark)[static_cast<size_t>(s)] = stamp;
  while (!stack.empty()) {
    const int32_t s = stack.back();
    stack.pop_back();
    for (int32_t t : nfa.states[static_cast<size_t>(s)].eps) {
      if ((*mark)[static_cast<size_t>(t)] != stamp) {
        (*mark)[static_cast<size_t>(t)] = stamp;
        set->push_back(t);
        stack.push_back(t);
      }
    }
  }
  // Only states with byte edges (and the accepting one) distinguish DFA states.
  std::sort(set->begin(), set->end());
}

}  // namespace

absl::StatusOr<ByteDfa> ByteDfa::Compile(absl::string_view pattern, const DfaLimits& limits) {
  Parser parser(pattern, limits);
  absl::StatusOr<Node> root = parser.Parse();
  if (!root.ok()) return root.status();
  Nfa nfa;
  nfa.max_states = limits.max_nfa_states;
  const std::pair<int32_t, int32_t> ends = nfa.Build(*root);
  const int32_t nfa_start = ends.first, nfa_accept = ends.second;
  if (nfa.overflow) {
    return absl::InvalidArgumentError(
        absl::StrCat("constraint too complex: more than ", limits.max_nfa_states, " automaton states (NFA)"));
  }
  // Subset construction. A DFA state is the sorted set of NFA states with byte edges (or the
  // accepting state) in an epsilon closure.
  std::vector<uint32_t> mark(nfa.states.size(), 0);
  uint32_t stamp = 0;
  auto key_of = [&](std::vector<int32_t> closure) {
    std::vector<int32_t> key;
    for (int32_t s : closure) {
      if (!nfa.states[static_cast<size_t>(s)].edges.empty() || s == nfa_accept) key.push_back(s);
    }
    return key;
  };
  absl::flat_hash_map<std::vector<int32_t>, int32_t> ids;
  std::vector<std::vector<int32_t>> sets;
  ByteDfa dfa;
  auto intern = [&](std::vector<int32_t> key) -> int32_t {
    auto it = ids.find(key);
    if (it != ids.end()) return it->second;
    const int32_t id = static_cast<int32_t>(sets.size());
    ids.emplace(key, id);
    dfa.accepting_.push_back(std::binary_search(key.begin(), key.end(), nfa_accept) ? 1 : 0);
    sets.push_back(std::move(key));
    return id;
  };
  {
    std::vector<int32_t> c = {nfa_start};
    Closure(nfa, &c, &mark, ++stamp);
    dfa.start_ = intern(key_of(std::move(c)));
  }
  for (size_t d = 0; d < sets.size(); ++d) {
    if (static_cast<int32_t>(sets.size()) > limits.max_dfa_states) {
      return absl::InvalidArgumentError(
          absl::StrCat("constraint too complex: more than ", limits.max_dfa_states, " automaton states (DFA)"));
    }
    dfa.next_.resize((d + 1) * 256, -1);
    std::vector<Nfa::Edge> edges;
    for (int32_t s : sets[d]) {
      const auto& e = nfa.states[static_cast<size_t>(s)].edges;
      edges.insert(edges.end(), e.begin(), e.end());
    }
    std::vector<int> bounds = {0, 256};
    for (const Nfa::Edge& e : edges) {
      bounds.push_back(e.lo);
      bounds.push_back(e.hi + 1);
    }
    std::sort(bounds.begin(), bounds.end());
    bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      const int lo = bounds[i], hi = bounds[i + 1] - 1;
      std::vector<int32_t> targets;
      ++stamp;
      for (const Nfa::Edge& e : edges) {
        if (e.lo <= lo && hi <= e.hi && mark[static_cast<size_t>(e.to)] != stamp) {
          mark[static_cast<size_t>(e.to)] = stamp;
          targets.push_back(e.to);
        }
      }
      if (targets.empty()) continue;
      Closure(nfa, &targets, &mark, ++stamp);
      const int32_t to = intern(key_of(std::move(targets)));
      for (int b = lo; b <= hi; ++b) dfa.next_[d * 256 + static_cast<size_t>(b)] = to;
    }
  }
  // Keep only live states: those from which an accepting state can be reached.
  const size_t n = sets.size();
  std::vector<std::vector<int32_t>> reverse(n);
  for (size_t s = 0; s < n; ++s) {
    for (int b = 0; b < 256; ++b) {
      const int32_t t = dfa.next_[s * 256 + static_cast<size_t>(b)];
      if (t >= 0 && (reverse[static_cast<size_t>(t)].empty() || reverse[static_cast<size_t>(t)].back() != static_cast<int32_t>(s))) {
        reverse[static_cast<size_t>(t)].push_back(static_cast<int32_t>(s));
      }
    }
  }
  std::vector<uint8_t> live(n, 0);
  std::vector<int32_t> stack;
  for (size_t s = 0; s < n; ++s) {
    if (dfa.accepting_[s]) {
      live[s] = 1;
      stack.push_back(static_cast<int32_t>(s));
    }
  }
  while (!stack.empty()) {
    const int32_t s = stack.back();
    stack.pop_back();
    for (int32_t p : reverse[static_cast<size_t>(s)]) {
      if (!live[static_cast<size_t>(p)]) {
        live[static_cast<size_t>(p)] = 1;
        stack.push_back(p);
      }
    }
  }
  if (!live[static_cast<size_t>(dfa.start_)]) return absl::InvalidArgumentError("constraint matches no text at all");
  // Renumber the live states densely and drop the rest (a dead state, e.g. after an empty class
  // such as [^\d\D], must not stay in the table: every state the DFA reports can still accept).
  std::vector<int32_t> renumber(n, -1);
  int32_t kept = 0;
  for (size_t s = 0; s < n; ++s) {
    if (live[s]) renumber[s] = kept++;
  }
  ByteDfa out;
  out.start_ = renumber[static_cast<size_t>(dfa.start_)];
  out.next_.assign(static_cast<size_t>(kept) * 256, -1);
  out.accepting_.assign(static_cast<size_t>(kept), 0);
  out.has_out_.assign(static_cast<size_t>(kept), 0);
  out.loops_.assign(static_cast<size_t>(kept), {});
  for (size_t s = 0; s < n; ++s) {
    const int32_t ns = renumber[s];
    if (ns < 0) continue;
    out.accepting_[static_cast<size_t>(ns)] = dfa.accepting_[s];
    for (int b = 0; b < 256; ++b) {
      const int32_t t = dfa.next_[s * 256 + static_cast<size_t>(b)];
      const int32_t nt = t >= 0 ? renumber[static_cast<size_t>(t)] : -1;
      out.next_[static_cast<size_t>(ns) * 256 + static_cast<size_t>(b)] = nt;
      if (nt >= 0) out.has_out_[static_cast<size_t>(ns)] = 1;
      if (nt == ns) out.loops_[static_cast<size_t>(ns)].set(static_cast<size_t>(b));
    }
  }
  return out;
}

int32_t ByteDfa::Walk(int32_t state, absl::string_view text) const {
  for (char c : text) {
    if (state < 0) return -1;
    state = Next(state, static_cast<uint8_t>(c));
  }
  return state;
}

bool ByteDfa::FullMatch(absl::string_view text) const {
  const int32_t s = Walk(start_, text);
  return s >= 0 && IsAccepting(s);
}

}  // namespace shardserve::structured
