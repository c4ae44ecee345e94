// Tensor-core attention for prefill rows (the plan is in attention.cuh, "Prefill on tensor cores").
#include <cuda_bf16.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "worker/kernels/cuda/attention.cuh"
#include "worker/kernels/cuda/pdl.cuh"
#include "worker/kernels/shared/attention_math.h"

namespace shardserve::kernels::cuda {
namespace {

using Bf16 = __nv_bfloat16;

constexpr int kWarp = 32;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kTile = 16;                     // the MMA shape: 16 x 16 x 16
constexpr int kRows = kWarps * kTile;         // query rows per block (16 per warp)
constexpr int kKeys = 32;                     // keys per step of a block
constexpr int kVec = 8;                       // bf16 per 16-byte load
constexpr int64_t kMaxGrid = 65535;

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }


struct MmaShape {
  int64_t block_size, q_heads, kv_heads, sliding_window, chunk_size;
  float scale, softcap;
  const float* sinks;  // [q_heads] or null (AttentionParams::sinks)
};

// Shared memory of one block, in this order (every part a multiple of 32 bytes, as the MMA loads
// and stores need): q_hi, q_lo [kRows, kD] bf16; k, v [kKeys, kD] bf16; o [kRows, kD] f32;
// s [kRows, kKeys] f32; p_hi, p_lo [kRows, kKeys] bf16.
constexpr size_t MmaSharedBytes(int d) {
  return size_t{2} * kRows * d * sizeof(Bf16) + size_t{2} * kKeys * d * sizeof(Bf16) + size_t{kRows} * d * sizeof(float) +
         size_t{kRows} * kKeys * sizeof(float) + size_t{2} * kRows * kKeys * sizeof(Bf16);
}

// A value as the sum of two bf16 (the second the first's rounding error): products of the pair with
// an exact bf16 operand, summed in f32, carry about 16 bits of the value instead of 8.
__device__ __forceinline__ void SplitBf16(float x, Bf16* hi, Bf16* lo) {
  const Bf16 h = __float2bfloat16_rn(x);
  *hi = h;
  *lo = __float2bfloat16_rn(x - __bfloat162float(h));
}

// grid.x strides over a sequence's tiles of kRows query rows, grid.y = query head, grid.z strides
// over sequences, skipping those of fewer than kMinMmaAttentionRows rows. Each warp owns 16 rows of
// the tile; lanes 2r and 2r + 1 keep row r's softmax state (m, l) and each handle half of its keys
// and of its output columns.
template <int kD>
__global__ void __launch_bounds__(kThreads)
    MmaPrefillAttentionKernel(const float* __restrict__ q, float* __restrict__ out, const AttnSeq* __restrict__ seqs,
                              int64_t num_seqs, const int32_t* __restrict__ block_table,
                              const Bf16* __restrict__ cache_k, const Bf16* __restrict__ cache_v, MmaShape sh) {
  pdl::LaunchDependents();
  pdl::Wait();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  extern __shared__ __align__(128) unsigned char smem[];
  Bf16* q_hi = reinterpret_cast<Bf16*>(smem);
  Bf16* q_lo = q_hi + kRows * kD;
  Bf16* k_s = q_lo + kRows * kD;
  Bf16* v_s = k_s + kKeys * kD;
  float* o_s = reinterpret_cast<float*>(v_s + kKeys * kD);
  float* s_s = o_s + kRows * kD;
  Bf16* p_hi = reinterpret_cast<Bf16*>(s_s + kRows * kKeys);
  Bf16* p_lo = p_hi + kRows * kKeys;

  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int64_t h = blockIdx.y;
  const int64_t g = h / (sh.q_heads / sh.kv_heads);
  const int64_t kv_row = sh.kv_heads * kD;  // elements per cache row (all kv heads)
  const int my_row = warp * kTile + lane / 2;  // of the tile
  const int half = lane % 2;
  Bf16* warp_q_hi = q_hi + warp * kTile * kD;
  Bf16* warp_q_lo = q_lo + warp * kTile * kD;
  float* warp_o = o_s + warp * kTile * kD;
  float* warp_s = s_s + warp * kTile * kKeys;
  Bf16* warp_p_hi = p_hi + warp * kTile * kKeys;
  Bf16* warp_p_lo = p_lo + warp * kTile * kKeys;

  for (int64_t s = blockIdx.z; s < num_seqs; s += gridDim.z) {
    const AttnSeq seq = seqs[s];
    // A decode row (or a few): the split-K kernel's, launched beside this one (attention.cuh). The
    // whole block skips it, before its first barrier.
    if (seq.q_len < kMinMmaAttentionRows) continue;
    const int32_t* table = block_table + seq.table_begin;
    for (int64_t i0 = int64_t{blockIdx.x} * kRows; i0 < seq.q_len; i0 += int64_t{gridDim.x} * kRows) {
      const int64_t rows = seq.q_len - i0 < kRows ? seq.q_len - i0 : kRows;
      __syncthreads();  // the previous tile is done with the shared arrays
      for (int e = threadIdx.x; e < kRows * kD; e += kThreads) {
        const int r = e / kD;
        const float x = r < rows ? q[((seq.q_begin + i0 + r) * sh.q_heads + h) * kD + e % kD] : 0.f;
        SplitBf16(x, &q_hi[e], &q_lo[e]);
        o_s[e] = 0.f;
      }
      const long long first_pos = seq.pos_begin + i0;
      const long long key_begin = AttentionFirstKey(first_pos, sh.sliding_window, sh.chunk_size);
      const long long key_end = first_pos + rows;  // one past the last row's own position
      const bool row_ok = my_row < rows;
      const long long my_pos = first_pos + my_row;
      const long long my_first = AttentionFirstKey(my_pos, sh.sliding_window, sh.chunk_size);
      float m = -INFINITY, l = 0.f;
      __syncthreads();
      for (long long kb = key_begin; kb < key_end; kb += kKeys) {
        // This step's key and value rows (zeros past the end), 16 bytes per load.
        for (int e = threadIdx.x; e < kKeys * (kD / kVec); e += kThreads) {
          const int j = e / (kD / kVec);
          const int c = (e % (kD / kVec)) * kVec;
          uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
          if (kb + j < key_end) {
            const int64_t off = PagedCacheRow(table, kb + j, sh.block_size) * kv_row + g * kD + c;
            kv = *reinterpret_cast<const uint4*>(cache_k + off);
            vv = *reinterpret_cast<const uint4*>(cache_v + off);
          }
          *reinterpret_cast<uint4*>(k_s + j * kD + c) = kv;
          *reinterpret_cast<uint4*>(v_s + j * kD + c) = vv;
        }
        __syncthreads();
        // Scores of the warp's 16 rows against the step's keys: (q_hi + q_lo) . k.
        for (int n = 0; n < kKeys / kTile; ++n) {
          wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float> acc;
          wmma::fill_fragment(acc, 0.f);
#pragma unroll
          for (int k = 0; k < kD / kTile; ++k) {
            wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, Bf16, wmma::col_major> b;
            wmma::load_matrix_sync(b, k_s + n * kTile * kD + k * kTile, kD);
            wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, Bf16, wmma::row_major> a;
            wmma::load_matrix_sync(a, warp_q_hi + k * kTile, kD);
            wmma::mma_sync(acc, a, b, acc);
            wmma::load_matrix_sync(a, warp_q_lo + k * kTile, kD);
            wmma::mma_sync(acc, a, b, acc);
          }
          wmma::store_matrix_sync(warp_s + n * kTile, acc, kKeys, wmma::mem_row_major);
        }
        __syncwarp();
        // The online softmax of the row over the step's keys (each lane of the pair half of them).
        constexpr int kHalfKeys = kKeys / 2;
        float score[kHalfKeys];
        unsigned valid = 0;  // bit c: key c of the lane's half is one the row attends to
        float step_max = -INFINITY;
#pragma unroll
        for (int c = 0; c < kHalfKeys; ++c) {
          const int col = half * kHalfKeys + c;
          const long long key = kb + col;
          const float scaled = warp_s[(lane / 2) * kKeys + col] * sh.scale;
          score[c] = sh.softcap > 0.f ? SoftCap(scaled, sh.softcap) : scaled;
          if (row_ok && key >= my_first && key <= my_pos) {
            valid |= 1u << c;
            step_max = fmaxf(step_max, score[c]);
          }
        }
        step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 1));
        const float rescale = SoftmaxChunkRescale(step_max, &m, l);
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < kHalfKeys; ++c) {
          const int col = half * kHalfKeys + c;
          const float p = (valid >> c) & 1u ? expf(score[c] - m) : 0.f;
          sum += p;
          SplitBf16(p, &warp_p_hi[(lane / 2) * kKeys + col], &warp_p_lo[(lane / 2) * kKeys + col]);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * rescale + sum;
        // The warp's 16 rows of o scaled by their rows' factors (both lanes of a pair hold the
        // same), a row at a time with the lanes on consecutive floats: walked a row per lane pair,
        // the 32 lanes' addresses would be kD / 2 floats apart, all in one shared-memory bank.
#pragma unroll
        for (int r = 0; r < kTile; ++r) {
          const float row_rescale = __shfl_sync(0xffffffffu, rescale, 2 * r);
          float* o_row = warp_o + r * kD;
#pragma unroll
          for (int e = lane; e < kD; e += kWarp) o_row[e] *= row_rescale;
        }
        __syncwarp();
        // o += (p_hi + p_lo) . v over the step's keys.
#pragma unroll
        for (int dt = 0; dt < kD / kTile; ++dt) {
          wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float> acc;
          wmma::load_matrix_sync(acc, warp_o + dt * kTile, kD, wmma::mem_row_major);
#pragma unroll
          for (int k = 0; k < kKeys / kTile; ++k) {
            wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, Bf16, wmma::row_major> b;
            wmma::load_matrix_sync(b, v_s + k * kTile * kD + dt * kTile, kD);
            wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, Bf16, wmma::row_major> a;
            wmma::load_matrix_sync(a, warp_p_hi + k * kTile, kKeys);
            wmma::mma_sync(acc, a, b, acc);
            wmma::load_matrix_sync(a, warp_p_lo + k * kTile, kKeys);
            wmma::mma_sync(acc, a, b, acc);
          }
          wmma::store_matrix_sync(warp_o + dt * kTile, acc, kD, wmma::mem_row_major);
        }
        __syncthreads();  // every warp is done with the step's keys and values
      }
      // A row's own key is always in its range, so l > 0. Written a row at a time, as the
      // rescale above (consecutive lanes on consecutive floats, coalesced stores).
#pragma unroll
      for (int r = 0; r < kTile; ++r) {
        const float row_m = __shfl_sync(0xffffffffu, m, 2 * r);
        const float row_l = __shfl_sync(0xffffffffu, l, 2 * r) + SinkMass(sh.sinks, h, row_m);
        if (warp * kTile + r >= rows) continue;  // the same for every lane
        const float* o_row = warp_o + r * kD;
        float* dst = out + ((seq.q_begin + i0 + warp * kTile + r) * sh.q_heads + h) * kD;
        for (int e = lane; e < kD; e += kWarp) dst[e] = o_row[e] / row_l;
      }
    }
  }
#endif
}

// seqs, num_seqs: the sequences the grid spans (the batch's, from its first long one to its last).
template <int kD>
cudaError_t LaunchMma(const AttentionParams& p, const AttnSeq* seqs, int64_t num_seqs, int64_t max_q_len,
                      cudaStream_t stream) {
  const size_t shared = MmaSharedBytes(kD);
  auto* kernel = MmaPrefillAttentionKernel<kD>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(shared));
      err != cudaSuccess) {
    return err;
  }
  const MmaShape sh{.block_size = p.cache.block_size,
                    .q_heads = p.q_heads,
                    .kv_heads = p.cache.kv_heads,
                    .sliding_window = p.sliding_window,
                    .chunk_size = p.chunk_size,
                    .scale = p.scale,
                    .softcap = p.softcap,
                    .sinks = p.sinks};
  const dim3 grid(GridFor((max_q_len + kRows - 1) / kRows), static_cast<unsigned>(p.q_heads), GridFor(num_seqs));
  if (cudaError_t err = pdl::Launch(kernel, grid, kThreads, shared, stream, p.q, p.out, seqs, num_seqs,
                                    p.paged.block_table, static_cast<const Bf16*>(p.cache.k),
                                    static_cast<const Bf16*>(p.cache.v), sh);
      err != cudaSuccess) {
    return err;
  }
  return cudaGetLastError();
}

bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

bool MmaAttentionApplies(const AttentionParams& p, int compute_major) {
  if (compute_major < 8 || p.cache.dtype != DType::kBF16 || p.q_heads > kMaxGrid) return false;
  if (p.cache.head_dim != 64 && p.cache.head_dim != 128) return false;
  if (!Aligned16(p.cache.k) || !Aligned16(p.cache.v)) return false;
  return p.paged.MaxQueryLen() >= kMinMmaAttentionRows;
}

size_t MmaAttentionSharedBytes(int64_t head_dim) { return MmaSharedBytes(static_cast<int>(head_dim)); }

cudaError_t LaunchMmaAttention(const AttentionParams& p, cudaStream_t stream) {
  // The sequences from the first of at least kMinMmaAttentionRows rows to the last: blocks of the
  // decode rows around them would only return (a step's prefill chunks usually sit together, so
  // the grid then has none of theirs).
  int64_t first = -1, last = -1;
  for (int64_t s = 0; s < p.paged.num_seqs; ++s) {
    if (p.paged.host_seqs[s].q_len < kMinMmaAttentionRows) continue;
    if (first < 0) first = s;
    last = s;
  }
  if (first < 0 || p.q_heads == 0) return cudaSuccess;
  const int64_t max_q_len = p.paged.MaxQueryLen();
  const AttnSeq* seqs = p.paged.seqs + first;
  const int64_t num_seqs = last - first + 1;
  switch (p.cache.head_dim) {
    case 64:
      return LaunchMma<64>(p, seqs, num_seqs, max_q_len, stream);
    case 128:
      return LaunchMma<128>(p, seqs, num_seqs, max_q_len, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace shardserve::kernels::cuda
