#include "worker/kernels/cpu/cpu_backend.h"

#include <cblas.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/tensor/dtype.h"
#include "common/status/macros.h"
#include "worker/kernels/cpu/gemv.h"
#include "worker/kernels/cpu/mxfp4.h"
#include "worker/kernels/cpu/q8.h"
#include "worker/kernels/cpu/softmax.h"
#include "worker/kernels/shared/attention_math.h"
#include "worker/kernels/shared/fp8_math.h"
#include "worker/kernels/shared/moe_math.h"
#include "worker/kernels/shared/row_math.h"
#include "worker/kernels/shared/sampling_host.h"
#include "worker/kernels/shared/sampling_math.h"

namespace shardserve::kernels {
namespace {

#define SHARDSERVE_VALIDATE(p)                 \
  do {                                         \
    if (auto st = (p).Validate(); !st.ok()) return st; \
  } while (false)

constexpr size_t kHugePage = size_t{2} << 20;

void FreeHost(void* p) { std::free(p); }

// a . b in 16 interleaved partial sums folded pairwise: a fixed order (the same result wherever
// the rows live) that the compiler turns into vector FMAs. A single running sum would be a chain
// of dependent adds, ~4 cycles per element: at decode this made attention over a 100-token
// context cost as much as reading the weights of an int8 layer. Every product is added by an
// explicit fused multiply-add: left to itself, g++ fused some (the 16 sums, the tail's last
// elements) and not others (the tail's first ones, multiplied as a vector, then added in order),
// an order DotKeyTile could not reproduce.
inline float Dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] = FusedMulAdd(acc[j], a[e + j], b[e + j]);
  }
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  }
  float s = acc[0];
  for (; e < n; ++e) s = FusedMulAdd(s, a[e], b[e]);
  return s;
}

// Dot(q, k_t, d) for the kKeyTile keys whose rows are the columns [0, kKeyTile) of kt, a [d, ld]
// matrix (keys transposed: element e of key t at kt[e * ld + t]), into out. Every key's sum is
// formed in Dot's order (the same 16 interleaved partial sums, folded the same way, then the
// tail), so each result is bit-identical to Dot's; the vector lanes run across keys instead of
// along the row, which keeps them busy at small head sizes (Dot of an 8-wide row is a chain of 8
// dependent multiply-adds) and needs no reduction across lanes at any size. The upper 8 partial
// sums are formed first, then the lower 8 (each pass's sums fit in registers), then the fold.
constexpr int kKeyTile = 8;
inline void DotKeyTile(const float* q, const float* kt, int64_t ld, int64_t d, float* out) {
  constexpr int kLanes = 16, kHalf = kLanes / 2;
#if defined(__AVX2__) && defined(__FMA__)
  // Spelled out: left to itself, g++ kept the partial sums in memory and loaded keys one by one.
  static_assert(kKeyTile == 8);
  __m256 s = _mm256_setzero_ps();
  int64_t e = 0;
  if (d >= kLanes) {
    __m256 hi[kHalf], lo[kHalf];
    for (int j = 0; j < kHalf; ++j) hi[j] = lo[j] = _mm256_setzero_ps();
    const int64_t end = d / kLanes * kLanes;
    for (int64_t b = 0; b < end; b += kLanes) {
      for (int j = 0; j < kHalf; ++j) {
        hi[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[b + kHalf + j]), _mm256_loadu_ps(kt + (b + kHalf + j) * ld), hi[j]);
      }
    }
    for (int64_t b = 0; b < end; b += kLanes) {
      for (int j = 0; j < kHalf; ++j) {
        lo[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[b + j]), _mm256_loadu_ps(kt + (b + j) * ld), lo[j]);
      }
    }
    for (int j = 0; j < kHalf; ++j) lo[j] = _mm256_add_ps(lo[j], hi[j]);
    for (int w = kHalf / 2; w >= 1; w /= 2) {
      for (int j = 0; j < w; ++j) lo[j] = _mm256_add_ps(lo[j], lo[j + w]);
    }
    s = lo[0];
    e = end;
  }
  for (; e < d; ++e) s = _mm256_fmadd_ps(_mm256_set1_ps(q[e]), _mm256_loadu_ps(kt + e * ld), s);
  _mm256_storeu_ps(out, s);
#else
  float s[kKeyTile] = {};
  int64_t e = 0;
  if (d >= kLanes) {
    float hi[kHalf][kKeyTile] = {}, lo[kHalf][kKeyTile] = {};
    const int64_t end = d / kLanes * kLanes;
    for (int64_t b = 0; b < end; b += kLanes) {
      for (int j = 0; j < kHalf; ++j) {
        const float a = q[b + kHalf + j];
        const float* k = kt + (b + kHalf + j) * ld;
        for (int t = 0; t < kKeyTile; ++t) hi[j][t] = FusedMulAdd(hi[j][t], a, k[t]);
      }
    }
    for (int64_t b = 0; b < end; b += kLanes) {
      for (int j = 0; j < kHalf; ++j) {
        const float a = q[b + j];
        const float* k = kt + (b + j) * ld;
        for (int t = 0; t < kKeyTile; ++t) lo[j][t] = FusedMulAdd(lo[j][t], a, k[t]);
      }
    }
    for (int j = 0; j < kHalf; ++j) {
      for (int t = 0; t < kKeyTile; ++t) lo[j][t] += hi[j][t];
    }
    for (int w = kHalf / 2; w >= 1; w /= 2) {
      for (int j = 0; j < w; ++j) {
        for (int t = 0; t < kKeyTile; ++t) lo[j][t] += lo[j + w][t];
      }
    }
    for (int t = 0; t < kKeyTile; ++t) s[t] = lo[0][t];
    e = end;
  }
  for (; e < d; ++e) {
    const float a = q[e];
    const float* k = kt + e * ld;
    for (int t = 0; t < kKeyTile; ++t) s[t] = FusedMulAdd(s[t], a, k[t]);
  }
  for (int t = 0; t < kKeyTile; ++t) out[t] = s[t];
#endif
}

// out[g][0, kWidth) = sum over keys j in [0, n) of w[g][j] * rows[j][offs[g] + (0, kWidth)], for G
// heads at once, each sum formed in ascending key order by fused multiply-adds from 0: the same
// bits as the per-key accumulation of a decode step, with G * kWidth / 8 independent vector sums
// held in registers instead of one row of partial sums per head in memory. kWidth: a multiple of 8.
template <int G, int kWidth>
inline void WeightedRowSum(const float* const* rows, int64_t n, const float* const* w, const int64_t* offs,
                           float* const* out) {
  static_assert(kWidth % 8 == 0);
#if defined(__AVX2__) && defined(__FMA__)
  // Spelled out: left to itself, g++ turned the loops around (elements outer, partial sums in
  // memory) and did not vectorize them.
  constexpr int kVecs = kWidth / 8;
  __m256 acc[G][kVecs];
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < kVecs; ++v) acc[g][v] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* r = rows[j];
    for (int g = 0; g < G; ++g) {
      const __m256 wj = _mm256_set1_ps(w[g][j]);
      const float* x = r + offs[g];
      for (int v = 0; v < kVecs; ++v) acc[g][v] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x + 8 * v), acc[g][v]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(out[g] + 8 * v, acc[g][v]);
  }
#else
  for (int g = 0; g < G; ++g) {
    for (int t = 0; t < kWidth; ++t) {
      float acc = 0.0f;
      for (int64_t j = 0; j < n; ++j) acc = FusedMulAdd(acc, w[g][j], rows[j][offs[g] + t]);
      out[g][t] = acc;
    }
  }
#endif
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int blas_threads) : blas_threads_(blas_threads) {}
  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string name() const override { return "cpu"; }
  bool SupportsOp(Op op, DType dtype) const override {
    switch (op) {
      case Op::kEmbedding:
        return dtype != DType::kQ8 && dtype != DType::kMxfp4;  // rows are widened on the fly
      case Op::kLinear:
        return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kQ8 || dtype == DType::kMxfp4;
      case Op::kKvWrite:
      case Op::kAttention:
        // f32, or float8 e4m3 codes (an FP8 KV cache, KvCacheFormat::kFp8E4M3).
        return dtype == DType::kF32 || dtype == DType::kF8E4M3;
      case Op::kRmsNorm:
      case Op::kAddRmsNorm:
      case Op::kRope:
      case Op::kSiluMul:
      case Op::kAdd:
      case Op::kGatherRows:
      case Op::kScatterAddRows:
      case Op::kSigmoidScaleRows:
      case Op::kArgmaxRows:
      case Op::kZero:
      case Op::kScale:
      case Op::kScaleRows:
      case Op::kMlaKvWrite:
      case Op::kMlaAttention:
      case Op::kSampleRows:
      case Op::kMoeRoute:
        return dtype == DType::kF32;
      case Op::kHeadLinear:
        return dtype == DType::kF32 || dtype == DType::kBF16;
      case Op::kGroupedLinear:
      case Op::kMoeCombine:
        // The engine's Linear and ScatterAddRows per expert are the CPU path (nothing to gain). The
        // ops run all the same (a Linear per group; the combine's shared math), in both forms, so
        // that tests check the device-offsets form and the engine's device path against them.
        return false;
    }
    return false;
  }
  // The device-offsets form reads the offsets where they are (host memory), for any group size.
  int64_t MaxDeviceGroupRows(DType dtype) const override {
    return SupportsOp(Op::kLinear, dtype) ? std::numeric_limits<int64_t>::max() : 0;
  }
  void* stream_handle() const override { return nullptr; }
  // Ops run as they are called: there is nothing to record.
  bool SupportsCapture() const override { return false; }
  absl::StatusOr<std::unique_ptr<OpGraph>> Capture(absl::FunctionRef<absl::Status()> /*record*/) override {
    return absl::UnimplementedError("cpu: op graphs are not supported");
  }
  int64_t AttentionShapeKey(const AttentionParams& /*p*/) const override { return 0; }
  // Host memory needs no reservation: the bf16 path's widening buffer is bounded (kWidenFloats).
  absl::Status Reserve(const StepLimits& /*limits*/) override { return absl::OkStatus(); }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    // Large buffers (weights, KV cache) are 2 MiB aligned and backed by transparent huge pages
    // where the kernel allows it: decode streams every weight once per token, and 4 KiB pages
    // cost a TLB miss every 4 KiB of that stream.
    const size_t align = bytes >= kHugePage ? kHugePage : 64;
    const size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
    }
    if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // advisory; failure is harmless
    std::memset(p, 0, rounded);
    return DeviceBuffer(p, bytes, &FreeHost);
  }
  absl::StatusOr<DeviceBuffer> QuantizeWeights(DType format, const float* host, int64_t rows, int64_t cols) override {
    if (format != DType::kQ8 || rows < 0 || cols < 0) {
      return absl::InvalidArgumentError(absl::StrCat("cpu: cannot quantize a [", rows, ", ", cols, "] matrix to ",
                                                     DTypeName(format), " (only Q8)"));
    }
    ASSIGN_OR_RETURN(DeviceBuffer buf, Allocate(cpu::Q8Layout::For(rows, cols).bytes));
    cpu::PackQ8(host, rows, cols, buf.as<uint8_t>());
    return buf;
  }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status Embedding(const EmbeddingParams& p) override {
    SHARDSERVE_VALIDATE(p);
    if (!SupportsOp(Op::kEmbedding, p.table.dtype)) return UnsupportedWeights(name(), Op::kEmbedding, p.table.dtype);
    const size_t row_bytes = static_cast<size_t>(p.hidden) * DTypeSize(p.table.dtype);
    const auto* table = static_cast<const uint8_t*>(p.table.data);
    for (int64_t t = 0; t < p.tokens; ++t) {
      ConvertToFloat(p.table.dtype, table + static_cast<size_t>(p.ids[t]) * row_bytes, static_cast<size_t>(p.hidden),
                     p.out + t * p.hidden);
    }
    return absl::OkStatus();
  }

  absl::Status Linear(const LinearParams& p) override {
    SHARDSERVE_VALIDATE(p);
    if (p.tokens == 0 || p.out == 0) return absl::OkStatus();
    switch (p.w.dtype) {
      case DType::kF32:
        break;
      case DType::kBF16:
        return LinearBf16(p, static_cast<const uint16_t*>(p.w.data));
      case DType::kQ8:
        cpu::Q8Linear(p.x, static_cast<const uint8_t*>(p.w.data), p.bias, p.y, p.tokens, p.in, p.out, p.accumulate);
        return absl::OkStatus();
      case DType::kMxfp4:
        return LinearMxfp4(p);
      case DType::kF16:
      case DType::kF8E4M3:
      case DType::kU8:
        return UnsupportedWeights(name(), Op::kLinear, p.w.dtype);
    }
    const auto* w = static_cast<const float*>(p.w.data);
    if (p.tokens <= cpu::SmallBatchMaxTokens()) {
      cpu::SmallBatchLinear(p.x, w, p.bias, p.y, p.tokens, p.in, p.out, p.accumulate, 0, p.out);
      return absl::OkStatus();
    }
    // The blocked kernel runs on one thread; with more BLAS threads sgemm's parallelism wins.
    if (p.tokens <= cpu::BlockedMaxTokens() && blas_threads_ == 1) {
      cpu::BlockedLinear(p.x, w, p.bias, p.y, p.tokens, p.in, p.out, p.accumulate, 0, p.out);
      return absl::OkStatus();
    }
    const float beta = p.accumulate ? 1.0f : 0.0f;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(p.tokens), static_cast<int>(p.out),
                static_cast<int>(p.in), 1.0f, p.x, static_cast<int>(p.in), w, static_cast<int>(p.in), beta, p.y,
                static_cast<int>(p.out));
    if (p.bias != nullptr) AddBias(p);
    return absl::OkStatus();
  }

  // MXFP4 weights: decode steps decode them in registers (cpu/mxfp4.h); larger batches widen
  // blocks of rows to f32 in the bounded scratch and run the f32 kernels on them.
  absl::Status LinearMxfp4(const LinearParams& p) {
    const auto* codes = static_cast<const uint8_t*>(p.w.data);
    if (p.tokens <= cpu::kMxfp4FusedMaxTokens || p.in == 0) {
      for (int64_t t = 0; t < p.tokens; t += cpu::kMxfp4FusedMaxTokens) {
        const int64_t n = std::min(cpu::kMxfp4FusedMaxTokens, p.tokens - t);
        cpu::Mxfp4SmallBatchLinear(p.x + t * p.in, codes, p.w.mxfp4_scales, p.bias, p.y + t * p.out, n, p.in, p.out,
                                   p.accumulate, 0, p.out);
      }
      return absl::OkStatus();
    }
    const int64_t rows = std::min(p.out, std::max<int64_t>(16, kWidenFloats / p.in));
    widened_.resize(static_cast<size_t>(rows * p.in));
    const bool blocked = p.tokens <= cpu::BlockedMaxTokens() && blas_threads_ == 1;
    const float beta = p.accumulate ? 1.0f : 0.0f;
    for (int64_t o = 0; o < p.out; o += rows) {
      const int64_t n = std::min(rows, p.out - o);
      cpu::Mxfp4DequantizeRows(codes, p.w.mxfp4_scales, p.in, o, o + n, widened_.data());
      if (blocked) {
        // Rows [0, n) of the widened block are rows [o, o + n) of y (stride p.out) and the bias.
        cpu::BlockedLinear(p.x, widened_.data(), p.bias != nullptr ? p.bias + o : nullptr, p.y + o, p.tokens, p.in,
                           p.out, p.accumulate, 0, n);
        continue;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(p.tokens), static_cast<int>(n),
                  static_cast<int>(p.in), 1.0f, p.x, static_cast<int>(p.in), widened_.data(), static_cast<int>(p.in),
                  beta, p.y + o, static_cast<int>(p.out));
    }
    if (!blocked && p.bias != nullptr) AddBias(p);
    return absl::OkStatus();
  }

  // The f32 dispatch with bfloat16 weights: their thresholds, and above them sgemm on blocks of
  // rows widened to f32 in a bounded scratch buffer.
  absl::Status LinearBf16(const LinearParams& p, const uint16_t* w) {
    if (p.tokens <= cpu::SmallBatchMaxTokensBf16()) {
      cpu::SmallBatchLinearBf16(p.x, w, p.bias, p.y, p.tokens, p.in, p.out, p.accumulate, 0, p.out);
      return absl::OkStatus();
    }
    // (in = 0 also goes here: sgemm takes no leading dimension below 1.)
    if ((p.tokens <= cpu::BlockedMaxTokensBf16() && blas_threads_ == 1) || p.in == 0) {
      cpu::BlockedLinearBf16(p.x, w, p.bias, p.y, p.tokens, p.in, p.out, p.accumulate, 0, p.out);
      return absl::OkStatus();
    }
    const int64_t rows = std::min(p.out, std::max<int64_t>(16, kWidenFloats / p.in));
    widened_.resize(static_cast<size_t>(rows * p.in));
    const float beta = p.accumulate ? 1.0f : 0.0f;
    for (int64_t o = 0; o < p.out; o += rows) {
      const int64_t n = std::min(rows, p.out - o);
      cpu::WidenBf16(w + o * p.in, widened_.data(), n * p.in);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(p.tokens), static_cast<int>(n),
                  static_cast<int>(p.in), 1.0f, p.x, static_cast<int>(p.in), widened_.data(), static_cast<int>(p.in),
                  beta, p.y + o, static_cast<int>(p.out));
    }
    if (p.bias != nullptr) AddBias(p);
    return absl::OkStatus();
  }

  static void AddBias(const LinearParams& p) {
    for (int64_t t = 0; t < p.tokens; ++t) {
      float* yt = p.y + t * p.out;
      for (int64_t o = 0; o < p.out; ++o) yt[o] += p.bias[o];
    }
  }

  absl::Status RmsNorm(const RmsNormParams& p) override {
    SHARDSERVE_VALIDATE(p);
    for (int64_t t = 0; t < p.tokens; ++t) {
      RmsNormRow(p.x + t * p.hidden, p.weight, p.y + t * p.hidden, static_cast<int>(p.hidden), p.eps);
    }
    return absl::OkStatus();
  }

  absl::Status AddRmsNorm(const AddRmsNormParams& p) override {
    SHARDSERVE_VALIDATE(p);
    for (int64_t t = 0; t < p.tokens; ++t) {
      AddRmsNormRow(p.x + t * p.hidden, p.y + t * p.hidden, p.weight, p.out + t * p.hidden,
                    static_cast<int>(p.hidden), p.eps);
    }
    return absl::OkStatus();
  }

  absl::Status Rope(const RopeParams& p) override {
    SHARDSERVE_VALIDATE(p);
    const int64_t rot = p.rotary_dim > 0 ? p.rotary_dim : p.head_dim;
    const int64_t half = rot / 2;
    cos_.resize(static_cast<size_t>(half));
    sin_.resize(static_cast<size_t>(half));
    for (int64_t t = 0; t < p.tokens; ++t) {
      // float32 angles, as Hugging Face computes them.
      const float pos = static_cast<float>(p.positions[t]) * p.position_scale;
      for (int64_t i = 0; i < half; ++i) {
        const float angle = pos * p.inv_freq[i];
        cos_[static_cast<size_t>(i)] = std::cos(angle) * p.scale;
        sin_[static_cast<size_t>(i)] = std::sin(angle) * p.scale;
      }
      for (int64_t h = 0; h < p.q_heads; ++h) {
        RopeHead(p.q + (t * p.q_heads + h) * p.head_dim, cos_.data(), sin_.data(), static_cast<int>(rot));
      }
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        RopeHead(p.k + (t * p.kv_heads + h) * p.head_dim, cos_.data(), sin_.data(), static_cast<int>(rot));
      }
    }
    return absl::OkStatus();
  }

  absl::Status KvWrite(const KvWriteParams& p) override {
    SHARDSERVE_VALIDATE(p);
    if (!SupportsOp(Op::kKvWrite, p.cache.dtype)) return UnsupportedWeights(name(), Op::kKvWrite, p.cache.dtype);
    // RoPE fused with the write: on the CPU nothing is saved by one pass, so it is the Rope op
    // itself, then the write (the CUDA kernel's results are these).
    if (p.rope.has_value()) RETURN_IF_ERROR(Rope(*p.rope));
    const KvLayerView& c = p.cache;
    const bool fp8 = c.dtype == DType::kF8E4M3;
    const int64_t row = c.kv_heads * c.head_dim;
    // Stores `n` values at element `dst` of a cache: copied, or encoded as e4m3 codes (the device's
    // encoder, so a CUDA rank writes the same bytes).
    auto store = [&](void* cache, int64_t dst, const float* src, int64_t n) {
      if (!fp8) {
        std::memcpy(static_cast<float*>(cache) + dst, src, n * sizeof(float));
        return;
      }
      uint8_t* out = static_cast<uint8_t*>(cache) + dst;
      for (int64_t i = 0; i < n; ++i) out[i] = E4M3Encode(src[i]);
    };
    const int64_t bs = c.block_size;
    for (int64_t s = 0; s < p.paged.num_seqs; ++s) {
      const AttnSeq& q = p.paged.seqs[s];
      const int32_t* table = p.paged.block_table + q.table_begin;
      // Copy in runs that stay within one block.
      for (int64_t i = 0; i < q.q_len;) {
        const int64_t pos = q.pos_begin + i;
        const int64_t off = pos % bs;
        const int64_t run = std::min(bs - off, q.q_len - i);
        const int64_t dst = (int64_t{table[pos / bs]} * bs + off) * row;
        const int64_t src = (q.q_begin + i) * row;
        store(c.k, dst, p.k + src, run * row);
        store(c.v, dst, p.v + src, run * row);
        i += run;
      }
    }
    return absl::OkStatus();
  }

  absl::Status Attention(const AttentionParams& p) override {
    SHARDSERVE_VALIDATE(p);
    if (!SupportsOp(Op::kAttention, p.cache.dtype)) return UnsupportedWeights(name(), Op::kAttention, p.cache.dtype);
    const KvLayerView& c = p.cache;
    const int64_t d = c.head_dim;
    const int64_t row = c.kv_heads * d;
    const int64_t bs = c.block_size;
    const bool fp8 = c.dtype == DType::kF8E4M3;
    const int64_t heads = p.q_heads;
    const int64_t group = heads / c.kv_heads;
    // The first key a query at `pos` sees (the CUDA kernels' function; never decreases as pos grows).
    auto first_key = [&](int64_t pos) -> int64_t { return AttentionFirstKey(pos, p.sliding_window, p.chunk_size); };
    // n values of an FP8 cache from element `at`, decoded into out.
    auto decode = [&](const void* cache, int64_t at, int64_t n, float* out) {
      const uint8_t* codes = static_cast<const uint8_t*>(cache) + at;
      for (int64_t e = 0; e < n; ++e) out[e] = E4M3Decode(codes[e]);
    };
    // fn(j, run) for the runs of positions [from, to) that each lie in one block (contiguous rows).
    auto for_each_run = [&](int64_t from, int64_t to, auto&& fn) {
      for (int64_t j = from; j < to;) {
        const int64_t run = std::min(bs - j % bs, to - j);
        fn(j, run);
        j += run;
      }
    };
    for (int64_t s = 0; s < p.paged.num_seqs; ++s) {
      const AttnSeq& q = p.paged.seqs[s];
      const int32_t* table = p.paged.block_table + q.table_begin;
      // An FP8 cache is read as f32 decoded values (the products are then those of an f32 cache
      // holding them). With several queries (a prefill), every key and value row they see, [base,
      // last position], is decoded once into kv_rows_ (keys, then values), rather than again for
      // every later query, while that takes at most kMaxDecodedKvBytes; otherwise (one query, or a
      // longer context) each block's rows are decoded as they are read.
      const int64_t base = first_key(q.pos_begin);
      const int64_t seen = q.q_len > 0 ? q.pos_begin + q.q_len - base : 0;
      const bool decode_all = fp8 && q.q_len > 1 && 2 * seen * row * int64_t{sizeof(float)} <= kMaxDecodedKvBytes;
      if (decode_all) {
        kv_rows_.resize(static_cast<size_t>(2 * seen * row));
        for_each_run(base, base + seen, [&](int64_t j, int64_t run) {
          const int64_t at = (int64_t{table[j / bs]} * bs + j % bs) * row;
          decode(c.k, at, run * row, kv_rows_.data() + (j - base) * row);
          decode(c.v, at, run * row, kv_rows_.data() + (seen + j - base) * row);
        });
      }
      // The K (or V) rows from position j on, `run` of them in one block, as f32: in place, or decoded.
      auto rows = [&](bool values, int64_t j, int64_t run) -> const float* {
        if (decode_all) return kv_rows_.data() + ((values ? seen : 0) + j - base) * row;
        const int64_t at = (int64_t{table[j / bs]} * bs + j % bs) * row;
        if (!fp8) return static_cast<const float*>(values ? c.v : c.k) + at;
        kv_rows_.resize(static_cast<size_t>(run * row));
        decode(values ? c.v : c.k, at, run * row, kv_rows_.data());
        return kv_rows_.data();
      };
      // With several queries, the keys they see are also transposed once per sequence into
      // key_cols_, [kv_heads][d][ld] (ld = seen rounded up, plus a tile of zeros), and scored
      // kKeyTile keys at a time by DotKeyTile: the same bits as Dot per key (so a prefill, its
      // chunks and later decode steps agree exactly), several times faster at small head sizes.
      const bool tiled = q.q_len > 1 && seen * row * int64_t{sizeof(float)} <= kMaxDecodedKvBytes;
      const int64_t ld = (seen + 2 * kKeyTile - 1) / kKeyTile * kKeyTile;
      // A prefill's value rows, one pointer per key from base on, when they stay put for the whole
      // call (an f32 cache, or an FP8 cache decoded once): its weighted sums then run per head.
      const bool value_rows = tiled && (!fp8 || decode_all);
      if (value_rows) {
        value_rows_.resize(static_cast<size_t>(seen));
        for_each_run(base, base + seen, [&](int64_t j, int64_t run) {
          const float* vb = rows(/*values=*/true, j, run);
          for (int64_t r = 0; r < run; ++r) value_rows_[static_cast<size_t>(j - base + r)] = vb + r * row;
        });
      }
      if (tiled) {
        key_cols_.resize(std::max(key_cols_.size(), static_cast<size_t>(row * ld)));
        for (int64_t e = 0; e < row; ++e) std::fill_n(key_cols_.data() + e * ld + seen, ld - seen, 0.f);
        for_each_run(base, base + seen, [&](int64_t j, int64_t run) {
          const float* kb = rows(/*values=*/false, j, run);
          for (int64_t r = 0; r < run; ++r) {
            const float* kr = kb + r * row;
            float* col = key_cols_.data() + (j - base + r);
            for (int64_t e = 0; e < row; ++e) col[e * ld] = kr[e];
          }
        });
      }
      for (int64_t i = 0; i < q.q_len; ++i) {
        const int64_t t = q.q_begin + i;
        const int64_t pos = q.pos_begin + i;
        const int64_t lo = first_key(pos);
        const int64_t n = pos + 1 - lo;
        scores_.resize(std::max(scores_.size(), static_cast<size_t>(heads * n + kKeyTile)));
        float* sc = scores_.data();  // [heads, n]
        const float* qt = p.q + t * heads * d;
        float* ot = p.out + t * heads * d;
        if (tiled) {
          // Per head, tiles of keys from lo on; the last tile's extra columns (later keys, or the
          // zero padding) land past the head's n scores and are overwritten by the next head's.
          for (int64_t h = 0; h < heads; ++h) {
            const float* kt = key_cols_.data() + (h / group) * d * ld + (lo - base);
            float* sh = sc + h * n;
            for (int64_t k0 = 0; k0 < n; k0 += kKeyTile) DotKeyTile(qt + h * d, kt + k0, ld, d, sh + k0);
            for (int64_t k = 0; k < n; ++k) {
              const float score = sh[k] * p.scale;
              sh[k] = p.softcap > 0.0f ? SoftCap(score, p.softcap) : score;
            }
          }
        } else {
          // Keys [lo, pos] walked block by block (rows of one block are contiguous), every query
          // head at each key, so that a block's lookup is paid once per key row rather than per
          // head. Per (head, key) the dot product and, per head, the weighted sum over keys in
          // ascending order are those of a contiguous cache: the results do not depend on the
          // block layout.
          for_each_run(lo, pos + 1, [&](int64_t j, int64_t run) {
            const float* kb = rows(/*values=*/false, j, run);
            for (int64_t r = 0; r < run; ++r) {
              const float* kr = kb + r * row;
              for (int64_t h = 0; h < heads; ++h) {
                const float* qh = qt + h * d;
                const float score = Dot(qh, kr + (h / group) * d, d) * p.scale;
                sc[h * n + (j - lo + r)] = p.softcap > 0.0f ? SoftCap(score, p.softcap) : score;
              }
            }
          });
        }
        for (int64_t h = 0; h < heads; ++h) cpu::SoftmaxInPlace(sc + h * n, n, p.sinks == nullptr ? nullptr : p.sinks + h);
        if (value_rows) {
          // Head sizes that are multiples of 64: a head at a time, 64 elements (8 vector sums) at a
          // time, so that each key's row is read once per head. Others: 4 heads (or 1) at a time,
          // 8 elements at a time (a small head's row is read once), the rest one by one.
          const float* const* vr = value_rows_.data() + (lo - base);
          const int64_t width = d % 64 == 0 ? 64 : 8;
          const int64_t step = width == 8 && heads % 4 == 0 ? 4 : 1;
          for (int64_t h0 = 0; h0 < heads; h0 += step) {
            const float* w[4];
            float* o[4];
            int64_t offs[4];
            for (int64_t g = 0; g < step; ++g) w[g] = sc + (h0 + g) * n;
            int64_t e0 = 0;
            for (; e0 + width <= d; e0 += width) {
              for (int64_t g = 0; g < step; ++g) {
                offs[g] = ((h0 + g) / group) * d + e0;
                o[g] = ot + (h0 + g) * d + e0;
              }
              if (width == 64) {
                WeightedRowSum<1, 64>(vr, n, w, offs, o);
              } else if (step == 4) {
                WeightedRowSum<4, 8>(vr, n, w, offs, o);
              } else {
                WeightedRowSum<1, 8>(vr, n, w, offs, o);
              }
            }
            for (int64_t g = 0; g < step; ++g) {
              const int64_t off = ((h0 + g) / group) * d;
              for (int64_t e = e0; e < d; ++e) {
                float acc = 0.f;
                for (int64_t j = 0; j < n; ++j) acc = FusedMulAdd(acc, w[g][j], vr[j][off + e]);
                ot[(h0 + g) * d + e] = acc;
              }
            }
          }
          continue;
        }
        std::fill(ot, ot + heads * d, 0.f);
        for_each_run(lo, pos + 1, [&](int64_t j, int64_t run) {
          const float* vb = rows(/*values=*/true, j, run);
          for (int64_t r = 0; r < run; ++r) {
            const float* vrow = vb + r * row;
            for (int64_t h = 0; h < heads; ++h) {
              const float* vj = vrow + (h / group) * d;
              const float w = sc[h * n + (j - lo + r)];
              float* oh = ot + h * d;
              for (int64_t e = 0; e < d; ++e) oh[e] = FusedMulAdd(oh[e], w, vj[e]);
            }
          }
        });
      }
    }
    return absl::OkStatus();
  }

  absl::Status SiluMul(const SiluMulParams& p) override {
    SHARDSERVE_VALIDATE(p);
    // The activation chosen once, outside the loop.
    if (p.act == GateActivation::kGeluTanh) {
      for (int64_t i = 0; i < p.n; ++i) p.out[i] = GatedProduct(GateActivation::kGeluTanh, p.gate[i], p.up[i]);
    } else if (p.act == GateActivation::kClampedSwiglu) {
      for (int64_t i = 0; i < p.n; ++i) p.out[i] = ClampedSwiglu(p.gate[i], p.up[i]);
    } else {
      for (int64_t i = 0; i < p.n; ++i) p.out[i] = GatedProduct(GateActivation::kSilu, p.gate[i], p.up[i]);
    }
    return absl::OkStatus();
  }

  absl::Status Scale(const ScaleParams& p) override {
    SHARDSERVE_VALIDATE(p);
    for (int64_t i = 0; i < p.n; ++i) {
      const float v = p.x[i] * p.scale;
      p.x[i] = p.softcap > 0.0f ? SoftCap(v, p.softcap) : v;
    }
    return absl::OkStatus();
  }

  absl::Status Add(const AddParams& p) override {
    SHARDSERVE_VALIDATE(p);
    for (int64_t i = 0; i < p.n; ++i) p.x[i] += p.y[i];
    return absl::OkStatus();
  }

  absl::Status GatherRows(const GatherRowsParams& p) override {
    SHARDSERVE_VALIDATE(p);
    for (int64_t i = 0; i < p.count; ++i) {
      std::memcpy(p.dst + i * p.width, p.src + int64_t{p.rows[i]} * p.width, p.width * sizeof(float));
    }
    return absl::OkStatus();
  }

  absl::Status ScatterAddRows(const ScatterAddRowsParams& p) override {
    SHARDSERVE_VALIDATE(p);
    for (int64_t i = 0; i < p.count; ++i) {
      float* dst = p.dst + int64_t{p.rows[i]} * p.width;
      const float* src = p.src + i * p.width;
      const float s = p.scales[i];
      for (int64_t e = 0; e < p.width; ++e) dst[e] += s * src[e];
    }
    return absl::OkStatus();
  }

  absl::Status ScaleRows(const ScaleRowsParams& p) override {
    SHARDSERVE_VALIDATE(p);
    for (int64_t t = 0; t < p.tokens; ++t) {
      float* x = p.x + t * p.width;
      for (int64_t e = 0; e < p.width; ++e) x[e] *= p.scales[t];
    }
    return absl::OkStatus();
  }

  absl::Status SigmoidScaleRows(const SigmoidScaleRowsParams& p) override {
    SHARDSERVE_VALIDATE(p);
    for (int64_t t = 0; t < p.tokens; ++t) {
      const float g = 1.0f / (1.0f + std::exp(-p.gate[t]));
      float* x = p.x + t * p.width;
      for (int64_t e = 0; e < p.width; ++e) x[e] *= g;
    }
    return absl::OkStatus();
  }

  absl::Status ArgmaxRows(const ArgmaxRowsParams& p) override {
    SHARDSERVE_VALIDATE(p);
    for (int64_t r = 0; r < p.rows; ++r) {
      const float* row = p.x + r * p.stride;
      p.out[r] = static_cast<int32_t>(std::max_element(row, row + p.width) - row);
    }
    return absl::OkStatus();
  }

  absl::Status SampleRows(const SampleRowsParams& p) override {
    SHARDSERVE_VALIDATE(p);
    for (int64_t r = 0; r < p.rows; ++r) {
      const RowSamplingParams& q = p.params[r];
      p.out[r] = row_sampler_.Sample(p.x + r * p.stride, p.width, q.temperature, q.top_k, q.top_p, q.min_p,
                                     SamplingUniformOf(q.seed, q.step));
    }
    return absl::OkStatus();
  }

  // Each token routed in turn, then GroupByExpert over the batch: the host routing the engine ran
  // before MoeRoute existed, with the same functions.
  absl::Status MoeRoute(const MoeRouteParams& p) override {
    SHARDSERVE_VALIDATE(p);
    const MoeRouting& r = p.routing;
    const int64_t k = r.top_k;
    route_scratch_.resize(static_cast<size_t>(RouteTokenScratch(r)));
    route_experts_.resize(static_cast<size_t>(p.tokens * k));
    route_weights_.resize(static_cast<size_t>(p.tokens * k));
    route_fill_.resize(static_cast<size_t>(r.num_experts));
    for (int64_t t = 0; t < p.tokens; ++t) {
      RouteToken(r, p.logits + t * r.num_experts, p.score_bias, route_scratch_.data(), route_experts_.data() + t * k,
                 route_weights_.data() + t * k);
    }
    GroupByExpert(route_experts_.data(), route_weights_.data(), static_cast<int>(p.tokens), r.top_k, r.num_experts,
                  p.offsets, p.rows, p.scales, route_fill_.data());
    if (p.host_offsets != nullptr && p.host_offsets != p.offsets) {
      std::memcpy(p.host_offsets, p.offsets, static_cast<size_t>(r.num_experts + 1) * sizeof(int32_t));
    }
    return absl::OkStatus();
  }

  absl::Status HeadLinear(const HeadLinearParams& p) override {
    SHARDSERVE_VALIDATE(p);
    if (p.w.dtype != DType::kF32 && p.w.dtype != DType::kBF16) {
      return UnsupportedWeights(name(), Op::kHeadLinear, p.w.dtype);
    }
    if (p.tokens == 0 || p.out == 0 || p.heads == 0) return absl::OkStatus();
    const int64_t mat = p.out * p.in;
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* w = nullptr;
      if (p.w.dtype == DType::kF32) {
        w = static_cast<const float*>(p.w.data) + h * mat;
      } else {
        // Widened one head at a time (a head's matrix is small: out x in of one head).
        head_widened_.resize(static_cast<size_t>(mat));
        const uint16_t* src = static_cast<const uint16_t*>(p.w.data) + h * mat;
        for (int64_t i = 0; i < mat; ++i) head_widened_[static_cast<size_t>(i)] = BFloat16ToFloat(src[i]);
        w = head_widened_.data();
      }
      const float* x = p.x + h * p.x_width + p.x_offset;
      float* y = p.y + h * p.y_width + p.y_offset;
      const int64_t ldx = p.heads * p.x_width, ldy = p.heads * p.y_width;
      if (p.in == 0) {
        if (!p.accumulate) {
          for (int64_t t = 0; t < p.tokens; ++t) std::fill(y + t * ldy, y + t * ldy + p.out, 0.f);
        }
        continue;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(p.tokens), static_cast<int>(p.out),
                  static_cast<int>(p.in), 1.0f, x, static_cast<int>(ldx), w, static_cast<int>(p.in),
                  p.accumulate ? 1.0f : 0.0f, y, static_cast<int>(ldy));
    }
    return absl::OkStatus();
  }

  absl::Status MlaKvWrite(const MlaKvWriteParams& p) override {
    SHARDSERVE_VALIDATE(p);
    if (p.cache.dtype != DType::kF32) return UnsupportedWeights(name(), Op::kMlaKvWrite, p.cache.dtype);
    const MlaCacheView& c = p.cache;
    auto* cache = static_cast<float*>(c.data);
    const int64_t row = c.row(), bs = c.block_size;
    for (int64_t s = 0; s < p.paged.num_seqs; ++s) {
      const AttnSeq& q = p.paged.seqs[s];
      const int32_t* table = p.paged.block_table + q.table_begin;
      for (int64_t i = 0; i < q.q_len; ++i) {
        const int64_t pos = q.pos_begin + i;
        float* dst = cache + (int64_t{table[pos / bs]} * bs + pos % bs) * row;
        const int64_t t = q.q_begin + i;
        std::memcpy(dst, p.latent + t * c.latent_dim, c.latent_dim * sizeof(float));
        if (c.rope_dim > 0) std::memcpy(dst + c.latent_dim, p.rope + t * c.rope_dim, c.rope_dim * sizeof(float));
      }
    }
    return absl::OkStatus();
  }

  absl::Status MlaAttention(const MlaAttentionParams& p) override {
    SHARDSERVE_VALIDATE(p);
    if (p.cache.dtype != DType::kF32) return UnsupportedWeights(name(), Op::kMlaAttention, p.cache.dtype);
    const MlaCacheView& c = p.cache;
    const auto* cache = static_cast<const float*>(c.data);
    const int64_t lat = c.latent_dim, rd = c.rope_dim, row = c.row(), bs = c.block_size;
    const int64_t heads = p.q_heads;
    for (int64_t s = 0; s < p.paged.num_seqs; ++s) {
      const AttnSeq& q = p.paged.seqs[s];
      const int32_t* table = p.paged.block_table + q.table_begin;
      for (int64_t i = 0; i < q.q_len; ++i) {
        const int64_t t = q.q_begin + i;
        const int64_t pos = q.pos_begin + i;
        const int64_t n = pos + 1;
        scores_.resize(std::max(scores_.size(), static_cast<size_t>(heads * n)));
        float* sc = scores_.data();  // [heads, n]
        const float* ql = p.q_latent + t * heads * lat;
        const float* qr = p.q_rope == nullptr ? nullptr : p.q_rope + t * heads * rd;
        float* ot = p.out + t * heads * lat;
        // Every head reads the same cached row: walk the keys once, every head at each (as
        // Attention does), in ascending key order per head.
        for (int64_t j = 0; j < n; ++j) {
          const float* kr = cache + (int64_t{table[j / bs]} * bs + j % bs) * row;
          for (int64_t h = 0; h < heads; ++h) {
            float score = Dot(ql + h * lat, kr, lat);
            if (rd > 0) score += p.rope_scale * Dot(qr + h * rd, kr + lat, rd);
            sc[h * n + j] = score * p.scale;
          }
        }
        for (int64_t h = 0; h < heads; ++h) SoftmaxRow(sc + h * n, static_cast<int>(n));
        std::fill(ot, ot + heads * lat, 0.f);
        for (int64_t j = 0; j < n; ++j) {
          const float* kr = cache + (int64_t{table[j / bs]} * bs + j % bs) * row;
          for (int64_t h = 0; h < heads; ++h) {
            const float w = sc[h * n + j];
            float* oh = ot + h * lat;
            for (int64_t e = 0; e < lat; ++e) oh[e] += w * kr[e];
          }
        }
      }
    }
    return absl::OkStatus();
  }

  // A Linear per non-empty group (the engine's per-expert sums), the groups given or read from
  // the offsets.
  absl::Status GroupedLinear(const GroupedLinearParams& p) override {
    SHARDSERVE_VALIDATE(p);
    if (!SupportsOp(Op::kLinear, p.dtype())) return UnsupportedWeights(name(), Op::kGroupedLinear, p.dtype());
    const GroupedLinearParams::Group* groups = p.groups;
    int64_t num_groups = p.num_groups;
    if (p.device_offsets()) {
      RETURN_IF_ERROR(ReadDeviceGroups("GroupedLinear", p.device, p.rows, p.host_weights, p.weights));
      groups = held_groups_.data();
      num_groups = static_cast<int64_t>(held_groups_.size());
    }
    for (int64_t g = 0; g < num_groups; ++g) {
      const GroupedLinearParams::Group& group = groups[g];
      if (group.count == 0) continue;
      RETURN_IF_ERROR(Linear({.x = p.x + group.begin * p.in, .w = group.w, .y = p.y + group.begin * p.out,
                              .tokens = group.count, .in = p.in, .out = p.out, .accumulate = p.accumulate}));
    }
    return absl::OkStatus();
  }

  // Each token's rows found group by group (TokenGroupedRows) and added with CombineElement: the
  // functions the CUDA kernel runs, and the sums of a ScatterAddRows per group.
  absl::Status MoeCombine(const MoeCombineParams& p) override {
    SHARDSERVE_VALIDATE(p);
    combine_ranges_.clear();
    if (p.device_offsets()) {
      RETURN_IF_ERROR(ReadDeviceGroups("MoeCombine", p.device, p.count, nullptr, nullptr));
      for (const GroupedLinearParams::Group& g : held_groups_) {
        combine_ranges_.push_back({static_cast<int32_t>(g.begin), static_cast<int32_t>(g.count)});
      }
    } else {
      for (int64_t g = 0; g < p.num_groups; ++g) {
        combine_ranges_.push_back({static_cast<int32_t>(p.groups[g].begin), static_cast<int32_t>(p.groups[g].count)});
      }
    }
    combine_found_.resize(combine_ranges_.size());
    for (int64_t t = 0; t < p.tokens; ++t) {
      const int n = TokenGroupedRows(p.rows, combine_ranges_.data(), static_cast<int>(combine_ranges_.size()),
                                     static_cast<int32_t>(t), combine_found_.data());
      float* d = p.dst + t * p.width;
      for (int64_t e = 0; e < p.width && n > 0; ++e) {
        d[e] = CombineElement(d[e], p.src, p.scales, combine_found_.data(), n, p.width, e);
      }
    }
    return absl::OkStatus();
  }

  absl::Status Zero(const ZeroParams& p) override {
    SHARDSERVE_VALIDATE(p);
    std::fill(p.x, p.x + p.n, 0.f);
    return absl::OkStatus();
  }

 private:
  // The held experts' groups of the device-offsets form into held_groups_ (with their weights when
  // host_weights is given), after the checks a device backend cannot make: offsets that start at
  // 0 or later, never decrease and end within `rows`; a group within max_rows_per_group; device
  // ids and weight tables equal to the host lists (this "device" memory is host memory).
  absl::Status ReadDeviceGroups(absl::string_view op, const DeviceExpertGroups& d, int64_t rows,
                                const WeightView* host_weights, const void* const* weights) {
    held_groups_.clear();
    const int32_t* off = d.offsets;
    if (off[0] < 0 || off[d.num_experts] > rows) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": expert offsets [", off[0], ", ", off[d.num_experts],
                                                     "] outside [0, ", rows, "]"));
    }
    for (int64_t e = 0; e < d.num_experts; ++e) {
      if (off[e + 1] < off[e]) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": expert offsets decrease after expert ", e));
      }
    }
    for (int64_t i = 0; i < d.num_held; ++i) {
      const int32_t e = d.host_ids[i];
      if (d.ids[i] != e) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": device expert id ", i, " is ", d.ids[i], ", not ", e));
      }
      if (weights != nullptr && weights[i] != host_weights[i].data) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": the device weight table of expert ", e,
                                                       " is not its host weights"));
      }
      const int64_t count = off[e + 1] - off[e];
      if (count > d.max_rows_per_group) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": expert ", e, " has ", count,
                                                       " rows, above max_rows_per_group ", d.max_rows_per_group));
      }
      held_groups_.push_back(
          {.w = host_weights != nullptr ? host_weights[i] : WeightView(), .begin = off[e], .count = count});
    }
    return absl::OkStatus();
  }

  const int blas_threads_;
  // GroupedLinear and MoeCombine: the device-offsets form's groups, and the combine's ranges and
  // one token's found rows.
  std::vector<GroupedLinearParams::Group> held_groups_;
  std::vector<GroupRange> combine_ranges_;
  std::vector<int32_t> combine_found_;
  // Per-call scratch, grown on demand (amortised: it reaches its final size on the first step).
  std::vector<float> cos_, sin_, scores_;
  // Attention over an FP8 cache: one sequence's key and value rows decoded, or one block's.
  static constexpr int64_t kMaxDecodedKvBytes = int64_t{64} << 20;
  std::vector<float> kv_rows_;
  std::vector<float> key_cols_;  // Attention: a sequence's keys transposed for DotKeyTile
  std::vector<const float*> value_rows_;  // Attention: a sequence's value rows, one per key
  std::vector<float> head_widened_;  // HeadLinear: one head's bfloat16 matrix widened
  HostRowSampler row_sampler_;       // SampleRows: the engine Sampler's arithmetic and scratch
  // MoeRoute: one token's routing scratch, the batch's choices and GroupByExpert's fill counters.
  std::vector<float> route_scratch_, route_weights_;
  std::vector<int32_t> route_experts_, route_fill_;
  // Rows of bfloat16 weights widened for sgemm: at most kWidenFloats (1 MiB; or 16 rows, if more).
  // 4 MiB measured level or slower at 256 tokens (shardserve-bench-kernels).
  static constexpr int64_t kWidenFloats = int64_t{1} << 18;
  std::vector<float> widened_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(int blas_threads) {
  if (blas_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("cpu backend: blas_threads must be >= 1, got ", blas_threads));
  }
  openblas_set_num_threads(blas_threads);
  return std::unique_ptr<Backend>(new CpuBackend(blas_threads));
}

}  // namespace shardserve::kernels
