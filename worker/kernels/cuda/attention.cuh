// Paged causal attention on CUDA, split-K over the keys ("flash-decoding"). Internal to
// worker/kernels/cuda: only cuda_backend.cu includes this header.
//
// One block computes, for one query row of one sequence and one kv head, the attention of up to
// kMaxHeadsPerBlock query heads of that kv head's group over one split of the row's keys: each key
// row of K and V is read once for all those heads (GQA reuse), the block's warps take every
// kAttnWarps-th chunk of 32 keys (each lane scores one key of the chunk, then the lanes sum the
// chunk's value rows over head_dim; head_dim above kMaxChunkedHeadDim: every kAttnWarps-th key,
// lanes over head_dim) with an online softmax each, and the warps' states are merged in shared
// memory (kernels/shared/attention_math.h). With one split the block writes the output; with several,
// each block writes its state (m, l, acc) to the partials workspace, fences, and counts itself in
// on an arrival counter of its (row, kv head, head block); the block that arrives last merges the
// splits of its heads into the output, in the same launch (a second launch would add its fixed
// latency, ~2.5 us, to every decode step's layer). The counters live in a small device workspace the
// caller zeroes once (AttentionCounterCount); each launch leaves them at zero again (the last
// arrival's atomicInc wraps the count), so back-to-back launches and CUDA-graph replays need no
// reset. Splitting keeps all multiprocessors busy when a decode batch has few rows and long
// contexts; nothing the size of the context is ever materialised. The cache's elements (f32, bf16,
// f16, or FP8 e4m3 codes: kv_cache.cuh) are widened to f32 as they are read; key rows of 16-byte
// multiples (head_dim a multiple of 4, 8 or 16 elements) take 16-byte loads.
//
// Dispatch (CudaBackend::Attention): a step's sequences of at least kMinMmaAttentionRows new rows go
// to the tensor-core kernel below where it applies (MmaAttentionApplies), the others to this one.
// A continuous-batching step that mixes a prefill chunk with decode rows is then two launches on
// the stream, which write disjoint rows of the output and share the device-side sequence array:
// each kernel skips the other's sequences (by q_len, a whole block at a time, before it touches
// shared memory, partials or counters), and the plan below counts only the rows this kernel takes,
// so a few decode rows beside a long prefill still split their keys over the machine instead of
// each walking its whole context in a 64-row tile of the tensor-core kernel. A batch whose
// sequences are all long, or all short, is one launch as before. Sizes come from the host copy of
// the sequences (PagedSeqs::host_seqs), which must match the device's, as for every launch here.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_ATTENTION_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_ATTENTION_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "worker/kernels/backend.h"

namespace shardserve::kernels::cuda {

inline constexpr int kAttnWarps = 4;
inline constexpr int kMaxHeadsPerBlock = 8;
// The largest head_dim of the chunked kernel (lanes score one key each); larger ones walk the keys
// one at a time.
inline constexpr int64_t kMaxChunkedHeadDim = 256;
inline constexpr int kMaxAttnSplits = 32;
// Partial states the split path may keep at once (slots x q_heads x splits: AttentionPlan); beyond
// it, fewer splits.
inline constexpr int64_t kMaxAttnPartials = 1 << 16;

// Every sequence, whatever its new rows (PlanAttention's max_q_len without the tensor-core kernel).
inline constexpr int64_t kAnyQueryLen = INT32_MAX;

struct AttentionPlan {
  int heads_per_block = 1;  // query heads of one group per block
  int splits = 1;           // blocks per (row, kv head, head block) over the keys
  // The sequences the kernel takes: those of at most max_q_len new rows. The others (a prefill
  // beside decode rows) are the tensor-core kernel's: every block skips them.
  int32_t max_q_len = static_cast<int32_t>(kAnyQueryLen);
  // Where a row's partial states and arrival counter live. 0: at its token (rows of [tokens,
  // q_heads]). > 0: row i of sequence s at slot s * slot_stride + i, slot_stride being the most rows
  // of a sequence taken ([num_seqs * slot_stride, q_heads]): when the kernel takes a batch's decode
  // rows but not its prefill, a workspace the size of the decode rows instead of the step's tokens,
  // so that the cap below (kMaxAttnPartials) leaves them their splits.
  int slot_stride = 0;
};

// Chooses heads per block (as many of a group as fit in 48 KiB of shared memory, at most 8, halved
// while the blocks would not reach two per multiprocessor) and
// splits (enough blocks for two per multiprocessor, at most one per 128 keys of the longest row,
// at most kMaxAttnSplits, within kMaxAttnPartials) for the rows of the sequences of at most
// `max_q_len` new rows (the blocks and the longest context counted over those alone). When that
// leaves out some of the batch's sequences, slots are per sequence where num_seqs x the most rows
// taken is at most the batch's tokens (else per token), and the cap counts the slots: the partials
// and counters then never need more than a plan over the whole batch could (so within what
// CudaBackend::Reserve sizes for its tokens). heads_per_block = 0 when even one head does not fit
// (head_dim above about 2400): the backend refuses the op.
AttentionPlan PlanAttention(const AttentionParams& p, int multiprocessors, int64_t max_q_len = kAnyQueryLen);

// Floats of partials workspace a plan needs: 0 for one split, else slots x q_heads x splits x
// (head_dim + 2), the slots being the batch's tokens or num_seqs x slot_stride.
size_t AttentionPartialFloats(const AttentionParams& p, const AttentionPlan& plan);
// The most partial floats any Attention within (max_q_heads, max_head_dim) can need.
size_t MaxAttentionPartialFloats(int64_t max_head_dim);

// Arrival counters (unsigned int) a plan needs: 0 for one split, else slots x q_heads (the counter
// of a (row, kv head, head block) is the one of its first query head; the others stay unused, so
// that the kernel indexes them as it does the partials). A plan splits only when slots x q_heads x
// splits <= kMaxAttnPartials (for a plan over every sequence: rows x q_heads x splits, its rows
// being the batch's tokens), so kMaxAttnCounters (128 KiB) always suffice.
size_t AttentionCounterCount(const AttentionParams& p, const AttentionPlan& plan);
inline constexpr int64_t kMaxAttnCounters = kMaxAttnPartials / 2;

// Enqueues the attention of the plan's sequences (one kernel). `partials`: at least
// AttentionPartialFloats() floats; `counters`: at least AttentionCounterCount() counters, all zero
// (zero them once when allocated: every launch leaves them zero). Both may be null when the plan has
// one split; otherwise null is cudaErrorInvalidValue. A launch owns them until it completes:
// launches sharing them must be ordered (one stream), which holds for PDL launches too, since the
// kernel touches them only after pdl::Wait(). A launch that faults may leave counters non-zero (the
// context is lost anyway).
cudaError_t LaunchAttention(const AttentionParams& p, const AttentionPlan& plan, float* partials,
                            unsigned int* counters, cudaStream_t stream);

// ---- Prefill on tensor cores (attention_mma.cu) ----
// The kernel above scores keys on the CUDA cores one query row at a time, which suits decode rows
// (memory-bound) but makes long prefills compute-bound on scalar FMAs. For the sequences of at least
// kMinMmaAttentionRows new rows, with a bf16 cache and head_dim 64 or 128 on compute capability
// >= 8.0, a block takes 64 query rows of one query head (16 per warp) and walks their keys 32 at a
// time in flash-attention style: scores = q . k^T and out += p . v on tensor cores (16x16x16 bf16
// MMAs, f32 accumulation), the online softmax per row in between (kernels/shared/attention_math.h).
// The f32 operands q and p enter as the sum of two bf16 (the value rounded, then its rounding
// error), each multiplied by the exact bf16 keys and values: about 16 bits of each instead of bf16's
// 8, so the result stays within f32-level tolerance of the CPU backend's. Nothing the size of the
// context is materialised; the block's shared memory holds one 32-key tile and its rows' partial
// output. Shorter sequences (decode rows) would each take a whole 64-row tile for one row and walk
// their context in one block: they are LaunchAttention's (see "Dispatch" above).
inline constexpr int64_t kMinMmaAttentionRows = 16;

// Whether LaunchMmaAttention takes the op's long sequences on a device of compute capability
// `compute_major` (the batch has one of at least kMinMmaAttentionRows rows). Only bf16 caches: f32,
// f16 and FP8 ones take LaunchAttention whatever their rows.
bool MmaAttentionApplies(const AttentionParams& p, int compute_major);
// Dynamic shared memory of its blocks for head_dim (64 or 128): 56 KiB and 96 KiB.
size_t MmaAttentionSharedBytes(int64_t head_dim);
// Enqueues it for the sequences of at least kMinMmaAttentionRows rows (MmaAttentionApplies must
// hold); the others' rows are left untouched, for LaunchAttention with a plan of max_q_len =
// kMinMmaAttentionRows - 1. The grid spans the sequences from the first long one to the last (the
// blocks of short ones in between return at once), so a prefill chunk placed beside decode rows
// costs no blocks for them.
cudaError_t LaunchMmaAttention(const AttentionParams& p, cudaStream_t stream);

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_ATTENTION_CUH_
