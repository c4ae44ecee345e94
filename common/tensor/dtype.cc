#include "common/tensor/dtype.h"

#include <bit>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardserve {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kQ8: return 1;
    case DType::kU8: return 1;
    case DType::kMxfp4: return 1;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kQ8: return "Q8";
    case DType::kU8: return "U8";
    case DType::kMxfp4: return "MXFP4";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  if (name == "U8") return DType::kU8;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype \"", name, "\" (supported: F32, F16, BF16, F8_E4M3, U8)"));
}

absl::string_view QuantizationName(Quantization q) {
  switch (q) {
    case Quantization::kNone: return "none";
    case Quantization::kInt8: return "int8";
  }
  return "?";
}

absl::StatusOr<Quantization> ParseQuantization(absl::string_view name) {
  if (name == "none" || name.empty()) return Quantization::kNone;
  if (name == "int8") return Quantization::kInt8;
  return absl::InvalidArgumentError(absl::StrCat("unknown quantization \"", name, "\" (choices: none, int8)"));
}

absl::string_view KvCacheFormatName(KvCacheFormat f) { return f == KvCacheFormat::kFp8E4M3 ? "fp8_e4m3" : "auto"; }

absl::StatusOr<KvCacheFormat> ParseKvCacheFormat(absl::string_view name) {
  if (name == "auto" || name.empty()) return KvCacheFormat::kAuto;
  if (name == "fp8" || name == "fp8_e4m3") return KvCacheFormat::kFp8E4M3;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV cache dtype \"", name, "\" (choices: auto, fp8, fp8_e4m3)"));
}

absl::StatusOr<DType> ParseHiddenWireDtype(absl::string_view name) {
  if (absl::EqualsIgnoreCase(name, "f32")) return DType::kF32;
  if (absl::EqualsIgnoreCase(name, "bf16")) return DType::kBF16;
  return absl::InvalidArgumentError(absl::StrCat("\"", name, "\" is not a hidden-state wire dtype (f32 or bf16)"));
}

int64_t Q8MatrixBytes(int64_t rows, int64_t cols) {
  const int64_t padded_rows = (rows + 15) / 16 * 16;
  const int64_t blocks = (cols + 63) / 64;
  const int64_t quants = padded_rows * blocks * 64;
  return (quants + 63) / 64 * 64 + padded_rows * blocks * 4;
}

int64_t Mxfp4MatrixBytes(int64_t rows, int64_t cols) { return rows * cols / 2 + rows * cols / 32; }

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

float E4M3ToFloat(uint8_t v) {
  const float sign = (v & 0x80u) != 0 ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xf;
  const int mant = v & 0x7;
  if (exp == 0xf && mant == 0x7) return std::bit_cast<float>(0x7fc00000u);  // NaN
  // Subnormals (exp 0): mant/8 * 2^-6; normals: (1 + mant/8) * 2^(exp-7). Both exact in float.
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
}

uint8_t FloatToE4M3(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7fu;  // NaN
  if (abs < 0x3c800000u) {                     // below the smallest normal e4m3 (2^-6): subnormal
    // The code is the number of 2^-9 steps, rounded to nearest even; 8 steps is the code of 2^-6.
    const float steps = std::bit_cast<float>(abs) * 512.0f;  // < 8, exact
    uint32_t q = static_cast<uint32_t>(steps);
    const float rest = steps - static_cast<float>(q);
    if (rest > 0.5f || (rest == 0.5f && (q & 1u) != 0)) ++q;
    return sign | static_cast<uint8_t>(q);
  }
  if (abs >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (and inf): saturate
  // Normal: keep 3 of the 23 mantissa bits, rounding to nearest even on the whole exponent and
  // mantissa (a carry moves to the next binade), then move the exponent bias from 127 to 7.
  // Below 448 the result is at most 0x7e (448 itself).
  const uint32_t rounded = (abs + 0x7ffffu + ((abs >> 20) & 1u)) >> 20;
  return sign | static_cast<uint8_t>(rounded - (120u << 3));
}

float BFloat16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat16(float f) {
  uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t FloatToHalf(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                        // below the smallest normal half: subnormal
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // * 2^24, exact
    // Round to nearest even via the FPU: values here are < 1024 so the integer is exact.
    const float r = scaled + 12582912.0f - 12582912.0f;  // 1.5 * 2^23 trick
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u) - (112u << 23);
  return sign | static_cast<uint16_t>(m >> 13);
}

namespace {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHARDSERVE_DTYPE_AVX2 1
// Compiled for AVX2 whatever the target of the rest (-march stays the distribution's default
// here), and called only where the CPU has it.
bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2");
  return have;
}

// FloatToBFloat16 of 8 floats, as 16-bit values in the low halves of 32-bit lanes.
__attribute__((target("avx2"))) inline __m256i RoundToBf16x8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  // NaN: |bits| > 0x7f800000, compared as signed 32-bit values (|bits| is never negative).
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

// The first count / 16 * 16 values; returns how many it converted.
__attribute__((target("avx2"))) size_t NarrowBf16Avx2(const float* src, size_t count, unsigned char* dst) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    // packus packs within 128-bit lanes, [a0-3 b0-3 a4-7 b4-7]; the permute puts a before b. The
    // values are below 2^16, so its unsigned saturation changes none.
    const __m256i packed =
        _mm256_packus_epi32(RoundToBf16x8(_mm256_loadu_ps(src + i)), RoundToBf16x8(_mm256_loadu_ps(src + i + 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i), _mm256_permute4x64_epi64(packed, 0xd8));
  }
  return i;
}

__attribute__((target("avx2"))) size_t WidenBf16Avx2(const unsigned char* src, size_t count, float* dst) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
  return i;
}
#endif

}  // namespace

void ConvertToFloat(DType dtype, const void* src, size_t count, float* dst) {
  const auto* bytes = static_cast<const unsigned char*>(src);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * sizeof(float));
      return;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        dst[i] = HalfToFloat(h);
      }
      return;
    case DType::kBF16: {
      size_t i = 0;
#if SHARDSERVE_DTYPE_AVX2
      if (HaveAvx2()) i = WidenBf16Avx2(bytes, count, dst);
#endif
      for (; i < count; ++i) {
        uint16_t b;
        std::memcpy(&b, bytes + 2 * i, 2);
        dst[i] = BFloat16ToFloat(b);
      }
      return;
    }
    case DType::kF8E4M3:
      for (size_t i = 0; i < count; ++i) dst[i] = E4M3ToFloat(bytes[i]);
      return;
    case DType::kQ8:
    case DType::kMxfp4:
      return;  // packed layouts, not elements (see the header)
    case DType::kU8:
      for (size_t i = 0; i < count; ++i) dst[i] = static_cast<float>(bytes[i]);
      return;
  }
}

absl::Status ConvertFromFloat(DType dtype, const float* src, size_t count, void* dst) {
  auto* out = static_cast<unsigned char*>(dst);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * sizeof(float));
      return absl::OkStatus();
    case DType::kBF16: {
      size_t i = 0;
#if SHARDSERVE_DTYPE_AVX2
      if (HaveAvx2()) i = NarrowBf16Avx2(src, count, out);
#endif
      for (; i < count; ++i) {
        const uint16_t b = FloatToBFloat16(src[i]);
        std::memcpy(out + 2 * i, &b, 2);
      }
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write ", DTypeName(dtype), " from float (only F32 and BF16)"));
  }
}

}  // namespace shardserve
