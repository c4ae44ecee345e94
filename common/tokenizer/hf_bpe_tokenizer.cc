#include "common/tokenizer/hf_bpe_tokenizer.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status/macros.h"
#include "common/tokenizer/internal/added_vocabulary.h"
#include "common/tokenizer/internal/bpe_model.h"
#include "common/tokenizer/internal/decoder.h"
#include "common/tokenizer/internal/json_util.h"
#include "common/tokenizer/internal/normalizer.h"
#include "common/tokenizer/internal/post_processor.h"
#include "common/tokenizer/internal/pre_tokenizer.h"
#include "common/tokenizer/internal/string_view.h"
#include "common/tokenizer/utf8.h"

namespace shardserve {
namespace {

using tokenizer_internal::AddedToken;
using tokenizer_internal::AddedTokenMatcher;
using tokenizer_internal::BpeModel;
using tokenizer_internal::DecoderChain;
using tokenizer_internal::Json;
using tokenizer_internal::JsonWhere;
using tokenizer_internal::Normalizer;
using tokenizer_internal::PreTokenizer;
using tokenizer_internal::Segment;
using tokenizer_internal::SpecialAffixes;

class HfBpeTokenizer final : public Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Parse(std::string_view text, std::string_view label,
                                                          const TokenizerConfig& config);

  TokenizerKind kind() const override { return TokenizerKind::kHfBpe; }
  const std::string& source() const override { return source_; }
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens) const override;
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const override;
  std::unique_ptr<StreamDecoder> NewStreamDecoder(bool skip_special_tokens) const override;
  int32_t vocab_size() const override { return vocab_size_; }
  std::optional<int32_t> bos_id() const override { return special_ids_.bos; }
  const std::vector<int32_t>& eos_ids() const override { return special_ids_.eos; }
  absl::StatusOr<std::string> IdToPiece(int32_t id) const override;
  std::optional<int32_t> PieceToId(std::string_view piece) const override;
  bool IsSpecial(int32_t id) const override { return id >= 0 && id < vocab_size_ && is_special_[id]; }
  const std::optional<std::string>& chat_template() const override { return chat_template_; }

  // The spelling of a valid id, or nullptr (InvalidArgument-worthy) when the id has none.
  const std::string* Spelling(int32_t id) const;
  absl::Status UnknownId(int32_t id) const;
  const DecoderChain& decoder() const { return *decoder_; }

 private:
  HfBpeTokenizer() = default;
  absl::Status EncodeText(std::string_view text, bool at_input_start, BpeModel::Scratch* scratch,
                          std::vector<int32_t>* ids) const;

  // All constant after Parse().
  std::string source_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<DecoderChain> decoder_;
  std::vector<AddedToken> added_;
  absl::flat_hash_map<int32_t, const AddedToken*> added_by_id_;
  absl::flat_hash_map<std::string, int32_t> added_by_content_;
  std::unique_ptr<AddedTokenMatcher> raw_matcher_;         // normalized=false tokens
  std::unique_ptr<AddedTokenMatcher> normalized_matcher_;  // normalized=true tokens
  SpecialAffixes affixes_;
  int32_t vocab_size_ = 0;
  std::vector<bool> is_special_;
  SpecialTokenIds special_ids_;
  std::optional<std::string> chat_template_;
};

class HfStreamDecoder final : public StreamDecoder {
 public:
  HfStreamDecoder(const HfBpeTokenizer* tokenizer, bool skip_special_tokens)
      : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens), stream_(&tokenizer->decoder()) {}

  absl::StatusOr<std::string> Next(int32_t id) override {
    const std::string* spelling = tokenizer_->Spelling(id);
    if (spelling == nullptr) return tokenizer_->UnknownId(id);
    std::string out;
    if (skip_special_tokens_ && tokenizer_->IsSpecial(id)) return out;
    RETURN_IF_ERROR(stream_.Feed(*spelling, &out));
    return out;
  }

  std::string Finish() override {
    std::string out;
    stream_.Finish(&out);
    return out;
  }

  std::unique_ptr<StreamDecoder> Clone() const override { return std::make_unique<HfStreamDecoder>(*this); }

 private:
  const HfBpeTokenizer* tokenizer_;
  const bool skip_special_tokens_;
  DecoderChain::Stream stream_;
};

absl::StatusOr<std::unique_ptr<Tokenizer>> HfBpeTokenizer::Parse(std::string_view text, std::string_view label,
                                                                 const TokenizerConfig& config) {
  Json doc = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat(tokenizer_internal::AbslView(label), ": not valid JSON (corrupt or truncated tokenizer.json?)"));
  }
  const JsonWhere root{label, ""};
  if (!doc.is_object()) return root.Error("is not a JSON object");
  auto member = [&doc](const char* key) -> const Json& {
    static const Json kNull;
    auto it = doc.find(key);
    return it == doc.end() ? kNull : *it;
  };
  auto t = std::unique_ptr<HfBpeTokenizer>(new HfBpeTokenizer());
  t->source_ = std::string(label);
  ASSIGN_OR_RETURN(t->normalizer_, Normalizer::FromJson(member("normalizer"), root.Child("normalizer")));
  ASSIGN_OR_RETURN(t->pre_tokenizer_, PreTokenizer::FromJson(member("pre_tokenizer"), root.Child("pre_tokenizer")));
  ASSIGN_OR_RETURN(t->model_,
                   BpeModel::FromJson(member("model"), root.Child("model"), t->pre_tokenizer_->byte_level()));
  ASSIGN_OR_RETURN(t->decoder_, DecoderChain::FromJson(member("decoder"), root.Child("decoder")));
  ASSIGN_OR_RETURN(t->added_, tokenizer_internal::ParseAddedTokens(member("added_tokens"), root.Child("added_tokens"),
                                                                   tokenizer_internal::kMaxVocabId));

  t->vocab_size_ = t->model_->id_limit();
  std::vector<const AddedToken*> raw_tokens;
  std::vector<std::string> raw_patterns;
  std::vector<const AddedToken*> norm_tokens;
  std::vector<std::string> norm_patterns;
  for (const AddedToken& a : t->added_) {
    t->vocab_size_ = std::max(t->vocab_size_, a.id + 1);
    t->added_by_id_.emplace(a.id, &a);
    t->added_by_content_.emplace(a.content, a.id);
    if (a.normalized) {
      std::string pattern;
      RETURN_IF_ERROR(t->normalizer_->Normalize(a.content, &pattern));
      norm_tokens.push_back(&a);
      norm_patterns.push_back(std::move(pattern));
    } else {
      raw_tokens.push_back(&a);
      raw_patterns.push_back(a.content);
    }
  }
  t->raw_matcher_ = std::make_unique<AddedTokenMatcher>(raw_tokens, raw_patterns);
  t->normalized_matcher_ = std::make_unique<AddedTokenMatcher>(norm_tokens, norm_patterns);
  ASSIGN_OR_RETURN(t->affixes_, tokenizer_internal::ParsePostProcessor(member("post_processor"),
                                                                       root.Child("post_processor"), t->vocab_size_));

  // The library skips a token when its spelling is the content of a special added token.
  absl::flat_hash_set<std::string> special_contents;
  for (const AddedToken& a : t->added_) {
    if (a.special) special_contents.insert(a.content);
  }
  t->is_special_.assign(t->vocab_size_, false);
  for (int32_t id = 0; id < t->vocab_size_; ++id) {
    const std::string* s = t->Spelling(id);
    t->is_special_[id] = s != nullptr && special_contents.contains(*s);
  }

  // Without a configured BOS, a single id the post-processor puts first is the BOS.
  std::optional<int32_t> model_bos;
  if (t->affixes_.prefix.size() == 1) model_bos = t->affixes_.prefix[0];
  const HfBpeTokenizer* self = t.get();
  ASSIGN_OR_RETURN(t->special_ids_, ResolveSpecialTokenIds(
                                        config, [self](std::string_view piece) { return self->PieceToId(piece); },
                                        t->vocab_size_, model_bos, std::nullopt));
  t->chat_template_ = config.chat_template;
  return t;
}

const std::string* HfBpeTokenizer::Spelling(int32_t id) const {
  auto it = added_by_id_.find(id);
  if (it != added_by_id_.end()) return &it->second->content;
  return model_->IdToToken(id);
}

absl::Status HfBpeTokenizer::UnknownId(int32_t id) const {
  return absl::InvalidArgumentError(absl::StrCat("token id ", id, " is not in the vocabulary of ", source_,
                                                 " (valid ids are below ", vocab_size_,
                                                 id >= 0 && id < vocab_size_ ? ", but this one is unassigned)" : ")"));
}

absl::StatusOr<std::string> HfBpeTokenizer::IdToPiece(int32_t id) const {
  const std::string* s = Spelling(id);
  if (s == nullptr) return UnknownId(id);
  return *s;
}

std::optional<int32_t> HfBpeTokenizer::PieceToId(std::string_view piece) const {
  auto it = added_by_content_.find(tokenizer_internal::AbslView(piece));
  if (it != added_by_content_.end()) return it->second;
  return model_->TokenToId(piece);
}

absl::Status HfBpeTokenizer::EncodeText(std::string_view text, bool at_input_start, BpeModel::Scratch* scratch,
                                        std::vector<int32_t>* ids) const {
  std::string normalized_storage;
  std::string_view normalized = text;
  if (!normalizer_->is_identity()) {
    RETURN_IF_ERROR(normalizer_->Normalize(text, &normalized_storage));
    normalized = normalized_storage;
  }
  std::vector<Segment> segments;
  if (normalized_matcher_->empty()) {
    if (!normalized.empty()) segments.push_back(Segment{-1, 0, normalized.size()});
  } else {
    normalized_matcher_->Split(normalized, &segments);
  }
  for (const Segment& s : segments) {
    if (s.id >= 0) {
      ids->push_back(s.id);
      continue;
    }
    RETURN_IF_ERROR(pre_tokenizer_->PreTokenize(normalized.substr(s.begin, s.end - s.begin),
                                                at_input_start && s.begin == 0,
                                                [&](std::string_view word) { model_->Tokenize(word, scratch, ids); }));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> HfBpeTokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  RETURN_IF_ERROR(ValidateUtf8(text));
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids = affixes_.prefix;
  BpeModel::Scratch scratch;
  if (raw_matcher_->empty()) {
    if (!text.empty()) RETURN_IF_ERROR(EncodeText(text, /*at_input_start=*/true, &scratch, &ids));
  } else {
    std::vector<Segment> segments;
    raw_matcher_->Split(text, &segments);
    for (const Segment& s : segments) {
      if (s.id >= 0) {
        ids.push_back(s.id);
      } else {
        RETURN_IF_ERROR(EncodeText(text.substr(s.begin, s.end - s.begin), s.begin == 0, &scratch, &ids));
      }
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), affixes_.suffix.begin(), affixes_.suffix.end());
  return ids;
}

absl::StatusOr<std::string> HfBpeTokenizer::Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* s = Spelling(id);
    if (s == nullptr) return UnknownId(id);
    if (skip_special_tokens && is_special_[id]) continue;
    tokens.push_back(*s);
  }
  return decoder_->Decode(std::move(tokens));
}

std::unique_ptr<StreamDecoder> HfBpeTokenizer::NewStreamDecoder(bool skip_special_tokens) const {
  return std::make_unique<HfStreamDecoder>(this, skip_special_tokens);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> ParseHfBpeTokenizer(std::string_view json, std::string_view label,
                                                               const TokenizerConfig& config) {
  return HfBpeTokenizer::Parse(json, label, config);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfBpeTokenizer(const std::string& path, const TokenizerConfig& config) {
  ASSIGN_OR_RETURN(std::string text, ReadTokenizerFile(path));
  return HfBpeTokenizer::Parse(text, path, config);
}

}  // namespace shardserve
