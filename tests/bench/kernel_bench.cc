// The CPU Linear kernels side by side on one thread, at decode and short-prefill batch sizes, with
// f32 and with bfloat16 weights: SmallBatchLinear (one weight stream, per-output dot products),
// BlockedLinear's AVX2 body (4 rows x 3 tokens of ymm tiles) and AVX-512 body (4 rows x 6 tokens
// of zmm tiles, where the CPU has it), OpenBLAS sgemm (f32), and for bfloat16 the CPU backend's
// Linear, which picks among its kernels and, above them, widens blocks of rows for sgemm. Weights
// are cold: each timed call reads a different copy from a pool larger than the last-level cache,
// as a decode step does. Prints GFLOP/s (GF/s), the ratio of the f32 kernel the backend picks to
// sgemm, the ratio of the bfloat16 pick to the f32 pick, the int8 (Q8) Linear and its ratio to the
// f32 pick, the MXFP4 Linear (gpt-oss's expert format) and its ratio to the bfloat16 pick and, at 1
// token, the weight bytes read per second (GB/s) of the four (Q8 and MXFP4: their bytes plus
// scales).
// Usage: shardserve-bench-kernels [--pool_mb=512] [--reps=3] [--tokens=1,2,3,4,8,16,32,48,64,128,256]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "worker/kernels/cpu/cpu_backend.h"
#include "worker/kernels/cpu/gemv.h"
#include "worker/kernels/cpu/q8.h"

ABSL_FLAG(int32_t, pool_mb, 512, "weight pool size in MB per weight type (should exceed the last-level cache)");
ABSL_FLAG(int32_t, reps, 3, "timed passes over the pool; the best is reported");
ABSL_FLAG(std::vector<std::string>, tokens,
          std::vector<std::string>({"1", "2", "3", "4", "8", "16", "32", "48", "64", "128", "256"}),
          "token counts");

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// "%6.1f", or "-" for a kernel not run.
std::string Cell(double v) {
  char buf[32];
  if (v > 0) {
    std::snprintf(buf, sizeof(buf), "%6.1f", v);
  } else {
    std::snprintf(buf, sizeof(buf), "%6s", "-");
  }
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace shardserve::kernels::cpu;
  auto backend_or = shardserve::kernels::CreateCpuBackend(1);  // also sets OpenBLAS to one thread
  if (!backend_or.ok()) {
    std::fprintf(stderr, "%s\n", backend_or.status().ToString().c_str());
    return 1;
  }
  shardserve::kernels::Backend& backend = **backend_or;
  const size_t pool_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_pool_mb)) * (size_t{1} << 20);
  const size_t pool = pool_bytes / sizeof(float), pool16 = pool_bytes / sizeof(uint16_t);
  std::vector<float> weights(pool);
  for (size_t i = 0; i < pool; ++i) weights[i] = static_cast<float>(i % 7) * 1e-3f;
  std::vector<uint16_t> weights16(pool16);
  for (size_t i = 0; i < pool16; ++i) weights16[i] = static_cast<uint16_t>(0x3A00 + i % 7);  // ~5e-4
  std::vector<int64_t> token_counts;
  for (const auto& s : absl::GetFlag(FLAGS_tokens)) token_counts.push_back(std::atoi(s.c_str()));
  const bool avx512 = HaveAvx512();
  // Llama-shaped products: attention projection, MLP up, MLP down, vocabulary head (100M model).
  // And gpt-oss's expert gate/up product (2880 x 2 x 2880), whose weights are MXFP4 as released.
  const int64_t shapes[][2] = {{768, 768}, {768, 2048}, {2048, 768}, {768, 32000}, {2880, 5760}};
  std::printf("AVX-512: %s. f32: small up to %ld tokens, blocked%s up to %ld, sgemm above. bf16: small up to %ld, "
              "blocked%s up to %ld, widened sgemm above. GF/s; small run up to 128 tokens, blocked up to %ld.\n",
              avx512 ? "yes" : "no (blocked512 not run)", static_cast<long>(SmallBatchMaxTokens()),
              avx512 ? "512" : "2", static_cast<long>(BlockedMaxTokens()),
              static_cast<long>(SmallBatchMaxTokensBf16()), avx512 ? "512" : "2",
              static_cast<long>(BlockedMaxTokensBf16()),
              static_cast<long>(std::max(BlockedMaxTokens(), BlockedMaxTokensBf16())));
  std::printf("Q8: %s body.\n", HaveAvx512Vnni() ? "AVX-512 VNNI" : "AVX2");
  std::printf("%-13s %6s | %6s %6s %6s %6s %6s %7s | %6s %6s %6s %6s %9s | %6s %7s | %6s %8s | %s\n", "in x out",
              "tokens", "small", "blk2", "blk512", "sgemm", "picked", "pk/sgemm", "small", "blk2", "blk512", "picked",
              "bf16/f32", "q8", "q8/f32", "mxfp4", "mx4/bf16", "1-token GB/s f32 bf16 q8 mxfp4");
  for (const auto& shape : shapes) {
    const int64_t in = shape[0], out = shape[1];
    const size_t mat = static_cast<size_t>(in * out);
    const size_t copies = std::max<size_t>(1, pool / mat), copies16 = std::max<size_t>(1, pool16 / mat);
    // Q8 copies of the matrix, packed from the f32 pool's first copy.
    const size_t q8_bytes = Q8Layout::For(out, in).bytes;
    const size_t copies8 = std::max<size_t>(1, pool_bytes / q8_bytes);
    std::vector<uint8_t> weights8(copies8 * q8_bytes);
    PackQ8(weights.data(), out, in, weights8.data());
    for (size_t c = 1; c < copies8; ++c) std::copy_n(weights8.data(), q8_bytes, weights8.data() + c * q8_bytes);
    // MXFP4 copies: code pairs [out, in / 2], then scale bytes [out, in / 32] (2^-7 .. 2^0).
    const size_t mx_codes = static_cast<size_t>(out * in / 2), mx_bytes = mx_codes + static_cast<size_t>(out * in / 32);
    const size_t copies4 = std::max<size_t>(1, pool_bytes / mx_bytes);
    std::vector<uint8_t> weights4(copies4 * mx_bytes);
    for (size_t i = 0; i < weights4.size(); ++i) {
      weights4[i] = static_cast<uint8_t>(i % mx_bytes < mx_codes ? i % 251 : 120 + i % 8);
    }
    for (int64_t m : token_counts) {
      std::vector<float> x(static_cast<size_t>(m * in), 0.01f), y(static_cast<size_t>(m * out));
      // Seconds per call, the best of the passes.
      auto seconds = [&](auto&& f, const auto* base, size_t n, size_t stride) {
        double best = 1e30;
        for (int r = 0; r < absl::GetFlag(FLAGS_reps); ++r) {
          const double t0 = Now();
          for (size_t c = 0; c < n; ++c) f(base + c * stride);
          best = std::min(best, (Now() - t0) / static_cast<double>(n));
        }
        return best;
      };
      const double flops = 2.0 * static_cast<double>(m * in * out);
      auto gf = [&](auto&& f) { return flops / seconds(f, weights.data(), copies, mat) / 1e9; };
      auto gf16 = [&](auto&& f) { return flops / seconds(f, weights16.data(), copies16, mat) / 1e9; };
      auto gf8 = [&](auto&& f) { return flops / seconds(f, weights8.data(), copies8, q8_bytes) / 1e9; };
      auto gf4 = [&](auto&& f) { return flops / seconds(f, weights4.data(), copies4, mx_bytes) / 1e9; };
      // The stream kernels are slow at large batches and never picked there.
      const bool run_small = m <= 128;
      const bool run_blocked = m <= std::max(BlockedMaxTokens(), BlockedMaxTokensBf16());
      double small = 0, blocked2 = 0, blocked512 = 0, small16 = 0, blocked2_16 = 0, blocked512_16 = 0;
      if (run_small) {
        small = gf([&](const float* w) { SmallBatchLinear(x.data(), w, nullptr, y.data(), m, in, out, false, 0, out); });
        small16 = gf16([&](const uint16_t* w) {
          SmallBatchLinearBf16(x.data(), w, nullptr, y.data(), m, in, out, false, 0, out);
        });
      }
      if (run_blocked) {
        blocked2 =
            gf([&](const float* w) { BlockedLinearAvx2(x.data(), w, nullptr, y.data(), m, in, out, false, 0, out); });
        if (avx512) {
          blocked512 = gf(
              [&](const float* w) { BlockedLinearAvx512(x.data(), w, nullptr, y.data(), m, in, out, false, 0, out); });
        }
        blocked2_16 = gf16([&](const uint16_t* w) {
          BlockedLinearBf16Avx2(x.data(), w, nullptr, y.data(), m, in, out, false, 0, out);
        });
        if (avx512) {
          blocked512_16 = gf16([&](const uint16_t* w) {
            BlockedLinearBf16Avx512(x.data(), w, nullptr, y.data(), m, in, out, false, 0, out);
          });
        }
      }
      const double sgemm = gf([&](const float* w) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(out),
                    static_cast<int>(in), 1.f, x.data(), static_cast<int>(in), w, static_cast<int>(in), 0.f, y.data(),
                    static_cast<int>(out));
      });
      bool ok = true;
      const double picked16 = gf16([&](const uint16_t* w) {
        ok &= backend.Linear({.x = x.data(), .w = shardserve::kernels::WeightView::Bf16(w), .y = y.data(), .tokens = m, .in = in, .out = out}).ok();
      });
      const double q8 = gf8([&](const uint8_t* w) {
        ok &= backend.Linear({.x = x.data(), .w = shardserve::kernels::WeightView(shardserve::DType::kQ8, w),
                              .y = y.data(), .tokens = m, .in = in, .out = out})
                  .ok();
      });
      const double mx4 = gf4([&](const uint8_t* w) {
        ok &= backend.Linear({.x = x.data(), .w = shardserve::kernels::WeightView::Mxfp4(w, w + mx_codes),
                              .y = y.data(), .tokens = m, .in = in, .out = out})
                  .ok();
      });
      if (!ok) {
        std::fprintf(stderr, "bf16, Q8 or MXFP4 Linear failed\n");
        return 1;
      }
      const double blocked = avx512 ? blocked512 : blocked2;
      const double picked = m <= SmallBatchMaxTokens() ? small : m <= BlockedMaxTokens() ? blocked : sgemm;
      std::string gbs;
      if (m == 1) {
        // One token reads each weight once per 2 flops.
        gbs = Cell(picked / 2 * sizeof(float)) + " " + Cell(picked16 / 2 * sizeof(uint16_t)) + " " +
              Cell(q8 / 2 * static_cast<double>(q8_bytes) / static_cast<double>(mat)) + " " +
              Cell(mx4 / 2 * static_cast<double>(mx_bytes) / static_cast<double>(mat));
      }
      std::printf("%5ld x %-5ld %6ld | %s %s %s %s %s %7.2fx | %s %s %s %s %8.2fx | %s %6.2fx | %s %7.2fx | %s\n",
                  static_cast<long>(in), static_cast<long>(out), static_cast<long>(m), Cell(small).c_str(),
                  Cell(blocked2).c_str(), Cell(blocked512).c_str(), Cell(sgemm).c_str(), Cell(picked).c_str(),
                  picked / sgemm, Cell(small16).c_str(), Cell(blocked2_16).c_str(), Cell(blocked512_16).c_str(),
                  Cell(picked16).c_str(), picked16 / picked, Cell(q8).c_str(), q8 / picked, Cell(mx4).c_str(),
                  mx4 / picked16, gbs.c_str());
    }
  }
  return 0;
}
