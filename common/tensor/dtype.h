// Element types of tensors that cross the project's boundaries (checkpoints, activations on the
// wire), and the weight formats kernels take. Engine math is f32.
#ifndef SHARDSERVE_COMMON_TENSOR_DTYPE_H_
#define SHARDSERVE_COMMON_TENSOR_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace shardserve {

enum class DType : uint8_t {
  kF32 = 1,
  kF16 = 2,
  kBF16 = 3,
  // float8 e4m3 ("fn": no infinities, 0x7f/0xff NaN, max 448), as FP8 checkpoints store weights
  // (their scales are separate tensors; see common/model_spec's quantization config).
  kF8E4M3 = 4,
  // Weights only, never in a checkpoint or on the wire: block-quantized int8 in the kernels' packed
  // layout (worker/kernels/shared/q8_pack.h), made at load by --quantize=int8. DTypeSize is the
  // int8 payload (1); the per-block scales are extra (Q8PackedBytes).
  kQ8 = 5,
  // Raw bytes (safetensors "U8"): an MXFP4 checkpoint's packed e2m1 pairs and e8m0 block scales
  // (see common/model_spec's Mxfp4Quantization). Read as float, each byte becomes its value 0-255.
  kU8 = 6,
  // Weights only, never in a checkpoint or on the wire: an MXFP4 checkpoint's matrix kept as it is
  // stored, [rows, cols] as rows x cols / 2 bytes of e2m1 code pairs (the even column in the low
  // nibble) plus rows x cols / 32 e8m0 scale bytes (WeightView::mxfp4_scales); cols a multiple of 32.
  // DTypeSize is 1 (a byte holds two weights); Mxfp4MatrixBytes counts a matrix.
  kMxfp4 = 7,
};

// Bytes per element.
size_t DTypeSize(DType dtype);
// "F32", "F16", "BF16", "F8_E4M3": the spelling safetensors uses ("Q8" for kQ8, "MXFP4" for kMxfp4).
absl::string_view DTypeName(DType dtype);
// Parses a safetensors dtype string: F32, F16, BF16, F8_E4M3, U8. Any other dtype (I8, F64, F8_E5M2,
// ...) is InvalidArgument naming it.
absl::StatusOr<DType> ParseDType(absl::string_view name);

// IEEE half and bfloat16 to float, exact.
float HalfToFloat(uint16_t h);
float BFloat16ToFloat(uint16_t b);
// float to half / bfloat16 with round-to-nearest-even (NaN stays NaN, overflow becomes inf).
uint16_t FloatToHalf(float f);
uint16_t FloatToBFloat16(float f);
// float8 e4m3fn to float, exact (0x7f and 0xff are NaN).
float E4M3ToFloat(uint8_t v);
// float to float8 e4m3fn with round-to-nearest-even, saturating: magnitudes above the largest
// finite value 448 (infinities included) become +-448 (0x7e / 0xfe), as FP8 quantizers clamp;
// NaN becomes 0x7f (0xff when its sign bit is set); the sign of zero is kept. Every non-NaN code c
// satisfies FloatToE4M3(E4M3ToFloat(c)) == c.
uint8_t FloatToE4M3(float f);

// How the loader stores weight matrices (the linear projections and the lm_head; embeddings, norms
// and routers are never quantized). kInt8: DType::kQ8 on backends that take it, 64-weight blocks.
enum class Quantization : uint8_t { kNone = 0, kInt8 = 1 };
// "none", "int8".
absl::string_view QuantizationName(Quantization q);
// Parses "none" / "int8" (as flags and the Helm chart spell them); anything else is
// InvalidArgument naming the value and the choices.
absl::StatusOr<Quantization> ParseQuantization(absl::string_view name);
// How workers keep the paged KV cache. kAuto: the checkpoint's bf16/f16 where the backend takes it,
// else f32 (worker/engine's KvCacheDType). kFp8E4M3: float8 e4m3fn codes, 1 byte per element (half
// of bf16), without a scale: a value is stored rounded to nearest even and saturated to +-448
// (FloatToE4M3), as vLLM's kv_cache_dtype "fp8" with its default scale of 1.
enum class KvCacheFormat : uint8_t { kAuto = 0, kFp8E4M3 = 1 };
// "auto", "fp8_e4m3".
absl::string_view KvCacheFormatName(KvCacheFormat f);
// Parses "auto" (or empty), "fp8" and "fp8_e4m3"; anything else is InvalidArgument naming the
// value and the choices.
absl::StatusOr<KvCacheFormat> ParseKvCacheFormat(absl::string_view name);
// Parses --hidden_wire_dtype, how hidden states travel between pipeline stages: "f32" or "bf16"
// (any case) as kF32 / kBF16; anything else is InvalidArgument naming the value and the choices.
absl::StatusOr<DType> ParseHiddenWireDtype(absl::string_view name);
// Bytes of a [rows, cols] matrix stored as kQ8: rows padded to panels of 16, each row to blocks of
// 64 int8 weights, plus one f32 scale per block of every padded row (the scales start 64-byte
// aligned). The CPU kernels' packed layout (worker/kernels/cpu/q8.h) has exactly this size; the
// memory model (common/plan/memory_model.h) counts with it.
int64_t Q8MatrixBytes(int64_t rows, int64_t cols);
// Bytes of a [rows, cols] matrix kept as kMxfp4 (cols a multiple of 32): a half byte per weight
// plus one scale byte per 32 weights, 17/32 of a byte per weight.
int64_t Mxfp4MatrixBytes(int64_t rows, int64_t cols);

// Converts `count` little-endian elements of `dtype` (not kQ8 or kMxfp4) at `src` to float. `src` need not
// be aligned.
void ConvertToFloat(DType dtype, const void* src, size_t count, float* dst);
// The reverse for kF32 and kBF16 (FloatToBFloat16 of each value): writes `count` little-endian
// elements of `dtype` to `dst`, which need not be aligned. Any other dtype is InvalidArgument
// naming it, and nothing is written. BF16 both ways runs 16 values at a time with AVX2 where the
// CPU has it (checked at run time), at about memory speed.
absl::Status ConvertFromFloat(DType dtype, const float* src, size_t count, void* dst);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_TENSOR_DTYPE_H_
