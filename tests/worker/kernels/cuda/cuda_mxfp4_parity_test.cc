// CUDA's Linear with MXFP4 weights (DType::kMxfp4: code pairs + e8m0 scale bytes, linear_mxfp4.cuh)
// against the CPU backend's Linear of the same MXFP4 weights (cpu/mxfp4.h, itself checked against a
// double reference in mxfp4_math_test.cc). Both decode every weight with kernels/shared/
// mxfp4_math.h. Skipped without a device (label gpu).
//
// Tolerances: up to kGemvMxfp4MaxTokens (8) tokens the GPU's GEMV multiplies the same f32 weights by
// the f32 activations, only the summation order differs: the f32 tolerance (1e-4 of the largest
// output, nmse 1e-8). Above, the weights are widened to bf16 (exact: two significant bits) and the
// activations rounded to bf16 for the tensor cores: 2e-2 of the largest output and nmse 1e-5, as for
// the FP8 and 16-bit GEMMs.
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/tensor/dtype.h"
#include "tests/worker/kernels/cuda/cuda_parity_fixture.h"
#include "worker/kernels/shared/mxfp4_math.h"

namespace shardserve::kernels {
namespace {

struct Mxfp4Case {
  int64_t tokens, in, out;
  bool accumulate, bias;
};

void PrintTo(const Mxfp4Case& c, std::ostream* os) {
  *os << "t" << c.tokens << "_in" << c.in << "_out" << c.out << (c.accumulate ? "_acc" : "") << (c.bias ? "_bias" : "");
}

std::string CaseName(const ::testing::TestParamInfo<Mxfp4Case>& info) {
  std::ostringstream os;
  PrintTo(info.param, &os);
  return os.str();
}

// Random codes, and scale bytes 2^-6 .. 2^1 (the released experts' range is similar).
void RandomMxfp4(int64_t out, int64_t in, uint32_t seed, std::vector<uint8_t>* codes, std::vector<uint8_t>* scales) {
  std::mt19937 rng(seed);
  codes->resize(static_cast<size_t>(out * in / 2));
  scales->resize(static_cast<size_t>(out * in / kMxfp4Block));
  for (uint8_t& b : *codes) b = static_cast<uint8_t>(rng() & 0xffu);
  for (uint8_t& s : *scales) s = static_cast<uint8_t>(121 + rng() % 8);
}

class CudaMxfp4ParityTest : public CudaParityTest, public ::testing::WithParamInterface<Mxfp4Case> {};

TEST_P(CudaMxfp4ParityTest, MatchesCpuOnTheSameWeights) {
  const Mxfp4Case c = GetParam();
  ASSERT_TRUE(backend(kGpu).SupportsOp(Op::kLinear, DType::kMxfp4));
  ASSERT_TRUE(backend(kRef).SupportsOp(Op::kLinear, DType::kMxfp4));
  std::vector<uint8_t> host_codes, host_scales;
  RandomMxfp4(c.out, c.in, 51, &host_codes, &host_scales);
  auto codes = Mirror(host_codes);
  auto scales = Mirror(host_scales);
  auto x = Mirror(RandomFloats(c.tokens * c.in, 52));
  auto bias = Mirror(RandomFloats(c.out, 53));
  auto y = Mirror(RandomFloats(c.tokens * c.out, 54));  // nonzero, so accumulate matters
  RunBoth([&](Backend& b, int s) {
    return b.Linear({.x = x.at(s), .w = WeightView::Mxfp4(codes.at(s), scales.at(s)),
                     .bias = c.bias ? bias.at(s) : nullptr, .y = y.at(s), .tokens = c.tokens, .in = c.in,
                     .out = c.out, .accumulate = c.accumulate});
  });
  if (c.tokens <= 8) {
    ExpectMirrorsClose(y);
  } else {
    ExpectMirrorsClose(y, 2e-2f, 1e-5);
  }
}

// Tokens 1, 2, 5, 8 (the GEMV, gpt-oss-20b's [2880 x 2] and [2880] widths among them) and 9, 64
// (bf16 GEMM on widened rows; 9 tokens of a [2100, 4096] matrix in chunks of the scratch).
INSTANTIATE_TEST_SUITE_P(Shapes, CudaMxfp4ParityTest,
                         ::testing::Values(Mxfp4Case{1, 2880, 5760, false, true}, Mxfp4Case{2, 2880, 300, true, true},
                                           Mxfp4Case{5, 64, 33, false, false}, Mxfp4Case{8, 1024, 130, true, false},
                                           Mxfp4Case{1, 32, 1, false, true}, Mxfp4Case{9, 4096, 2100, true, false},
                                           Mxfp4Case{64, 2880, 257, false, true}),
                         CaseName);

// x at an odd float offset (not 16-byte aligned) takes the GEMV's scalar activation loads.
TEST_F(CudaParityTest, Mxfp4GemvWithUnalignedActivations) {
  const int64_t tokens = 3, in = 256, out = 70;
  std::vector<uint8_t> host_codes, host_scales;
  RandomMxfp4(out, in, 61, &host_codes, &host_scales);
  auto codes = Mirror(host_codes);
  auto scales = Mirror(host_scales);
  auto x = Mirror(RandomFloats(tokens * in + 1, 62));
  auto y = Mirror(std::vector<float>(tokens * out));
  RunBoth([&](Backend& b, int s) {
    return b.Linear({.x = x.at(s) + 1, .w = WeightView::Mxfp4(codes.at(s), scales.at(s)), .y = y.at(s),
                     .tokens = tokens, .in = in, .out = out});
  });
  ExpectMirrorsClose(y);
}

}  // namespace
}  // namespace shardserve::kernels
