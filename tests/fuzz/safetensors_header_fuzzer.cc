// libFuzzer target: safetensors headers and index files. Any input must produce either a parsed
// header whose entries satisfy the documented invariants, or an error status — never a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "absl/strings/string_view.h"
#include "common/safetensors/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  // The first 8 bytes choose the data-section size; the rest is the header text.
  uint64_t data_size = 0;
  std::memcpy(&data_size, data, 8);
  data_size %= (uint64_t{1} << 40);
  const absl::string_view header(reinterpret_cast<const char*>(data + 8), size - 8);
  auto entries = shardserve::ParseSafetensorsHeader(header, data_size, "fuzz");
  if (entries.ok()) {
    uint64_t prev_end = 0;
    for (const auto& e : *entries) {
      if (e.begin > e.end || e.end > data_size) std::abort();
      if (e.begin < prev_end && e.begin != e.end) std::abort();
      if (e.end > prev_end) prev_end = e.end;
    }
  }
  (void)shardserve::ParseSafetensorsIndex(header, "fuzz");
  return 0;
}
