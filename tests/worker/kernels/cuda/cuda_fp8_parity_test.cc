// CUDA's Linear with F8_E4M3 weights (codes + scales, linear_fp8.cuh) against the CPU backend's f32
// Linear of the same weights dequantized on the host by kernels/shared/fp8_math.h (bit for bit
// common/fp8's values, fp8_math_test.cc). Skipped without a device (label gpu).
//
// Tolerances: up to kGemvFp8MaxTokens (8) tokens the GPU's GEMV multiplies the same f32 weights by
// the f32 activations, only the summation order differs: the f32 tolerance (1e-4 of the largest
// output, nmse 1e-8). Above, the weights are dequantized to bf16 and the activations rounded to
// bf16 for the tensor cores (about 2^-9 relative per product each): 2e-2 of the largest output and
// nmse 1e-5, as for the 16-bit GEMM (cuda_parity_test.cc).
//
// LinearGroup of F8_E4M3 parts (q/k/v-like, gate/up-like) up to 8 tokens is one launch of the FP8
// GEMV over every part's rows: each part matches the CPU's Linear of its dequantized weights, and
// equals bit for bit what the GPU's Linear of that part alone gives (the same kernel, a group of
// one), whatever the group's size or its parts' load paths.
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/tensor/dtype.h"
#include "tests/worker/kernels/cuda/cuda_parity_fixture.h"
#include "worker/kernels/shared/fp8_math.h"

namespace shardserve::kernels {
namespace {

// A matrix slice [out, in] of random codes (no NaN) with random scales in blocks of block_rows x
// block_cols (0 x 0: one per-tensor scale), starting at (row_offset, col_offset) of its first block.
struct Fp8Case {
  int64_t tokens, in, out;
  int64_t block_rows, block_cols, row_offset, col_offset;
  bool accumulate, bias;
};

void PrintTo(const Fp8Case& c, std::ostream* os) {
  *os << "t" << c.tokens << "_in" << c.in << "_out" << c.out << "_b" << c.block_rows << "x" << c.block_cols << "_o"
      << c.row_offset << "x" << c.col_offset << (c.accumulate ? "_acc" : "") << (c.bias ? "_bias" : "");
}

std::string CaseName(const ::testing::TestParamInfo<Fp8Case>& info) {
  std::ostringstream os;
  PrintTo(info.param, &os);
  return os.str();
}

struct Fp8Matrix {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  Fp8ScaleGrid grid;  // scales pointer unset
};

Fp8Matrix RandomFp8(const Fp8Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Fp8Matrix m;
  m.codes.resize(static_cast<size_t>(c.out * c.in));
  for (uint8_t& v : m.codes) {
    v = static_cast<uint8_t>(rng() & 0xffu);
    if ((v & 0x7fu) == 0x7fu) v = 0x38;  // 1.0 instead of NaN
  }
  int64_t grid_rows = 1;
  if (c.block_rows > 0) {
    m.grid = {.block_rows = c.block_rows, .block_cols = c.block_cols,
              .grid_cols = (c.col_offset + c.in + c.block_cols - 1) / c.block_cols, .row_offset = c.row_offset,
              .col_offset = c.col_offset};
    grid_rows = (c.row_offset + c.out + c.block_rows - 1) / c.block_rows;
  } else {
    m.grid = {.block_rows = c.out, .block_cols = c.in, .grid_cols = 1};
  }
  std::uniform_real_distribution<float> scale(1e-3f, 2e-2f);
  m.scales.resize(static_cast<size_t>(grid_rows * m.grid.grid_cols));
  for (float& s : m.scales) s = scale(rng);
  return m;
}

std::vector<float> Dequantized(const Fp8Matrix& m, int64_t out, int64_t in) {
  std::vector<float> w(static_cast<size_t>(out * in));
  Fp8ScaleGrid g = m.grid;
  g.scales = m.scales.data();
  for (int64_t r = 0; r < out; ++r) Fp8DequantizeRow(m.codes.data(), g, r, in, w.data() + r * in);
  return w;
}

class CudaFp8ParityTest : public CudaParityTest, public ::testing::WithParamInterface<Fp8Case> {};

TEST_P(CudaFp8ParityTest, MatchesCpuOnDequantizedWeights) {
  const Fp8Case c = GetParam();
  ASSERT_TRUE(backend(kGpu).SupportsOp(Op::kLinear, DType::kF8E4M3));
  const Fp8Matrix m = RandomFp8(c, 21);
  auto x = Mirror(RandomFloats(c.tokens * c.in, 22));
  auto w = Mirror(Dequantized(m, c.out, c.in));
  auto codes = Mirror(m.codes);
  auto scales = Mirror(m.scales);
  auto bias = Mirror(RandomFloats(c.out, 23));
  auto y = Mirror(RandomFloats(c.tokens * c.out, 24));  // nonzero, so accumulate matters
  RunBoth([&](Backend& b, int s) {
    Fp8ScaleGrid g = m.grid;
    g.scales = scales.at(s);
    const WeightView view = s == kRef ? WeightView(w.at(s)) : WeightView::F8E4M3(codes.at(s), g);
    return b.Linear({.x = x.at(s), .w = view, .bias = c.bias ? bias.at(s) : nullptr, .y = y.at(s), .tokens = c.tokens,
                     .in = c.in, .out = c.out, .accumulate = c.accumulate});
  });
  if (c.tokens <= 8) {
    ExpectMirrorsClose(y);
  } else {
    ExpectMirrorsClose(y, 2e-2f, 1e-5);
  }
}

// Tokens 1, 3, 8 (the GEMV; in = 4096 and 1024 with 128-wide blocks take its 16-byte loads, in = 100
// and blocks of 24 x 20 with offsets its scalar path) and 9, 64 (dequantized bf16 GEMM); per-tensor
// scales; 9 tokens of a [2100, 4096] matrix dequantize in two chunks of the scratch.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaFp8ParityTest,
    ::testing::Values(Fp8Case{1, 4096, 300, 128, 128, 0, 0, false, false},
                      Fp8Case{3, 1024, 257, 128, 128, 64, 0, true, true},
                      Fp8Case{8, 1024, 130, 0, 0, 0, 0, false, true},
                      Fp8Case{3, 100, 65, 24, 20, 5, 7, true, false},
                      Fp8Case{1, 17, 7, 0, 0, 0, 0, false, true},
                      Fp8Case{9, 1024, 257, 128, 128, 0, 64, false, true},
                      Fp8Case{64, 300, 129, 24, 20, 23, 19, true, true},
                      Fp8Case{64, 1024, 512, 0, 0, 0, 0, false, false},
                      Fp8Case{9, 4096, 2100, 128, 128, 0, 0, true, false}),
    CaseName);

// After Reserve sized the scratch for 256 tokens, a 9-token FP8 GEMM dequantizes its chunks into
// what is left beside x (247 of 257 rows, then 10) and allocates nothing: it records into a graph,
// whose replay gives the CPU's products.
TEST_F(CudaParityTest, Fp8GemmInTheReservedScratchIsRecordable) {
  ASSERT_TRUE(backend(kGpu).Reserve({.max_tokens = 256, .max_linear_in = 1024}).ok());
  const Fp8Case c{9, 1024, 257, 128, 128, 0, 0, false, true};
  const Fp8Matrix m = RandomFp8(c, 41);
  auto x = Mirror(RandomFloats(c.tokens * c.in, 42));
  auto w = Mirror(Dequantized(m, c.out, c.in));
  auto codes = Mirror(m.codes);
  auto scales = Mirror(m.scales);
  auto bias = Mirror(RandomFloats(c.out, 43));
  auto y = Mirror(std::vector<float>(c.tokens * c.out));
  auto params = [&](int s) {
    Fp8ScaleGrid g = m.grid;
    g.scales = scales.at(s);
    return LinearParams{.x = x.at(s), .w = s == kRef ? WeightView(w.at(s)) : WeightView::F8E4M3(codes.at(s), g),
                        .bias = bias.at(s), .y = y.at(s), .tokens = c.tokens, .in = c.in, .out = c.out};
  };
  ASSERT_TRUE(backend(kRef).Linear(params(kRef)).ok());
  auto graph = backend(kGpu).Capture([&] { return backend(kGpu).Linear(params(kGpu)); });
  ASSERT_TRUE(graph.ok()) << graph.status();
  ASSERT_TRUE((*graph)->Replay().ok());
  ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  ExpectMirrorsClose(y, 2e-2f, 1e-5);
}

TEST_F(CudaParityTest, Fp8WeightsAreCudaLinearOnly) {
  EXPECT_TRUE(backend(kGpu).SupportsOp(Op::kLinear, DType::kF8E4M3));
  EXPECT_FALSE(backend(kRef).SupportsOp(Op::kLinear, DType::kF8E4M3));  // CPU ranks dequantize on load
  for (Op op : {Op::kEmbedding, Op::kGroupedLinear, Op::kHeadLinear, Op::kKvWrite}) {
    EXPECT_FALSE(backend(kGpu).SupportsOp(op, DType::kF8E4M3)) << OpName(op);
  }
}

// LinearGroup with F8_E4M3 parts at 2 tokens: one GEMV launch for both.
TEST_F(CudaParityTest, LinearGroupOfFp8PartsMatchesCpu) {
  const int64_t tokens = 2, in = 256;
  const int64_t outs[2] = {96, 40};
  auto x = Mirror(RandomFloats(tokens * in, 31));
  std::vector<Fp8Matrix> mats;
  std::vector<Mirrored<float>> w, scales, y;
  std::vector<Mirrored<uint8_t>> codes;
  for (int i = 0; i < 2; ++i) {
    const Fp8Case c{tokens, in, outs[i], 128, 128, 0, 0, false, false};
    mats.push_back(RandomFp8(c, 32 + i));
    w.push_back(Mirror(Dequantized(mats.back(), outs[i], in)));
    codes.push_back(Mirror(mats.back().codes));
    scales.push_back(Mirror(mats.back().scales));
    y.push_back(Mirror(std::vector<float>(tokens * outs[i])));
  }
  RunBoth([&](Backend& b, int s) {
    LinearGroupParams g{.x = x.at(s), .tokens = tokens, .in = in, .num_parts = 2};
    for (int i = 0; i < 2; ++i) {
      Fp8ScaleGrid grid = mats[i].grid;
      grid.scales = scales[i].at(s);
      g.parts[i] = {.w = s == kRef ? WeightView(w[i].at(s)) : WeightView::F8E4M3(codes[i].at(s), grid),
                    .y = y[i].at(s), .out = outs[i]};
    }
    return b.LinearGroup(g);
  });
  for (const auto& part : y) ExpectMirrorsClose(part);
}

// One part of an FP8 LinearGroup: its rows, its scale blocks as Fp8Case describes them (0 x 0:
// per-tensor) and what it adds.
struct Fp8GroupPart {
  int64_t out, block_rows, block_cols, row_offset, col_offset;
  bool bias, accumulate;
};

struct Fp8GroupLayout {
  std::string name;
  int64_t in;
  std::vector<Fp8GroupPart> parts;
};

void PrintTo(const Fp8GroupLayout& l, std::ostream* os) {
  *os << l.name << " (in " << l.in << ", outs";
  for (const Fp8GroupPart& part : l.parts) *os << " " << part.out;
  *os << ")";
}

// The host data of a group in both backends, y already holding nonzero values (so that
// accumulate matters); `alone` holds the same initial y, for the parts' Linear one by one.
class CudaFp8GroupTest : public CudaParityTest {
 protected:
  struct Data {
    int64_t tokens = 0, in = 0;
    std::vector<Fp8GroupPart> parts;
    std::vector<Fp8Matrix> mats;
    Mirrored<float> x;
    std::vector<Mirrored<float>> w, scales, bias, y, alone;
    std::vector<Mirrored<uint8_t>> codes;
  };

  Data Make(int64_t tokens, const Fp8GroupLayout& layout, uint32_t seed) {
    Data d;
    d.tokens = tokens;
    d.in = layout.in;
    d.parts = layout.parts;
    d.x = Mirror(RandomFloats(static_cast<size_t>(tokens * layout.in), seed));
    for (size_t i = 0; i < layout.parts.size(); ++i) {
      const Fp8GroupPart& part = layout.parts[i];
      const Fp8Case c{tokens, layout.in, part.out, part.block_rows, part.block_cols, part.row_offset, part.col_offset,
                      part.accumulate, part.bias};
      const auto part_seed = static_cast<uint32_t>(seed + 10 * (i + 1));
      d.mats.push_back(RandomFp8(c, part_seed));
      d.w.push_back(Mirror(Dequantized(d.mats.back(), part.out, layout.in)));
      d.codes.push_back(Mirror(d.mats.back().codes));
      d.scales.push_back(Mirror(d.mats.back().scales));
      d.bias.push_back(Mirror(RandomFloats(static_cast<size_t>(part.out), part_seed + 1)));
      const std::vector<float> y0 = RandomFloats(static_cast<size_t>(tokens * part.out), part_seed + 2);
      d.y.push_back(Mirror(y0));
      d.alone.push_back(Mirror(y0));
    }
    return d;
  }

  // Part i as a Linear on `side` (the CPU's with the dequantized f32 weights) writing into y.
  static LinearParams PartLinear(const Data& d, size_t i, int side, float* y) {
    const Fp8GroupPart& part = d.parts[i];
    Fp8ScaleGrid grid = d.mats[i].grid;
    grid.scales = d.scales[i].at(side);
    const WeightView w = side == kRef ? WeightView(d.w[i].at(side)) : WeightView::F8E4M3(d.codes[i].at(side), grid);
    return {.x = d.x.at(side), .w = w, .bias = part.bias ? d.bias[i].at(side) : nullptr, .y = y, .tokens = d.tokens,
            .in = d.in, .out = part.out, .accumulate = part.accumulate};
  }

  static LinearGroupParams Group(const Data& d, int side) {
    LinearGroupParams g{
        .x = d.x.at(side), .tokens = d.tokens, .in = d.in, .num_parts = static_cast<int>(d.parts.size())};
    for (size_t i = 0; i < d.parts.size(); ++i) {
      const LinearParams p = PartLinear(d, i, side, d.y[i].at(side));
      g.parts[i] = {.w = p.w, .bias = p.bias, .y = p.y, .out = p.out, .accumulate = p.accumulate};
    }
    return g;
  }
};

// q/k/v-like (three parts of different heights, one with bias, one accumulating, starting inside
// their scale blocks), gate/up-like (two parts of 2300 rows: more rows than one wave of blocks has
// warps, so each warp walks several), mixed (a part whose 20-column blocks rule out the 16-byte
// loads beside two that take them: two launches) and scalar (in = 100: no 16-byte loads at all).
// in = 1008 is a multiple of 16 but not of 128: the last scale block of each row is ragged.
const Fp8GroupLayout kFp8GroupLayouts[] = {
    {"qkv",
     1008,
     {{257, 128, 128, 0, 0, true, false}, {72, 128, 128, 64, 48, false, true}, {72, 128, 128, 100, 0, false, false}}},
    {"gate_up", 1008, {{2300, 128, 128, 37, 16, false, false}, {2300, 128, 128, 37, 16, true, true}}},
    {"mixed",
     1008,
     {{300, 128, 128, 0, 0, true, false}, {200, 24, 20, 5, 7, false, true}, {45, 0, 0, 0, 0, true, true}}},
    {"scalar", 100, {{65, 24, 20, 5, 7, true, false}, {33, 128, 128, 0, 0, false, true}}},
};

// (tokens, layout)
using Fp8GroupCase = std::tuple<int64_t, Fp8GroupLayout>;

std::string GroupCaseName(const ::testing::TestParamInfo<Fp8GroupCase>& info) {
  std::ostringstream os;
  os << "t" << std::get<0>(info.param) << "_" << std::get<1>(info.param).name;
  return os.str();
}

class CudaFp8GroupParityTest : public CudaFp8GroupTest, public ::testing::WithParamInterface<Fp8GroupCase> {};

TEST_P(CudaFp8GroupParityTest, MatchesCpuAndEachPartAlone) {
  const auto& [tokens, layout] = GetParam();
  ASSERT_TRUE(backend(kGpu).SupportsOp(Op::kLinear, DType::kF8E4M3));
  const Data d = Make(tokens, layout, 51);
  RunBoth([&](Backend& b, int s) { return b.LinearGroup(Group(d, s)); });
  for (size_t i = 0; i < d.parts.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "part " << i);
    ExpectMirrorsClose(d.y[i]);
  }
  for (size_t i = 0; i < d.parts.size(); ++i) {
    ASSERT_TRUE(backend(kGpu).Linear(PartLinear(d, i, kGpu, d.alone[i].at(kGpu))).ok());
  }
  ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  for (size_t i = 0; i < d.parts.size(); ++i) {
    EXPECT_EQ(Read(d.y[i], kGpu), Read(d.alone[i], kGpu)) << "part " << i << ": the group's sums differ from alone";
  }
}

INSTANTIATE_TEST_SUITE_P(TokensAndLayouts, CudaFp8GroupParityTest,
                         ::testing::Combine(::testing::Values<int64_t>(1, 2, 3, 5, 8),
                                            ::testing::ValuesIn(kFp8GroupLayouts)),
                         GroupCaseName);

// The gated form with F8_E4M3 gate and up parts (an FP8 MLP's decode step): the group GEMV, then
// the activation, as the CPU's two Linears and SiluMul.
TEST_F(CudaFp8GroupTest, GatedGroupMatchesCpu) {
  const Fp8GroupLayout layout{"gated", 1008, {{700, 128, 128, 0, 0, false, false}, {700, 128, 128, 0, 0, false, false}}};
  for (int64_t tokens : {1, 3, 8}) {
    for (GateActivation act : {GateActivation::kSilu, GateActivation::kGeluTanh, GateActivation::kClampedSwiglu}) {
      SCOPED_TRACE(::testing::Message() << tokens << " tokens, activation " << static_cast<int>(act));
      const Data d = Make(tokens, layout, 61);
      RunBoth([&](Backend& b, int s) {
        LinearGroupParams g = Group(d, s);
        g.gated = act;
        return b.LinearGroup(g);
      });
      ExpectMirrorsClose(d.y[0]);
    }
  }
}

// A 1-token q/k/v group recorded into a graph: its replay gives the CPU's products.
TEST_F(CudaFp8GroupTest, RecordsIntoAGraph) {
  const Data d = Make(1, kFp8GroupLayouts[0], 81);
  ASSERT_TRUE(backend(kRef).LinearGroup(Group(d, kRef)).ok());
  auto graph = backend(kGpu).Capture([&] { return backend(kGpu).LinearGroup(Group(d, kGpu)); });
  ASSERT_TRUE(graph.ok()) << graph.status();
  ASSERT_TRUE((*graph)->Replay().ok());
  ASSERT_TRUE(backend(kGpu).Synchronize().ok());
  for (size_t i = 0; i < d.parts.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "part " << i);
    ExpectMirrorsClose(d.y[i]);
  }
}

}  // namespace
}  // namespace shardserve::kernels
