// The CPU Linear kernels side by side on one thread, at decode and short-prefill batch sizes:
// SmallBatchLinear (one weight stream, per-output dot products), BlockedLinear's AVX2 body (4 rows
// x 3 tokens of ymm tiles) and AVX-512 body (4 rows x 6 tokens of zmm tiles, where the CPU has
// it) and OpenBLAS sgemm. Weights are cold: each timed call reads a different copy
// from a pool larger than the last-level cache, as a decode step does. Prints GFLOP/s and the
// ratio of the kernel the backend picks to sgemm.
// Usage: shardserve-bench-kernels [--pool_mb=512] [--reps=3] [--tokens=1,2,3,4,8,16,32,48,64,128]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "worker/kernels/cpu/gemv.h"

ABSL_FLAG(int32_t, pool_mb, 512, "weight pool size in MB (should exceed the last-level cache)");
ABSL_FLAG(int32_t, reps, 3, "timed passes over the pool; the best is reported");
ABSL_FLAG(std::vector<std::string>, tokens,
          std::vector<std::string>({"1", "2", "3", "4", "8", "16", "32", "48", "64", "128"}), "token counts");

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace shardserve::kernels::cpu;
  openblas_set_num_threads(1);
  const size_t pool = static_cast<size_t>(absl::GetFlag(FLAGS_pool_mb)) * (size_t{1} << 20) / sizeof(float);
  std::vector<float> weights(pool);
  for (size_t i = 0; i < pool; ++i) weights[i] = static_cast<float>(i % 7) * 1e-3f;
  std::vector<int64_t> token_counts;
  for (const auto& s : absl::GetFlag(FLAGS_tokens)) token_counts.push_back(std::atoi(s.c_str()));
  const bool avx512 = HaveAvx512();
  // Llama-shaped products: attention projection, MLP up, MLP down, vocabulary head (100M model).
  const int64_t shapes[][2] = {{768, 768}, {768, 2048}, {2048, 768}, {768, 32000}};
  std::printf("AVX-512: %s; the backend uses small up to %ld tokens, blocked%s up to %ld\n",
              avx512 ? "yes" : "no (blocked512 not run)", static_cast<long>(SmallBatchMaxTokens()),
              avx512 ? "512" : "2", static_cast<long>(BlockedMaxTokens()));
  std::printf("%-16s %6s %12s %12s %12s %12s %10s\n", "in x out", "tokens", "small", "blocked2", "blocked512",
              "sgemm", "picked/sgemm");
  for (const auto& shape : shapes) {
    const int64_t in = shape[0], out = shape[1];
    const size_t mat = static_cast<size_t>(in * out);
    const size_t copies = std::max<size_t>(1, pool / mat);
    for (int64_t m : token_counts) {
      std::vector<float> x(static_cast<size_t>(m * in), 0.01f), y(static_cast<size_t>(m * out));
      auto time = [&](auto&& f) {
        double best = 1e30;
        for (int r = 0; r < absl::GetFlag(FLAGS_reps); ++r) {
          const double t0 = Now();
          for (size_t c = 0; c < copies; ++c) f(weights.data() + c * mat);
          best = std::min(best, (Now() - t0) / static_cast<double>(copies));
        }
        return 2.0 * static_cast<double>(m * in * out) / best / 1e9;
      };
      const double small = time([&](const float* w) {
        SmallBatchLinear(x.data(), w, nullptr, y.data(), m, in, out, false, 0, out);
      });
      const double blocked2 = time([&](const float* w) {
        BlockedLinearAvx2(x.data(), w, nullptr, y.data(), m, in, out, false, 0, out);
      });
      const double blocked512 = avx512 ? time([&](const float* w) {
        BlockedLinearAvx512(x.data(), w, nullptr, y.data(), m, in, out, false, 0, out);
      })
                                       : 0.0;
      const double sgemm = time([&](const float* w) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(out),
                    static_cast<int>(in), 1.f, x.data(), static_cast<int>(in), w, static_cast<int>(in), 0.f, y.data(),
                    static_cast<int>(out));
      });
      const double blocked = avx512 ? blocked512 : blocked2;
      const double picked = m <= SmallBatchMaxTokens() ? small : m <= BlockedMaxTokens() ? blocked : sgemm;
      char b512[32] = "           -";
      if (avx512) std::snprintf(b512, sizeof(b512), "%7.1f GF/s", blocked512);
      std::printf("%5ld x %-8ld %6ld %7.1f GF/s %7.1f GF/s %s %7.1f GF/s %9.2fx\n", static_cast<long>(in),
                  static_cast<long>(out), static_cast<long>(m), small, blocked2, b512, sgemm, picked / sgemm);
    }
  }
  return 0;
}
