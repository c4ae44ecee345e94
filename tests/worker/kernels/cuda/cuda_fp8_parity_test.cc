// CUDA's Linear with F8_E4M3 weights (codes + scales, linear_fp8.cuh) against the CPU backend's f32
// Linear of the same weights dequantized on the host by kernels/shared/fp8_math.h (bit for bit
// common/fp8's values, fp8_math_test.cc). Skipped without a device (label gpu).
//
// Tolerances: up to kGemvFp8MaxTokens (8) tokens the GPU's GEMV multiplies the same f32 weights by
// the f32 activations, only the summation order differs: the f32 tolerance (1e-4 of the largest
// output, nmse 1e-8). Above, the weights are dequantized to bf16 and the activations rounded to
// bf16 for the tensor cores (about 2^-9 relative per product each): 2e-2 of the largest output and
// nmse 1e-5, as for the 16-bit GEMM (cuda_parity_test.cc).
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
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

// LinearGroup with F8_E4M3 parts: a Linear per part (the default), each the GEMV at 2 tokens.
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

}  // namespace
}  // namespace shardserve::kernels
