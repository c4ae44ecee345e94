// Kernels of attention.cuh. The per-key and merge arithmetic is kernels/shared/attention_math.h,
// which the CPU tests check against the CPU backend's attention.
#include "worker/kernels/cuda/attention.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "worker/kernels/cuda/kv_cache.cuh"
#include "worker/kernels/cuda/pdl.cuh"
#include "worker/kernels/shared/attention_math.h"

namespace shardserve::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = kAttnWarps * kWarp;
constexpr int64_t kMaxGrid = 65535;
constexpr size_t kSharedBytes = 48 * 1024;
constexpr int64_t kKeysPerSplit = 128;

unsigned GridFor(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}


size_t SharedBytes(int heads, int64_t head_dim) {
  // q [heads, d], acc [warps, heads, d], states [warps, heads, 2], scales [heads, kMaxAttnSplits]
  // (a head's warps, or its splits), l [heads].
  static_assert(kAttnWarps <= kMaxAttnSplits, "the scales hold a head's warps or its splits");
  const size_t d = static_cast<size_t>(head_dim);
  const size_t h = static_cast<size_t>(heads);
  return ((kAttnWarps + 1) * h * d + 2 * kAttnWarps * h + kMaxAttnSplits * h + h) * sizeof(float);
}

struct Shape {
  int64_t block_size, q_heads, kv_heads, head_dim, sliding_window;
  int64_t chunk_size;  // > 0: keys from pos - pos % chunk_size only (Llama-4)
  float scale;
  float softcap;  // > 0: scores soft-capped (Gemma-2)
  const float* sinks;  // [q_heads] or null (AttentionParams::sinks)
  int heads_per_block, head_blocks, splits;
  int max_q_len;    // sequences with more new rows are another kernel's (AttentionPlan::max_q_len)
  int slot_stride;  // AttentionPlan::slot_stride
};

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// How a warp walks its keys.
enum class KeyWalk {
  kPerKey,         // one key at a time, lanes over head_dim (any head_dim)
  kChunked,        // kWarp keys at a time, one per lane (head_dim <= kMaxChunkedHeadDim)
  kChunkedVector,  // kChunked with 16-byte loads of each key row (head_dim a multiple of 16 bytes)
};

// dots[hh] = q_s[hh] . kj for the block's heads, kj being one key row of the cache (head_dim
// d <= kMaxD; T a cache element type of kv_cache.cuh). The vector walk issues the row's 16-byte loads
// kBatch at a time, all of a batch before its first product (a run-time loop over d would wait for
// each load in turn: head_dim 64 in bf16 and 128 in fp8 are one batch); the sums are in the same
// order either way. A load holds 16 / sizeof(T) elements: 4 f32, 8 bf16/f16, 16 fp8 codes.
template <typename T, KeyWalk kWalk, int kMaxD>
__device__ __forceinline__ void DotHeads(const T* __restrict__ kj, const float* q_s, int64_t d, int nh,
                                         float (&dots)[kMaxHeadsPerBlock]) {
#pragma unroll
  for (int hh = 0; hh < kMaxHeadsPerBlock; ++hh) dots[hh] = 0.f;
  if constexpr (kWalk == KeyWalk::kChunkedVector) {
    constexpr int kN = 16 / sizeof(T);
    constexpr int kLoads = (kMaxD + kN - 1) / kN;
    constexpr int kMaxBatch = sizeof(T) == 4 ? 4 : 8;  // f32 rows: fewer at once, or the registers spill
    constexpr int kBatch = kLoads < kMaxBatch ? kLoads : kMaxBatch;
    for (int base = 0; base < kLoads; base += kBatch) {
      uint4 raw[kBatch];
#pragma unroll
      for (int v = 0; v < kBatch; ++v) {
        const int64_t e = int64_t{base + v} * kN;
        raw[v] = e < d ? *reinterpret_cast<const uint4*>(kj + e) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int v = 0; v < kBatch; ++v) {
        const int64_t e = int64_t{base + v} * kN;
        if (e >= d) break;
        const T* kv = reinterpret_cast<const T*>(&raw[v]);
        float kf[kN];
#pragma unroll
        for (int i = 0; i < kN; ++i) kf[i] = Widen(kv[i]);
#pragma unroll
        for (int hh = 0; hh < kMaxHeadsPerBlock; ++hh) {
          if (hh < nh) {
            const float* qh = q_s + hh * d + e;  // every lane reads the same address: a broadcast
#pragma unroll
            for (int i = 0; i < kN; ++i) dots[hh] += qh[i] * kf[i];
          }
        }
      }
    }
  } else {
    for (int64_t e = 0; e < d; ++e) {
      const float kf = Widen(kj[e]);
#pragma unroll
      for (int hh = 0; hh < kMaxHeadsPerBlock; ++hh) {
        if (hh < nh) dots[hh] += q_s[hh * d + e] * kf;
      }
    }
  }
}

// grid.x = kv head x head block x split, grid.y strides over a sequence's rows, grid.z over
// sequences (those with more than sh.max_q_len rows skipped). partials: [slots, q_heads, splits,
// head_dim + 2] (acc, then m and l), or null when splits == 1 (then the output is written directly).
// counters: [slots, q_heads] arrival counts, zero on entry and on exit (null with partials), the one
// of a (row, kv head, head block) at its first query head h0: the last split block of it to store
// its states merges all the splits into the output (attention.cuh). A row's slot is its token, or
// with sh.slot_stride > 0 its sequence's index x slot_stride + its index in the sequence.
// kDpl: head_dim elements per lane in the chunked walks (head_dim <= kDpl * kWarp).
// Blocks per multiprocessor asked of ptxas, which otherwise picks a register budget by its own
// occupancy heuristics: the scalar chunked walk three (at most 168 registers; left to itself, ptxas
// squeezed it into 128 and spilled in the key loop), the per-key walk four (128, as it had before
// the split merge moved into this kernel). The vector walk over an FP8 cache three up to head_dim 128
// (kDpl <= 4): left to itself, ptxas gave it 178 registers at head_dim 128 on sm_90 (two blocks per
// multiprocessor where the bf16 walk, at 168, fits three); under the bound it takes 160 (sm_80: 168)
// without spilling. At head_dim 256 the bound spills, so that walk keeps ptxas's choice (two blocks,
// like the 16-bit ones), as do the other vector walks. Check `-Xptxas -v` for spills after changing
// the kernel.
template <typename T, KeyWalk kWalk, int kDpl>
constexpr int kMinBlocksPerSm = kWalk == KeyWalk::kChunked ? 3
                                : kWalk == KeyWalk::kPerKey ? 4
                                : sizeof(T) == 1 && kDpl <= 4 ? 3
                                                              : 1;

template <typename T, KeyWalk kWalk, int kDpl>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<T, kWalk, kDpl>)
    SplitAttentionKernel(const float* __restrict__ q, float* __restrict__ out, const AttnSeq* __restrict__ seqs,
                         int64_t num_seqs, const int32_t* __restrict__ block_table, const T* __restrict__ cache_k,
                         const T* __restrict__ cache_v, Shape sh, float* __restrict__ partials,
                         unsigned int* __restrict__ counters) {
  pdl::LaunchDependents();
  pdl::Wait();
  extern __shared__ float smem[];
  const int hpb = sh.heads_per_block;
  const int64_t d = sh.head_dim;
  float* q_s = smem;                                // [hpb, d]
  float* acc_s = q_s + hpb * d;                     // [warps, hpb, d]
  float* state_s = acc_s + kAttnWarps * hpb * d;    // [warps, hpb, 2]
  float* scale_s = state_s + kAttnWarps * hpb * 2;  // [hpb, kMaxAttnSplits]
  float* l_s = scale_s + hpb * kMaxAttnSplits;      // [hpb]
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int split = static_cast<int>(blockIdx.x % sh.splits);
  const int head_block = static_cast<int>((blockIdx.x / sh.splits) % sh.head_blocks);
  const int64_t g = blockIdx.x / (static_cast<int64_t>(sh.splits) * sh.head_blocks);
  const int64_t group = sh.q_heads / sh.kv_heads;
  const int64_t h0 = g * group + int64_t{head_block} * hpb;
  const int nh = static_cast<int>(group - int64_t{head_block} * hpb < hpb ? group - int64_t{head_block} * hpb : hpb);
  const int64_t row = sh.kv_heads * d;
  float* my_acc = acc_s + warp * hpb * d;
  for (int64_t s = blockIdx.z; s < num_seqs; s += gridDim.z) {
    const AttnSeq seq = seqs[s];
    // The tensor-core kernel's sequence (a prefill beside this launch's decode rows). The whole
    // block skips it, as does every split block of its rows: their counters are never touched, so
    // they stay at zero.
    if (seq.q_len > sh.max_q_len) continue;
    const int32_t* table = block_table + seq.table_begin;
    for (int64_t i = blockIdx.y; i < seq.q_len; i += gridDim.y) {
      const int64_t t = seq.q_begin + i;
      const int64_t slot = sh.slot_stride > 0 ? s * sh.slot_stride + i : t;
      const int64_t pos = seq.pos_begin + i;
      const int64_t lo = AttentionFirstKey(pos, sh.sliding_window, sh.chunk_size);
      long long kb = 0, ke = 0;
      SplitKeys(lo, pos, sh.splits, split, &kb, &ke);
      __syncthreads();  // the previous row is done with the shared arrays
      const float* qh = q + (t * sh.q_heads + h0) * d;
      for (int64_t e = threadIdx.x; e < nh * d; e += blockDim.x) q_s[e] = qh[e];
      if constexpr (kWalk == KeyWalk::kPerKey) {
        for (int64_t e = lane; e < nh * d; e += kWarp) my_acc[e] = 0.f;
      }
      __syncthreads();
      float m[kMaxHeadsPerBlock], l[kMaxHeadsPerBlock];
#pragma unroll
      for (int hh = 0; hh < kMaxHeadsPerBlock; ++hh) {
        m[hh] = -INFINITY;
        l[hh] = 0.f;
      }
      if constexpr (kWalk == KeyWalk::kPerKey) {
        // Warp-uniform loop: every lane of a warp sees the same key j.
        for (long long j = kb + warp; j < ke; j += kAttnWarps) {
          const int64_t cache_row = PagedCacheRow(table, j, sh.block_size);
          const T* kj = cache_k + cache_row * row + g * d;
          const T* vj = cache_v + cache_row * row + g * d;
#pragma unroll
          for (int hh = 0; hh < kMaxHeadsPerBlock; ++hh) {
            if (hh < nh) {
              float dot = 0.f;
              for (int64_t e = lane; e < d; e += kWarp) dot += q_s[hh * d + e] * Widen(kj[e]);
              const float raw = WarpSum(dot) * sh.scale;
              const float score = sh.softcap > 0.f ? SoftCap(raw, sh.softcap) : raw;
              float rescale = 0.f, weight = 0.f;
              OnlineSoftmaxStep(score, &m[hh], &l[hh], &rescale, &weight);
              float* acc = my_acc + hh * d;
              for (int64_t e = lane; e < d; e += kWarp) acc[e] = acc[e] * rescale + weight * Widen(vj[e]);
            }
          }
        }
      } else {
        // Chunks of kWarp keys: each lane scores one key of the chunk for every head (its whole key
        // row, so the loads of the chunk's rows are all in flight at once); then, lanes over
        // head_dim, the chunk's value rows are summed with the weights taken from the lanes that
        // scored them. acc[hh][k] holds element lane + k * kWarp of head hh.
        float acc[kMaxHeadsPerBlock][kDpl];
#pragma unroll
        for (int hh = 0; hh < kMaxHeadsPerBlock; ++hh) {
#pragma unroll
          for (int k = 0; k < kDpl; ++k) acc[hh][k] = 0.f;
        }
        // Value rows loaded per group, all before the group's sums.
        constexpr int kGroup = kDpl == 2 ? 16 : 16 / kDpl;
        for (long long c = kb + int64_t{warp} * kWarp; c < ke; c += int64_t{kAttnWarps} * kWarp) {
          const long long j = c + lane;
          const bool valid = j < ke;
          const int64_t cache_row = valid ? PagedCacheRow(table, j, sh.block_size) : 0;
          float dots[kMaxHeadsPerBlock];
          DotHeads<T, kWalk, kDpl * kWarp>(cache_k + cache_row * row + g * d, q_s, d, valid ? nh : 0, dots);
          float p[kMaxHeadsPerBlock];
#pragma unroll
          for (int hh = 0; hh < kMaxHeadsPerBlock; ++hh) {
            p[hh] = 0.f;
            if (hh < nh) {
              const float scaled = dots[hh] * sh.scale;
              const float score = valid ? (sh.softcap > 0.f ? SoftCap(scaled, sh.softcap) : scaled) : -INFINITY;
              const float rescale = SoftmaxChunkRescale(WarpMax(score), &m[hh], l[hh]);
              p[hh] = valid ? expf(score - m[hh]) : 0.f;
              l[hh] = l[hh] * rescale + WarpSum(p[hh]);
#pragma unroll
              for (int k = 0; k < kDpl; ++k) acc[hh][k] *= rescale;
            }
          }
          // Keys past the chunk's end (the group's tail) have weight 0 and read row 0 of the cache,
          // in bounds; their values count as 0, so no stale Inf/NaN there can leak in as 0 * Inf.
          const int n = static_cast<int>(ke - c < kWarp ? ke - c : kWarp);
          for (int j0 = 0; j0 < n; j0 += kGroup) {
            float v[kGroup][kDpl];
#pragma unroll
            for (int u = 0; u < kGroup; ++u) {
              const int64_t vrow = __shfl_sync(0xffffffffu, cache_row, (j0 + u) % kWarp);
              const T* vj = cache_v + vrow * row + g * d;
              const bool key = j0 + u < n;
#pragma unroll
              for (int k = 0; k < kDpl; ++k) {
                const int64_t e = lane + int64_t{k} * kWarp;
                v[u][k] = key && e < d ? Widen(vj[e]) : 0.f;
              }
            }
#pragma unroll
            for (int u = 0; u < kGroup; ++u) {
#pragma unroll
              for (int hh = 0; hh < kMaxHeadsPerBlock; ++hh) {
                if (hh < nh) {
                  const float w = __shfl_sync(0xffffffffu, p[hh], (j0 + u) % kWarp);
#pragma unroll
                  for (int k = 0; k < kDpl; ++k) acc[hh][k] += w * v[u][k];
                }
              }
            }
          }
        }
#pragma unroll
        for (int hh = 0; hh < kMaxHeadsPerBlock; ++hh) {
          if (hh < nh) {
#pragma unroll
            for (int k = 0; k < kDpl; ++k) {
              const int64_t e = lane + int64_t{k} * kWarp;
              if (e < d) my_acc[hh * d + e] = acc[hh][k];
            }
          }
        }
      }
      if (lane == 0) {
#pragma unroll
        for (int hh = 0; hh < kMaxHeadsPerBlock; ++hh) {
          if (hh < nh) {
            state_s[(warp * hpb + hh) * 2] = m[hh];
            state_s[(warp * hpb + hh) * 2 + 1] = l[hh];
          }
        }
      }
      __syncthreads();
      // Merge states, one thread per head computing the scales (MergeSoftmaxStates), then every
      // thread its elements. Pass 0 merges the block's warps (state_s, acc_s) into the output (one
      // split) or into this split's partial state. Pass 1 runs only in the split block that arrives
      // last for its (row, kv head, head block): it merges every split's partial state of its
      // heads into the output. One code for both keeps the kernel's registers where they were
      // (a separate merge loop made ptxas spill in the key loops). State i of head hh: m at
      // ml[hh * ml_head + i * ml_src], l after it; its acc at acc[hh * acc_head + i * acc_src + e].
      const int64_t part_row = (slot * sh.q_heads + h0) * sh.splits * (d + 2);  // partials of head h0
      const float* ml = state_s;
      const float* accs = acc_s;
      // 32-bit offsets (head_dim <= ~2400, splits <= 32): 64-bit ones cost registers here.
      const int di = static_cast<int>(d);
      int ml_head = 2, ml_src = hpb * 2, acc_head = di, acc_src = hpb * di;
      int n = kAttnWarps;
      for (int pass = 0;; ++pass) {
        const bool to_out = pass == 1 || partials == nullptr;
        if (threadIdx.x < nh) {
          const int hh = static_cast<int>(threadIdx.x);
          float m_all = 0.f;
          l_s[hh] = MergeSoftmaxStates(ml + hh * ml_head, n, ml_src, scale_s + hh * kMaxAttnSplits, &m_all);
          if (to_out) {
            l_s[hh] += SinkMass(sh.sinks, h0 + hh, m_all);  // once, on the merged state
          } else {
            float* part = partials + part_row + (int64_t{hh} * sh.splits + split) * (d + 2);
            part[d] = m_all;
            part[d + 1] = l_s[hh];
          }
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < nh * di; idx += blockDim.x) {
          const int hh = idx / di;
          const int e = idx - hh * di;
          const float o = MergeAccElement(accs + hh * acc_head + e, n, acc_src, scale_s + hh * kMaxAttnSplits);
          if (to_out) {
            // The row has key `pos` (in some split), so l > 0.
            out[(t * sh.q_heads + h0 + hh) * d + e] = o / l_s[hh];
          } else {
            partials[part_row + (hh * sh.splits + split) * (di + 2) + e] = o;
          }
        }
        if (to_out) break;
        // Release: every thread fences its stores of the partial state, the barrier orders them
        // before thread 0's fence (cumulative) and its atomic, which counts the block in.
        __threadfence();
        __syncthreads();
        // atomicInc wraps to 0 when it finds splits - 1: the last arrival both learns that it is
        // last and leaves the counter at zero for the next launch or graph replay.
        unsigned int arrived = 0;
        if (threadIdx.x == 0) {
          __threadfence();
          arrived = atomicInc(counters + slot * sh.q_heads + h0, sh.splits - 1u);
          __threadfence();  // acquire: the other splits' states, fenced before they counted in
        }
        if (!__syncthreads_or(threadIdx.x == 0 && arrived == sh.splits - 1u)) break;
        // Acquire for every thread (the barrier carries thread 0's observation). The loads of
        // pass 1 are ordinary ones after this fence, which the memory model makes see the other
        // blocks' stores (fence.sc at gpu scope: no stale L1 line); the fence also keeps the
        // compiler from reusing values loaded earlier.
        __threadfence();
        ml = partials + part_row + d;
        accs = partials + part_row;
        ml_head = acc_head = sh.splits * (di + 2);
        ml_src = acc_src = di + 2;
        n = sh.splits;
      }
    }
  }
}

template <typename T, int kDpl>
void LaunchChunked(bool aligned, const AttentionParams& p, const Shape& sh, dim3 grid, size_t shared, float* partials,
                   unsigned int* counters, cudaStream_t stream) {
  const auto* k = static_cast<const T*>(p.cache.k);
  const auto* v = static_cast<const T*>(p.cache.v);
  if (aligned) {
    pdl::Launch(SplitAttentionKernel<T, KeyWalk::kChunkedVector, kDpl>, grid, kThreads, shared, stream, p.q, p.out,
                p.paged.seqs, p.paged.num_seqs, p.paged.block_table, k, v, sh, partials, counters);
  } else {
    pdl::Launch(SplitAttentionKernel<T, KeyWalk::kChunked, kDpl>, grid, kThreads, shared, stream, p.q, p.out,
                p.paged.seqs, p.paged.num_seqs, p.paged.block_table, k, v, sh, partials, counters);
  }
}

// The attention kernel for the cache's type and head_dim: chunked up to kMaxChunkedHeadDim (with
// 16-byte key loads when every key row is 16-byte aligned: head_dim a multiple of 4 f32, 8 bf16/f16
// or 16 fp8 elements), else one key at a time.
template <typename T>
void LaunchSplit(const AttentionParams& p, const Shape& sh, dim3 grid, size_t shared, float* partials,
                 unsigned int* counters, cudaStream_t stream) {
  const auto* k = static_cast<const T*>(p.cache.k);
  const auto* v = static_cast<const T*>(p.cache.v);
  const bool aligned =
      (p.cache.head_dim * static_cast<int64_t>(sizeof(T))) % 16 == 0 && (reinterpret_cast<uintptr_t>(k) & 15u) == 0;
  const int64_t d = p.cache.head_dim;
  if (d > kMaxChunkedHeadDim) {
    pdl::Launch(SplitAttentionKernel<T, KeyWalk::kPerKey, 1>, grid, kThreads, shared, stream, p.q, p.out, p.paged.seqs,
                p.paged.num_seqs, p.paged.block_table, k, v, sh, partials, counters);
  } else if (d <= 2 * kWarp) {
    LaunchChunked<T, 2>(aligned, p, sh, grid, shared, partials, counters, stream);
  } else if (d <= 4 * kWarp) {
    LaunchChunked<T, 4>(aligned, p, sh, grid, shared, partials, counters, stream);
  } else {
    LaunchChunked<T, 8>(aligned, p, sh, grid, shared, partials, counters, stream);
  }
}


// Rows of the partials and counters of a plan (AttentionPlan::slot_stride).
size_t Slots(const AttentionParams& p, const AttentionPlan& plan) {
  return plan.slot_stride > 0 ? static_cast<size_t>(p.paged.num_seqs) * static_cast<size_t>(plan.slot_stride)
                              : static_cast<size_t>(p.tokens);
}

}  // namespace

AttentionPlan PlanAttention(const AttentionParams& p, int multiprocessors, int64_t max_q_len) {
  AttentionPlan plan;
  plan.max_q_len = static_cast<int32_t>(max_q_len < kAnyQueryLen ? max_q_len : kAnyQueryLen);
  const int64_t group = p.q_heads / p.cache.kv_heads;
  int heads = static_cast<int>(group < kMaxHeadsPerBlock ? group : kMaxHeadsPerBlock);
  while (heads > 0 && SharedBytes(heads, p.cache.head_dim) > kSharedBytes) --heads;
  plan.heads_per_block = heads;
  if (heads == 0) return plan;
  // The rows this launch takes, the longest context among them and the most rows of one sequence.
  int64_t rows = 0, longest = 0, most_rows = 0;
  bool every_seq = true;
  for (int64_t s = 0; s < p.paged.num_seqs; ++s) {
    const AttnSeq& seq = p.paged.host_seqs[s];
    if (seq.q_len > plan.max_q_len) {
      every_seq = false;
      continue;
    }
    rows += seq.q_len;
    const int64_t end = int64_t{seq.pos_begin} + seq.q_len;
    longest = end > longest ? end : longest;
    most_rows = seq.q_len > most_rows ? seq.q_len : most_rows;
  }
  if (p.sliding_window > 0 && longest > p.sliding_window) longest = p.sliding_window;
  if (p.chunk_size > 0 && longest > p.chunk_size) longest = p.chunk_size;
  const int64_t target = 2 * static_cast<int64_t>(multiprocessors > 0 ? multiprocessors : 1);
  // A block walks its heads one after another: with too few blocks for the multiprocessors, fewer
  // heads per block (more blocks, each key row then read by several blocks, from L2).
  while (heads > 1 && rows * p.cache.kv_heads * ((group + heads - 1) / heads) < target) heads = (heads + 1) / 2;
  plan.heads_per_block = heads;
  const int64_t head_blocks = (group + heads - 1) / heads;
  const int64_t blocks = rows * p.cache.kv_heads * head_blocks;
  int64_t splits = blocks >= target ? 1 : (target + blocks - 1) / (blocks > 0 ? blocks : 1);
  const int64_t by_keys = (longest + kKeysPerSplit - 1) / kKeysPerSplit;
  splits = splits < by_keys ? splits : by_keys;
  splits = splits < kMaxAttnSplits ? splits : kMaxAttnSplits;
  // The slots the partials and counters are indexed by: the batch's tokens when it takes every
  // sequence (as Slots() counts them: a direct caller's rows may be fewer). Taking only the short
  // ones (decode rows beside a prefill), per-token slots would size the workspace, and cap the
  // splits, by the prefill's tokens too: slots per sequence instead while they are no more than the
  // tokens (as for decode rows of one token each beside a prefill), so the workspace never outgrows
  // what a plan over the whole batch may use (what Reserve sizes).
  int64_t slots = p.tokens;
  if (!every_seq) {
    if (most_rows > 0 && p.paged.num_seqs * most_rows <= p.tokens) {
      plan.slot_stride = static_cast<int>(most_rows);
      slots = p.paged.num_seqs * most_rows;
    } else {
      slots = p.tokens;
    }
  }
  const int64_t partial_rows = slots * p.q_heads;
  if (partial_rows > 0 && splits * partial_rows > kMaxAttnPartials) splits = kMaxAttnPartials / partial_rows;
  plan.splits = static_cast<int>(splits < 1 ? 1 : splits);
  return plan;
}

size_t AttentionPartialFloats(const AttentionParams& p, const AttentionPlan& plan) {
  if (plan.splits <= 1) return 0;
  return Slots(p, plan) * static_cast<size_t>(p.q_heads) * static_cast<size_t>(plan.splits) *
         static_cast<size_t>(p.cache.head_dim + 2);
}

size_t MaxAttentionPartialFloats(int64_t max_head_dim) {
  return static_cast<size_t>(kMaxAttnPartials) * static_cast<size_t>(max_head_dim + 2);
}

size_t AttentionCounterCount(const AttentionParams& p, const AttentionPlan& plan) {
  if (plan.splits <= 1) return 0;
  return Slots(p, plan) * static_cast<size_t>(p.q_heads);
}

cudaError_t LaunchAttention(const AttentionParams& p, const AttentionPlan& plan, float* partials,
                            unsigned int* counters, cudaStream_t stream) {
  // The most rows of a sequence this launch takes (grid.y).
  int64_t max_q_len = 0;
  for (int64_t s = 0; s < p.paged.num_seqs; ++s) {
    const int64_t q_len = p.paged.host_seqs[s].q_len;
    if (q_len <= plan.max_q_len && q_len > max_q_len) max_q_len = q_len;
  }
  if (max_q_len == 0 || p.q_heads == 0) return cudaSuccess;
  if (plan.splits > 1 && (partials == nullptr || counters == nullptr)) return cudaErrorInvalidValue;
  if (plan.heads_per_block < 1) return cudaErrorInvalidValue;  // no head fits a block's shared memory
  const int64_t group = p.q_heads / p.cache.kv_heads;
  const int head_blocks = static_cast<int>((group + plan.heads_per_block - 1) / plan.heads_per_block);
  const Shape sh{.block_size = p.cache.block_size,
                 .q_heads = p.q_heads,
                 .kv_heads = p.cache.kv_heads,
                 .head_dim = p.cache.head_dim,
                 .sliding_window = p.sliding_window,
                 .chunk_size = p.chunk_size,
                 .scale = p.scale,
                 .softcap = p.softcap,
                 .sinks = p.sinks,
                 .heads_per_block = plan.heads_per_block,
                 .head_blocks = head_blocks,
                 .splits = plan.splits,
                 .max_q_len = plan.max_q_len,
                 .slot_stride = plan.slot_stride};
  // grid.x: kv heads x head blocks x splits, far below 2^31 - 1 for any model.
  const dim3 grid(static_cast<unsigned>(p.cache.kv_heads * head_blocks * plan.splits), GridFor(max_q_len),
                  GridFor(p.paged.num_seqs));
  const size_t shared = SharedBytes(plan.heads_per_block, p.cache.head_dim);
  float* part = plan.splits > 1 ? partials : nullptr;
  unsigned int* count = plan.splits > 1 ? counters : nullptr;
  switch (p.cache.dtype) {
    case DType::kF32:
      LaunchSplit<float>(p, sh, grid, shared, part, count, stream);
      break;
    case DType::kBF16:
      LaunchSplit<__nv_bfloat16>(p, sh, grid, shared, part, count, stream);
      break;
    case DType::kF16:
      LaunchSplit<__half>(p, sh, grid, shared, part, count, stream);
      break;
    case DType::kF8E4M3:
      LaunchSplit<E4M3>(p, sh, grid, shared, part, count, stream);
      break;
    case DType::kQ8:
    case DType::kU8:
    case DType::kMxfp4:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace shardserve::kernels::cuda
