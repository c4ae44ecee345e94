// Step deltas (common/rpc/step_delta.h): bytes per decode step on the coordinator's stream to
// stage 0, and the CPU cost of building, coding, serializing, parsing and decoding a step, with and
// without deltas, for --sequences running sequences that each decode one token per step.
//
//   shardserve-bench-step-delta --sequences=16 --context=512
//   shardserve-bench-step-delta --sequences=64 --context=512 --penalties
//
// The step is what the scheduler builds (coordinator/scheduler/scheduler.cc): each sequence's
// whole block table (context / 16 blocks), its sampling parameters and request id, and with
// --penalties its penalty history (--history distinct ids, one count changing per step).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/rpc/step_delta.h"
#include "coordinator/client/proto_convert.h"

ABSL_FLAG(int32_t, sequences, 16, "running sequences per step");
ABSL_FLAG(int32_t, context, 512, "tokens each sequence holds at the start (its block table: context / 16 blocks)");
ABSL_FLAG(int32_t, steps, 256, "decode steps to time (each sequence grows by one token a step)");
ABSL_FLAG(bool, penalties, false, "sequences use a repetition penalty: their history travels with each step");
ABSL_FLAG(int32_t, runs, 7, "timed runs of each encoding (alternating); the best is printed");
ABSL_FLAG(std::string, only, "",
          "\"full\" or \"deltas\": run just that encoding once, without warm-up or output (for "
          "valgrind --tool=callgrind, whose instruction counts a loaded machine does not change)");
ABSL_FLAG(int32_t, history, 300, "with --penalties: distinct ids in each sequence's history");

namespace shardserve {
namespace {

constexpr int kBlockTokens = 16;

struct Sim {
  std::vector<coordinator::StepSequenceInput> seqs;
  int step = 0;
};

Sim MakeSim(int n, int context, bool penalties, int history) {
  Sim sim;
  int32_t next_block = 0;
  for (int i = 0; i < n; ++i) {
    coordinator::StepSequenceInput s;
    s.sequence_id = static_cast<uint64_t>(1000 + i);
    s.request_id = "req-" + std::to_string(40000 + i);
    s.pos_begin = context;
    for (int b = 0; b * kBlockTokens < context + 1; ++b) s.block_ids.push_back(next_block++);
    s.token_ids = {1234};
    s.sample = true;
    s.sampling = {.temperature = 0.8f, .top_k = 50, .top_p = 0.95f, .seed = static_cast<uint64_t>(7 + i)};
    s.sample_index = 100;
    if (penalties) {
      s.sampling.repetition_penalty = 1.1f;
      for (int h = 0; h < history; ++h) {
        s.penalty_token_ids.push_back(h * 97);
        s.penalty_token_counts.push_back(h % 3);
      }
    }
    sim.seqs.push_back(std::move(s));
  }
  return sim;
}

// Advances every sequence by the token it sampled: a new block every 16 positions, one penalty
// count up.
void Advance(Sim& sim, int32_t* next_block) {
  ++sim.step;
  for (coordinator::StepSequenceInput& s : sim.seqs) {
    ++s.pos_begin;
    ++s.sample_index;
    s.token_ids = {static_cast<int32_t>((s.pos_begin * 31) % 32000)};
    if (static_cast<int>(s.block_ids.size()) * kBlockTokens < s.pos_begin + 1) s.block_ids.push_back((*next_block)++);
    if (!s.penalty_token_counts.empty()) {
      ++s.penalty_token_counts[static_cast<size_t>(sim.step) % s.penalty_token_counts.size()];
    }
  }
}

struct Result {
  double bytes_per_step = 0;
  double us_per_step = 0;
};

Result Measure(bool deltas) {
  const int n = absl::GetFlag(FLAGS_sequences);
  Sim sim = MakeSim(n, absl::GetFlag(FLAGS_context), absl::GetFlag(FLAGS_penalties), absl::GetFlag(FLAGS_history));
  int32_t next_block = 1 << 20;
  rpc::StepDeltaEncoder encoder;
  rpc::StepDeltaDecoder decoder;
  const int steps = absl::GetFlag(FLAGS_steps);
  double bytes = 0;
  std::chrono::nanoseconds spent{0};
  v1::StepRequest request, received;
  std::string wire;
  for (int i = 0; i < steps; ++i) {
    coordinator::StepInput input{.step_id = static_cast<uint64_t>(i + 1), .sequences = sim.seqs};
    const auto start = std::chrono::steady_clock::now();
    coordinator::ToProto(input, &request);
    if (deltas) encoder.Encode(&request);
    request.SerializeToString(&wire);
    if (!received.ParseFromString(wire) || !decoder.Decode(&received).ok()) {
      std::fprintf(stderr, "step %d did not decode\n", i);
      std::exit(1);
    }
    spent += std::chrono::steady_clock::now() - start;
    bytes += static_cast<double>(wire.size());
    Advance(sim, &next_block);
  }
  if (steps == 0) return {};
  return {.bytes_per_step = bytes / steps,
          .us_per_step = std::chrono::duration<double, std::micro>(spent).count() / steps};
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (const std::string only = absl::GetFlag(FLAGS_only); !only.empty()) {
    if (only != "full" && only != "deltas") {
      std::fprintf(stderr, "--only must be full or deltas, got %s\n", only.c_str());
      return 2;
    }
    shardserve::Measure(only == "deltas");
    return 0;
  }
  // Warm up (allocations, caches), then alternate to even out the machine's load.
  shardserve::Measure(false);
  shardserve::Measure(true);
  std::vector<shardserve::Result> full, coded;
  for (int r = 0; r < absl::GetFlag(FLAGS_runs); ++r) {
    full.push_back(shardserve::Measure(false));
    coded.push_back(shardserve::Measure(true));
  }
  auto best = [](std::vector<shardserve::Result> v) {
    return *std::min_element(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.us_per_step < b.us_per_step; });
  };
  const shardserve::Result f = best(full), c = best(coded);
  std::printf("%d sequences, context %d, penalties %s: per decode step (best of %d runs of %d steps)\n",
              absl::GetFlag(FLAGS_sequences), absl::GetFlag(FLAGS_context), absl::GetFlag(FLAGS_penalties) ? "on" : "off",
              absl::GetFlag(FLAGS_runs), absl::GetFlag(FLAGS_steps));
  std::printf("  full:   %9.0f bytes  %8.1f us (build + serialize + parse)\n", f.bytes_per_step, f.us_per_step);
  std::printf("  deltas: %9.0f bytes  %8.1f us (build + code + serialize + parse + decode)\n", c.bytes_per_step,
              c.us_per_step);
  std::printf("  ratio:  %9.3f        %8.2f\n", c.bytes_per_step / f.bytes_per_step, c.us_per_step / f.us_per_step);
  return 0;
}
