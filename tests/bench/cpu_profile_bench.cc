// "This CPU" for `shardserve simulate`: the figures of its CPU device profile, measured with the
// engine's own kernels (the CPU backend's Linear, which picks among the stream, blocked and sgemm
// bodies as a worker does), on one thread, and how much two stages of one machine slow each other.
//
//   shardserve-bench-cpu-profile [--in=768 --out=2048] [--decode_tokens=1] [--prefill_tokens=64]
//       [--pool_mb=128] [--seconds=1]
//
// Prints one JSON object, in the terms of the simulator's CPU roofline (an op takes its reads
// plus its arithmetic, device_profile.h):
//   flops_per_s          FLOP/s of a --prefill_tokens product (a prefill chunk's) whose weights
//                        are already in cache: arithmetic alone;
//   memory_bytes_per_s   weight bytes read per second by a --decode_tokens product (a decode step's
//                        access pattern: every call reads another copy of the matrix from a pool
//                        larger than the last-level cache), less its arithmetic at flops_per_s;
//   memory_parallelism   the two-stage probe: the same products on two threads at once, each with a
//   compute_parallelism  pool of its own, as two stage workers of one machine run; the two threads'
//                        rates together over one thread's alone, clamped to [1, 2] (what
//                        `shardserve simulate --cpu_memory_parallelism / --cpu_compute_parallelism`
//                        take);
// and, for the record, the per-thread rates each figure comes from. Each figure is the best of
// three passes of --seconds each. The figures only mean something on an otherwise idle machine.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "worker/kernels/backend.h"
#include "worker/kernels/cpu/cpu_backend.h"

ABSL_FLAG(int64_t, in, 768, "the product's input width (the 100M model's hidden size)");
ABSL_FLAG(int64_t, out, 2048, "the product's output width (the 100M model's MLP width)");
ABSL_FLAG(int64_t, decode_tokens, 1, "tokens of the bandwidth product");
ABSL_FLAG(int64_t, prefill_tokens, 64, "tokens of the compute product");
ABSL_FLAG(int32_t, pool_mb, 128, "weight pool per thread, MB (should exceed the last-level cache)");
ABSL_FLAG(double, seconds, 1.0, "length of one timed pass");

namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// One thread's products: a backend, a pool of weight copies, its activations.
class Runner {
 public:
  Runner(int64_t tokens, int64_t in, int64_t out, size_t pool_bytes)
      : tokens_(tokens), in_(in), out_(out), x_(static_cast<size_t>(tokens * in), 0.01f),
        y_(static_cast<size_t>(tokens * out)) {
    auto backend = shardserve::kernels::CreateCpuBackend(1);  // also sets OpenBLAS to one thread
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
      std::exit(1);
    }
    backend_ = *std::move(backend);
    const size_t mat = static_cast<size_t>(in * out);
    copies_ = std::max<size_t>(1, pool_bytes / sizeof(float) / mat);
    weights_.resize(copies_ * mat);
    for (size_t i = 0; i < weights_.size(); ++i) weights_[i] = static_cast<float>(i % 7) * 1e-3f;
  }

  // Products per second over `seconds`, once `go` is set.
  double Rate(double seconds, const std::atomic<bool>& go) {
    while (!go.load(std::memory_order_acquire)) {
    }
    const size_t mat = static_cast<size_t>(in_ * out_);
    int64_t calls = 0;
    const double t0 = Now();
    double t = t0;
    for (size_t c = 0; t - t0 < seconds; c = (c + 1) % copies_, t = Now()) {
      absl::Status st = backend_->Linear({.x = x_.data(), .w = weights_.data() + c * mat, .y = y_.data(),
                                          .tokens = tokens_, .in = in_, .out = out_});
      if (!st.ok()) {
        std::fprintf(stderr, "Linear failed: %s\n", st.ToString().c_str());
        std::exit(1);
      }
      ++calls;
    }
    return static_cast<double>(calls) / (t - t0);
  }

 private:
  int64_t tokens_, in_, out_;
  std::unique_ptr<shardserve::kernels::Backend> backend_;
  size_t copies_ = 1;
  std::vector<float> weights_, x_, y_;
};

// Per-thread products per second with `threads` (1 or 2) running at once: the best of 3 passes,
// the mean over the threads.
double Measure(std::vector<std::unique_ptr<Runner>>& runners, int threads, double seconds) {
  double best = 0;
  for (int pass = 0; pass < 3; ++pass) {
    std::atomic<bool> go{false};
    std::vector<double> rates(static_cast<size_t>(threads));
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; ++i) {
      pool.emplace_back([&, i] { rates[static_cast<size_t>(i)] = runners[static_cast<size_t>(i)]->Rate(seconds, go); });
    }
    go.store(true, std::memory_order_release);
    for (std::thread& t : pool) t.join();
    double sum = 0;
    for (double r : rates) sum += r;
    best = std::max(best, sum / threads);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t in = absl::GetFlag(FLAGS_in), out = absl::GetFlag(FLAGS_out);
  const int64_t decode = absl::GetFlag(FLAGS_decode_tokens), prefill = absl::GetFlag(FLAGS_prefill_tokens);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  if (in < 1 || out < 1 || decode < 1 || prefill < 1 || !(seconds > 0) || absl::GetFlag(FLAGS_pool_mb) < 1) {
    std::fprintf(stderr, "--in, --out, --decode_tokens, --prefill_tokens, --pool_mb and --seconds must be positive\n");
    return 2;
  }
  const size_t pool = static_cast<size_t>(absl::GetFlag(FLAGS_pool_mb)) << 20;
  const double mat_bytes = static_cast<double>(in * out) * sizeof(float);
  // Two runners (one per thread) with cold weights (a pool each) or hot ones (one copy each).
  auto runners = [&](int64_t tokens, size_t bytes) {
    std::vector<std::unique_ptr<Runner>> r;
    for (int i = 0; i < 2; ++i) r.push_back(std::make_unique<Runner>(tokens, in, out, bytes));
    return r;
  };
  std::vector<std::unique_ptr<Runner>> prefillers = runners(prefill, 0);
  const double prefill_one = Measure(prefillers, 1, seconds), prefill_two = Measure(prefillers, 2, seconds);
  prefillers.clear();
  std::vector<std::unique_ptr<Runner>> decoders = runners(decode, pool);
  const double decode_one = Measure(decoders, 1, seconds), decode_two = Measure(decoders, 2, seconds);
  const double flops = prefill_one * 2.0 * static_cast<double>(prefill * in * out);
  const double flops_two = prefill_two * 2.0 * static_cast<double>(prefill * in * out);
  // Seconds of a decode product that are its reads: all of it less its arithmetic (at least a
  // tenth of it, should the arithmetic estimate exceed the measurement).
  const double decode_flops = 2.0 * static_cast<double>(decode * in * out);
  auto read_seconds = [&](double calls_per_s, double flop_rate) {
    return std::max(0.1 / calls_per_s, 1 / calls_per_s - decode_flops / flop_rate);
  };
  const double bandwidth = mat_bytes / read_seconds(decode_one, flops);
  const double bandwidth_two = mat_bytes / read_seconds(decode_two, flops_two);
  auto parallelism = [](double one, double two) { return std::clamp(2 * two / one, 1.0, 2.0); };
  std::printf(
      "{\"memory_bytes_per_s\": %.6g, \"flops_per_s\": %.6g, \"memory_parallelism\": %.4f, "
      "\"compute_parallelism\": %.4f, \"memory_bytes_per_s_per_thread_of_two\": %.6g, "
      "\"flops_per_s_per_thread_of_two\": %.6g, \"shape\": [%ld, %ld], \"decode_tokens\": %ld, "
      "\"prefill_tokens\": %ld}\n",
      bandwidth, flops, parallelism(bandwidth, bandwidth_two), parallelism(flops, flops_two), bandwidth_two,
      flops_two, static_cast<long>(in), static_cast<long>(out), static_cast<long>(decode),
      static_cast<long>(prefill));
  return 0;
}
