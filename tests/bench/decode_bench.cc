// Decode and prefill speed of the single-process engine against this machine's own ceilings,
// measured in the same run:
//   decode  tok/s  vs  read-bandwidth roofline = bandwidth / weight bytes read per token
//   prefill tok/s  vs  the sgemm rate (GFLOP/s) on a prefill-shaped product
// A MoE model's roofline counts the experts a token reads (num_experts_per_tok of each layer's).
// Each model runs with every --quantize choice (default: none and int8), whose rooflines count the
// bytes actually held (int8 plus scales), and the int8/none ratios of decode and prefill are
// printed per rank count.
// Usage: shardserve-bench-decode [--model=DIR] [--threads=1] [--tokens=128] [--quantize=none,int8]
//   Without --model it benchmarks ../shared/models/stories260K and the generated 100M model
//   (written once to --scratch, default /tmp/shardserve-100m).
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/memory_model.h"
#include "common/safetensors/safetensors.h"
#include "common/status/macros.h"
#include "tests/testing/random_model.h"
#include "worker/engine/generator.h"
#include "worker/comm/host/host_communicator.h"
#include "worker/engine/executor.h"
#include "worker/kernels/registry.h"

ABSL_FLAG(std::string, model, "", "model directory; empty = stories260K and the generated 100M model");
ABSL_FLAG(std::string, scratch, "/tmp/shardserve-100m", "where the 100M model is generated");
ABSL_FLAG(bool, bf16, false, "generate the 100M model with BF16 weights (use another --scratch)");
ABSL_FLAG(int32_t, threads, 1, "BLAS threads");
ABSL_FLAG(int32_t, tokens, 128, "decode tokens to time");
ABSL_FLAG(int32_t, prefill, 256, "prefill prompt length");
ABSL_FLAG(std::vector<std::string>, batches, std::vector<std::string>({"1", "8", "16"}),
          "batch sizes for the batched-decode table (tokens/s with B sequences decoding together)");
ABSL_FLAG(std::vector<std::string>, quantize, std::vector<std::string>({"none", "int8"}),
          "weight storage to compare (the coordinator's --quantize choices)");
ABSL_FLAG(std::vector<std::string>, ranks, std::vector<std::string>({"1", "2"}),
          "tensor-parallel CPU rank counts to compare");

namespace shardserve {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Sum of a float range with independent vector accumulators: reads at the memory's speed.
float SumRange(const float* p, size_t n) {
#if defined(__AVX2__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  float s = 0;
  for (float x : out) s += x;
  for (; i < n; ++i) s += p[i];
  return s;
#else
  float acc[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += p[i + static_cast<size_t>(j)];
  }
  float s = 0;
  for (float x : acc) s += x;
  for (; i < n; ++i) s += p[i];
  return s;
#endif
}

// Best-of-5 read bandwidth (bytes/s) over a 1 GiB array with `threads` threads.
double ReadBandwidth(int threads) {
  const size_t n = (size_t{1} << 30) / sizeof(float);
  float* data = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
  for (size_t i = 0; i < n; ++i) data[i] = 1.0f;
  double best = 0;
  volatile float sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<float> sums(static_cast<size_t>(threads));
    const double t0 = Now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const size_t chunk = n / static_cast<size_t>(threads);
        sums[static_cast<size_t>(t)] = SumRange(data + chunk * static_cast<size_t>(t), chunk);
      });
    }
    for (auto& th : pool) th.join();
    const double dt = Now() - t0;
    for (float s : sums) sink = sink + s;
    best = std::max(best, static_cast<double>(n * sizeof(float)) / dt);
  }
  std::free(data);
  return best;
}

// sgemm GFLOP/s for [m, k] x [n, k]^T, best of 5.
double SgemmRate(int m, int n, int k) {
  std::vector<float> a(static_cast<size_t>(m) * k, 0.01f), b(static_cast<size_t>(n) * k, 0.02f),
      c(static_cast<size_t>(m) * n);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = Now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.f, a.data(), k, b.data(), k, 0.f, c.data(), n);
    best = std::max(best, 2.0 * m * n * k / (Now() - t0) / 1e9);
  }
  return best;
}

struct BenchResult {
  double decode_tok_s = 0;
  double prefill_tok_s = 0;
  double step_s = 0;
};

absl::StatusOr<BenchResult> Bench(const std::string& dir, int ranks, Quantization quantize, double bandwidth,
                                  double sgemm_gflops) {
  ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(dir));
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(dir));
  const int32_t decode_tokens = absl::GetFlag(FLAGS_tokens);
  const int32_t prefill = std::min<int32_t>(absl::GetFlag(FLAGS_prefill),
                                            static_cast<int32_t>(spec.max_position_embeddings) - decode_tokens - 2);
  engine::ExecutorOptions options{.cpu_ranks = ranks, .cpu_threads = absl::GetFlag(FLAGS_threads)};
  // One sequence: KV blocks for the whole context.
  options.model = {.num_kv_blocks = (spec.max_position_embeddings + 15) / 16,
                   .kv_block_size = 16,
                   .max_step_tokens = std::max(prefill, 1),
                   .quantize = quantize};
  const double load0 = Now();
  ASSIGN_OR_RETURN(auto model, engine::TpExecutor::Create(spec, *ckpt, options));
  const double load_s = Now() - load0;
  const std::vector<int32_t> blocks = engine::WholeContextBlocks(model->options(), 0);
  // The CPU backend keeps the embedding in the checkpoint's dtype (never quantized).
  const int64_t emb_bytes =
      spec.vocab_size * spec.hidden_size * (spec.dtype.has_value() ? static_cast<int64_t>(DTypeSize(*spec.dtype)) : 4);
  // Decode reads every weight once per token except the embedding table (one row per rank),
  // unless the lm_head is the embedding itself.
  // A MoE layer reads num_experts_per_tok of its routed experts per token, not all of them.
  double held = 0, experts_held = 0;
  for (size_t b : model->WeightBytesPerRank()) held += static_cast<double>(b);
  for (const RankMemory& m : model->MemoryPerRank()) experts_held += static_cast<double>(m.experts);
  const double unread_experts =
      spec.IsMoe() ? experts_held * (1.0 - static_cast<double>(spec.moe.top_k) / spec.moe.num_experts) : 0.0;
  const double weight_read =
      held - unread_experts - (spec.tie_word_embeddings ? 0.0 : static_cast<double>(emb_bytes) * ranks);

  // Decode: one sequence, greedy, after a 1-token prompt; time the steps after a short warm-up.
  std::vector<int32_t> ctx = {1};
  int32_t pos = 0;
  auto step = [&](std::vector<int32_t> tokens) -> absl::StatusOr<int32_t> {
    ASSIGN_OR_RETURN(auto r, model->Step({engine::StepSequence{.block_ids = blocks, .pos_begin = pos, .tokens = tokens}}));
    pos += static_cast<int32_t>(tokens.size());
    const auto& l = r.logits[0];
    return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
  };
  ASSIGN_OR_RETURN(int32_t tok, step({1}));
  for (int i = 0; i < 4; ++i) {
    ASSIGN_OR_RETURN(tok, step({tok}));
  }
  const double t0 = Now();
  for (int i = 0; i < decode_tokens; ++i) {
    ASSIGN_OR_RETURN(tok, step({tok}));
  }
  const double decode_s = Now() - t0;
  const double tok_s = decode_tokens / decode_s;
  // KV bytes read per token on average over the timed positions.
  const double kv_read = 2.0 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4 * (5 + decode_tokens / 2.0);
  const double roofline = bandwidth / (weight_read + kv_read);

  // Prefill: one prompt of `prefill` tokens in one step, best of 3.
  double prefill_best = 0;
  std::vector<int32_t> prompt(static_cast<size_t>(prefill));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + i % 200);
  for (int rep = 0; rep < 3 && prefill > 0; ++rep) {
    const double p0 = Now();
    RETURN_IF_ERROR(model->Step({engine::StepSequence{.block_ids = blocks, .pos_begin = 0, .tokens = prompt}}).status());
    prefill_best = std::max(prefill_best, prefill / (Now() - p0));
  }
  // Two flops per multiplied weight: every parameter but the embedding's lookup (and the norms),
  // and in MoE layers only the experts a token is routed to.
  int64_t unrouted = 0;
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    if (spec.IsSparseLayer(l)) {
      unrouted += (spec.moe.num_experts - spec.moe.top_k) * 3 * spec.hidden_size * spec.moe.expert_intermediate_size;
    }
  }
  const double flops_per_token =
      2.0 * static_cast<double>(spec.NumParameters() - unrouted -
                                (spec.tie_word_embeddings ? 0 : spec.vocab_size * spec.hidden_size));
  const double prefill_gflops = prefill_best * flops_per_token / 1e9;

  // Batched decode: B sequences at context ~32, one new token each per step.
  std::vector<std::pair<int, double>> batched;
  for (const auto& b_str : absl::GetFlag(FLAGS_batches)) {
    const int b = std::atoi(b_str.c_str());
    if (b < 1) continue;
    engine::ExecutorOptions bo = options;
    bo.model.num_kv_blocks = b * ((spec.max_position_embeddings + 15) / 16);
    bo.model.max_step_tokens = std::max(32 * b, 1);
    ASSIGN_OR_RETURN(auto bm, engine::TpExecutor::Create(spec, *ckpt, bo));
    std::vector<engine::StepSequence> seqs(static_cast<size_t>(b));
    for (int i = 0; i < b; ++i) {
      seqs[static_cast<size_t>(i)] = engine::StepSequence{
          .block_ids = engine::WholeContextBlocks(bm->options(), i), .pos_begin = 0,
          .tokens = std::vector<int32_t>(32, 3 + i)};
    }
    RETURN_IF_ERROR(bm->Step(seqs).status());
    for (auto& s : seqs) {
      s.pos_begin = 32;
      s.tokens = {5};
    }
    const int steps = std::max(8, decode_tokens / 4);
    const double b0 = Now();
    for (int i = 0; i < steps; ++i) {
      RETURN_IF_ERROR(bm->Step(seqs).status());
      for (auto& s : seqs) ++s.pos_begin;
    }
    batched.emplace_back(b, b * steps / (Now() - b0));
  }

  std::printf("\nmodel %s on %d CPU rank(s), quantize=%s: %.1fM parameters, %.1f MB weights held (loaded in %.2f s), "
              "%.1f MB read per decoded token\n",
              dir.c_str(), ranks, std::string(QuantizationName(quantize)).c_str(), spec.NumParameters() / 1e6,
              held / 1e6, load_s, weight_read / 1e6);
  std::printf("  decode : %8.1f tok/s   roofline %8.1f tok/s   fraction of roofline %.3f\n", tok_s, roofline,
              tok_s / roofline);
  std::printf("  prefill: %8.1f tok/s   (%d-token prompt) %.1f GFLOP/s = %.3f of sgemm %.1f GFLOP/s\n", prefill_best,
              prefill, prefill_gflops, prefill_gflops / sgemm_gflops, sgemm_gflops);
  for (const auto& [b, t] : batched) {
    std::printf("  batched decode, %2d sequences: %8.1f tok/s (%.2fx of batch 1 at the same context)\n", b, t,
                t / batched.front().second);
  }
  return BenchResult{.decode_tok_s = tok_s, .prefill_tok_s = prefill_best, .step_s = decode_s / decode_tokens};
}

// Mean latency (s) of an all-reduce of `count` floats between `ranks` host ranks.
double AllReduceLatency(int ranks, size_t count, int iters) {
  auto comms = *comm::CreateHostGroup(ranks);
  std::vector<std::vector<float>> data(static_cast<size_t>(ranks), std::vector<float>(count, 1.f));
  const double t0 = Now();
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      for (int i = 0; i < iters; ++i) (void)comms[static_cast<size_t>(r)]->AllReduceSum(data[static_cast<size_t>(r)].data(), count);
    });
  }
  for (auto& t : threads) t.join();
  return (Now() - t0) / iters;
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace shardserve;
  const int threads = absl::GetFlag(FLAGS_threads);
  openblas_set_num_threads(threads);
  const double bw = ReadBandwidth(threads);
  const double bw2 = threads == 1 ? ReadBandwidth(2) : bw;
  const double sgemm = SgemmRate(256, 2048, 768);
  openblas_set_num_threads(2);
  const double sgemm2 = SgemmRate(256, 2048, 768);
  openblas_set_num_threads(threads);
  std::printf("machine: read bandwidth %.1f GB/s (%d thread), %.1f GB/s (2 threads); sgemm %.1f GFLOP/s (%d thread), "
              "%.1f GFLOP/s (2 threads)\n",
              bw / 1e9, threads, bw2 / 1e9, sgemm, threads, sgemm2);
  std::vector<std::string> dirs;
  if (!absl::GetFlag(FLAGS_model).empty()) {
    dirs.push_back(absl::GetFlag(FLAGS_model));
  } else {
    dirs.push_back("../shared/models/stories260K");
    const std::string scratch = absl::GetFlag(FLAGS_scratch);
    if (!std::filesystem::exists(scratch + "/model.safetensors")) {
      std::printf("writing the 100M model to %s ...\n", scratch.c_str());
      if (auto st = testing::WriteRandomLlama(scratch, testing::HundredMModel(absl::GetFlag(FLAGS_bf16)), 1234); !st.ok()) {
        std::fprintf(stderr, "%s\n", st.ToString().c_str());
        return 1;
      }
    }
    dirs.push_back(scratch);
  }
  std::vector<int> rank_counts;
  for (const auto& r : absl::GetFlag(FLAGS_ranks)) rank_counts.push_back(std::atoi(r.c_str()));
  std::vector<Quantization> quantizations;
  for (const auto& q : absl::GetFlag(FLAGS_quantize)) {
    auto parsed = ParseQuantization(q);
    if (!parsed.ok()) {
      std::fprintf(stderr, "--quantize: %s\n", std::string(parsed.status().message()).c_str());
      return 2;
    }
    quantizations.push_back(*parsed);
  }
  if (quantizations.empty()) quantizations.push_back(Quantization::kNone);
  for (const auto& d : dirs) {
    std::vector<BenchResult> results;  // per rank count, the first quantization
    for (int ranks : rank_counts) {
      std::vector<BenchResult> per_q;
      for (Quantization q : quantizations) {
        // Ceilings at the same number of threads as ranks (2 cores on the reference machines).
        auto r = Bench(d, ranks, q, ranks == 1 ? bw : bw2, ranks == 1 ? sgemm : sgemm2);
        if (!r.ok()) {
          std::fprintf(stderr, "%s: %s\n", d.c_str(), r.status().ToString().c_str());
          return 1;
        }
        per_q.push_back(*r);
      }
      for (size_t i = 1; i < per_q.size(); ++i) {
        std::printf("  %d rank(s): quantize=%s vs %s: decode %.2fx, prefill %.2fx\n", ranks,
                    std::string(QuantizationName(quantizations[i])).c_str(),
                    std::string(QuantizationName(quantizations[0])).c_str(),
                    per_q[i].decode_tok_s / per_q[0].decode_tok_s, per_q[i].prefill_tok_s / per_q[0].prefill_tok_s);
      }
      results.push_back(per_q[0]);
    }
    if (rank_counts.size() == 2 && rank_counts[0] == 1 && rank_counts[1] == 2) {
      auto spec = LoadModelSpec(d);
      const double speedup = results[1].decode_tok_s / results[0].decode_tok_s;
      const double ceiling = bw2 / bw;
      const double lat = AllReduceLatency(2, static_cast<size_t>(spec->hidden_size), 20000);
      const double per_step = (2.0 * spec->num_layers) * lat;
      std::printf("  tensor parallel: 2 ranks vs 1: %.2fx; bandwidth ceiling %.2fx; %.2f of the ceiling\n", speedup,
                  ceiling, speedup / ceiling);
      std::printf("  host all-reduce of %ld floats: %.2f us; %d per decode step = %.1f%% of a %.2f ms step\n",
                  static_cast<long>(spec->hidden_size), lat * 1e6, static_cast<int>(2 * spec->num_layers),
                  100.0 * per_step / results[1].step_s, results[1].step_s * 1e3);
    }
  }
  return 0;
}
