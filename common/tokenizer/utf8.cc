#include "common/tokenizer/utf8.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardserve {
namespace {

// The valid range of the second byte for each lead byte (Unicode Table 3-7); later continuation
// bytes are always 0x80..0xBF.
struct LeadInfo {
  int length;  // 0: not a lead byte
  uint8_t lo;
  uint8_t hi;
};

LeadInfo Lead(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};  // continuation bytes and overlong 2-byte leads
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};  // no overlongs
  if (b == 0xED) return {3, 0x80, 0x9F};  // no surrogates
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};  // no overlongs
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};  // nothing above U+10FFFF
  return {0, 0, 0};
}

}  // namespace

size_t Utf8PrefixLength(std::string_view s, bool* complete) {
  *complete = false;
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const LeadInfo lead = Lead(p[0]);
  if (lead.length == 0) return 0;
  if (lead.length == 1) {
    *complete = true;
    return 1;
  }
  size_t n = 1;
  for (; n < static_cast<size_t>(lead.length); ++n) {
    if (n >= s.size()) return n;  // a valid prefix so far
    const uint8_t lo = n == 1 ? lead.lo : 0x80;
    const uint8_t hi = n == 1 ? lead.hi : 0xBF;
    if (p[n] < lo || p[n] > hi) return n;
  }
  *complete = true;
  return n;
}

absl::Status ValidateUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    if (static_cast<uint8_t>(text[i]) < 0x80) {  // fast path for ASCII
      ++i;
      continue;
    }
    bool complete = false;
    const size_t n = Utf8PrefixLength(text.substr(i), &complete);
    if (!complete) {
      const auto lead = static_cast<uint8_t>(text[i]);
      if (n == 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "text is not valid UTF-8: byte 0x%02X at byte offset %d cannot start a character", lead, i));
      }
      if (i + n >= text.size()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("text is not valid UTF-8: the character starting at byte offset %d (0x%02X) is "
                            "truncated by the end of the text",
                            i, lead));
      }
      return absl::InvalidArgumentError(absl::StrFormat(
          "text is not valid UTF-8: the character starting at byte offset %d (0x%02X) is broken by byte 0x%02X at "
          "byte offset %d",
          i, lead, static_cast<uint8_t>(text[i + n]), i + n));
    }
    i += n;
  }
  return absl::OkStatus();
}

char32_t DecodeUtf8Char(std::string_view s, size_t* length) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  if (p[0] < 0x80) {
    *length = 1;
    return p[0];
  }
  if (p[0] < 0xE0) {
    *length = 2;
    return (char32_t{p[0] & 0x1Fu} << 6) | (p[1] & 0x3Fu);
  }
  if (p[0] < 0xF0) {
    *length = 3;
    return (char32_t{p[0] & 0x0Fu} << 12) | (char32_t{p[1] & 0x3Fu} << 6) | (p[2] & 0x3Fu);
  }
  *length = 4;
  return (char32_t{p[0] & 0x07u} << 18) | (char32_t{p[1] & 0x3Fu} << 12) | (char32_t{p[2] & 0x3Fu} << 6) |
         (p[3] & 0x3Fu);
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  Utf8StreamAssembler assembler(InvalidUtf8Policy::kMaximalSubpart);
  assembler.Append(bytes, &out);
  assembler.Break(&out);
  return out;
}

void Utf8StreamAssembler::Append(std::string_view bytes, std::string* out) {
  if (pending_.empty()) {
    // Common case: copy the valid prefix straight through, keep only the tail.
    size_t i = 0;
    while (i < bytes.size()) {
      if (static_cast<uint8_t>(bytes[i]) < 0x80) {
        ++i;
        continue;
      }
      bool complete = false;
      const size_t n = Utf8PrefixLength(bytes.substr(i), &complete);
      if (!complete) break;
      i += n;
    }
    out->append(bytes.data(), i);
    bytes.remove_prefix(i);
    if (bytes.empty()) return;
  }
  pending_.append(bytes);
  Drain(/*final=*/false, out);
}

void Utf8StreamAssembler::Break(std::string* out) { Drain(/*final=*/true, out); }

void Utf8StreamAssembler::Drain(bool final, std::string* out) {
  std::string_view rest = pending_;
  while (!rest.empty()) {
    bool complete = false;
    const size_t n = Utf8PrefixLength(rest, &complete);
    if (complete) {
      out->append(rest.data(), n);
      rest.remove_prefix(n);
      continue;
    }
    if (n == rest.size() && !final) break;  // may still be completed by later bytes
    out->append(kUtf8Replacement);
    rest.remove_prefix(policy_ == InvalidUtf8Policy::kPerByte || n == 0 ? 1 : n);
  }
  pending_ = std::string(rest);
}

}  // namespace shardserve
