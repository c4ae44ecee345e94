#include "common/tokenizer/internal/byte_level.h"

#include <array>

#include "common/tokenizer/utf8.h"

namespace shardserve::tokenizer_internal {
namespace {

struct Tables {
  std::array<char32_t, 256> byte_to_char;
  std::array<int16_t, 324> char_to_byte;  // every mapped character is below U+0144
};

Tables MakeTables() {
  Tables t{};
  t.char_to_byte.fill(-1);
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next++);
    t.byte_to_char[b] = c;
    t.char_to_byte[c] = static_cast<int16_t>(b);
  }
  return t;
}

const Tables& GetTables() {
  static const Tables tables = MakeTables();
  return tables;
}

}  // namespace

char32_t ByteToChar(uint8_t b) { return GetTables().byte_to_char[b]; }

int CharToByte(char32_t c) {
  const Tables& t = GetTables();
  return c < t.char_to_byte.size() ? t.char_to_byte[c] : -1;
}

void AppendByteLevel(std::string_view bytes, std::string* out) {
  for (char ch : bytes) AppendUtf8(ByteToChar(static_cast<uint8_t>(ch)), out);
}

bool ByteLevelToBytes(std::string_view text, std::string* out) {
  size_t i = 0;
  while (i < text.size()) {
    size_t len = 0;
    const int b = CharToByte(DecodeUtf8Char(text.substr(i), &len));
    if (b < 0) return false;
    out->push_back(static_cast<char>(b));
    i += len;
  }
  return true;
}

}  // namespace shardserve::tokenizer_internal
