// The block-level arithmetic of flash-style attention, shared by the CUDA kernel (which runs it per
// warp and per split of the keys, "flash-decoding") and the CPU tests that check it against the
// CPU backend. Every function is SHARDSERVE_HD, allocates nothing and has no failure mode.
//
// A softmax state summarises a run of keys for one query head: m = the largest score seen
// (-inf before any key), l = sum of exp(score - m), and acc[e] = sum of exp(score - m) * v[e].
// The attention output of the run is acc / l. Two runs' states combine exactly (up to rounding)
// by rescaling each to the larger m, which is what lets the keys be split across warps and
// blocks and merged afterwards.
#ifndef SHARDSERVE_WORKER_KERNELS_SHARED_ATTENTION_MATH_H_
#define SHARDSERVE_WORKER_KERNELS_SHARED_ATTENTION_MATH_H_

#include <cmath>

#include "worker/kernels/shared/row_math.h"

namespace shardserve::kernels {

// Adds one key with `score` to the state (m, l): updates them and returns in `*rescale` the factor
// the caller applies to its acc before adding `*weight` * v (acc = acc * rescale + weight * v).
// The first key of a run (m = -inf) gets rescale 0.
SHARDSERVE_HD void OnlineSoftmaxStep(float score, float* m, float* l, float* rescale, float* weight) {
  const float m_new = *m > score ? *m : score;
  *rescale = *l > 0.f ? expf(*m - m_new) : 0.f;
  *weight = expf(score - m_new);
  *l = *l * *rescale + *weight;
  *m = m_new;
}

// The online softmax over a chunk of keys scored at once (the CUDA kernel's lanes score one key
// each): raises the running maximum *m to include the chunk's largest score and returns the factor
// by which the running l and acc are scaled first (0 while they hold no key). The chunk's weights
// are then expf(score - *m), and their sum is added to the scaled l.
SHARDSERVE_HD float SoftmaxChunkRescale(float chunk_max, float* m, float l) {
  const float m_new = *m > chunk_max ? *m : chunk_max;
  const float rescale = l > 0.f ? expf(*m - m_new) : 0.f;
  *m = m_new;
  return rescale;
}

// Merges `n` states: state i has m = ml[i * stride] and l = ml[i * stride + 1] (states with l = 0
// hold no keys and are ignored). Writes scales[i] (0 for empty states) such that the merged acc is
// sum_i scales[i] * acc_i, and returns the merged l (0 when every state is empty); the merged m
// goes to `*m_out` when it is not null. scales: [n].
SHARDSERVE_HD float MergeSoftmaxStates(const float* ml, int n, int stride, float* scales, float* m_out) {
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) {
    const float mi = ml[i * stride];
    if (ml[i * stride + 1] > 0.f && mi > m) m = mi;
  }
  float l = 0.f;
  for (int i = 0; i < n; ++i) {
    const float li = ml[i * stride + 1];
    scales[i] = li > 0.f ? expf(ml[i * stride] - m) : 0.f;
    l += li * scales[i];
  }
  if (m_out != nullptr) *m_out = m;
  return l;
}

// One element of the merged acc of `n` states, state i's element being acc[i * stride]: the sum of
// acc[i * stride] * scales[i] in order of i, with the scales MergeSoftmaxStates wrote. The merged
// output element is it over the merged l. The CUDA kernel merges its warps and then, in the block
// that arrives last, its splits with it.
SHARDSERVE_HD float MergeAccElement(const float* acc, int n, int stride, const float* scales) {
  float o = 0.f;
  for (int i = 0; i < n; ++i) o += acc[i * stride] * scales[i];
  return o;
}

// The softmax mass of head `head`'s attention sink (ModelSpec::attention_sinks) against a state
// whose maximum score is m: e^(sink - m), added to the state's l before the output is divided by
// it, so that the sink takes its share of the softmax and brings no value. 0 without sinks.
SHARDSERVE_HD float SinkMass(const float* sinks, long long head, float m) {
  return sinks != nullptr ? expf(sinks[head] - m) : 0.f;
}

// How the keys [lo, pos] of one query row are split: split `split` of `splits` covers
// [*begin, *end) (possibly empty). Splits are contiguous and in order, of equal length but the
// last.
SHARDSERVE_HD void SplitKeys(long long lo, long long pos, int splits, int split, long long* begin, long long* end) {
  const long long n = pos + 1 - lo;
  const long long chunk = (n + splits - 1) / splits;
  long long b = lo + chunk * split;
  long long e = b + chunk;
  if (b > pos + 1) b = pos + 1;
  if (e > pos + 1) e = pos + 1;
  *begin = b;
  *end = e;
}

// The row of the paged cache that holds position `pos` of a sequence whose block table is `table`
// (blocks of block_size positions).
SHARDSERVE_HD long long PagedCacheRow(const int* table, long long pos, long long block_size) {
  return static_cast<long long>(table[pos / block_size]) * block_size + pos % block_size;
}

// The first key a query at position `pos` attends to: 0, or within a sliding window of `window`
// keys (pos - window + 1, when window > 0), or within its chunk of `chunk` positions (pos - pos %
// chunk, when chunk > 0), whichever is latest. Never decreases as pos grows, so the first row of a
// run of consecutive positions has the run's smallest.
SHARDSERVE_HD long long AttentionFirstKey(long long pos, long long window, long long chunk) {
  long long lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
  if (chunk > 0 && pos - pos % chunk > lo) lo = pos - pos % chunk;
  return lo;
}

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_WORKER_KERNELS_SHARED_ATTENTION_MATH_H_
