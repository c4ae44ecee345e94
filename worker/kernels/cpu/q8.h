// Block-quantized int8 weights (DType::kQ8) on the CPU backend: packing at load, and y = x . W^T
// with int8 dot products.
//
// Quantization. Each row of W [out, in] is cut into blocks of kQ8Block consecutive weights (the
// last block of a row padded with zeros). A block holds s = max|w| / 127 and q = round(w / s) in
// [-127, 127] (a block of zeros has s = 0). At every call the activations are quantized the same
// way, per token and block, so that
//   y[t, o] = sum over blocks b of  float(sum_k qw[o, k] qx[t, k]) * (sw[o, b] * sx[t, b])
// where the integer block sums are exact and the f32 sum over blocks runs in block order with one
// fused multiply-add per block. Every body below (AVX-512 VNNI, AVX2, scalar) computes exactly
// that, so their results are bit-identical; Q8LinearReference states it in plain code.
//
// Packed layout of one matrix (Q8Layout), one buffer:
//   quants: [panels][in_pad / 4][kQ8PanelRows][4] uint8 = q + 128 of rows panel*16 .. +15 and
//           columns 4g .. 4g+3, so one 64-byte load is the operand of one vpdpbusd (unsigned bytes
//           times the token's signed bytes, 16 int32 sums of 4 products);
//   scales: [panels][blocks][kQ8PanelRows] float, one vector per panel and block;
// with in_pad = blocks * kQ8Block and out padded to whole panels with zero rows. Tensor-parallel
// slices are quantized on their own (a rank's blocks start at its first column).
#ifndef SHARDSERVE_WORKER_KERNELS_CPU_Q8_H_
#define SHARDSERVE_WORKER_KERNELS_CPU_Q8_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shardserve::kernels::cpu {

inline constexpr int64_t kQ8Block = 64;
inline constexpr int64_t kQ8PanelRows = 16;

struct Q8Layout {
  int64_t out = 0, in = 0;
  int64_t panels = 0;  // ceil(out / kQ8PanelRows)
  int64_t blocks = 0;  // ceil(in / kQ8Block)
  int64_t in_pad = 0;  // blocks * kQ8Block
  size_t quant_bytes = 0;
  size_t scale_offset = 0;  // quant_bytes rounded up to 64
  size_t bytes = 0;         // the whole buffer
  static Q8Layout For(int64_t out, int64_t in);
};

// Quantizes w [out, in] (f32, row-major) into `dst` (Q8Layout::For(out, in).bytes bytes).
void PackQ8(const float* w, int64_t out, int64_t in, uint8_t* dst);
// The dequantized weight (s * q) at [row, col] of a packed matrix: for tests.
float Q8Weight(const uint8_t* packed, int64_t out, int64_t in, int64_t row, int64_t col);

// Activations quantized per token and block, as the products read them.
struct Q8Activations {
  int64_t tokens = 0, in_pad = 0, blocks = 0;
  std::vector<int8_t> q;       // [tokens, in_pad], zero-padded
  std::vector<float> scale;    // [tokens, blocks]
  std::vector<int32_t> comp;   // [tokens, blocks]: 128 * sum of the block's q (the unsigned bias's share)
};
void QuantizeActivations(const float* x, int64_t tokens, int64_t in, Q8Activations* a);

// y[t] (+)= W . x[t] (+ bias) for W packed by PackQ8; x: [tokens, in], y: [tokens, out] (y must
// not alias x). Quantizes x into a per-thread buffer and runs the fastest body this CPU has.
void Q8Linear(const float* x, const uint8_t* packed, const float* bias, float* y, int64_t tokens, int64_t in,
              int64_t out, bool accumulate);

// The bodies, on activations already quantized (a.tokens tokens). The VNNI one must only be
// called where HaveAvx512Vnni(); the AVX2 one where the library was built for AVX2 (else it runs
// the scalar one).
void Q8LinearVnni(const Q8Activations& a, const uint8_t* packed, const float* bias, float* y, int64_t in,
                  int64_t out, bool accumulate);
void Q8LinearAvx2(const Q8Activations& a, const uint8_t* packed, const float* bias, float* y, int64_t in,
                  int64_t out, bool accumulate);
void Q8LinearReference(const Q8Activations& a, const uint8_t* packed, const float* bias, float* y, int64_t in,
                       int64_t out, bool accumulate);

// Whether this CPU (and OS) runs AVX-512F/BW/VL with VNNI; checked once.
bool HaveAvx512Vnni();

}  // namespace shardserve::kernels::cpu

#endif  // SHARDSERVE_WORKER_KERNELS_CPU_Q8_H_
