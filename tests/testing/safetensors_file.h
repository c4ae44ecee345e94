// Writing and taking apart safetensors files in tests: build a checkpoint tensor by tensor (raw
// bytes in any dtype, e.g. F8_E4M3 codes with their scales), or read one back with the raw bytes of
// every tensor so that a test can corrupt or replace some and write it out again.
#ifndef SHARDSERVE_TESTS_TESTING_SAFETENSORS_FILE_H_
#define SHARDSERVE_TESTS_TESTING_SAFETENSORS_FILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve::testing {

struct StoredTensor {
  std::string name;
  std::string dtype;  // as safetensors spells it: "F32", "BF16", "F8_E4M3", ...
  std::vector<int64_t> shape;
  std::string bytes;  // little-endian elements, row-major
};

// The bytes of a safetensors file holding `tensors` in order (the header padded to 8 bytes). The
// caller keeps dtype, shape and byte counts consistent (Checkpoint rejects them otherwise).
std::string SafetensorsFile(const std::vector<StoredTensor>& tensors);

// Every tensor of the safetensors file at `path`, in data order, with its raw bytes. Errors of
// ParseSafetensorsHeader; NotFound when the file cannot be read.
absl::StatusOr<std::vector<StoredTensor>> ReadSafetensorsFile(const std::string& path);

// `values` as little-endian f32 bytes.
std::string F32Bytes(const std::vector<float>& values);

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_SAFETENSORS_FILE_H_
