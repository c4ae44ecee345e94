// The block math of the CUDA attention kernel (kernels/shared/attention_math.h), run on the CPU
// the way the kernel runs it — keys split over blocks, each split's keys interleaved over warps,
// warps merged, then splits merged — against the CPU backend's Attention op, the oracle.
#include "worker/kernels/shared/attention_math.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "worker/kernels/backend.h"
#include "worker/kernels/registry.h"

namespace shardserve::kernels {
namespace {

constexpr int kWarps = 4;  // as the CUDA kernel's kAttnWarps

std::vector<float> Random(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

constexpr int kLanes = 32;  // keys per chunk in the chunked kernel (one per lane)

// One query head over keys [lo, pos] of contiguous k, v ([keys, d]), computed as the kernel does:
// per key (each warp takes every kWarps-th key) or `chunked` (each warp takes every kWarps-th
// chunk of kLanes keys, scores them at once and updates its state once per chunk).
std::vector<float> SplitAttention(const float* q, const float* k, const float* v, int d, long long lo, long long pos,
                                  int splits, float scale, bool chunked) {
  std::vector<float> split_states(static_cast<size_t>(splits) * static_cast<size_t>(d + 2));  // acc, m, l
  for (int sp = 0; sp < splits; ++sp) {
    long long kb = 0, ke = 0;
    SplitKeys(lo, pos, splits, sp, &kb, &ke);
    float warp_state[kWarps * 2];
    std::vector<float> warp_acc(static_cast<size_t>(kWarps * d), 0.f);
    for (int w = 0; w < kWarps; ++w) {
      float m = -INFINITY, l = 0.f;
      for (long long c = kb + w * kLanes; chunked && c < ke; c += kWarps * kLanes) {
        const long long n = std::min<long long>(kLanes, ke - c);
        float scores[kLanes];
        float chunk_max = -INFINITY;
        for (long long j = 0; j < n; ++j) {
          float dot = 0.f;
          for (int e = 0; e < d; ++e) dot += q[e] * k[(c + j) * d + e];
          scores[j] = dot * scale;
          chunk_max = std::max(chunk_max, scores[j]);
        }
        const float rescale = SoftmaxChunkRescale(chunk_max, &m, l);
        float sum = 0.f;
        for (int e = 0; e < d; ++e) warp_acc[w * d + e] *= rescale;
        for (long long j = 0; j < n; ++j) {
          const float weight = std::exp(scores[j] - m);
          sum += weight;
          for (int e = 0; e < d; ++e) warp_acc[w * d + e] += weight * v[(c + j) * d + e];
        }
        l = l * rescale + sum;
      }
      for (long long j = kb + w; !chunked && j < ke; j += kWarps) {
        float dot = 0.f;
        for (int e = 0; e < d; ++e) dot += q[e] * k[j * d + e];
        float rescale = 0.f, weight = 0.f;
        OnlineSoftmaxStep(dot * scale, &m, &l, &rescale, &weight);
        for (int e = 0; e < d; ++e) warp_acc[w * d + e] = warp_acc[w * d + e] * rescale + weight * v[j * d + e];
      }
      warp_state[w * 2] = m;
      warp_state[w * 2 + 1] = l;
    }
    float scales[kWarps];
    float m_all = 0.f;
    const float l_all = MergeSoftmaxStates(warp_state, kWarps, 2, scales, &m_all);
    float* out = split_states.data() + static_cast<size_t>(sp) * (d + 2);
    for (int e = 0; e < d; ++e) out[e] = MergeAccElement(warp_acc.data() + e, kWarps, d, scales);
    out[d] = m_all;
    out[d + 1] = l_all;
  }
  std::vector<float> scales(static_cast<size_t>(splits));
  const float total = MergeSoftmaxStates(split_states.data() + d, splits, d + 2, scales.data(), nullptr);
  std::vector<float> result(static_cast<size_t>(d));
  for (int e = 0; e < d; ++e) {
    result[e] = MergeAccElement(split_states.data() + e, splits, d + 2, scales.data()) / total;
  }
  return result;
}

struct Case {
  int keys, splits, window;
  bool chunked;
};

class AttentionMathTest : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionMathTest, SplitAndMergedStatesEqualTheCpuBackend) {
  const Case c = GetParam();
  const int d = 40;
  const int64_t block = 16;
  const int64_t blocks = (c.keys + block - 1) / block;
  // One sequence decoding its last position; its cache in blocks [0, blocks) in order, one kv head.
  const auto q = Random(static_cast<size_t>(d), 1, -2.f, 2.f);
  auto k = Random(static_cast<size_t>(blocks * block * d), 2, -2.f, 2.f);
  auto v = Random(static_cast<size_t>(blocks * block * d), 3, -1.f, 1.f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const long long pos = c.keys - 1;
  const long long lo = c.window > 0 ? std::max<long long>(0, pos - c.window + 1) : 0;
  const std::vector<float> got = SplitAttention(q.data(), k.data(), v.data(), d, lo, pos, c.splits, scale, c.chunked);

  auto cpu = CreateBackend({});
  ASSERT_TRUE(cpu.ok());
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) table[static_cast<size_t>(b)] = static_cast<int32_t>(b);
  const AttnSeq seq{.q_begin = 0, .q_len = 1, .pos_begin = static_cast<int32_t>(pos), .table_begin = 0,
                    .table_len = static_cast<int32_t>(blocks)};
  std::vector<float> want(static_cast<size_t>(d));
  ASSERT_TRUE((*cpu)->Attention({.q = q.data(),
                                 .out = want.data(),
                                 .paged = {.seqs = &seq, .host_seqs = &seq, .num_seqs = 1, .block_table = table.data(),
                                           .host_block_table = table.data(), .table_entries = blocks},
                                 .tokens = 1,
                                 .q_heads = 1,
                                 .cache = {.k = k.data(), .v = v.data(), .num_blocks = blocks, .block_size = block,
                                           .kv_heads = 1, .head_dim = d},
                                 .scale = scale,
                                 .sliding_window = c.window})
                  .ok());
  float max_ref = 0.f;
  for (float w : want) max_ref = std::max(max_ref, std::fabs(w));
  for (int e = 0; e < d; ++e) EXPECT_NEAR(got[e], want[e], 1e-5f * max_ref + 1e-7f) << "element " << e;
}

// More splits than keys (empty splits), one key, windows, and long rows; per key and chunked
// (partial chunks, empty warps, several chunks per warp).
INSTANTIATE_TEST_SUITE_P(
    Splits, AttentionMathTest,
    ::testing::Values(Case{1, 1, 0, false}, Case{1, 4, 0, false}, Case{3, 8, 0, false}, Case{5, 2, 0, false},
                      Case{128, 1, 0, false}, Case{129, 2, 0, false}, Case{1000, 8, 0, false},
                      Case{1000, 32, 0, false}, Case{2047, 16, 300, false}, Case{700, 5, 64, false},
                      Case{1, 1, 0, true}, Case{3, 8, 0, true}, Case{33, 1, 0, true}, Case{129, 2, 0, true},
                      Case{1000, 1, 0, true}, Case{1000, 8, 0, true}, Case{2047, 16, 300, true},
                      Case{700, 5, 64, true}),
    [](const auto& test_info) {
      return std::string(test_info.param.chunked ? "chunked_" : "per_key_") + "keys" +
             std::to_string(test_info.param.keys) + "_splits" + std::to_string(test_info.param.splits) + "_window" +
             std::to_string(test_info.param.window);
    });

TEST(SplitKeysTest, SplitsCoverTheRowOnceInOrder) {
  for (long long lo : {0LL, 7LL}) {
    for (long long pos = lo; pos < lo + 70; ++pos) {
      for (int splits : {1, 2, 3, 7, 32, 100}) {
        long long next = lo;
        for (int sp = 0; sp < splits; ++sp) {
          long long b = 0, e = 0;
          SplitKeys(lo, pos, splits, sp, &b, &e);
          ASSERT_LE(b, e);
          if (b < e) {
            ASSERT_EQ(b, next) << "lo " << lo << " pos " << pos << " splits " << splits << " split " << sp;
            next = e;
          }
        }
        EXPECT_EQ(next, pos + 1) << "lo " << lo << " pos " << pos << " splits " << splits;
      }
    }
  }
}

// Position pos of a sequence lives in block table[pos / block_size], at offset pos % block_size.
TEST(PagedCacheRowTest, FollowsTheBlockTable) {
  const int table[] = {5, 0, 3};
  const long long block_size = 4;
  // Positions 0-3 in block 5 (rows 20-23), 4-7 in block 0 (rows 0-3), 8-11 in block 3 (rows 12-15).
  const long long want[] = {20, 21, 22, 23, 0, 1, 2, 3, 12, 13, 14, 15};
  for (long long pos = 0; pos < 12; ++pos) EXPECT_EQ(PagedCacheRow(table, pos, block_size), want[pos]) << pos;
}

TEST(PagedSeqsTest, MaxQueryLenIsTheLongestSequencesNewRows) {
  const AttnSeq seqs[] = {{.q_begin = 0, .q_len = 3}, {.q_begin = 3, .q_len = 17}, {.q_begin = 20, .q_len = 1}};
  EXPECT_EQ((PagedSeqs{.host_seqs = seqs, .num_seqs = 3}).MaxQueryLen(), 17);
  EXPECT_EQ((PagedSeqs{.host_seqs = seqs, .num_seqs = 1}).MaxQueryLen(), 3);
  EXPECT_EQ(PagedSeqs{}.MaxQueryLen(), 0);
}

// The first key of a row, against the definition spelled out key by key (AttentionParams: keys
// with pos - key < window, and keys of the query's chunk), and never decreasing with pos.
TEST(AttentionFirstKeyTest, IsTheFirstKeyTheRowMaySee) {
  for (long long window : {0LL, 1LL, 5LL, 64LL}) {
    for (long long chunk : {0LL, 1LL, 4LL, 48LL}) {
      long long previous = 0;
      for (long long pos = 0; pos < 200; ++pos) {
        long long want = 0;
        while (want <= pos && ((window > 0 && pos - want >= window) || (chunk > 0 && want / chunk != pos / chunk))) {
          ++want;
        }
        const long long got = AttentionFirstKey(pos, window, chunk);
        EXPECT_EQ(got, want) << "pos " << pos << " window " << window << " chunk " << chunk;
        EXPECT_GE(got, previous);
        previous = got;
      }
    }
  }
}

TEST(MergeSoftmaxStatesTest, EmptyStatesGetNoWeight) {
  const float states[6] = {-INFINITY, 0.f, 2.f, 3.f, -INFINITY, 0.f};  // (m, l) x 3; only the middle has keys
  float scales[3] = {9.f, 9.f, 9.f};
  float m = 0.f;
  EXPECT_EQ(MergeSoftmaxStates(states, 3, 2, scales, &m), 3.f);
  EXPECT_EQ(m, 2.f);
  EXPECT_EQ(scales[0], 0.f);
  EXPECT_EQ(scales[1], 1.f);
  EXPECT_EQ(scales[2], 0.f);
  const float none[4] = {-INFINITY, 0.f, -INFINITY, 0.f};
  EXPECT_EQ(MergeSoftmaxStates(none, 2, 2, scales, nullptr), 0.f);
  EXPECT_EQ(scales[0], 0.f);
  EXPECT_EQ(scales[1], 0.f);
}

TEST(MergeSoftmaxStatesTest, RescalesToTheLargestMaximum) {
  // Two runs: keys with scores {0, 1} and {3}. Merged l = (e^0 + e^1) e^-3 + 1.
  const float states[4] = {1.f, 1.f + std::exp(-1.f), 3.f, 1.f};
  float scales[2];
  const float l = MergeSoftmaxStates(states, 2, 2, scales, nullptr);
  EXPECT_NEAR(scales[0], std::exp(-2.f), 1e-7);
  EXPECT_EQ(scales[1], 1.f);
  EXPECT_NEAR(l, (1.f + std::exp(1.f)) * std::exp(-3.f) + 1.f, 1e-6);
}

TEST(MergeAccElementTest, SumsTheScaledStatesAlongTheStride) {
  // Three states of a 2-element acc, stored [state, element]: element 1 of each is 10, 20, 30.
  const float acc[6] = {1.f, 10.f, 2.f, 20.f, 3.f, 30.f};
  const float scales[3] = {0.5f, 0.f, 2.f};
  EXPECT_EQ(MergeAccElement(acc + 1, 3, 2, scales), 10.f * 0.5f + 30.f * 2.f);
  EXPECT_EQ(MergeAccElement(acc, 3, 2, scales), 1.f * 0.5f + 3.f * 2.f);
  EXPECT_EQ(MergeAccElement(acc, 0, 2, scales), 0.f);  // no states
}

}  // namespace
}  // namespace shardserve::kernels
