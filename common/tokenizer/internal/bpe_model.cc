#include "common/tokenizer/internal/bpe_model.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status/macros.h"
#include "common/tokenizer/internal/byte_level.h"
#include "common/tokenizer/internal/string_view.h"
#include "common/tokenizer/utf8.h"

namespace shardserve::tokenizer_internal {
namespace {

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

absl::Status RequireUnset(const Json& j, const char* key, const JsonWhere& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty())) return absl::OkStatus();
  return where.Child(key).Unsupported(absl::StrCat("is ", it->dump(), "; only null is supported"));
}

}  // namespace

absl::Status BpeModel::LoadVocab(const Json& vocab, const JsonWhere& where) {
  if (!vocab.is_object()) return where.Error("is missing or not an object of token -> id");
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= kMaxVocabId ||
        (it.value().is_number_unsigned() && it.value().get<uint64_t>() >= kMaxVocabId)) {
      return where.Error(absl::StrCat("has token \"", it.key(), "\" with id ", it.value().dump(),
                                      ", not an integer in [0, ", kMaxVocabId, ")"));
    }
    max_id = std::max(max_id, it.value().get<int64_t>());
  }
  id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  has_id_.assign(static_cast<size_t>(max_id + 1), false);
  token_to_id_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const auto id = static_cast<int32_t>(it.value().get<int64_t>());
    if (has_id_[id]) {
      return where.Error(absl::StrCat("gives id ", id, " to both \"", id_to_token_[id], "\" and \"", it.key(), "\""));
    }
    has_id_[id] = true;
    id_to_token_[id] = it.key();
    token_to_id_.emplace(it.key(), id);
  }
  return absl::OkStatus();
}

absl::Status BpeModel::LoadMerges(const Json& merges, const JsonWhere& where) {
  if (!merges.is_array()) return where.Error("is missing or not a list");
  merges_.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const Json& m = merges[i];
    std::string left;
    std::string right;
    if (m.is_string()) {  // "a b"
      std::vector<std::string> parts = absl::StrSplit(m.get<std::string>(), ' ');
      if (parts.size() != 2) return where.Index(i).Error("is not two tokens separated by one space");
      left = std::move(parts[0]);
      right = std::move(parts[1]);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["a", "b"]
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      return where.Index(i).Error("is neither \"a b\" nor [\"a\", \"b\"]");
    }
    auto l = token_to_id_.find(left);
    auto r = token_to_id_.find(right);
    auto merged = token_to_id_.find(absl::StrCat(left, right));
    for (const auto& [found, token] :
         {std::pair{l != token_to_id_.end(), left}, std::pair{r != token_to_id_.end(), right},
          std::pair{merged != token_to_id_.end(), absl::StrCat(left, right)}}) {
      if (!found) return where.Index(i).Error(absl::StrCat("uses \"", token, "\", which is not in the vocabulary"));
    }
    // A repeated pair keeps the later rank, as the `tokenizers` library's hash map does.
    merges_[PairKey(l->second, r->second)] = Merge{static_cast<int32_t>(i), merged->second};
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromJson(const Json& j, const JsonWhere& where, bool byte_level) {
  if (!j.is_object()) return where.Error("is missing or not an object");
  ASSIGN_OR_RETURN(std::string type, JsonStringOr(j, "type", "BPE", where));
  if (type != "BPE") {
    return where.Child("type").Unsupported(
        absl::StrCat("is \"", type, "\"; only BPE models are supported (not Unigram, WordPiece or WordLevel)"));
  }
  auto dropout = j.find("dropout");
  if (dropout != j.end() && !dropout->is_null() && !(dropout->is_number() && dropout->get<double>() == 0.0)) {
    return where.Child("dropout").Unsupported("is set; BPE dropout (random merges) is not supported");
  }
  RETURN_IF_ERROR(RequireUnset(j, "continuing_subword_prefix", where));
  RETURN_IF_ERROR(RequireUnset(j, "end_of_word_suffix", where));

  auto model = std::unique_ptr<BpeModel>(new BpeModel());
  model->byte_level_ = byte_level;
  ASSIGN_OR_RETURN(model->byte_fallback_, JsonBoolOr(j, "byte_fallback", false, where));
  ASSIGN_OR_RETURN(model->fuse_unk_, JsonBoolOr(j, "fuse_unk", false, where));
  ASSIGN_OR_RETURN(model->ignore_merges_, JsonBoolOr(j, "ignore_merges", false, where));
  auto vocab = j.find("vocab");
  RETURN_IF_ERROR(model->LoadVocab(vocab == j.end() ? Json() : *vocab, where.Child("vocab")));
  auto merges = j.find("merges");
  RETURN_IF_ERROR(model->LoadMerges(merges == j.end() ? Json() : *merges, where.Child("merges")));
  ASSIGN_OR_RETURN(std::string unk, JsonStringOr(j, "unk_token", "", where));
  if (!unk.empty()) {
    auto it = model->token_to_id_.find(unk);
    if (it == model->token_to_id_.end()) {
      return where.Child("unk_token").Error(absl::StrCat("\"", unk, "\" is not in the vocabulary"));
    }
    model->unk_id_ = it->second;
  }

  model->FindSplitMarker();
  model->unit_id_.fill(-1);
  model->fallback_id_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    auto it = model->token_to_id_.find(absl::StrFormat("<0x%02X>", b));
    if (it != model->token_to_id_.end()) model->fallback_id_[b] = it->second;
  }
  if (byte_level) {
    std::string raw;
    for (const auto& [token, id] : model->token_to_id_) {
      raw.clear();
      if (ByteLevelToBytes(token, &raw)) model->bytes_to_id_.emplace(raw, id);
    }
    for (int b = 0; b < 256; ++b) {
      auto it = model->bytes_to_id_.find(std::string(1, static_cast<char>(b)));
      if (it != model->bytes_to_id_.end()) model->unit_id_[b] = it->second;
    }
  } else {
    for (int c = 0; c < 128; ++c) {
      auto it = model->token_to_id_.find(std::string(1, static_cast<char>(c)));
      if (it != model->token_to_id_.end()) model->unit_id_[c] = it->second;
    }
  }
  return model;
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = token_to_id_.find(AbslView(token));
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || id >= id_limit() || !has_id_[id]) return nullptr;
  return &id_to_token_[id];
}

const BpeModel::Merge* BpeModel::FindMerge(int32_t left, int32_t right) const {
  auto it = merges_.find(PairKey(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

// Mirrors BPE::merge_word of the `tokenizers` library, including where a pending unknown token is
// flushed relative to byte-fallback tokens.
void BpeModel::InitialSymbols(std::string_view word, std::vector<int32_t>* symbols) const {
  bool pending_unk = false;
  size_t i = 0;
  while (i < word.size()) {
    const auto lead = static_cast<uint8_t>(word[i]);
    size_t len = 1;
    int32_t id = -1;
    if (byte_level_) {
      id = unit_id_[lead];
    } else if (lead < 0x80) {
      id = unit_id_[lead];
    } else {
      DecodeUtf8Char(word.substr(i), &len);
      auto it = token_to_id_.find(AbslView(word.substr(i, len)));
      if (it != token_to_id_.end()) id = it->second;
    }
    const std::string_view unit = word.substr(i, len);
    i += len;
    if (id >= 0) {
      if (pending_unk) symbols->push_back(unk_id_);
      pending_unk = false;
      symbols->push_back(id);
      continue;
    }
    if (byte_fallback_) {
      // In byte-level mode the unit's vocabulary spelling is its byte-level character.
      std::string spelled;
      if (byte_level_) AppendByteLevel(unit, &spelled);
      const std::string_view bytes = byte_level_ ? std::string_view(spelled) : unit;
      const bool all =
          std::all_of(bytes.begin(), bytes.end(), [&](char b) { return fallback_id_[static_cast<uint8_t>(b)] >= 0; });
      if (all) {
        for (char b : bytes) symbols->push_back(fallback_id_[static_cast<uint8_t>(b)]);
        continue;
      }
    }
    if (unk_id_ >= 0) {
      if (pending_unk && !fuse_unk_) symbols->push_back(unk_id_);
      pending_unk = true;
    }
  }
  if (pending_unk) symbols->push_back(unk_id_);
}

// Mirrors Word::merge_all of the `tokenizers` library: lowest rank first, then leftmost; a queued
// merge is stale when its left symbol is gone, has no right neighbour, or the current pair no
// longer produces the same token.
void BpeModel::MergeSymbols(Scratch* scratch) const {
  std::vector<int32_t>& s = scratch->symbols;
  const auto n = static_cast<int32_t>(s.size());
  if (n < 2) return;
  using Candidate = Scratch::Candidate;
  auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::vector<int32_t>& prev = scratch->prev;
  std::vector<int32_t>& next = scratch->next;
  std::vector<Candidate>& heap = scratch->heap;
  prev.resize(n);
  next.resize(n);
  heap.clear();
  for (int32_t i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
    if (i + 1 < n) {
      if (const Merge* m = FindMerge(s[i], s[i + 1])) heap.push_back({m->rank, i, m->new_id});
    }
  }
  std::make_heap(heap.begin(), heap.end(), later);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate top = heap.back();
    heap.pop_back();
    if (s[top.pos] < 0) continue;
    const int32_t right = next[top.pos];
    if (right < 0) continue;
    const Merge* current = FindMerge(s[top.pos], s[right]);
    if (current == nullptr || current->new_id != top.new_id) continue;
    s[top.pos] = top.new_id;
    s[right] = -1;
    next[top.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.pos;
    if (prev[top.pos] >= 0) {
      if (const Merge* m = FindMerge(s[prev[top.pos]], s[top.pos])) {
        heap.push_back({m->rank, prev[top.pos], m->new_id});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
    if (next[top.pos] >= 0) {
      if (const Merge* m = FindMerge(s[top.pos], s[next[top.pos]])) {
        heap.push_back({m->rank, top.pos, m->new_id});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
  }
  s.erase(std::remove(s.begin(), s.end(), -1), s.end());
}

namespace {
constexpr size_t kMaxCachedWord = 48;
constexpr size_t kMaxCacheEntries = 1 << 16;
}  // namespace

void BpeModel::FindSplitMarker() {
  const std::string marker = "\xE2\x96\x81";  // U+2581
  if (byte_level_ || !token_to_id_.contains(marker)) return;
  for (const auto& [token, id] : token_to_id_) {
    for (size_t p = token.find(marker, 1); p != std::string::npos; p = token.find(marker, p + 1)) {
      if (p < marker.size() || token.compare(p - marker.size(), marker.size(), marker) != 0) return;
    }
  }
  split_marker_ = marker;
}

void BpeModel::Tokenize(std::string_view word, Scratch* scratch, std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    const auto& lookup = byte_level_ ? bytes_to_id_ : token_to_id_;
    auto it = lookup.find(AbslView(word));
    if (it != lookup.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  if (split_marker_.empty() || word.size() <= kMaxCachedWord) {
    TokenizeChunk(word, scratch, ids);
    return;
  }
  const std::string_view marker = split_marker_;
  size_t begin = 0;
  for (size_t p = word.find(marker, 1); p != std::string_view::npos; p = word.find(marker, p + 1)) {
    if (p >= marker.size() && word.substr(p - marker.size(), marker.size()) == marker) continue;  // "▁▁"
    TokenizeChunk(word.substr(begin, p - begin), scratch, ids);
    begin = p;
  }
  TokenizeChunk(word.substr(begin), scratch, ids);
}

void BpeModel::TokenizeChunk(std::string_view word, Scratch* scratch, std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  // Short words repeat (Zipf): remember their ids for the rest of the call.
  const bool cacheable = word.size() <= kMaxCachedWord;
  if (cacheable) {
    auto it = scratch->cache.find(AbslView(word));
    if (it != scratch->cache.end()) {
      ids->insert(ids->end(), scratch->cached_ids.begin() + it->second.first,
                  scratch->cached_ids.begin() + it->second.second);
      return;
    }
  }
  scratch->symbols.clear();
  InitialSymbols(word, &scratch->symbols);
  MergeSymbols(scratch);
  ids->insert(ids->end(), scratch->symbols.begin(), scratch->symbols.end());
  if (cacheable && scratch->cache.size() < kMaxCacheEntries) {
    const auto begin = static_cast<uint32_t>(scratch->cached_ids.size());
    scratch->cached_ids.insert(scratch->cached_ids.end(), scratch->symbols.begin(), scratch->symbols.end());
    scratch->cache.emplace(std::string(word),
                           std::pair<uint32_t, uint32_t>{begin, static_cast<uint32_t>(scratch->cached_ids.size())});
  }
}

}  // namespace shardserve::tokenizer_internal
