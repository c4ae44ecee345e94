// CUDA vs CPU parity of continuous-batching steps that mix prefill sequences with decode rows, over
// a bf16 cache: sequences of at least 16 new rows (kMinMmaAttentionRows) take the tensor-core kernel,
// the others the split-K kernel, two launches on the stream that share the sequence array and each
// skip the other's sequences (attention.cuh, "Dispatch"). The decode rows sit deep in their contexts
// and the split kernel is planned for them alone, so it splits their keys (a plan over the whole
// batch, prefill rows included, would not). Each case checks, against the CPU oracle at the f32
// tolerance of the other bf16-cache attention cases:
//   * one launch pair, then two queued back to back (the split counters each launch leaves at zero),
//     then three replays of a CUDA graph recorded after a first run had sized the workspace (as
//     Reserve() does before the engine records steps); outputs start as NaN, so a row neither kernel
//     writes fails;
//   * that the mixed step computes bit for bit what the prefill sequences alone and the decode rows
//     alone compute (each kernel's result for a row depends on its own launch only: a kernel that
//     also wrote the other's rows would race with it);
//   * with CudaBackendOptions::mma_attention off (--nomma_attention), every row on the split kernel.
// Tests skip without a device.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "common/tensor/dtype.h"
#include "tests/worker/kernels/cuda/cuda_parity_fixture.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/registry.h"

namespace shardserve::kernels {
namespace {

// A prefill chunk of 100 rows continuing a cached prefix of 200 (two 64-row tiles), then decode rows
// at positions 2999, 1000, 2047 and 300.
const std::vector<SeqSpec> kChunkThenDecodes = {{200, 100}, {2999, 1}, {1000, 1}, {2047, 1}, {300, 1}};
// Two prefill sequences (a 64-row prompt, a 37-row chunk after 500 cached positions) among decode
// rows and a 3-row sequence (speculative decoding's shape): the tensor-core grid spans the decode
// rows between the prefills, which it skips; the split kernel's slots are per sequence, 3 each.
const std::vector<SeqSpec> kInterleaved = {{700, 1},  {0, 64},    {1500, 1}, {1200, 3},
                                           {2500, 1}, {500, 37}, {3000, 1}};
// A 15-row sequence (the most a split-kernel sequence has) beside a 16-row one (the fewest the
// tensor cores take) and decode rows: 6 sequences x 15 slots would exceed the step's 35 tokens, so
// the split kernel's slots are per token.
const std::vector<SeqSpec> kPerTokenSlots = {{1000, 15}, {0, 16}, {400, 1}, {900, 1}, {1800, 1}, {2600, 1}};

struct MixedCase {
  std::string batch_name;
  std::vector<SeqSpec> batch;
  int64_t q_heads, kv_heads, head_dim, sliding_window;
};

void PrintTo(const MixedCase& c, std::ostream* os) {
  *os << c.batch_name << "_q" << c.q_heads << "_kv" << c.kv_heads << "_d" << c.head_dim << "_window"
      << c.sliding_window;
}

std::string MixedName(const ::testing::TestParamInfo<MixedCase>& info) { return ::testing::PrintToString(info.param); }

class CudaMixedAttentionParityTest : public CudaParityTest, public ::testing::WithParamInterface<MixedCase> {
 protected:
  static constexpr int64_t kBlock = 16;
  static constexpr int32_t kBlocks = 256;  // 4096 positions; later tables reuse ids (attention only reads)

  void SetUp() override {
    CudaParityTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    const MixedCase& c = GetParam();
    paged_ = MirrorPaged(LayOutPaged(c.batch, kBlock, kBlocks, 401));
    tokens_ = paged_.host.tokens;
    const size_t cache_elems = static_cast<size_t>(kBlocks * kBlock * c.kv_heads * c.head_dim);
    // The GPU's bf16 cache, and the CPU's f32 one holding the same values.
    const std::vector<uint16_t> k16 = Narrow(DType::kBF16, RandomFloats(cache_elems, 402, -2.f, 2.f));
    const std::vector<uint16_t> v16 = Narrow(DType::kBF16, RandomFloats(cache_elems, 403));
    k16_ = Mirror(k16);
    v16_ = Mirror(v16);
    k_ = Mirror(Widen(DType::kBF16, k16));
    v_ = Mirror(Widen(DType::kBF16, v16));
    // Scores of a few units, so the softmax is neither flat nor one-hot.
    q_ = Mirror(RandomFloats(static_cast<size_t>(tokens_ * c.q_heads * c.head_dim), 404, -2.f, 2.f));
    auto want = Mirror(std::vector<float>(q_.n));
    ASSERT_TRUE(backend(kRef).Attention(Params(kRef, want.at(kRef), paged_.at(kRef))).ok());
    want_ = Read(want, kRef);
    // The point of these cases: the decode rows' plan splits their keys (on GPUs of at least 65
    // multiprocessors, such as the A100, H100 and H200); a plan over the whole batch would not.
    ASSERT_GT(backend(kGpu).AttentionShapeKey(Params(kGpu, want.at(kGpu), paged_.at(kGpu))), 1);
  }

  AttentionParams Params(int side, float* out, const PagedSeqs& paged) const {
    const MixedCase& c = GetParam();
    const bool gpu = side == kGpu;
    const KvLayerView cache{.k = gpu ? static_cast<void*>(k16_.at(side)) : static_cast<void*>(k_.at(side)),
                            .v = gpu ? static_cast<void*>(v16_.at(side)) : static_cast<void*>(v_.at(side)),
                            .num_blocks = kBlocks, .block_size = kBlock, .kv_heads = c.kv_heads,
                            .head_dim = c.head_dim, .dtype = gpu ? DType::kBF16 : DType::kF32};
    return {.q = q_.at(side), .out = out, .paged = paged, .tokens = tokens_, .q_heads = c.q_heads, .cache = cache,
            .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)), .sliding_window = c.sliding_window};
  }
  AttentionParams GpuParams(const Mirrored<float>& out) const { return Params(kGpu, out.at(kGpu), paged_.at(kGpu)); }

  // A GPU output buffer filled with NaN: an element no kernel writes fails the comparison.
  Mirrored<float> NanOutput() { return Mirror(std::vector<float>(want_.size(), kNan)); }
  void FillNan(const Mirrored<float>& out) {
    const std::vector<float> nan(want_.size(), kNan);
    ASSERT_TRUE(backend(kGpu).CopyToDevice(out.at(kGpu), nan.data(), nan.size() * sizeof(float)).ok());
  }
  void ExpectMatchesCpu(const std::vector<float>& got) { ExpectClose(got, want_); }

  // The batch's sequences of (`prefill`) at least 16 rows or (!prefill) fewer, at their rows and
  // tables in the whole batch's arrays, in both backends' memory.
  MirroredPaged Part(bool prefill) {
    PagedLayout part = paged_.host;
    std::erase_if(part.seqs, [&](const AttnSeq& s) { return (s.q_len >= 16) != prefill; });
    return MirrorPaged(std::move(part));
  }

  static constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
  MirroredPaged paged_;
  int64_t tokens_ = 0;
  Mirrored<float> k_, v_, q_;
  Mirrored<uint16_t> k16_, v16_;
  std::vector<float> want_;
};

TEST_P(CudaMixedAttentionParityTest, MatchesCpu) {
  auto out = NanOutput();
  ASSERT_TRUE(backend(kGpu).Attention(GpuParams(out)).ok());
  ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  ExpectMatchesCpu(Read(out, kGpu));
}

TEST_P(CudaMixedAttentionParityTest, TwoLaunchesInARowMatchCpu) {
  auto first = NanOutput();
  auto second = NanOutput();
  // Queued back to back, no wait between: the second finds the counters the first left.
  ASSERT_TRUE(backend(kGpu).Attention(GpuParams(first)).ok());
  ASSERT_TRUE(backend(kGpu).Attention(GpuParams(second)).ok());
  ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  ExpectMatchesCpu(Read(first, kGpu));
  ExpectMatchesCpu(Read(second, kGpu));
}

TEST_P(CudaMixedAttentionParityTest, GraphReplaysMatchCpu) {
  auto out = NanOutput();
  // Once outside the recording, which sizes the backend's partials and counters (a recording
  // cannot allocate).
  ASSERT_TRUE(backend(kGpu).Attention(GpuParams(out)).ok());
  ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  ExpectMatchesCpu(Read(out, kGpu));
  auto graph = backend(kGpu).Capture([&] { return backend(kGpu).Attention(GpuParams(out)); });
  ASSERT_TRUE(graph.ok()) << graph.status();
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE(::testing::Message() << "replay " << replay);
    FillNan(out);
    ASSERT_TRUE((*graph)->Replay().ok());
    ASSERT_TRUE(backend(kGpu).Synchronize().ok());
    ExpectMatchesCpu(Read(out, kGpu));
  }
}

TEST_P(CudaMixedAttentionParityTest, IsItsPartsBitForBit) {
  auto mixed = NanOutput();
  auto parts = NanOutput();
  const MirroredPaged prefills = Part(true);
  const MirroredPaged decodes = Part(false);
  // The decode rows alone get the plan they get beside the prefills (the same splits, so the same
  // sums in the same order).
  ASSERT_EQ(backend(kGpu).AttentionShapeKey(Params(kGpu, parts.at(kGpu), decodes.at(kGpu))),
            backend(kGpu).AttentionShapeKey(GpuParams(mixed)));
  ASSERT_TRUE(backend(kGpu).Attention(GpuParams(mixed)).ok());
  ASSERT_TRUE(backend(kGpu).Attention(Params(kGpu, parts.at(kGpu), prefills.at(kGpu))).ok());
  ASSERT_TRUE(backend(kGpu).Attention(Params(kGpu, parts.at(kGpu), decodes.at(kGpu))).ok());
  ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  const std::vector<float> got = Read(mixed, kGpu);
  const std::vector<float> want = Read(parts, kGpu);
  ASSERT_EQ(got.size(), want.size());
  ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  ExpectMatchesCpu(got);
}

TEST_P(CudaMixedAttentionParityTest, WithoutTensorCoresMatchesCpu) {
  // Another backend on the same device reads this one's buffers.
  auto split_only = CreateBackend({.kind = DeviceKind::kCuda, .device_index = 0, .cuda_mma_attention = false});
  ASSERT_TRUE(split_only.ok()) << split_only.status();
  auto out = NanOutput();
  ASSERT_TRUE((*split_only)->Attention(GpuParams(out)).ok());
  ASSERT_TRUE((*split_only)->Synchronize().ok());
  ExpectMatchesCpu(Read(out, kGpu));
}

// GQA groups of 8 (head_dim 128), 8 over two prefills (head_dim 64 and 128, the latter under a
// 700-key window, which bounds the decode rows' splits and keys and the prefill rows' keys), 4 and
// none (8 kv heads).
INSTANTIATE_TEST_SUITE_P(Batches, CudaMixedAttentionParityTest,
                         ::testing::Values(MixedCase{"chunk_then_decodes", kChunkThenDecodes, 32, 4, 128, 0},
                                           MixedCase{"interleaved", kInterleaved, 16, 2, 64, 0},
                                           MixedCase{"interleaved", kInterleaved, 16, 2, 128, 700},
                                           MixedCase{"per_token_slots", kPerTokenSlots, 8, 2, 64, 0},
                                           MixedCase{"chunk_then_decodes", kChunkThenDecodes, 8, 8, 64, 0}),
                         MixedName);

}  // namespace
}  // namespace shardserve::kernels
