// Element types of tensors that cross the project's boundaries (checkpoints, activations on the
// wire). Engine math is f32; f16 and bf16 weights are converted on load.
#ifndef SHARDSERVE_COMMON_TENSOR_DTYPE_H_
#define SHARDSERVE_COMMON_TENSOR_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace shardserve {

enum class DType : uint8_t { kF32 = 1, kF16 = 2, kBF16 = 3 };

// Bytes per element.
size_t DTypeSize(DType dtype);
// "F32", "F16", "BF16": the spelling safetensors uses.
absl::string_view DTypeName(DType dtype);
// Parses a safetensors dtype string. Any other dtype (I8, F64, F8_E4M3, ...) is InvalidArgument
// naming it.
absl::StatusOr<DType> ParseDType(absl::string_view name);

// IEEE half and bfloat16 to float, exact.
float HalfToFloat(uint16_t h);
float BFloat16ToFloat(uint16_t b);
// float to half / bfloat16 with round-to-nearest-even (NaN stays NaN, overflow becomes inf).
uint16_t FloatToHalf(float f);
uint16_t FloatToBFloat16(float f);

// Converts `count` little-endian elements of `dtype` at `src` to float. `src` need not be aligned.
void ConvertToFloat(DType dtype, const void* src, size_t count, float* dst);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_TENSOR_DTYPE_H_
