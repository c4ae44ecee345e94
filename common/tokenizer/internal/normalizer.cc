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

void ReplaceAll(std::string_view in, std::string_view pattern, std::string_view content, std::string* out) {
  out->clear();
  size_t pos = 0;
  while (true) {
    const size_t hit = in.find(pattern, pos);
    if (hit == std::string_view::npos) break;
    out->append(in.data() + pos, hit - pos);
    out->append(content);
    pos = hit + pattern.size();
  }
  out->append(in.data() + pos, in.size() - pos);
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
    const Json* pattern = JsonMember(j, "pattern");
    if (pattern == nullptr || !pattern->is_object()) return where.Child("pattern").Error("is missing or not an object");
    ASSIGN_OR_RETURN(step.content, JsonString(j, "content", where));
    if (pattern->contains("String")) {
      step.kind = Kind::kReplaceString;
      ASSIGN_OR_RETURN(step.text, JsonString(*pattern, "String", where.Child("pattern")));
      if (step.text.empty()) return where.Child("pattern.String").Error("is empty");
    } else if (pattern->contains("Regex")) {
      step.kind = Kind::kReplaceRegex;
      ASSIGN_OR_RETURN(step.text, JsonString(*pattern, "Regex", where.Child("pattern")));
      auto re = Regex::Compile(step.text);
      if (!re.ok()) return where.Child("pattern.Regex").Error(std::string(re.status().message()));
      step.regex = *std::move(re);
    } else {
      return where.Child("pattern").Error("has neither \"String\" nor \"Regex\"");
    }
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
    case Kind::kReplaceString:
      ReplaceAll(in, step.text, step.content, out);
      return absl::OkStatus();
    case Kind::kReplaceRegex: {
      std::vector<std::pair<size_t, size_t>> matches;
      RETURN_IF_ERROR(step.regex->FindAll(in, &matches));
      out->clear();
      size_t pos = 0;
      for (const auto& [b, e] : matches) {
        out->append(in.data() + pos, b - pos);
        out->append(step.content);
        pos = e;
      }
      out->append(in.data() + pos, in.size() - pos);
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
