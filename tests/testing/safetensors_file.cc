#include "tests/testing/safetensors_file.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/safetensors/safetensors.h"
#include "common/tensor/dtype.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace shardserve::testing {

std::string SafetensorsFile(const std::vector<StoredTensor>& tensors) {
  // nlohmann's default object sorts keys; the data order is the given one, which the header's
  // offsets record.
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const StoredTensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = text.size();
  std::memcpy(out.data(), &n, 8);
  return out + text + data;
}

absl::StatusOr<std::vector<StoredTensor>> ReadSafetensorsFile(const std::string& path) {
  const std::string file = ReadFileOrEmpty(path);
  uint64_t n = 0;
  if (file.size() < 8) return absl::NotFoundError(absl::StrCat(path, ": missing or too short"));
  std::memcpy(&n, file.data(), 8);
  if (n > file.size() - 8) return absl::DataLossError(absl::StrCat(path, ": truncated"));
  const absl::string_view data = absl::string_view(file).substr(8 + n);
  auto entries = ParseSafetensorsHeader(absl::string_view(file).substr(8, n), data.size(), path);
  if (!entries.ok()) return entries.status();
  std::vector<StoredTensor> out;
  for (const SafetensorsEntry& e : *entries) {
    out.push_back({e.name, std::string(DTypeName(e.dtype)), e.shape,
                   std::string(data.substr(e.begin, e.end - e.begin))});
  }
  return out;
}

std::string F32Bytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

}  // namespace shardserve::testing
