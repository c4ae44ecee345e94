#include "coordinator/structured/grammar.h"

#include <algorithm>
#include <bitset>
#include <map>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardserve::structured {

// The tokens' bytes as a trie in depth-first order: the tokens of a node's subtree are the
// contiguous range [first_token, subtree_end) of tokens_, and subtree_bytes holds every byte on an
// edge below the node. A subtree whose bytes all loop on the DFA state reached at its root (the
// characters inside a JSON string, say) is allowed whole without walking it.
class TokenTrie {
 public:
  struct Node {
    int32_t first_edge = 0, num_edges = 0;    // into edge_byte_ / edge_child_
    int32_t first_token = 0, num_tokens = 0;  // into tokens_: the ids spelled by the path to here
    int32_t subtree_end = 0;                  // tokens_[first_token, subtree_end): the whole subtree's
  };

  explicit TokenTrie(const TokenVocabulary& vocab) {
    struct Build {
      std::map<uint8_t, int32_t> kids;
      std::vector<int32_t> tokens;
    };
    std::vector<Build> b(1);
    for (size_t id = 0; id < vocab.bytes.size(); ++id) {
      const std::string& s = vocab.bytes[id];
      if (s.empty()) continue;
      int32_t n = 0;
      for (char c : s) {
        const auto byte = static_cast<uint8_t>(c);
        auto it = b[static_cast<size_t>(n)].kids.find(byte);
        if (it == b[static_cast<size_t>(n)].kids.end()) {
          b.emplace_back();
          const int32_t k = static_cast<int32_t>(b.size()) - 1;
          b[static_cast<size_t>(n)].kids.emplace(byte, k);
          n = k;
        } else {
          n = it->second;
        }
      }
      b[static_cast<size_t>(n)].tokens.push_back(static_cast<int32_t>(id));
    }
    nodes_.resize(b.size());
    subtree_bytes_.resize(b.size());
    Flatten(b, 0);
  }

  // Sets in `mask` the bits of every token whose bytes the DFA can read from `state`.
  void Walk(const ByteDfa& dfa, int32_t state, std::string* mask) const {
    auto set = [mask](int32_t id) { (*mask)[static_cast<size_t>(id) / 8] |= static_cast<char>(1 << (id % 8)); };
    std::vector<std::pair<int32_t, int32_t>> stack = {{0, state}};  // (node, DFA state)
    while (!stack.empty()) {
      const auto [node, s] = stack.back();
      stack.pop_back();
      const Node& n = nodes_[static_cast<size_t>(node)];
      for (int32_t e = n.first_edge; e < n.first_edge + n.num_edges; ++e) {
        const int32_t t = dfa.Next(s, edge_byte_[static_cast<size_t>(e)]);
        if (t < 0) continue;
        const int32_t child = edge_child_[static_cast<size_t>(e)];
        const Node& c = nodes_[static_cast<size_t>(child)];
        const std::bitset<256>& loops = dfa.SelfLoops(t);
        if (loops.any() && (subtree_bytes_[static_cast<size_t>(child)] & ~loops).none()) {
          // Every path below stays in `t`, which is live: the whole subtree is allowed.
          for (int32_t k = c.first_token; k < c.subtree_end; ++k) set(tokens_[static_cast<size_t>(k)]);
          continue;
        }
        for (int32_t k = c.first_token; k < c.first_token + c.num_tokens; ++k) set(tokens_[static_cast<size_t>(k)]);
        stack.push_back({child, t});
      }
    }
  }

 private:
  // Numbers the subtree of build node `src` depth-first from nodes_ slot `slot`; returns the next
  // free slot. Recursion depth is the longest token (bytes), which is small.
  template <typename Build>
  int32_t Flatten(const std::vector<Build>& b, int32_t slot, int32_t src = 0) {
    const Build& from = b[static_cast<size_t>(src)];
    const int32_t me = slot++;
    nodes_[static_cast<size_t>(me)].first_token = static_cast<int32_t>(tokens_.size());
    nodes_[static_cast<size_t>(me)].num_tokens = static_cast<int32_t>(from.tokens.size());
    tokens_.insert(tokens_.end(), from.tokens.begin(), from.tokens.end());
    std::vector<std::pair<uint8_t, int32_t>> kids;  // (byte, slot of the child)
    std::bitset<256> below;
    for (const auto& [byte, k] : from.kids) {
      kids.push_back({byte, slot});
      below.set(byte);
      const int32_t child = slot;
      slot = Flatten(b, slot, k);
      below |= subtree_bytes_[static_cast<size_t>(child)];
    }
    subtree_bytes_[static_cast<size_t>(me)] = below;
    Node& n = nodes_[static_cast<size_t>(me)];
    n.subtree_end = static_cast<int32_t>(tokens_.size());
    n.first_edge = static_cast<int32_t>(edge_byte_.size());
    n.num_edges = static_cast<int32_t>(kids.size());
    for (const auto& [byte, child] : kids) {
      edge_byte_.push_back(byte);
      edge_child_.push_back(child);
    }
    return slot;
  }

  std::vector<Node> nodes_;
  std::vector<std::bitset<256>> subtree_bytes_;  // [nodes]: bytes on the edges below each node (cold data)
  std::vector<uint8_t> edge_byte_;
  std::vector<int32_t> edge_child_;
  std::vector<int32_t> tokens_;
};

namespace {

bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<uint8_t>(s[i]);
    const size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<uint8_t>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

// GPT-2's byte <-> printable character map, inverted: the byte of code point `c`, or -1.
int ByteOfByteLevelChar(uint32_t c) {
  static const auto* table = [] {
    auto* t = new std::map<uint32_t, int>();
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      (*t)[printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++)] = b;
    }
    return t;
  }();
  auto it = table->find(c);
  return it == table->end() ? -1 : it->second;
}

// Decodes UTF-8 `s` into code points; false when it is not valid UTF-8.
bool CodePoints(absl::string_view s, std::vector<uint32_t>* out) {
  if (!IsValidUtf8(s)) return false;
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    const size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : 4;
    uint32_t c = len == 1 ? b : len == 2 ? (b & 0x1Fu) : len == 3 ? (b & 0x0Fu) : (b & 0x07u);
    for (size_t k = 1; k < len; ++k) c = (c << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3Fu);
    out->push_back(c);
    i += len;
  }
  return true;
}

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // ▁
constexpr std::string_view kByteLevelSpace = "\xC4\xA0";  // Ġ

std::string SentencePieceBytes(const std::string& piece) {
  if (piece.size() == 6 && piece.rfind("<0x", 0) == 0 && piece[5] == '>') {
    int v = 0;
    for (int i = 3; i < 5; ++i) {
      const char c = piece[static_cast<size_t>(i)];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return piece;
      v = v * 16 + d;
    }
    return std::string(1, static_cast<char>(v));
  }
  std::string out;
  for (size_t i = 0; i < piece.size();) {
    if (piece.compare(i, kMetaspace.size(), kMetaspace) == 0) {
      out.push_back(' ');
      i += kMetaspace.size();
    } else {
      out.push_back(piece[i++]);
    }
  }
  return out;
}

std::string ByteLevelBytes(const std::string& piece) {
  std::vector<uint32_t> cps;
  if (!CodePoints(piece, &cps)) return std::string();
  std::string out;
  for (uint32_t c : cps) {
    const int b = ByteOfByteLevelChar(c);
    if (b < 0) return piece;  // not a byte-level spelling (an added token): its text as is
    out.push_back(static_cast<char>(b));
  }
  return out;
}

}  // namespace

TokenVocabulary VocabularyFromTokenizer(const Tokenizer& tokenizer, int32_t mask_size) {
  TokenVocabulary v;
  v.bytes.resize(static_cast<size_t>(std::max(mask_size, 1)));
  const int32_t n = std::min(tokenizer.vocab_size(), mask_size);
  std::vector<std::string> pieces(static_cast<size_t>(n));
  int64_t metaspace = 0, byte_level = 0;
  for (int32_t id = 0; id < n; ++id) {
    absl::StatusOr<std::string> p = tokenizer.IdToPiece(id);
    if (!p.ok()) continue;
    pieces[static_cast<size_t>(id)] = *std::move(p);
    if (pieces[static_cast<size_t>(id)].find(kMetaspace) != std::string::npos) ++metaspace;
    if (pieces[static_cast<size_t>(id)].find(kByteLevelSpace) != std::string::npos) ++byte_level;
  }
  const bool is_byte_level = tokenizer.kind() == TokenizerKind::kHfBpe && byte_level > metaspace;
  for (int32_t id = 0; id < n; ++id) {
    const std::string& piece = pieces[static_cast<size_t>(id)];
    if (piece.empty() || tokenizer.IsSpecial(id)) continue;
    std::string bytes = is_byte_level ? ByteLevelBytes(piece) : SentencePieceBytes(piece);
    if (bytes.empty()) continue;
    // Check against the tokenizer's own decoding where the bytes are whole characters (decoding
    // a lone token may drop one leading space; partial UTF-8 cannot be compared).
    if (IsValidUtf8(bytes)) {
      const int32_t ids[] = {id};
      absl::StatusOr<std::string> text = tokenizer.Decode(ids, /*skip_special_tokens=*/true);
      if (!text.ok()) continue;
      const bool same = *text == bytes || (bytes[0] == ' ' && *text == bytes.substr(1));
      if (!same) continue;
    }
    v.bytes[static_cast<size_t>(id)] = std::move(bytes);
  }
  for (int32_t id : tokenizer.eos_ids()) {
    if (id >= 0 && id < mask_size) {
      v.eos_ids.push_back(id);
      v.bytes[static_cast<size_t>(id)].clear();
    }
  }
  return v;
}

absl::string_view ConstraintKindName(ConstraintKind kind) {
  switch (kind) {
    case ConstraintKind::kJsonObject: return "json_object";
    case ConstraintKind::kJsonSchema: return "json_schema";
    case ConstraintKind::kRegex: return "regex";
  }
  return "?";
}

GrammarConstraint::GrammarConstraint(ByteDfa dfa, std::shared_ptr<const TokenVocabulary> vocab,
                                     std::shared_ptr<const TokenTrie> trie)
    : dfa_(std::move(dfa)), vocab_(std::move(vocab)), trie_(std::move(trie)), finished_(dfa_.num_states()) {
  masks_.resize(static_cast<size_t>(finished_) + 1);
}

std::shared_ptr<const std::string> GrammarConstraint::ComputeMask(int32_t state) const {
  auto mask = std::make_shared<std::string>((vocab_->bytes.size() + 7) / 8, '\0');
  bool any = false;
  if (state != finished_) {
    trie_->Walk(dfa_, state, mask.get());
    for (char c : *mask) any = any || c != 0;
  }
  // EOS where the text is complete; and as a way out where the vocabulary cannot spell any
  // continuation (a byte no token has), so that generation still ends.
  if (state == finished_ || dfa_.IsAccepting(state) || !any) {
    for (int32_t id : vocab_->eos_ids) (*mask)[static_cast<size_t>(id) / 8] |= static_cast<char>(1 << (id % 8));
  }
  return mask;
}

std::shared_ptr<const std::string> GrammarConstraint::AllowedMask(int32_t state) const {
  {
    absl::MutexLock lock(&mu_);
    const auto& m = masks_[static_cast<size_t>(state)];
    if (m != nullptr) return m;
  }
  std::shared_ptr<const std::string> mask = ComputeMask(state);  // outside the lock: may take a while
  absl::MutexLock lock(&mu_);
  auto& m = masks_[static_cast<size_t>(state)];
  if (m == nullptr) m = std::move(mask);
  return m;
}

int32_t GrammarConstraint::CachedMasksForTest() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(std::count_if(masks_.begin(), masks_.end(), [](const auto& m) { return m != nullptr; }));
}

int32_t GrammarConstraint::Advance(int32_t state, int32_t token) const {
  if (state < 0 || state >= finished_ || token < 0 || static_cast<size_t>(token) >= vocab_->bytes.size()) return -1;
  if (std::find(vocab_->eos_ids.begin(), vocab_->eos_ids.end(), token) != vocab_->eos_ids.end()) {
    // Allowed where the text is complete, or where nothing else could be (see ComputeMask).
    if (dfa_.IsAccepting(state)) return finished_;
    const std::shared_ptr<const std::string> m = AllowedMask(state);
    return ((*m)[static_cast<size_t>(token) / 8] >> (token % 8)) & 1 ? finished_ : -1;
  }
  const std::string& bytes = vocab_->bytes[static_cast<size_t>(token)];
  if (bytes.empty()) return -1;
  return dfa_.Walk(state, bytes);
}

ConstraintCompiler::ConstraintCompiler(TokenVocabulary vocab, CompilerOptions options)
    : options_(std::move(options)),
      vocab_(std::make_shared<const TokenVocabulary>(std::move(vocab))),
      trie_(std::make_shared<const TokenTrie>(*vocab_)) {}

ConstraintCompiler::~ConstraintCompiler() = default;

absl::StatusOr<std::shared_ptr<const GrammarConstraint>> ConstraintCompiler::CompileGrammar(const ConstraintSpec& spec) {
  const std::string key = absl::StrCat(ConstraintKindName(spec.kind), ":", spec.kind == ConstraintKind::kJsonObject ? "" : spec.text);
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
  }
  std::string regex;
  switch (spec.kind) {
    case ConstraintKind::kJsonObject:
      regex = JsonObjectRegex(options_.json);
      break;
    case ConstraintKind::kJsonSchema: {
      absl::StatusOr<std::string> r = JsonSchemaRegex(spec.text, options_.json);
      if (!r.ok()) return r.status();
      regex = *std::move(r);
      break;
    }
    case ConstraintKind::kRegex:
      regex = spec.text;
      break;
  }
  absl::StatusOr<ByteDfa> dfa = ByteDfa::Compile(regex, options_.dfa);
  if (!dfa.ok()) return dfa.status();
  const int64_t bytes = int64_t{dfa->num_states() + 1} *
                        static_cast<int64_t>(256 * sizeof(int32_t) + 2 + (vocab_->bytes.size() + 7) / 8);
  auto compiled = std::make_shared<const GrammarConstraint>(*std::move(dfa), vocab_, trie_);
  absl::MutexLock lock(&mu_);
  if (cache_.size() >= options_.max_cached || cached_bytes_ + bytes > options_.max_cached_bytes) {
    cache_.clear();
    cached_bytes_ = 0;
  }
  auto [it, inserted] = cache_.emplace(key, std::move(compiled));
  if (inserted) cached_bytes_ += bytes;
  return it->second;
}

absl::StatusOr<std::shared_ptr<const coordinator::TokenConstraint>> ConstraintCompiler::Compile(const ConstraintSpec& spec) {
  absl::StatusOr<std::shared_ptr<const GrammarConstraint>> g = CompileGrammar(spec);
  if (!g.ok()) return g.status();
  return std::shared_ptr<const coordinator::TokenConstraint>(*std::move(g));
}

}  // namespace shardserve::structured
