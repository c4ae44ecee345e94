// The fixture and helpers of the CUDA vs CPU parity tests (cuda_parity_test.cc and the files
// beside it): both backends created through the registry, the same host data mirrored into each,
// and isclose-style comparisons against the CPU oracle. Tests skip without a CUDA device.
#ifndef SHARDSERVE_TESTS_WORKER_KERNELS_CUDA_CUDA_PARITY_FIXTURE_H_
#define SHARDSERVE_TESTS_WORKER_KERNELS_CUDA_CUDA_PARITY_FIXTURE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "common/tensor/dtype.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/registry.h"

namespace shardserve::kernels {

// Index of each backend in the arrays below; the CPU one is the reference.
inline constexpr int kRef = 0;
inline constexpr int kGpu = 1;
inline constexpr int kSides = 2;

inline std::vector<float> RandomFloats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

inline std::vector<int32_t> RandomInts(size_t n, uint32_t seed, int32_t lo, int32_t hi) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(lo, hi);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = dist(rng);
  return v;
}

// `count` distinct values from [0, n), in random order (rows to gather, cache block ids).
inline std::vector<int32_t> DistinctRows(int32_t n, size_t count, uint32_t seed) {
  std::vector<int32_t> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(count);
  return all;
}

// The sequences of a paged-cache batch (KvWrite, Attention) and their block table, on the host.
struct PagedLayout {
  std::vector<AttnSeq> seqs;
  std::vector<int32_t> table;
  int64_t tokens = 0;  // the batch's rows: the sum of the sequences' q_len
};

// One sequence of LayOutPaged: q_len new rows at positions [pos_begin, pos_begin + q_len).
struct SeqSpec {
  int32_t pos_begin = 0, q_len = 0;
};

// The batch of `specs` in row order (sequence i's rows follow sequence i - 1's), each sequence with
// the table entries its positions need in blocks of `block_size`: the ids of DistinctRows(num_blocks,
// num_blocks, seed) taken in order, wrapping around. Every block is distinct while the tables need
// at most num_blocks entries; beyond that ids repeat, which only ops that merely read (Attention)
// may be given.
inline PagedLayout LayOutPaged(const std::vector<SeqSpec>& specs, int64_t block_size, int32_t num_blocks,
                               uint32_t seed) {
  const std::vector<int32_t> ids = DistinctRows(num_blocks, static_cast<size_t>(num_blocks), seed);
  PagedLayout layout;
  int32_t row = 0;
  for (const SeqSpec& spec : specs) {
    const int32_t blocks = static_cast<int32_t>((int64_t{spec.pos_begin} + spec.q_len + block_size - 1) / block_size);
    layout.seqs.push_back({.q_begin = row, .q_len = spec.q_len, .pos_begin = spec.pos_begin,
                           .table_begin = static_cast<int32_t>(layout.table.size()), .table_len = blocks});
    for (int32_t b = 0; b < blocks; ++b) layout.table.push_back(ids[layout.table.size() % ids.size()]);
    row += spec.q_len;
  }
  layout.tokens = row;
  return layout;
}

// Prefill rows (the tensor-core attention's cases, for a bf16 cache): a 100-token prompt (two tiles
// of 64 rows, the second partial), a 37-token chunk continuing a cached prefix of 50, and a 1-token
// prompt, in one batch (138 rows).
inline const std::vector<SeqSpec> kPrefillBatch = {{0, 100}, {50, 37}, {0, 1}};

// Every element within rtol * max|want| (plus a tiny atol for all-zero references), and a normalised
// mean squared error (test-backend-ops' nmse) far below that.
inline void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, float rtol = 1e-4f,
                 double max_nmse = 1e-8) {
  ASSERT_EQ(got.size(), want.size());
  float max_ref = 0.f;
  for (float w : want) max_ref = std::max(max_ref, std::fabs(w));
  const float tol = rtol * max_ref + 1e-6f;
  double err2 = 0, ref2 = 0;
  size_t worst = 0;
  float worst_diff = 0.f;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << "element " << i << " is " << got[i];
    const float diff = std::fabs(got[i] - want[i]);
    if (diff > worst_diff) {
      worst_diff = diff;
      worst = i;
    }
    err2 += static_cast<double>(diff) * diff;
    ref2 += static_cast<double>(want[i]) * want[i];
  }
  EXPECT_LE(worst_diff, tol) << "worst element " << worst << ": got " << got[worst] << ", want " << want[worst]
                             << " (max |ref| " << max_ref << ")";
  if (ref2 > 0) {
    EXPECT_LE(err2 / ref2, max_nmse) << "nmse";
  }
}

// `values` rounded to `dtype` (kBF16 or kF16, nearest even): their 16-bit patterns, and the same
// values widened back to f32 (exactly what a backend computes with).
inline std::vector<uint16_t> Narrow(DType dtype, const std::vector<float>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bits[i] = dtype == DType::kBF16 ? FloatToBFloat16(values[i]) : FloatToHalf(values[i]);
  }
  return bits;
}
inline std::vector<float> Widen(DType dtype, const std::vector<uint16_t>& bits) {
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    values[i] = dtype == DType::kBF16 ? BFloat16ToFloat(bits[i]) : HalfToFloat(bits[i]);
  }
  return values;
}

class CudaParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    auto cpu = CreateBackend({.kind = DeviceKind::kCpu});
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto gpu = CreateBackend({.kind = DeviceKind::kCuda, .device_index = 0});
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    owned_[kRef] = std::move(cpu).value();
    owned_[kGpu] = std::move(gpu).value();
  }

  Backend& backend(int side) { return *owned_[side]; }

  // The same host data in each backend's memory.
  template <typename T>
  struct Mirrored {
    DeviceBuffer buf[kSides];
    size_t n = 0;
    T* at(int side) const { return buf[side].as<T>(); }
  };

  template <typename T>
  Mirrored<T> Mirror(const std::vector<T>& host) {
    Mirrored<T> m;
    m.n = host.size();
    for (int side = 0; side < kSides; ++side) {
      // At least one element, so that zero-sized ops still get non-null pointers.
      auto buf = backend(side).Allocate(std::max<size_t>(1, host.size()) * sizeof(T));
      EXPECT_TRUE(buf.ok()) << buf.status();
      if (!buf.ok()) return m;
      m.buf[side] = std::move(buf).value();
      EXPECT_TRUE(backend(side).CopyToDevice(m.buf[side].template as<T>(), host.data(), host.size() * sizeof(T)).ok());
    }
    return m;
  }

  template <typename T>
  std::vector<T> Read(const Mirrored<T>& m, int side) {
    std::vector<T> host(m.n);
    EXPECT_TRUE(backend(side).CopyToHost(host.data(), m.at(side), m.n * sizeof(T)).ok());
    return host;
  }

  // A PagedLayout in both backends' memory, and as the ops' PagedSeqs (the host arrays are its own).
  struct MirroredPaged {
    PagedLayout host;
    Mirrored<AttnSeq> seqs;
    Mirrored<int32_t> table;
    PagedSeqs at(int side) const {
      return {.seqs = seqs.at(side), .host_seqs = host.seqs.data(), .num_seqs = static_cast<int64_t>(host.seqs.size()),
              .block_table = table.at(side), .host_block_table = host.table.data(),
              .table_entries = static_cast<int64_t>(host.table.size())};
    }
  };

  MirroredPaged MirrorPaged(PagedLayout layout) {
    MirroredPaged m;
    m.seqs = Mirror(layout.seqs);
    m.table = Mirror(layout.table);
    m.host = std::move(layout);
    return m;
  }

  // Runs `op(backend, side)` on both backends; each must succeed.
  template <typename Op>
  void RunBoth(Op op) {
    for (int side = 0; side < kSides; ++side) {
      const absl::Status st = op(backend(side), side);
      ASSERT_TRUE(st.ok()) << backend(side).name() << ": " << st;
    }
    ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  }

  void ExpectMirrorsClose(const Mirrored<float>& m, float rtol = 1e-4f, double max_nmse = 1e-8) {
    ExpectClose(Read(m, kGpu), Read(m, kRef), rtol, max_nmse);
  }

  std::unique_ptr<Backend> owned_[kSides];
};

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_TESTS_WORKER_KERNELS_CUDA_CUDA_PARITY_FIXTURE_H_
