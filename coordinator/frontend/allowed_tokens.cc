#include "coordinator/frontend/allowed_tokens.h"

#include <string>

namespace shardserve::coordinator::frontend {
namespace {

class AllowedTokenSet final : public TokenConstraint {
 public:
  AllowedTokenSet(absl::Span<const int32_t> ids, int64_t vocab_size) {
    std::string mask(static_cast<size_t>((vocab_size + 7) / 8), '\0');
    for (int32_t id : ids) mask[static_cast<size_t>(id) / 8] |= static_cast<char>(1u << (id % 8));
    mask_ = std::make_shared<const std::string>(std::move(mask));
  }

  int32_t StartState() const override { return 0; }
  std::shared_ptr<const std::string> AllowedMask(int32_t /*state*/) const override { return mask_; }
  int32_t Advance(int32_t /*state*/, int32_t token) const override { return Allows(token) ? 0 : -1; }
  bool IsFinished(int32_t /*state*/) const override { return false; }
  bool DecidesEos() const override { return false; }

 private:
  bool Allows(int32_t token) const {
    const size_t byte = static_cast<size_t>(token) / 8;
    return token >= 0 && byte < mask_->size() && ((static_cast<unsigned char>((*mask_)[byte]) >> (token % 8)) & 1u);
  }

  std::shared_ptr<const std::string> mask_;
};

}  // namespace

std::shared_ptr<const TokenConstraint> AllowedTokens(absl::Span<const int32_t> ids, int64_t vocab_size) {
  return std::make_shared<AllowedTokenSet>(ids, vocab_size);
}

}  // namespace shardserve::coordinator::frontend
