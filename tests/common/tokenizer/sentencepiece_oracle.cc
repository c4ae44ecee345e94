// No Abseil header may be included here (see the header).
#include "tests/common/tokenizer/sentencepiece_oracle.h"

#include <sentencepiece_processor.h>

namespace shardserve {

struct SentencePieceOracle::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

SentencePieceOracle::SentencePieceOracle() : impl_(std::make_unique<Impl>()) {}
SentencePieceOracle::~SentencePieceOracle() = default;

std::string SentencePieceOracle::LoadFromSerialized(std::string_view bytes) {
  const sentencepiece::util::Status st = impl_->sp.LoadFromSerializedProto(bytes);
  if (st.ok()) return std::string();
  std::string message = st.ToString();
  return message.empty() ? std::string("unknown error") : message;
}

std::string SentencePieceOracle::Encode(std::string_view text, std::vector<int>* ids) const {
  const sentencepiece::util::Status st = impl_->sp.Encode(text, ids);
  return st.ok() ? std::string() : st.ToString();
}

std::string SentencePieceOracle::Decode(const std::vector<int>& ids, std::string* text) const {
  const sentencepiece::util::Status st = impl_->sp.Decode(ids, text);
  return st.ok() ? std::string() : st.ToString();
}

int SentencePieceOracle::PieceCount() const { return impl_->sp.GetPieceSize(); }
std::string SentencePieceOracle::IdToPiece(int id) const { return impl_->sp.IdToPiece(id); }
int SentencePieceOracle::PieceToId(std::string_view piece) const { return impl_->sp.PieceToId(piece); }
bool SentencePieceOracle::IsControl(int id) const { return impl_->sp.IsControl(id); }
bool SentencePieceOracle::IsUnknown(int id) const { return impl_->sp.IsUnknown(id); }
bool SentencePieceOracle::IsUnused(int id) const { return impl_->sp.IsUnused(id); }
bool SentencePieceOracle::IsByte(int id) const { return impl_->sp.IsByte(id); }
int SentencePieceOracle::bos_id() const { return impl_->sp.bos_id(); }
int SentencePieceOracle::eos_id() const { return impl_->sp.eos_id(); }

}  // namespace shardserve
