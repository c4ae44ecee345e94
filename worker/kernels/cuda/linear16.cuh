// Linear with 16-bit weights (bfloat16 or IEEE half) on CUDA. Internal to worker/kernels/cuda:
// only cuda_backend.cu includes this header.
//
// Two paths, chosen by the backend on the number of tokens:
//   * Decode-sized batches (tokens <= kGemv16MaxTokens): LaunchGemv16 reads each weight row once
//     with 16-byte loads, widens it to f32 in registers and multiplies it with every token's f32
//     activations (f32 products and sums, like the CPU backend's bf16 path). Memory-bound: the
//     weights are the traffic, and one pass serves the whole batch.
//   * Larger batches: LaunchCastTo16 rounds the activations to the weights' type (round to nearest
//     even) in the backend's scratch, and cuBLAS multiplies 16-bit x 16-bit with f32 accumulation
//     on the tensor cores (cublasGemmEx, CUBLAS_COMPUTE_32F). Rounding the activations costs about
//     2^-9 (bf16) or 2^-12 (f16) relative per product; the parity test states the tolerance.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_LINEAR16_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_LINEAR16_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/tensor/dtype.h"
#include "worker/kernels/shared/row_math.h"

namespace shardserve::kernels::cuda {

inline constexpr int64_t kGemv16MaxTokens = 8;

// The products of one GEMV launch: up to kMaxParts weight matrices [out[p], in] of one 16-bit type
// that multiply the same activations, each with its own bias (or null), output y[p] ([tokens,
// out[p]] f32) and accumulate flag. Their rows are one index space, so one grid covers them all.
struct Gemv16Group {
  static constexpr int kMaxParts = 4;
  int parts = 0;
  const void* w[kMaxParts] = {};
  const float* bias[kMaxParts] = {};
  float* y[kMaxParts] = {};
  int64_t out[kMaxParts] = {};
  bool accumulate[kMaxParts] = {};
};

// The normed form of LinearGroup (backend.h, LinearGroupParams::norm) on the GEMV path: every
// block first computes each token's inverse RMS with the norm kernels' reduction (row_norm.cuh),
// then multiplies weight[i] * (x[t, i] * inv[t]) (RmsNormRow's formula) where the plain GEMV
// multiplies x[t, i]: bit for bit the RmsNorm kernel followed by the plain GEMV, without the norm's
// launch and its pass over memory. weight: [in] f32.
struct Gemv16Norm {
  const float* weight = nullptr;
  float eps = 0.f;
};

// y[p][t, o] (+)= sum_i x[t, i] * w[p][o, i] (+ bias[p][o]) for every part p and t < tokens <=
// kGemv16MaxTokens. x: [tokens, in] f32; the weights of `dtype` (kBF16 or kF16). `loads`: 16-byte
// weight loads each lane issues before using them (4 or 8; the same sums either way; the normed
// form always issues 4, for its registers). `multiprocessors`: the device's, to size one wave of blocks (any value gives the same
// sums). `norm` non-null: of the normalised rows of x (Gemv16Norm). Launched under PDL (pdl.cuh):
// the first weight rows stream into L2 while the previous kernel runs.
cudaError_t LaunchGemv16(DType dtype, const float* x, const Gemv16Group& group, int64_t tokens, int64_t in, int loads,
                         int multiprocessors, cudaStream_t stream, const Gemv16Norm* norm = nullptr);

// The gated form of LinearGroup (backend.h) on the GEMV path: gate and up matrices [out, in] of one
// 16-bit type, their biases (or null), and y ([tokens, out] f32, written, never read).
struct GatedGemv16Params {
  const void* w_gate = nullptr;
  const void* w_up = nullptr;
  const float* bias_gate = nullptr;
  const float* bias_up = nullptr;
  float* y = nullptr;
  int64_t out = 0;
  GateActivation act = GateActivation::kSilu;
};

// y[t, o] = GatedProduct(act, x[t] . w_gate[o] (+ bias_gate[o]), x[t] . w_up[o] (+ bias_up[o])) for
// t < tokens <= kGemv16MaxTokens, in one launch: one warp per output row computes both dots and
// writes the product once. Bit for bit what LaunchGemv16 of the two parts (no accumulation) and
// then the SiluMul kernel write (the same dots, sums and row math). Arguments as LaunchGemv16's.
cudaError_t LaunchGatedGemv16(DType dtype, const float* x, const GatedGemv16Params& gemv, int64_t tokens,
                              int64_t in, int loads, int multiprocessors, cudaStream_t stream,
                              const Gemv16Norm* norm = nullptr);

// dst[i] = x[i] rounded to `dtype` (kBF16 or kF16), as 16-bit patterns. x: [n]; dst: [n].
cudaError_t LaunchCastTo16(DType dtype, const float* x, void* dst, int64_t n, cudaStream_t stream);

// out[t, :] = table[ids[t], :] widened to f32. table: [vocab, hidden] of `dtype` (any DType).
cudaError_t LaunchEmbeddingTyped(DType dtype, const void* table, const int32_t* ids, float* out, int64_t tokens,
                                 int64_t hidden, cudaStream_t stream);

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_LINEAR16_CUH_
