// CUDA vs CPU parity of decode attention whose keys are split over several blocks (attention.cuh):
// one sequence, one new row deep in its context, so that a plan has few blocks per layer and splits
// each row's keys. The split blocks merge in the same launch: the last to count in on its (row,
// kv head, head block) counter merges, and every launch leaves the counters at zero. So each case
// runs the launch twice in a row and replays it from a CUDA graph three times, each result against
// the CPU oracle: a counter left non-zero would make the wrong block merge (early, over splits not
// yet written) or none at all (outputs left at their NaN fill). Tests skip without a device.
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "common/tensor/dtype.h"
#include "tests/worker/kernels/cuda/cuda_parity_fixture.h"
#include "worker/kernels/backend.h"

namespace shardserve::kernels {
namespace {

struct SplitDecodeCase {
  int64_t q_heads, kv_heads, head_dim, sliding_window;
  DType cache;  // the GPU's cache type (kF32 or kBF16); the CPU holds the same values in f32
  int64_t pos;  // the row's position: pos + 1 keys (fewer within a window)
};

void PrintTo(const SplitDecodeCase& c, std::ostream* os) {
  *os << "q" << c.q_heads << "_kv" << c.kv_heads << "_d" << c.head_dim << "_window" << c.sliding_window << "_"
      << DTypeName(c.cache) << "_pos" << c.pos;
}

std::string SplitDecodeName(const ::testing::TestParamInfo<SplitDecodeCase>& info) {
  return ::testing::PrintToString(info.param);
}

class CudaSplitDecodeParityTest : public CudaParityTest, public ::testing::WithParamInterface<SplitDecodeCase> {
 protected:
  static constexpr int64_t kBlock = 16;

  void SetUp() override {
    CudaParityTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    const SplitDecodeCase& c = GetParam();
    const int64_t blocks = (c.pos + 1 + kBlock - 1) / kBlock;
    num_blocks_ = blocks + 7;  // a few the table does not name
    table_ = DistinctRows(static_cast<int32_t>(num_blocks_), static_cast<size_t>(blocks), 131);
    seqs_ = {{.q_begin = 0, .q_len = 1, .pos_begin = static_cast<int32_t>(c.pos), .table_begin = 0,
              .table_len = static_cast<int32_t>(blocks)}};
    const size_t cache_elems = static_cast<size_t>(num_blocks_ * kBlock * c.kv_heads * c.head_dim);
    std::vector<float> k = RandomFloats(cache_elems, 132, -2.f, 2.f);
    std::vector<float> v = RandomFloats(cache_elems, 133);
    if (c.cache == DType::kBF16) {
      const std::vector<uint16_t> k16 = Narrow(DType::kBF16, k);
      const std::vector<uint16_t> v16 = Narrow(DType::kBF16, v);
      k16_ = Mirror(k16);
      v16_ = Mirror(v16);
      k = Widen(DType::kBF16, k16);
      v = Widen(DType::kBF16, v16);
    }
    k_ = Mirror(k);
    v_ = Mirror(v);
    dseqs_ = Mirror(seqs_);
    dtable_ = Mirror(table_);
    // Scores of a few units, so the softmax is neither flat nor one-hot.
    q_ = Mirror(RandomFloats(static_cast<size_t>(c.q_heads * c.head_dim), 134, -2.f, 2.f));
    want_ = Mirror(std::vector<float>(static_cast<size_t>(c.q_heads * c.head_dim)));
    ASSERT_TRUE(backend(kRef).Attention(Params(kRef, want_.at(kRef))).ok());
    want_host_ = Read(want_, kRef);
    // The point of these cases: the plan splits the keys (on any GPU of at least a few SMs).
    ASSERT_GT(backend(kGpu).AttentionShapeKey(Params(kGpu, want_.at(kGpu))), 1);
  }

  AttentionParams Params(int side, float* out) const {
    const SplitDecodeCase& c = GetParam();
    const bool narrow = side == kGpu && c.cache == DType::kBF16;
    KvLayerView cache{.num_blocks = num_blocks_, .block_size = kBlock, .kv_heads = c.kv_heads,
                      .head_dim = c.head_dim};
    cache.k = narrow ? static_cast<void*>(k16_.at(side)) : static_cast<void*>(k_.at(side));
    cache.v = narrow ? static_cast<void*>(v16_.at(side)) : static_cast<void*>(v_.at(side));
    cache.dtype = narrow ? DType::kBF16 : DType::kF32;
    const PagedSeqs paged{.seqs = dseqs_.at(side), .host_seqs = seqs_.data(), .num_seqs = 1,
                          .block_table = dtable_.at(side), .host_block_table = table_.data(),
                          .table_entries = static_cast<int64_t>(table_.size())};
    return {.q = q_.at(side), .out = out, .paged = paged, .tokens = 1, .q_heads = c.q_heads, .cache = cache,
            .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)), .sliding_window = c.sliding_window};
  }

  // A GPU output buffer filled with NaN: an element no block writes fails the comparison.
  Mirrored<float> NanOutput() { return Mirror(std::vector<float>(want_host_.size(), kNan)); }
  void FillNan(const Mirrored<float>& out) {
    const std::vector<float> nan(want_host_.size(), kNan);
    ASSERT_TRUE(backend(kGpu).CopyToDevice(out.at(kGpu), nan.data(), nan.size() * sizeof(float)).ok());
  }
  void ExpectMatchesCpu(const Mirrored<float>& out) { ExpectClose(Read(out, kGpu), want_host_); }

  static constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
  int64_t num_blocks_ = 0;
  std::vector<int32_t> table_;
  std::vector<AttnSeq> seqs_;
  Mirrored<float> k_, v_, q_, want_;
  Mirrored<uint16_t> k16_, v16_;
  Mirrored<AttnSeq> dseqs_;
  Mirrored<int32_t> dtable_;
  std::vector<float> want_host_;
};

TEST_P(CudaSplitDecodeParityTest, TwoLaunchesInARowMatchCpu) {
  auto first = NanOutput();
  auto second = NanOutput();
  // Queued back to back, no wait between: the second finds the counters the first left.
  ASSERT_TRUE(backend(kGpu).Attention(Params(kGpu, first.at(kGpu))).ok());
  ASSERT_TRUE(backend(kGpu).Attention(Params(kGpu, second.at(kGpu))).ok());
  ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  ExpectMatchesCpu(first);
  ExpectMatchesCpu(second);
}

TEST_P(CudaSplitDecodeParityTest, GraphReplaysMatchCpu) {
  auto out = NanOutput();
  // Once outside the recording, which sizes the backend's partials and counters (a recording
  // cannot allocate), as Reserve() does before the engine records its decode steps.
  ASSERT_TRUE(backend(kGpu).Attention(Params(kGpu, out.at(kGpu))).ok());
  ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  ExpectMatchesCpu(out);
  auto graph = backend(kGpu).Capture([&] { return backend(kGpu).Attention(Params(kGpu, out.at(kGpu))); });
  ASSERT_TRUE(graph.ok()) << graph.status();
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE(::testing::Message() << "replay " << replay);
    FillNan(out);
    ASSERT_TRUE((*graph)->Replay().ok());
    ASSERT_TRUE(backend(kGpu).Synchronize().ok());
    ExpectMatchesCpu(out);
  }
}

// GQA groups of 8 (the plan's head blocks shrink to one head each) and of 1, a sliding window (its
// split count follows the window, not the position), a bf16 cache on the 16-byte key loads, head_dim
// 68 (136-byte bf16 rows: the scalar chunked walk) and head_dim 320 (the per-key walk).
INSTANTIATE_TEST_SUITE_P(Shapes, CudaSplitDecodeParityTest,
                         ::testing::Values(SplitDecodeCase{32, 4, 128, 0, DType::kBF16, 3000},
                                           SplitDecodeCase{16, 2, 64, 0, DType::kF32, 2047},
                                           SplitDecodeCase{8, 8, 64, 0, DType::kBF16, 3000},
                                           SplitDecodeCase{16, 2, 128, 1024, DType::kF32, 4000},
                                           SplitDecodeCase{8, 2, 68, 0, DType::kBF16, 2500},
                                           SplitDecodeCase{4, 1, 320, 0, DType::kF32, 1500}),
                         SplitDecodeName);

}  // namespace
}  // namespace shardserve::kernels
