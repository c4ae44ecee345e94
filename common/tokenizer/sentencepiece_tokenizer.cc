#include "common/tokenizer/sentencepiece_tokenizer.h"

#include <algorithm>
#include <array>
#include <optional>
#include <queue>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status/macros.h"
#include "common/tokenizer/internal/decoder.h"
#include "common/tokenizer/internal/sentencepiece_model.h"
#include "common/tokenizer/internal/sentencepiece_normalizer.h"
#include "common/tokenizer/internal/string_view.h"
#include "common/tokenizer/utf8.h"

namespace shardserve {
namespace {

using tokenizer_internal::AbslView;
using tokenizer_internal::kSpaceSymbol;
using tokenizer_internal::SpModel;
using tokenizer_internal::SpNormalizer;
using PieceType = SpModel::PieceType;

// Per-call working memory: BPE buffers and a cache of the pieces of short chunks.
struct EncodeScratch {
  struct Symbol {
    int32_t prev;
    int32_t next;
    bool freeze;  // a user-defined symbol: never merged
    std::string_view piece;
  };
  struct Pair {
    float score;
    int32_t left;
    int32_t right;
    size_t size;
  };
  std::vector<Symbol> symbols;
  std::vector<std::string_view> pieces;
  absl::flat_hash_map<std::string, std::pair<uint32_t, uint32_t>> cache;  // chunk -> [begin, end) in cached
  std::vector<int32_t> cached;
};

// Decoding state of one sequence; Decode() and the stream decoder both run it, so they agree.
struct DecodeState {
  DecodeState() : assembler(InvalidUtf8Policy::kPerByte) {}
  Utf8StreamAssembler assembler;  // byte pieces: one U+FFFD per invalid byte, as SentencePiece does
  bool produced = false;          // some text (or a byte piece) has been produced
  bool bos_ws_seen = false;       // the previous piece consumed the first-word space
  bool is_bos_ws = true;          // a leading "▁" may still be dropped (once false, stays false)
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path, const TokenizerConfig& config);

  TokenizerKind kind() const override { return TokenizerKind::kSentencePiece; }
  const std::string& source() const override { return source_; }
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens) const override;
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const override;
  std::unique_ptr<StreamDecoder> NewStreamDecoder(bool skip_special_tokens) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(model_.pieces.size()); }
  std::optional<int32_t> bos_id() const override { return special_ids_.bos; }
  const std::vector<int32_t>& eos_ids() const override { return special_ids_.eos; }
  absl::StatusOr<std::string> IdToPiece(int32_t id) const override;
  std::optional<int32_t> PieceToId(std::string_view piece) const override;
  bool IsSpecial(int32_t id) const override { return id >= 0 && id < vocab_size() && Type(id) == PieceType::kControl; }
  const std::optional<std::string>& chat_template() const override { return chat_template_; }

  absl::Status CheckId(int32_t id) const;
  // Feeds one valid id to `state`; appends the text that is now final to `out`.
  void DecodeStep(int32_t id, DecodeState* state, std::string* out) const;

 private:
  SentencePieceTokenizer() = default;
  absl::Status Init(const std::string& path);
  PieceType Type(int32_t id) const { return model_.pieces[id].type; }
  // sentencepiece's PieceToId: control/unknown/byte pieces, then the others, else the unknown id.
  int32_t LookupPiece(std::string_view piece) const;
  void EncodeChunk(std::string_view chunk, EncodeScratch* scratch, std::vector<int32_t>* ids) const;
  void BpeChunk(std::string_view chunk, EncodeScratch* scratch) const;
  void Resegment(std::string_view piece,
                 const absl::flat_hash_map<std::string_view, std::pair<std::string_view, std::string_view>>& rev_merge,
                 std::vector<std::string_view>* out) const;

  // All constant after Load().
  std::string source_;
  SpModel model_;
  std::unique_ptr<SpNormalizer> normalizer_;
  absl::flat_hash_map<std::string, int32_t> pieces_;    // normal, user-defined and unused pieces
  absl::flat_hash_map<std::string, int32_t> reserved_;  // control, unknown and byte pieces
  std::vector<int16_t> byte_value_;                     // per id: the byte of a byte piece, else -1
  std::array<int32_t, 256> byte_id_{};                  // per byte: its byte piece, else the unknown id
  int32_t unk_id_ = -1;
  bool split_at_words_ = false;  // see FindSplitMarker in internal/bpe_model.h: same reasoning
  bool add_bos_ = false;
  bool add_eos_ = false;
  SpecialTokenIds special_ids_;
  std::optional<std::string> chat_template_;
};

class SpStreamDecoder final : public StreamDecoder {
 public:
  explicit SpStreamDecoder(const SentencePieceTokenizer* tokenizer) : tokenizer_(tokenizer) {}

  absl::StatusOr<std::string> Next(int32_t id) override {
    RETURN_IF_ERROR(tokenizer_->CheckId(id));
    std::string out;
    tokenizer_->DecodeStep(id, &state_, &out);
    return out;
  }

  std::string Finish() override {
    std::string out;
    state_.assembler.Break(&out);
    state_ = DecodeState();
    return out;
  }

  std::unique_ptr<StreamDecoder> Clone() const override { return std::make_unique<SpStreamDecoder>(*this); }

 private:
  const SentencePieceTokenizer* tokenizer_;
  DecodeState state_;
};

absl::Status SentencePieceTokenizer::Init(const std::string& path) {
  auto unsupported = [&](std::string_view what) {
    return absl::UnimplementedError(absl::StrCat(path, ": ", AbslView(what), " is not supported"));
  };
  if (model_.model_type != SpModel::ModelType::kBpe) {
    return unsupported("a SentencePiece model that is not BPE (Unigram, word or char; Llama and Mistral use BPE)");
  }
  if (model_.treat_whitespace_as_suffix) return unsupported("treat_whitespace_as_suffix");
  if (model_.has_denormalizer) return unsupported("a denormalizer");
  std::vector<std::string> user_defined;
  byte_value_.assign(model_.pieces.size(), -1);
  for (size_t i = 0; i < model_.pieces.size(); ++i) {
    const auto id = static_cast<int32_t>(i);
    const SpModel::Piece& p = model_.pieces[i];
    const bool normal =
        p.type == PieceType::kNormal || p.type == PieceType::kUserDefined || p.type == PieceType::kUnused;
    if (!(normal ? pieces_ : reserved_).emplace(p.piece, id).second) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": piece \"", p.piece, "\" (id ", id, ") is defined twice"));
    }
    if (p.type == PieceType::kUserDefined) user_defined.push_back(p.piece);
    if (p.type == PieceType::kUnknown) {
      if (unk_id_ >= 0) return absl::InvalidArgumentError(absl::StrCat(path, ": more than one unknown piece"));
      unk_id_ = id;
    }
    if (p.type == PieceType::kByte) {
      const int b = tokenizer_internal::ByteFallbackValue(p.piece);
      if (b < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": byte piece ", id, " is spelled \"", p.piece, "\", not <0xXX>"));
      }
      byte_value_[i] = static_cast<int16_t>(b);
    }
  }
  if (unk_id_ < 0) return absl::InvalidArgumentError(absl::StrCat(path, ": the model has no unknown piece"));
  byte_id_.fill(unk_id_);
  for (size_t i = 0; i < model_.pieces.size(); ++i) {
    if (byte_value_[i] >= 0) byte_id_[byte_value_[i]] = static_cast<int32_t>(i);
  }
  ASSIGN_OR_RETURN(normalizer_, SpNormalizer::Create(model_, user_defined, path));
  // Chunking at word starts is exact when no piece has "▁" right after another character.
  split_at_words_ = model_.escape_whitespaces && pieces_.contains(std::string(kSpaceSymbol));
  for (const auto& [piece, id] : pieces_) {
    for (size_t p = piece.find(kSpaceSymbol, 1); split_at_words_ && p != std::string::npos;
         p = piece.find(kSpaceSymbol, p + 1)) {
      if (p < kSpaceSymbol.size() || piece.compare(p - kSpaceSymbol.size(), kSpaceSymbol.size(), kSpaceSymbol) != 0) {
        split_at_words_ = false;
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> SentencePieceTokenizer::Load(const std::string& path,
                                                                        const TokenizerConfig& config) {
  ASSIGN_OR_RETURN(std::string bytes, ReadTokenizerFile(path));
  if (bytes.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": empty file, not a SentencePiece model"));
  auto t = std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer());
  t->source_ = path;
  ASSIGN_OR_RETURN(t->model_, tokenizer_internal::ParseSentencePieceModel(bytes, path));
  RETURN_IF_ERROR(t->Init(path));

  // The model's own <s> and </s>: control pieces with those spellings (sentencepiece's defaults).
  auto control = [&t](const char* piece) -> std::optional<int32_t> {
    auto it = t->reserved_.find(piece);
    if (it == t->reserved_.end() || t->Type(it->second) != PieceType::kControl) return std::nullopt;
    return it->second;
  };
  const SentencePieceTokenizer* self = t.get();
  ASSIGN_OR_RETURN(t->special_ids_, ResolveSpecialTokenIds(
                                        config, [self](std::string_view piece) { return self->PieceToId(piece); },
                                        t->vocab_size(), control("<s>"), control("</s>")));
  t->add_bos_ = config.add_bos_token.value_or(true) && t->special_ids_.bos.has_value();
  t->add_eos_ = config.add_eos_token.value_or(false) && !t->special_ids_.eos.empty();
  t->chat_template_ = config.chat_template;
  return t;
}

int32_t SentencePieceTokenizer::LookupPiece(std::string_view piece) const {
  if (auto it = reserved_.find(AbslView(piece)); it != reserved_.end()) return it->second;
  if (auto it = pieces_.find(AbslView(piece)); it != pieces_.end()) return it->second;
  return unk_id_;
}

// Mirrors sentencepiece::bpe::Model::SampleEncode (alpha = 0): merge the adjacent pair whose
// concatenation is the highest-scoring piece (leftmost on ties); user-defined symbols are frozen;
// unused pieces are split back into the pieces they were made of.
void SentencePieceTokenizer::BpeChunk(std::string_view chunk, EncodeScratch* scratch) const {
  using Symbol = EncodeScratch::Symbol;
  using Pair = EncodeScratch::Pair;
  std::vector<Symbol>& symbols = scratch->symbols;
  symbols.clear();
  while (!chunk.empty()) {
    Symbol s;
    size_t len = normalizer_->MatchUserDefined(chunk);
    s.freeze = len > 0;
    if (len == 0) DecodeUtf8Char(chunk, &len);
    s.piece = chunk.substr(0, len);
    s.prev = static_cast<int32_t>(symbols.size()) - 1;
    chunk.remove_prefix(len);
    s.next = chunk.empty() ? -1 : static_cast<int32_t>(symbols.size()) + 1;
    symbols.push_back(s);
  }
  auto worse = [](const Pair& a, const Pair& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Pair, std::vector<Pair>, decltype(worse)> agenda(worse);
  absl::flat_hash_map<std::string_view, std::pair<std::string_view, std::string_view>> rev_merge;
  auto maybe_add = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0 || symbols[left].freeze || symbols[right].freeze) return;
    const std::string_view piece(symbols[left].piece.data(), symbols[left].piece.size() + symbols[right].piece.size());
    auto it = pieces_.find(AbslView(piece));
    if (it == pieces_.end()) return;
    agenda.push(Pair{model_.pieces[it->second].score, left, right, piece.size()});
    if (Type(it->second) == PieceType::kUnused) rev_merge[piece] = {symbols[left].piece, symbols[right].piece};
  };
  for (size_t i = 1; i < symbols.size(); ++i) maybe_add(static_cast<int32_t>(i - 1), static_cast<int32_t>(i));
  while (!agenda.empty()) {
    const Pair top = agenda.top();
    agenda.pop();
    Symbol& left = symbols[top.left];
    Symbol& right = symbols[top.right];
    if (left.piece.empty() || right.piece.empty() || left.piece.size() + right.piece.size() != top.size) continue;
    left.piece = std::string_view(left.piece.data(), left.piece.size() + right.piece.size());
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.left;
    right.piece = std::string_view();
    maybe_add(left.prev, top.left);
    maybe_add(top.left, left.next);
  }
  scratch->pieces.clear();
  for (int32_t i = symbols.empty() ? -1 : 0; i != -1; i = symbols[i].next) {
    Resegment(symbols[i].piece, rev_merge, &scratch->pieces);
  }
}

void SentencePieceTokenizer::Resegment(
    std::string_view piece,
    const absl::flat_hash_map<std::string_view, std::pair<std::string_view, std::string_view>>& rev_merge,
    std::vector<std::string_view>* out) const {
  const int32_t id = LookupPiece(piece);
  auto it = Type(id) == PieceType::kUnused ? rev_merge.find(piece) : rev_merge.end();
  if (it == rev_merge.end()) {
    out->push_back(piece);
    return;
  }
  Resegment(it->second.first, rev_merge, out);
  Resegment(it->second.second, rev_merge, out);
}

void SentencePieceTokenizer::EncodeChunk(std::string_view chunk, EncodeScratch* scratch,
                                         std::vector<int32_t>* ids) const {
  constexpr size_t kMaxCachedChunk = 48;
  const bool cacheable = chunk.size() <= kMaxCachedChunk;
  if (cacheable) {
    if (auto it = scratch->cache.find(AbslView(chunk)); it != scratch->cache.end()) {
      ids->insert(ids->end(), scratch->cached.begin() + it->second.first, scratch->cached.begin() + it->second.second);
      return;
    }
  }
  BpeChunk(chunk, scratch);
  const size_t first = ids->size();
  // SentencePieceProcessor::PopulateSentencePieceText: unknown pieces become their bytes (byte
  // fallback) or one unknown id per run of unknown pieces.
  bool prev_unk = false;
  for (std::string_view piece : scratch->pieces) {
    const int32_t id = LookupPiece(piece);
    const bool unk = Type(id) == PieceType::kUnknown;
    if (unk && model_.byte_fallback) {
      for (char b : piece) ids->push_back(byte_id_[static_cast<uint8_t>(b)]);
    } else if (!(unk && prev_unk)) {
      ids->push_back(id);
    }
    prev_unk = unk;
  }
  // A run of unknown pieces can continue into the next chunk only if a chunk could start with
  // one; chunks start with "▁", which is a known piece, so caching per chunk is exact.
  if (cacheable && scratch->cache.size() < (1 << 16)) {
    const auto begin = static_cast<uint32_t>(scratch->cached.size());
    scratch->cached.insert(scratch->cached.end(), ids->begin() + static_cast<std::ptrdiff_t>(first), ids->end());
    scratch->cache.emplace(std::string(chunk),
                           std::pair<uint32_t, uint32_t>{begin, static_cast<uint32_t>(scratch->cached.size())});
  }
}

absl::StatusOr<std::vector<int32_t>> SentencePieceTokenizer::Encode(std::string_view text,
                                                                    bool add_special_tokens) const {
  RETURN_IF_ERROR(ValidateUtf8(text));
  const std::string normalized = normalizer_->Normalize(text);
  std::vector<int32_t> ids;
  ids.reserve(normalized.size() / 3 + 2);
  if (add_special_tokens && add_bos_) ids.push_back(*special_ids_.bos);
  EncodeScratch scratch;
  const std::string_view all = normalized;
  if (!split_at_words_) {
    if (!all.empty()) EncodeChunk(all, &scratch, &ids);
  } else {
    size_t begin = 0;
    for (size_t p = all.find(kSpaceSymbol, 1); p != std::string_view::npos; p = all.find(kSpaceSymbol, p + 1)) {
      if (p >= kSpaceSymbol.size() && all.substr(p - kSpaceSymbol.size(), kSpaceSymbol.size()) == kSpaceSymbol)
        continue;
      EncodeChunk(all.substr(begin, p - begin), &scratch, &ids);
      begin = p;
    }
    if (begin < all.size()) EncodeChunk(all.substr(begin), &scratch, &ids);
  }
  if (add_special_tokens && add_eos_) ids.push_back(special_ids_.eos.front());
  return ids;
}

// Mirrors SentencePieceProcessor::Decode: control pieces print nothing, the unknown piece prints
// unk_surface, runs of byte pieces print their UTF-8 (one U+FFFD per invalid byte), and "▁"
// prints as a space except at the start of the first word (add_dummy_prefix or
// remove_extra_whitespaces; with the latter, every leading "▁" piece is dropped).
void SentencePieceTokenizer::DecodeStep(int32_t id, DecodeState* state, std::string* out) const {
  if (byte_value_[id] >= 0) {
    const char b = static_cast<char>(byte_value_[id]);
    state->assembler.Append(std::string_view(&b, 1), out);
    state->produced = true;
    return;
  }
  const size_t mark = out->size();
  state->assembler.Break(out);
  if (state->bos_ws_seen || state->produced) state->is_bos_ws = false;
  std::string_view piece = model_.pieces[id].piece;
  std::string text;
  switch (Type(id)) {
    case PieceType::kControl:
      state->bos_ws_seen = false;
      break;
    case PieceType::kUnknown:
      text = model_.unk_surface;
      state->bos_ws_seen = false;
      break;
    case PieceType::kNormal:
    case PieceType::kUserDefined:
    case PieceType::kUnused:
    case PieceType::kByte: {
      bool has_bos_ws = false;
      if (state->is_bos_ws && (model_.add_dummy_prefix || model_.remove_extra_whitespaces)) {
        has_bos_ws = piece.starts_with(kSpaceSymbol);
        if (has_bos_ws) piece.remove_prefix(kSpaceSymbol.size());
        if (model_.remove_extra_whitespaces) has_bos_ws = false;
      }
      text = absl::StrReplaceAll(AbslView(piece), {{AbslView(kSpaceSymbol), " "}});
      state->bos_ws_seen = has_bos_ws;
      break;
    }
  }
  out->append(text);
  if (out->size() > mark) state->produced = true;
}

absl::Status SentencePieceTokenizer::CheckId(int32_t id) const {
  if (id >= 0 && id < vocab_size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("token id ", id, " is not in the vocabulary of ", source_,
                                                 " (valid ids are below ", vocab_size(), ")"));
}

absl::StatusOr<std::string> SentencePieceTokenizer::Decode(absl::Span<const int32_t> ids,
                                                           bool /*skip_special_tokens*/) const {
  for (int32_t id : ids) RETURN_IF_ERROR(CheckId(id));
  DecodeState state;
  std::string out;
  for (int32_t id : ids) DecodeStep(id, &state, &out);
  state.assembler.Break(&out);
  return out;
}

std::unique_ptr<StreamDecoder> SentencePieceTokenizer::NewStreamDecoder(bool /*skip_special_tokens*/) const {
  return std::make_unique<SpStreamDecoder>(this);
}

absl::StatusOr<std::string> SentencePieceTokenizer::IdToPiece(int32_t id) const {
  RETURN_IF_ERROR(CheckId(id));
  return model_.pieces[id].piece;
}

std::optional<int32_t> SentencePieceTokenizer::PieceToId(std::string_view piece) const {
  if (auto it = reserved_.find(AbslView(piece)); it != reserved_.end()) return it->second;
  if (auto it = pieces_.find(AbslView(piece)); it != pieces_.end()) return it->second;
  return std::nullopt;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePieceTokenizer(const std::string& path,
                                                                      const TokenizerConfig& config) {
  return SentencePieceTokenizer::Load(path, config);
}

}  // namespace shardserve
