// GPT-2's reversible map between bytes and printable Unicode characters ("bytes_to_unicode"), used
// by byte-level BPE (GPT-2, Llama-3, Qwen2): every byte of the text becomes one character, so a
// vocabulary of printable strings covers all byte sequences. Bytes that are printable in Latin-1
// ('!'..'~', '¡'..'¬', '®'..'ÿ') map to themselves; the other 68 map to U+0100 + n in byte order
// (so ' ' becomes 'Ġ' U+0120 and '\n' becomes 'Ċ' U+010A).
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_BYTE_LEVEL_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_BYTE_LEVEL_H_

#include <cstdint>
#include <string>
#include <string_view>

namespace shardserve::tokenizer_internal {

// The character byte `b` maps to.
char32_t ByteToChar(uint8_t b);

// The byte that `c` maps from, or -1 when `c` is not one of the 256 characters of the map.
int CharToByte(char32_t c);

// Appends the byte-level spelling of `bytes` (each byte as its character, UTF-8 encoded).
void AppendByteLevel(std::string_view bytes, std::string* out);

// Converts a byte-level spelling back to raw bytes. Returns false (leaving `out` unspecified) when
// `text` (valid UTF-8) contains a character outside the map.
bool ByteLevelToBytes(std::string_view text, std::string* out);

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_BYTE_LEVEL_H_
