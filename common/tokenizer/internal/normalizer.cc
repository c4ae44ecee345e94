#include "common/tokenizer/internal/normalizer.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"
#include "common/tokenizer/internal/string_view.h"
#include "common/tokenizer/utf8.h"

namespace shardserve::tokenizer_internal {
namespace {

absl::StatusOr<const icu::Normalizer2*> IcuNormalizer(int form) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  switch (form) {
    case 0:
      n = icu::Normalizer2::getNFCInstance(status);
      break;
    case 1:
      n = icu::Normalizer2::getNFDInstance(status);
      break;
    case 2:
      n = icu::Normalizer2::getNFKCInstance(status);
      break;
    default:
      n = icu::Normalizer2::getNFKDInstance(status);
      break;
  }
  if (U_FAILURE(status) || n == nullptr) {
    return absl::InternalError(absl::StrCat("ICU normalizer unavailable: ", u_errorName(status)));
  }
  return n;
}


}  // namespace

bool IsUnicodeWhitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

absl::Status Normalizer::AddSteps(const Json& j, const JsonWhere& where, std::vector<Step>* steps) {
  ASSIGN_OR_RETURN(std::string type, JsonType(j, where));
  if (type == "Sequence") {
    const Json* list = JsonMember(j, "normalizers");
    if (list == nullptr || !list->is_array()) return where.Child("normalizers").Error("is missing or not a list");
    size_t i = 0;
    for (const Json& e : *list) RETURN_IF_ERROR(AddSteps(e, where.Child("normalizers").Index(i++), steps));
    return absl::OkStatus();
  }
  Step step;
  if (type == "Prepend") {
    step.kind = Kind::kPrepend;
    ASSIGN_OR_RETURN(step.text, JsonString(j, "prepend", where));
  } else if (type == "Replace") {
    step.kind = Kind::kReplace;
    ASSIGN_OR_RETURN(step.replace, ReplaceRule::Parse(j, where));
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    step.kind = Kind::kUnicode;
    step.unicode_form = type == "NFC" ? 0 : type == "NFD" ? 1 : type == "NFKC" ? 2 : 3;
    RETURN_IF_ERROR(IcuNormalizer(step.unicode_form).status());
  } else if (type == "Strip") {
    step.kind = Kind::kStrip;
    ASSIGN_OR_RETURN(step.strip_left, JsonBoolOr(j, "strip_left", true, where));
    ASSIGN_OR_RETURN(step.strip_right, JsonBoolOr(j, "strip_right", true, where));
  } else {
    return where.Unsupported(
        absl::StrCat("is a \"", type,
                     "\" normalizer, which is not supported (supported: Sequence, Prepend, Replace, NFC, "
                     "NFD, NFKC, NFKD, Strip)"));
  }
  steps->push_back(std::move(step));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Normalizer>> Normalizer::FromJson(const Json& j, const JsonWhere& where) {
  auto n = std::unique_ptr<Normalizer>(new Normalizer());
  if (!j.is_null()) RETURN_IF_ERROR(AddSteps(j, where, &n->steps_));
  return n;
}

absl::Status Normalizer::Apply(const Step& step, std::string_view in, std::string* out) {
  switch (step.kind) {
    case Kind::kPrepend:
      if (in.empty()) {
        out->clear();
      } else {
        out->assign(step.text);
        out->append(in);
      }
      return absl::OkStatus();
    case Kind::kReplace: {
      ASSIGN_OR_RETURN(*out, step.replace.Apply(in));
      return absl::OkStatus();
    }
    case Kind::kUnicode: {
      ASSIGN_OR_RETURN(const icu::Normalizer2* n, IcuNormalizer(step.unicode_form));
      out->clear();
      UErrorCode status = U_ZERO_ERROR;
      const icu::StringPiece piece(in.data(), static_cast<int32_t>(in.size()));
      if (n->isNormalizedUTF8(piece, status) && U_SUCCESS(status)) {
        out->assign(in);
        return absl::OkStatus();
      }
      status = U_ZERO_ERROR;
      icu::StringByteSink<std::string> sink(out);
      n->normalizeUTF8(0, piece, sink, nullptr, status);
      if (U_FAILURE(status))
        return absl::InternalError(absl::StrCat("ICU normalization failed: ", u_errorName(status)));
      return absl::OkStatus();
    }
    case Kind::kStrip: {
      size_t b = 0;
      size_t e = in.size();
      size_t len = 0;
      while (step.strip_left && b < e && IsUnicodeWhitespace(DecodeUtf8Char(in.substr(b), &len))) b += len;
      while (step.strip_right && e > b) {
        size_t s = e - 1;
        while (s > b && (static_cast<uint8_t>(in[s]) & 0xC0) == 0x80) --s;
        if (!IsUnicodeWhitespace(DecodeUtf8Char(in.substr(s), &len))) break;
        e = s;
      }
      out->assign(in.substr(b, e - b));
      return absl::OkStatus();
    }
  }
  return absl::InternalError("unknown normalizer step");
}

absl::Status Normalizer::Normalize(std::string_view in, std::string* out) const {
  if (steps_.empty()) {
    out->assign(in);
    return absl::OkStatus();
  }
  std::string buffer(in);
  for (const Step& step : steps_) {
    RETURN_IF_ERROR(Apply(step, buffer, out));
    buffer.swap(*out);
  }
  out->swap(buffer);
  return absl::OkStatus();
}

}  // namespace shardserve::tokenizer_internal
