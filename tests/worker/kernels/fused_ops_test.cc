// The fused forms of ops on the CPU backend against the separate ops they replace:
//   * a gated LinearGroup (LinearGroupParams::gated) against two Linears and SiluMul;
//   * a normed LinearGroup (LinearGroupParams::norm) against RmsNorm and then the group;
//   * KvWrite with rope (KvWriteParams::rope) against Rope and then KvWrite.
// Both must be bit for bit the separate sequence (the engine's logits may not change by a bit), and
// both must refuse the combinations their contracts exclude with a message naming the problem.
// Random shapes from fixed seeds: odd `in`, GQA, rotary_dim < head_dim, both activations, every
// CPU Linear path (small batch, blocked, sgemm).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/tensor/dtype.h"
#include "tests/testing/status_matchers.h"
#include "tests/worker/kernels/random_values.h"
#include "worker/kernels/registry.h"

namespace shardserve::kernels {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

// Bit patterns, so that -0 and NaN payloads count: "equal" means the same bits.
std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<uint32_t>(v[i]);
  return b;
}

class FusedOpsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_OK_AND_ASSIGN(b_, CreateBackend({})); }
  std::unique_ptr<Backend> b_;
};

// ---- Gated LinearGroup ---------------------------------------------------------------------------

struct GatedCase {
  int64_t tokens, in, out;
  DType dtype;  // of both matrices (kF32 or kBF16; the CPU's Linear takes both)
  bool bias;
  GateActivation act;
};

TEST_F(FusedOpsTest, GatedLinearGroupIsTwoLinearsThenSiluMulBitForBit) {
  // tokens 1..9 take the small-batch kernels, 40 the blocked or sgemm paths; odd `in` leave a tail
  // after every vector width.
  constexpr GateActivation kSilu = GateActivation::kSilu, kGelu = GateActivation::kGeluTanh;
  constexpr GateActivation kClamped = GateActivation::kClampedSwiglu;
  const GatedCase cases[] = {
      {1, 17, 5, DType::kF32, false, kSilu},   {1, 96, 64, DType::kBF16, true, kSilu},
      {1, 64, 32, DType::kBF16, true, kClamped}, {40, 97, 65, DType::kF32, true, kClamped},
      {2, 33, 7, DType::kBF16, false, kGelu},  {3, 131, 40, DType::kF32, true, kGelu},
      {8, 64, 33, DType::kBF16, true, kSilu},  {9, 75, 18, DType::kF32, false, kSilu},
      {40, 129, 70, DType::kF32, true, kSilu}, {40, 97, 65, DType::kBF16, true, kGelu},
  };
  uint32_t seed = 100;
  for (const GatedCase& c : cases) {
    SCOPED_TRACE(absl::StrCat("tokens ", c.tokens, " in ", c.in, " out ", c.out, " ", DTypeName(c.dtype),
                              c.bias ? " bias" : "", " act ", static_cast<int>(c.act)));
    const size_t w_elems = static_cast<size_t>(c.out * c.in);
    const std::vector<float> x = Random(static_cast<size_t>(c.tokens * c.in), ++seed, 2.0f);
    const std::vector<float> wg32 = Random(w_elems, ++seed), wu32 = Random(w_elems, ++seed);
    const std::vector<float> bg = Random(static_cast<size_t>(c.out), ++seed);
    const std::vector<float> bu = Random(static_cast<size_t>(c.out), ++seed);
    std::vector<uint16_t> wg16(w_elems), wu16(w_elems);
    for (size_t i = 0; i < w_elems; ++i) {
      wg16[i] = FloatToBFloat16(wg32[i]);
      wu16[i] = FloatToBFloat16(wu32[i]);
    }
    const bool narrow = c.dtype == DType::kBF16;
    const WeightView wg = narrow ? WeightView::Bf16(wg16.data()) : WeightView(wg32.data());
    const WeightView wu = narrow ? WeightView::Bf16(wu16.data()) : WeightView(wu32.data());
    const size_t y_elems = static_cast<size_t>(c.tokens * c.out);

    // The separate ops, as the engine ran them before the fused form.
    std::vector<float> gate_ref(y_elems, 5.f), up_ref(y_elems, 5.f);
    ASSERT_TRUE(b_->Linear({.x = x.data(), .w = wg, .bias = c.bias ? bg.data() : nullptr, .y = gate_ref.data(),
                            .tokens = c.tokens, .in = c.in, .out = c.out})
                    .ok());
    ASSERT_TRUE(b_->Linear({.x = x.data(), .w = wu, .bias = c.bias ? bu.data() : nullptr, .y = up_ref.data(),
                            .tokens = c.tokens, .in = c.in, .out = c.out})
                    .ok());
    const std::vector<float> gate_pre = gate_ref;
    ASSERT_TRUE(b_->SiluMul({.gate = gate_ref.data(), .up = up_ref.data(), .out = gate_ref.data(),
                             .n = static_cast<int64_t>(y_elems), .act = c.act})
                    .ok());

    // The fused form; its outputs start as garbage.
    std::vector<float> gate(y_elems, -9.f), up(y_elems, -9.f);
    LinearGroupParams g{.x = x.data(), .tokens = c.tokens, .in = c.in, .num_parts = 2, .gated = c.act};
    g.parts[0] = {.w = wg, .bias = c.bias ? bg.data() : nullptr, .y = gate.data(), .out = c.out};
    g.parts[1] = {.w = wu, .bias = c.bias ? bu.data() : nullptr, .y = up.data(), .out = c.out};
    ASSERT_TRUE(b_->LinearGroup(g).ok());
    EXPECT_EQ(Bits(gate), Bits(gate_ref));

    // And the product is act(gate) * up, not merely what the separate ops happen to do: within f32
    // rounding of a double-precision evaluation on the same pre-activations. (The clamped SwiGLU's
    // up term is clamp(up, -7, 7) + 1.)
    for (size_t i = 0; i < y_elems; ++i) {
      double gv = gate_pre[i], uv = up_ref[i];
      if (c.act == GateActivation::kClampedSwiglu) {
        gv = std::min(gv, 7.0);
        uv = std::clamp(uv, -7.0, 7.0) + 1.0;
      }
      const double act = c.act == GateActivation::kGeluTanh
                             ? 0.5 * gv * (1.0 + std::tanh(0.7978845608028654 * (gv + 0.044715 * gv * gv * gv)))
                         : c.act == GateActivation::kClampedSwiglu ? gv / (1.0 + std::exp(-1.702 * gv))
                                                                    : gv / (1.0 + std::exp(-gv));
      ASSERT_NEAR(gate[i], act * uv, 1e-5 * (1.0 + std::fabs(act * uv))) << i;
    }
  }
}

TEST_F(FusedOpsTest, GatedLinearGroupRejectsWhatItCannotFuse) {
  std::vector<float> x(8), w(16), y0(8), y1(8), y2(8);
  LinearGroupParams g{.x = x.data(), .tokens = 2, .in = 4, .num_parts = 2, .gated = GateActivation::kSilu};
  g.parts[0] = {.w = w.data(), .y = y0.data(), .out = 4};
  g.parts[1] = {.w = w.data(), .y = y1.data(), .out = 4};
  ASSERT_TRUE(b_->LinearGroup(g).ok());  // the valid form, for contrast

  LinearGroupParams three = g;
  three.num_parts = 3;
  three.parts[2] = {.w = w.data(), .y = y2.data(), .out = 4};
  EXPECT_THAT(b_->LinearGroup(three),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gated form takes 2 parts (gate, up), got 3")));
  LinearGroupParams one = g;
  one.num_parts = 1;
  EXPECT_THAT(b_->LinearGroup(one), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got 1")));
  LinearGroupParams unequal = g;
  unequal.parts[1].out = 3;
  EXPECT_THAT(b_->LinearGroup(unequal),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gate and up of equal out, got 4 and 3")));
  for (int part = 0; part < 2; ++part) {
    LinearGroupParams acc = g;
    acc.parts[static_cast<size_t>(part)].accumulate = true;
    EXPECT_THAT(b_->LinearGroup(acc), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not accumulate")))
        << "part " << part;
  }
  LinearGroupParams same_y = g;
  same_y.parts[1].y = y0.data();
  EXPECT_THAT(b_->LinearGroup(same_y), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("write the same y")));
}

// ---- Normed LinearGroup --------------------------------------------------------------------------

TEST_F(FusedOpsTest, NormedLinearGroupIsRmsNormThenTheGroupBitForBit) {
  struct NormedCase {
    int64_t tokens, in, out;
    DType dtype;
    bool gated;
  };
  const NormedCase cases[] = {{1, 64, 24, DType::kBF16, false}, {1, 96, 33, DType::kF32, true},
                              {3, 131, 40, DType::kBF16, true}, {9, 75, 18, DType::kF32, false},
                              {40, 129, 70, DType::kBF16, false}};
  uint32_t seed = 700;
  for (const NormedCase& c : cases) {
    SCOPED_TRACE(absl::StrCat("tokens ", c.tokens, " in ", c.in, " out ", c.out, " ", DTypeName(c.dtype),
                              c.gated ? " gated" : " plain"));
    const int parts = c.gated ? 2 : 3;
    const size_t w_elems = static_cast<size_t>(c.out * c.in);
    const size_t y_elems = static_cast<size_t>(c.tokens * c.out);
    const std::vector<float> x = Random(static_cast<size_t>(c.tokens * c.in), ++seed, 3.0f);
    std::vector<float> nw = Random(static_cast<size_t>(c.in), ++seed);
    for (float& v : nw) v += 1.0f;
    std::vector<std::vector<float>> w32;
    std::vector<std::vector<uint16_t>> w16;
    for (int i = 0; i < parts; ++i) {
      w32.push_back(Random(w_elems, ++seed));
      std::vector<uint16_t> narrow(w_elems);
      for (size_t e = 0; e < w_elems; ++e) narrow[e] = FloatToBFloat16(w32.back()[e]);
      // The f32 weights (and the double-precision check) are exactly the bf16 ones' values.
      for (size_t e = 0; e < w_elems; ++e) w32.back()[e] = BFloat16ToFloat(narrow[e]);
      w16.push_back(std::move(narrow));
    }
    auto group = [&](const float* xin, std::vector<std::vector<float>>& ys) {
      LinearGroupParams g{.x = xin, .tokens = c.tokens, .in = c.in, .num_parts = parts};
      for (int i = 0; i < parts; ++i) {
        const size_t k = static_cast<size_t>(i);
        g.parts[k] = {.w = c.dtype == DType::kBF16 ? WeightView::Bf16(w16[k].data()) : WeightView(w32[k].data()),
                      .y = ys[k].data(), .out = c.out, .accumulate = !c.gated && i == 0};
      }
      if (c.gated) g.gated = GateActivation::kSilu;
      return g;
    };
    // The separate ops: RmsNorm into a buffer, then the group over it.
    std::vector<std::vector<float>> y_ref(static_cast<size_t>(parts), std::vector<float>(y_elems, 0.5f));
    std::vector<float> normed(x.size());
    ASSERT_TRUE(b_->RmsNorm({.x = x.data(), .weight = nw.data(), .y = normed.data(), .tokens = c.tokens,
                             .hidden = c.in, .eps = 1e-5f})
                    .ok());
    ASSERT_TRUE(b_->LinearGroup(group(normed.data(), y_ref)).ok());
    // The normed form over the raw rows.
    std::vector<std::vector<float>> y(static_cast<size_t>(parts), std::vector<float>(y_elems, 0.5f));
    std::vector<float> scratch(x.size(), -7.f);
    LinearGroupParams g = group(x.data(), y);
    g.norm = LinearGroupParams::Norm{.weight = nw.data(), .eps = 1e-5f, .scratch = scratch.data()};
    ASSERT_TRUE(b_->LinearGroup(g).ok());
    const int checked = c.gated ? 1 : parts;  // the gated form's parts[1].y is scratch
    for (int i = 0; i < checked; ++i) EXPECT_EQ(Bits(y[static_cast<size_t>(i)]), Bits(y_ref[static_cast<size_t>(i)]));

    // And it is the product with the normalised rows, not merely what the separate ops happen to
    // do: a plain part against a double-precision evaluation.
    if (!c.gated) {
      for (int64_t t = 0; t < c.tokens; ++t) {
        double ss = 0;
        for (int64_t i = 0; i < c.in; ++i) ss += double{x[static_cast<size_t>(t * c.in + i)]} * x[static_cast<size_t>(t * c.in + i)];
        const double inv = 1.0 / std::sqrt(ss / static_cast<double>(c.in) + 1e-5);
        for (int64_t o = 0; o < c.out; ++o) {
          double dot = 0, mag = 0;
          for (int64_t i = 0; i < c.in; ++i) {
            const double term = double{w32[1][static_cast<size_t>(o * c.in + i)]} * nw[static_cast<size_t>(i)] * inv *
                                x[static_cast<size_t>(t * c.in + i)];
            dot += term;
            mag += std::fabs(term);
          }
          ASSERT_NEAR(y[1][static_cast<size_t>(t * c.out + o)], dot, 1e-5 * (1.0 + mag)) << t << " " << o;
        }
      }
    }
  }
}

TEST_F(FusedOpsTest, NormedLinearGroupRejectsABadNormNamingIt) {
  std::vector<float> x(8), w(16), nw(4, 1.f), y0(8), y1(8), scratch(8);
  LinearGroupParams g{.x = x.data(), .tokens = 2, .in = 4, .num_parts = 2};
  g.parts[0] = {.w = w.data(), .y = y0.data(), .out = 4};
  g.parts[1] = {.w = w.data(), .y = y1.data(), .out = 4};
  g.norm = LinearGroupParams::Norm{.weight = nw.data(), .eps = 1e-6f, .scratch = scratch.data()};
  ASSERT_TRUE(b_->LinearGroup(g).ok());  // the valid form, for contrast

  LinearGroupParams no_weight = g;
  no_weight.norm->weight = nullptr;
  EXPECT_THAT(b_->LinearGroup(no_weight), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("norm weight")));
  LinearGroupParams no_scratch = g;
  no_scratch.norm->scratch = nullptr;
  EXPECT_THAT(b_->LinearGroup(no_scratch), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("scratch")));
  for (float eps : {-1e-6f, std::nanf(""), INFINITY}) {
    LinearGroupParams bad_eps = g;
    bad_eps.norm->eps = eps;
    EXPECT_THAT(b_->LinearGroup(bad_eps), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("eps must be finite")))
        << eps;
  }
  LinearGroupParams onto_x = g;
  onto_x.norm->scratch = x.data();
  EXPECT_THAT(b_->LinearGroup(onto_x), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("scratch aliases x")));
  LinearGroupParams onto_y = g;
  onto_y.norm->scratch = y1.data();
  EXPECT_THAT(b_->LinearGroup(onto_y),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("scratch aliases part 1's y")));
}

// ---- KvWrite with rope ---------------------------------------------------------------------------

struct RopeWriteCase {
  int64_t q_heads, kv_heads, head_dim, rotary_dim;  // rotary_dim 0: all of head_dim
  float position_scale, scale;
};

// A batch as the engine lays one out: sequences tiling the rows in order (a prefill across blocks,
// a decode step deep in its context, a chunk continuing a cached prefix), shuffled block ids.
struct Batch {
  static constexpr int64_t kBlockSize = 4, kNumBlocks = 24;
  std::vector<AttnSeq> seqs = {{.q_begin = 0, .q_len = 7, .pos_begin = 0, .table_begin = 0, .table_len = 2},
                               {.q_begin = 7, .q_len = 1, .pos_begin = 29, .table_begin = 2, .table_len = 8},
                               {.q_begin = 8, .q_len = 5, .pos_begin = 10, .table_begin = 10, .table_len = 4}};
  std::vector<int32_t> table;
  std::vector<int32_t> positions;
  int64_t tokens = 13;

  Batch() {
    table.resize(14);
    std::vector<int32_t> ids(kNumBlocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
    std::copy_n(ids.begin(), table.size(), table.begin());
    for (const AttnSeq& s : seqs) {
      for (int32_t j = 0; j < s.q_len; ++j) positions.push_back(s.pos_begin + j);
    }
  }
  PagedSeqs paged() const {
    return {.seqs = seqs.data(), .host_seqs = seqs.data(), .num_seqs = static_cast<int64_t>(seqs.size()),
            .block_table = table.data(), .host_block_table = table.data(),
            .table_entries = static_cast<int64_t>(table.size())};
  }
};

TEST_F(FusedOpsTest, KvWriteWithRopeIsRopeThenKvWriteBitForBit) {
  const RopeWriteCase cases[] = {
      {4, 4, 16, 0, 1.0f, 1.0f},     // multi-head, whole-head rotation
      {8, 2, 64, 0, 0.25f, 1.0f},    // GQA, a position scale (linear scaling)
      {6, 1, 64, 48, 1.0f, 1.19f},   // GQA to one kv head, partial rotation, longrope's factor
      {3, 3, 10, 4, 1.0f, 1.0f},     // a short odd-halved head: rotary_dim < head_dim
  };
  const Batch batch;
  uint32_t seed = 300;
  for (const RopeWriteCase& c : cases) {
    SCOPED_TRACE(absl::StrCat("q_heads ", c.q_heads, " kv_heads ", c.kv_heads, " head_dim ", c.head_dim,
                              " rotary_dim ", c.rotary_dim));
    const int64_t rot = c.rotary_dim > 0 ? c.rotary_dim : c.head_dim;
    std::vector<float> inv_freq(static_cast<size_t>(rot / 2));
    for (size_t i = 0; i < inv_freq.size(); ++i) {
      inv_freq[i] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / static_cast<float>(rot));
    }
    const int64_t row = c.kv_heads * c.head_dim;
    const size_t cache_elems = static_cast<size_t>(Batch::kNumBlocks * Batch::kBlockSize * row);
    const std::vector<float> q0 = Random(static_cast<size_t>(batch.tokens * c.q_heads * c.head_dim), ++seed);
    const std::vector<float> k0 = Random(static_cast<size_t>(batch.tokens * row), ++seed);
    const std::vector<float> v = Random(static_cast<size_t>(batch.tokens * row), ++seed);
    const std::vector<float> ck0 = Random(cache_elems, ++seed), cv0 = Random(cache_elems, ++seed);

    struct Side {
      std::vector<float> q, k, ck, cv;
    };
    auto run = [&](bool fused) -> Side {
      Side s{q0, k0, ck0, cv0};
      const RopeParams rope{.q = s.q.data(), .k = s.k.data(), .positions = batch.positions.data(),
                            .inv_freq = inv_freq.data(), .tokens = batch.tokens, .q_heads = c.q_heads,
                            .kv_heads = c.kv_heads, .head_dim = c.head_dim, .position_scale = c.position_scale,
                            .rotary_dim = c.rotary_dim, .scale = c.scale};
      KvWriteParams write{.k = s.k.data(), .v = v.data(), .paged = batch.paged(), .tokens = batch.tokens,
                          .cache = {s.ck.data(), s.cv.data(), Batch::kNumBlocks, Batch::kBlockSize, c.kv_heads,
                                    c.head_dim}};
      if (fused) {
        write.rope = rope;
      } else {
        EXPECT_TRUE(b_->Rope(rope).ok());
      }
      EXPECT_TRUE(b_->KvWrite(write).ok());
      return s;
    };
    const Side separate = run(false);
    const Side fused = run(true);
    EXPECT_EQ(Bits(fused.q), Bits(separate.q));
    EXPECT_EQ(Bits(fused.k), Bits(separate.k));
    EXPECT_EQ(Bits(fused.ck), Bits(separate.ck));
    EXPECT_EQ(Bits(fused.cv), Bits(separate.cv));
    // The rotation happened (q changed) and reached the cache (a cached key is a rotated one).
    EXPECT_NE(Bits(fused.q), Bits(q0));
    const AttnSeq& decode = batch.seqs[1];
    const int32_t block = batch.table[static_cast<size_t>(decode.table_begin + decode.pos_begin / Batch::kBlockSize)];
    const int64_t at = (int64_t{block} * Batch::kBlockSize + decode.pos_begin % Batch::kBlockSize) * row;
    for (int64_t e = 0; e < row; ++e) {
      ASSERT_EQ(fused.ck[static_cast<size_t>(at + e)], fused.k[static_cast<size_t>(decode.q_begin * row + e)]) << e;
    }
    // Elements past rotary_dim pass through unrotated.
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      for (int64_t e = rot; e < c.head_dim; ++e) {
        const size_t i = static_cast<size_t>(decode.q_begin * row + h * c.head_dim + e);
        ASSERT_EQ(fused.k[i], k0[i]) << "head " << h << " element " << e;
      }
    }
  }
}

TEST_F(FusedOpsTest, KvWriteWithRopeRejectsMismatchesNamingThem) {
  const Batch batch;
  const int64_t q_heads = 4, kv_heads = 2, d = 8, row = kv_heads * d;
  std::vector<float> q(static_cast<size_t>(batch.tokens * q_heads * d)), k(static_cast<size_t>(batch.tokens * row));
  std::vector<float> v(k.size()), other(k.size()), inv_freq(static_cast<size_t>(d / 2), 0.5f);
  std::vector<float> ck(static_cast<size_t>(Batch::kNumBlocks * Batch::kBlockSize * row)), cv(ck.size());
  const KvWriteParams valid{.k = k.data(), .v = v.data(), .paged = batch.paged(), .tokens = batch.tokens,
                            .cache = {ck.data(), cv.data(), Batch::kNumBlocks, Batch::kBlockSize, kv_heads, d},
                            .rope = RopeParams{.q = q.data(), .k = k.data(), .positions = batch.positions.data(),
                                               .inv_freq = inv_freq.data(), .tokens = batch.tokens,
                                               .q_heads = q_heads, .kv_heads = kv_heads, .head_dim = d}};
  ASSERT_TRUE(b_->KvWrite(valid).ok());
  auto expect_invalid = [&](const KvWriteParams& p, const std::string& what) {
    EXPECT_THAT(b_->KvWrite(p), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what))) << what;
  };
  KvWriteParams p = valid;
  p.rope->k = other.data();
  expect_invalid(p, "rope.k must be the k the op writes");
  p = valid;
  p.rope->tokens = batch.tokens - 1;
  expect_invalid(p, "rope shape (12 tokens, 2 kv heads of 8) differs from the write's (13 tokens");
  p = valid;
  p.rope->kv_heads = 1;
  expect_invalid(p, "differs from the write's");
  p = valid;
  p.rope->head_dim = 7;
  expect_invalid(p, "rope: Rope: bad size (head_dim must be even)");
  p = valid;
  p.rope->q = v.data();
  expect_invalid(p, "rope.q aliases k or v");
  p = valid;
  p.rope->positions = nullptr;
  expect_invalid(p, "rope: Rope: null pointer");

  // Rows that do not tile [0, tokens) in order: a gap, and sequences out of order.
  std::vector<AttnSeq> gap = batch.seqs;
  gap[1].q_begin = 8;
  gap[1].q_len = 0;
  p = valid;
  p.paged.seqs = p.paged.host_seqs = gap.data();
  expect_invalid(p, "sequence 1 starts at row 8, expected 7");
  std::vector<AttnSeq> swapped = {batch.seqs[1], batch.seqs[0], batch.seqs[2]};
  p = valid;
  p.paged.seqs = p.paged.host_seqs = swapped.data();
  expect_invalid(p, "sequence 0 starts at row 7, expected 0");
  p = valid;
  p.paged.num_seqs = 2;  // rows 8..12 belong to no sequence
  p.rope->tokens = p.tokens = batch.tokens;
  expect_invalid(p, "they cover 8 of 13 rows");
  // Without rope the same layouts are fine (KvWrite writes the rows its sequences name).
  p.rope.reset();
  EXPECT_TRUE(b_->KvWrite(p).ok());
}

}  // namespace
}  // namespace shardserve::kernels
