// Test-only: Debian's libsentencepiece behind std types, the oracle the native SentencePiece
// implementation (common/tokenizer/sentencepiece_tokenizer.h) is compared with.
//
// Only tests may link it: libsentencepiece.so exports a bundled protobuf 3.14 and aborts any
// process that also loads the system libprotobuf. And Debian's sentencepiece_processor.h declares
// `namespace absl { using std::string_view; }`, which is ambiguous with Abseil 20220623's own
// absl::string_view class, so only sentencepiece_oracle.cc (which includes no Abseil header)
// includes it; errors cross as strings.
#ifndef SHARDSERVE_TESTS_COMMON_TOKENIZER_SENTENCEPIECE_ORACLE_H_
#define SHARDSERVE_TESTS_COMMON_TOKENIZER_SENTENCEPIECE_ORACLE_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace shardserve {

class SentencePieceOracle {
 public:
  SentencePieceOracle();
  ~SentencePieceOracle();
  SentencePieceOracle(const SentencePieceOracle&) = delete;
  SentencePieceOracle& operator=(const SentencePieceOracle&) = delete;

  // Loads a serialized model. Returns "" on success, else the library's message.
  std::string LoadFromSerialized(std::string_view bytes);

  // Each returns "" on success, else the library's message.
  std::string Encode(std::string_view text, std::vector<int>* ids) const;
  std::string Decode(const std::vector<int>& ids, std::string* text) const;

  int PieceCount() const;
  std::string IdToPiece(int id) const;
  int PieceToId(std::string_view piece) const;  // the unknown id when absent
  bool IsControl(int id) const;
  bool IsUnknown(int id) const;
  bool IsUnused(int id) const;
  bool IsByte(int id) const;
  int bos_id() const;  // -1 when none
  int eos_id() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_COMMON_TOKENIZER_SENTENCEPIECE_ORACLE_H_
