// `shardserve bench`: a load generator for a running cluster. It sends generated requests through
// the C++ client (random prompt ids, lengths drawn from the given ranges, ignore_eos so every
// answer has the asked length), closed loop (`concurrency` clients sending back to back) or open
// loop (Poisson arrivals at `rate` per second, at most `concurrency` in flight: later arrivals wait
// client-side, and that wait counts in their TTFT), and summarises throughput and latency.
//
// Latency definitions: TTFT = send -> first token; inter-token latency = the gap between
// consecutive tokens of one request (a message carrying k tokens counts k gaps of gap/k);
// e2e = send -> final message. Percentiles are nearest-rank over all samples.
#ifndef SHARDSERVE_SDK_CLI_BENCH_H_
#define SHARDSERVE_SDK_CLI_BENCH_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "shardserve/client.h"

namespace shardserve::cli {

// An inclusive integer range "N" or "MIN:MAX", drawn uniformly.
struct LengthRange {
  int32_t min = 1, max = 1;
};

// Parses "N" or "MIN:MAX" (1 <= MIN <= MAX); InvalidArgument naming `flag` otherwise.
absl::StatusOr<LengthRange> ParseLengthRange(absl::string_view text, absl::string_view flag);

// Seeds the draw of the shared prefix (BenchOptions::shared_prefix_tokens).
inline constexpr uint64_t kSharedPrefixSeed = 0x5eed;

struct BenchOptions {
  int32_t concurrency = 1;     // clients (closed loop) or requests in flight at most (open loop), >= 1
  int64_t requests = 0;        // requests to send; 0 = until duration_s
  double duration_s = 0;       // stop sending after this long; 0 = until `requests` are sent
  double rate = 0;             // open loop: mean arrivals per second; 0 = closed loop
  LengthRange prompt_tokens{.min = 32, .max = 32};
  LengthRange output_tokens{.min = 64, .max = 64};  // max_tokens of each request
  int32_t prompt_vocab = 256;  // prompt ids are drawn from [1, prompt_vocab)
  // Tokens every prompt starts with (the same for all requests and all runs, whatever `seed`, as a
  // system prompt would be), before its own prompt_tokens; >= 0.
  int32_t shared_prefix_tokens = 0;
  float temperature = 0.0f;
  uint64_t seed = 1;           // of the prompt / length / arrival draws
  bool progress = false;       // a progress line on stderr (requests done, rate, ETA)
  // InvalidArgument naming the flag when out of range (exactly one of requests / duration_s must
  // bound the run, or both).
  absl::Status Validate() const;
};

// One request's measurements.
struct RequestSample {
  bool ok = false;
  std::string code;  // status code name when !ok
  double ttft_s = -1;  // < 0: no token arrived
  double e2e_s = 0;
  int32_t output_tokens = 0;
  int32_t prompt_tokens = 0;         // usage reported by the server
  int32_t cached_prompt_tokens = 0;  // of those, found in its prefix cache
  std::vector<double> itl_s;  // per token after the first
};

struct Percentiles {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
  int64_t count = 0;
};

struct BenchSummary {
  double wall_s = 0;
  int64_t completed = 0;  // OK requests
  int64_t failed = 0;
  std::map<std::string, int64_t> failed_by_code;
  int64_t output_tokens = 0;
  int64_t prompt_tokens = 0;         // of completed requests
  int64_t cached_prompt_tokens = 0;  // of those, found in the server's prefix cache
  double requests_per_s = 0;       // completed / wall
  double output_tokens_per_s = 0;  // output tokens of completed requests / wall
  Percentiles ttft_s, itl_s, e2e_s;
};

// Nearest-rank percentiles (and the mean) of `values`; all zero when empty. Pure.
Percentiles Summarize(std::vector<double> values);
// The summary of a run that took `wall_s`. Pure.
BenchSummary Summarize(const std::vector<RequestSample>& samples, double wall_s);

// The summary as one JSON object: requests_per_s, output_tokens_per_s, ttft_s / itl_s / e2e_s
// (each {p50, p90, p99, mean, count}), completed, failed, failed_by_code {CODE: n}, output_tokens,
// prompt_tokens, cached_prompt_tokens, wall_s.
std::string ToJson(const BenchSummary& summary);
// A human-readable table.
std::string ToTable(const BenchSummary& summary);

// Runs the load against `client` (shared by the sending threads). Errors only for invalid
// options; failed requests are counted in the summary.
absl::StatusOr<BenchSummary> RunBench(Client& client, const BenchOptions& options);

}  // namespace shardserve::cli

#endif  // SHARDSERVE_SDK_CLI_BENCH_H_
