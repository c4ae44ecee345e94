// tokenizer.json "model" of type BPE: vocabulary, merges applied by rank, unknown-token handling
// (unk_token, fuse_unk, byte_fallback) and ignore_merges, as in the `tokenizers` library.
//
// In byte-level mode (the pre-tokenizer ends with ByteLevel) words arrive as raw bytes: the
// vocabulary's byte-level spellings are converted to bytes once at load, so encoding never builds
// the byte-level strings.
//
// Thread-safety: immutable after FromJson; Tokenize may run on several threads at once.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_BPE_MODEL_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_BPE_MODEL_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tokenizer/internal/json_util.h"

namespace shardserve::tokenizer_internal {

// Ids are below this (16M; the largest real vocabularies have about 256K entries).
inline constexpr int64_t kMaxVocabId = int64_t{1} << 24;

class BpeModel {
 public:
  // `j` is the "model" object. InvalidArgument naming the file for a malformed vocabulary or
  // merges (ids out of range or repeated, merges of unknown tokens); Unimplemented for a model type
  // other than BPE or for options without an effect we reproduce (dropout, subword prefixes).
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromJson(const Json& j, const JsonWhere& where, bool byte_level);

  // Working memory for Tokenize, reused across the words of one Encode call, with a cache of the
  // ids of short words already seen in that call. Not thread-safe: one per call.
  class Scratch {
   private:
    friend class BpeModel;
    struct Candidate {
      int32_t rank;
      int32_t pos;
      int32_t new_id;
    };
    std::vector<int32_t> symbols;
    std::vector<int32_t> prev;
    std::vector<int32_t> next;
    std::vector<Candidate> heap;
    absl::flat_hash_map<std::string, std::pair<uint32_t, uint32_t>> cache;  // word -> [begin, end) in cached_ids
    std::vector<int32_t> cached_ids;
  };

  // Appends the ids of one word (raw bytes in byte-level mode, else UTF-8 text).
  void Tokenize(std::string_view word, Scratch* scratch, std::vector<int32_t>* ids) const;

  // The id of a vocabulary entry by its spelling in the file.
  std::optional<int32_t> TokenToId(std::string_view token) const;
  // The spelling of `id` in the file, or nullptr when the vocabulary has no such id.
  const std::string* IdToToken(int32_t id) const;
  // One past the largest id of the vocabulary.
  int32_t id_limit() const { return static_cast<int32_t>(id_to_token_.size()); }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  BpeModel() = default;
  absl::Status LoadVocab(const Json& vocab, const JsonWhere& where);
  absl::Status LoadMerges(const Json& merges, const JsonWhere& where);
  // Initial symbols of `word`: one per byte (byte-level) or per character, after unknown handling.
  void InitialSymbols(std::string_view word, std::vector<int32_t>* symbols) const;
  void MergeSymbols(Scratch* scratch) const;
  // Tokenize without the whole-word ignore_merges lookup and without chunking.
  void TokenizeChunk(std::string_view chunk, Scratch* scratch, std::vector<int32_t>* ids) const;
  // Decides split_marker_ (see there).
  void FindSplitMarker();
  const Merge* FindMerge(int32_t left, int32_t right) const;

  bool byte_level_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  int32_t unk_id_ = -1;

  std::vector<std::string> id_to_token_;  // "" with has_id_ false for gaps
  std::vector<bool> has_id_;
  absl::flat_hash_map<std::string, int32_t> token_to_id_;  // file spelling
  // Byte-level mode: raw bytes -> id, and the id of each single byte (-1 when missing).
  absl::flat_hash_map<std::string, int32_t> bytes_to_id_;
  std::array<int32_t, 256> unit_id_{};      // byte-level: byte's id; else ASCII char's id
  std::array<int32_t, 256> fallback_id_{};  // "<0xXX>" ids, -1 when missing
  absl::flat_hash_map<uint64_t, Merge> merges_;
  // SentencePiece-style vocabularies without a pre-tokenizer hand BPE the whole text as one word.
  // When no token contains a "▁" right after another character, no merge can cross the start of
  // a "▁..." word, so BPE on the whole equals BPE word by word; long words are then encoded in
  // chunks that start at each such "▁" (exact, and much faster). Empty when that does not hold.
  std::string split_marker_;
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_BPE_MODEL_H_
