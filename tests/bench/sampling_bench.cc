// The last stage's per-token host cost of what a request may ask for, on one logits row: the
// argmax (what a greedy request needs), seeded sampling (temperature, top-p), logprobs of the
// chosen token and the top 20, and the penalties over a token history. Prints microseconds per
// token and each as a multiple of the argmax, which only reads the row once.
//
//   shardserve-bench-sampling [--vocab=32000,151936] [--history=2000] [--iters=200]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/sampling/token_history.h"
#include "worker/engine/sampling.h"

ABSL_FLAG(std::string, vocab, "32000,151936", "vocabulary sizes, comma-separated");
ABSL_FLAG(int32_t, history, 2000, "tokens in the penalized sequence's history (half prompt, half generated)");
ABSL_FLAG(int32_t, iters, 200, "tokens timed per case");

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double MicrosPerCall(int iters, F&& f) {
  f(0);  // warm
  const auto start = Clock::now();
  for (int i = 0; i < iters; ++i) f(static_cast<uint64_t>(i + 1));
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count() / iters;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using shardserve::engine::SamplingParams;
  const int iters = absl::GetFlag(FLAGS_iters);
  std::printf("%-8s %-34s %10s %8s\n", "vocab", "case", "us/token", "x argmax");
  for (absl::string_view v : absl::StrSplit(absl::GetFlag(FLAGS_vocab), ',')) {
    int64_t vocab = 0;
    if (!absl::SimpleAtoi(v, &vocab) || vocab < 2) {
      std::fprintf(stderr, "bad --vocab entry '%s'\n", std::string(v).c_str());
      return 2;
    }
    std::mt19937 rng(1);
    std::normal_distribution<float> logit(0.f, 3.f);
    std::vector<float> row(static_cast<size_t>(vocab));
    for (float& l : row) l = logit(rng);
    std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
    std::vector<int32_t> prompt(static_cast<size_t>(absl::GetFlag(FLAGS_history) / 2));
    for (int32_t& t : prompt) t = id(rng);
    shardserve::TokenHistory history(prompt, /*with_prompt=*/true);
    for (int i = 0; i < absl::GetFlag(FLAGS_history) / 2; ++i) history.AddGenerated(id(rng));

    shardserve::engine::Sampler sampler;
    volatile int64_t sink = 0;
    const double argmax = MicrosPerCall(iters, [&](uint64_t) {
      sink = sink + (std::max_element(row.begin(), row.end()) - row.begin());
    });
    const SamplingParams sampled{.temperature = 0.8f, .top_p = 0.95f, .seed = 7};
    SamplingParams penalized = sampled;
    penalized.repetition_penalty = 1.1f;
    penalized.frequency_penalty = 0.3f;
    penalized.presence_penalty = 0.3f;
    penalized.history_ids = history.ids();
    penalized.history_counts = history.counts();
    SamplingParams greedy_penalized;
    greedy_penalized.presence_penalty = 0.5f;
    greedy_penalized.history_ids = history.ids();
    greedy_penalized.history_counts = history.counts();
    struct Case {
      const char* name;
      double us;
    };
    const std::vector<Case> cases = {
        {"argmax (greedy)", argmax},
        {"greedy + presence penalty", MicrosPerCall(iters, [&](uint64_t s) { sink = sink + sampler.Sample(row, greedy_penalized, s); })},
        {"temperature 0.8, top_p 0.95", MicrosPerCall(iters, [&](uint64_t s) { sink = sink + sampler.Sample(row, sampled, s); })},
        {"... + all three penalties", MicrosPerCall(iters, [&](uint64_t s) { sink = sink + sampler.Sample(row, penalized, s); })},
        {"logprob of the chosen token", MicrosPerCall(iters, [&](uint64_t s) {
           sink = sink + static_cast<int64_t>(shardserve::engine::ComputeLogprobs(row, static_cast<int32_t>(s % 7), 0).logprob);
         })},
        {"logprobs, top 20", MicrosPerCall(iters, [&](uint64_t s) {
           sink = sink + static_cast<int64_t>(shardserve::engine::ComputeLogprobs(row, static_cast<int32_t>(s % 7), 20).top_ids.size());
         })},
    };
    for (const Case& c : cases) {
      std::printf("%-8lld %-34s %10.1f %8.1f\n", static_cast<long long>(vocab), c.name, c.us, c.us / argmax);
    }
    std::printf("%-8lld history: %zu distinct ids\n", static_cast<long long>(vocab), history.ids().size());
  }
  return 0;
}
