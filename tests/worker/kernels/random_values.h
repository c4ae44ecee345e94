// Random test data for the CPU kernel tests (cpu_kernels_test): normally distributed f32 values
// from a fixed seed, the same values on every machine for a given seed.
#ifndef SHARDSERVE_TESTS_WORKER_KERNELS_RANDOM_VALUES_H_
#define SHARDSERVE_TESTS_WORKER_KERNELS_RANDOM_VALUES_H_

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace shardserve::kernels {

// n values drawn from N(0, scale^2) by a mt19937 seeded with `seed`.
inline std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

}  // namespace shardserve::kernels

#endif  // SHARDSERVE_TESTS_WORKER_KERNELS_RANDOM_VALUES_H_
