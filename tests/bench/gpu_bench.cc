// GPU decode and prefill speed of the engine against CUDA device 0's own ceilings, measured in the
// same run (built only with CUDA and SHARDSERVE_BENCH):
//   decode  tok/s (batch 1 and --batch)  vs  HBM roofline = copy bandwidth / bytes read per step
//   prefill tok/s                        vs  the bf16 tensor-core GEMM rate on a prefill-shaped product
//   all-reduce of one hidden state (8192 floats) over every GPU (NCCL), when there are >= 2
//   host CPU time per decode step (CLOCK_PROCESS_CPUTIME_ID over the timed steps)
//   a mixed step (--batch - 1 sequences decoding + a --mixed_prefill-token prompt chunk) against
//                                        its two parts as steps of their own
// The models are generated (tests/testing/random_model.h) into --scratch once: `llama`, a
// 1.1B-parameter bf16 Llama (TinyLlama's shape); `moe`, a 1.08B-parameter bf16 Mixtral-style MoE
// (12 layers, 8 experts of width 1408, top 2: 0.33B parameters used per token); and `llama_fp8`:
// the llama's shape and random weights with every projection (q/k/v/o, gate/up/down) stored as
// F8_E4M3 with 128 x 128 block scales (`weight_scale_inv`, the DeepSeek-V3 / Qwen3-FP8 layout;
// embedding, norms and lm_head bf16): 1.23 GB on disk against the llama's 2.2 GB, written in
// 7.6-8.8 s on a shared 2-core machine (the bf16 llama: 7.1 s; `write_s` in the report). CUDA
// ranks keep such matrices as 1-byte codes plus f32 scales (worker/kernels/cuda/linear_fp8.cuh):
// steps of up to 8 tokens read the codes in a GEMV (decode batch 1), larger ones (decode at
// --batch 32, prefill) dequantize chunks of rows to bf16 for the bf16 GEMM.
//
// The roofline counts the bytes the engine holds (TpExecutor::WeightBytesPerRank), not the
// checkpoint's: a backend without bf16 weights widens them to f32 on load and then reads twice as
// many bytes per step (InferLayout says which happened); an FP8 model's projections count their
// codes and scales (Fp8Layout: 1.0002 bytes per weight with 128 x 128 blocks, unless the engine
// dequantized them). The embedding table is not read by a decode step (one row per token);
// an MoE step reads only the experts its tokens are routed to (expected distinct experts for B
// random tokens: E * (1 - (1 - k/E)^B)); the KV cache adds its bytes per token times the context.
//
// Usage: shardserve-bench-gpu [--json] [--scratch=DIR] [--models=llama,moe,llama_fp8] [--tokens=64]
//        (all three models by default)
//        shardserve-bench-gpu --write_only [--scratch=DIR] [--models=...]   (no device needed)
// Without a CUDA device it says so and exits 0 ({"skipped": "no CUDA device"} with --json), after
// checking the --models names; --write_only writes the generated models (timing each) and exits.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/memory_model.h"
#include "common/safetensors/safetensors.h"
#include "common/status/macros.h"
#include "common/tensor/dtype.h"
#include "nlohmann/json.hpp"
#include "tests/testing/random_model.h"
#include "worker/comm/comm_registry.h"
#include "worker/engine/executor.h"
#include "worker/kernels/cuda/cuda_probe.h"
#include "worker/kernels/registry.h"

ABSL_FLAG(bool, json, false, "print one JSON object instead of text");
ABSL_FLAG(std::string, scratch, "/tmp/shardserve-gpu-bench", "where the generated models are written (once)");
ABSL_FLAG(std::vector<std::string>, models, std::vector<std::string>({"llama", "moe", "llama_fp8"}),
          "generated models to benchmark: llama (1.1B dense bf16), moe (1.1B Mixtral-style bf16, 8 experts top 2), "
          "llama_fp8 (the llama with FP8 e4m3 projections, 128x128 block scales)");
ABSL_FLAG(bool, write_only, false,
          "write the generated --models to --scratch (those not there yet), print the seconds each took, and exit; "
          "needs no device");
ABSL_FLAG(int32_t, tokens, 64, "decode steps to time at batch 1 (half as many at --batch)");
ABSL_FLAG(int32_t, batch, 32, "sequences per step of the batched decode");
ABSL_FLAG(int32_t, prefill, 512, "prefill prompt length (tokens)");
ABSL_FLAG(int32_t, context, 32, "prompt length of each sequence before the timed decode steps");
ABSL_FLAG(int32_t, mixed_prefill, 256,
          "prompt tokens of the mixed step's prefill chunk, beside --batch - 1 sequences decoding a token each "
          "(0 = no mixed step)");
ABSL_FLAG(bool, pdl, false,
          "launch the decode kernels with programmatic dependent launch (compute capability >= 9.0; "
          "worker/kernels/cuda/pdl.cuh)");
ABSL_FLAG(bool, mma_attention, true,
          "prefill attention on tensor cores where it applies (false: the CUDA-core kernel, for comparisons)");
ABSL_FLAG(bool, fused_norm, true,
          "the norms before a layer's q/k/v and MLP products inside the decode GEMV (false: an RmsNorm kernel "
          "before each, for comparisons)");
ABSL_FLAG(bool, moe_device_offsets, true,
          "MoE decode steps keep the experts' row offsets on the device and replay as CUDA graphs (false: the "
          "host copy of the offsets, op by op)");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "the KV cache: auto (the checkpoint's bf16) or fp8 (float8 e4m3: half of bf16's kv_bytes_per_token)");
ABSL_FLAG(bool, blocking_sync, false,
          "the host blocks in its waits for the device instead of spinning (cudaDeviceScheduleBlockingSync): "
          "host_cpu_ms_per_step then counts the host's work rather than its waiting");
ABSL_FLAG(int64_t, copy_mib, 1024, "size of the device-to-device copy that measures the bandwidth (MiB)");

namespace shardserve {
namespace {

using nlohmann::json;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

bool KnownModel(const std::string& name) { return name == "llama" || name == "moe" || name == "llama_fp8"; }

// The generated shapes: 1.10B (llama, llama_fp8) and 1.08B (moe) parameters; bf16, with FP8
// projections in llama_fp8.
testing::RandomLlamaShape ModelShape(const std::string& name) {
  testing::RandomLlamaShape s;
  s.vocab = 32000;
  s.hidden = 2048;
  s.heads = 32;
  s.kv_heads = 4;
  s.max_positions = 2048;
  s.bf16 = true;
  if (name == "moe") {
    s.layers = 12;
    s.intermediate = 1408;  // per expert
    s.experts = 8;
    s.experts_per_tok = 2;
  } else {  // TinyLlama-1.1B's shape
    s.layers = 22;
    s.intermediate = 5632;
    s.fp8 = name == "llama_fp8";  // 128 x 128 blocks
  }
  return s;
}

// Parameter counts of the spec, by how a decode step reads them.
struct ParamCounts {
  double embedding = 0;      // read one row per token: not counted as read
  double norms = 0;          // f32 on every backend
  double matrices = 0;       // every linear layer incl. lm_head, router and all experts
  double lm_head = 0;
  double routers = 0;        // f32 on every backend (part of `matrices`)
  double inactive_expert = 0;  // one expert of one layer (w1, w2, w3); 0 for dense models
  double active_matrices_per_token = 0;  // the matrices one token multiplies with
};

ParamCounts CountParams(const ModelSpec& s) {
  ParamCounts c;
  const double h = static_cast<double>(s.hidden_size);
  const double q = static_cast<double>(s.num_heads * s.head_dim);
  const double kv = static_cast<double>(s.num_kv_heads * s.head_dim);
  const double layers = static_cast<double>(s.num_layers);
  c.embedding = static_cast<double>(s.vocab_size) * h;
  c.norms = layers * 2 * h + h;
  const double attn = h * q + 2 * h * kv + q * h;
  const double lm_head = static_cast<double>(s.vocab_size) * h;
  c.lm_head = lm_head;
  if (s.IsMoe()) {
    const double e = static_cast<double>(s.moe.num_experts);
    c.routers = layers * e * h;
    c.inactive_expert = 3 * h * static_cast<double>(s.moe.expert_intermediate_size);
    c.matrices = layers * (attn + e * h + e * c.inactive_expert) + lm_head;
    c.active_matrices_per_token =
        layers * (attn + e * h + static_cast<double>(s.moe.top_k) * c.inactive_expert) + lm_head;
  } else {
    c.matrices = layers * (attn + 3 * h * static_cast<double>(s.intermediate_size)) + lm_head;
    c.active_matrices_per_token = c.matrices;
  }
  return c;
}

// How the engine holds the weights, inferred from the bytes it reports: norms are f32; matrices
// take `matrix_elem` bytes per element (2: kept as bf16, 4: widened to f32); the embedding table
// either is f32 or shares the matrices' dtype (`embedding_elem`), whichever fits the held bytes to
// a whole element size best (both fit equally when everything is f32).
struct HeldLayout {
  double matrix_elem = 4;
  double embedding_elem = 4;
  // FP8 checkpoints: what the memory model (common/plan/memory_model.h) predicts a CUDA rank holds.
  double predicted_bytes = 0;
};

// The matrix dtype a backend holds, from its bytes per element (codes plus scales for FP8).
const char* DtypeHeld(double bytes_per_element) {
  return bytes_per_element < 1.5 ? "f8e4m3" : bytes_per_element < 3 ? "bf16" : "f32";
}

HeldLayout InferLayout(const ParamCounts& c, double held) {
  const double f32_embedding = (held - 4 * (c.embedding + c.norms)) / c.matrices;
  const double same_as_matrices = (held - 4 * c.norms) / (c.matrices + c.embedding);
  auto off = [](double e) { return std::min(std::abs(e - 2), std::abs(e - 4)); };
  if (off(same_as_matrices) < off(f32_embedding)) return {same_as_matrices, same_as_matrices};
  return {f32_embedding, 4};
}

// An FP8 checkpoint on one CUDA rank: the embedding, norms, routers and lm_head (left unconverted)
// take the bytes the memory model gives them; the rest of what the engine holds is the projections,
// 1 byte per weight plus the f32 scales of its blocks when kept as F8_E4M3 (about 2 when the engine
// dequantized them to bf16 instead, as it does on backends without FP8 Linear).
HeldLayout Fp8Layout(const ModelSpec& s, const ParamCounts& c, double held) {
  const WeightFormats f = WorkerWeightFormats(s, /*cuda=*/true, Quantization::kNone);
  const RankMemory m =
      RankMemoryOf(s, RankShard{.layer_end = s.num_layers, .has_embedding = true, .has_lm_head = true}, f);
  HeldLayout h;
  h.embedding_elem = static_cast<double>(m.embedding) / c.embedding;
  h.matrix_elem = (held - static_cast<double>(m.embedding + m.norms_biases + m.lm_head)) /
                  (c.matrices - c.lm_head - c.routers);
  h.predicted_bytes = static_cast<double>(m.Weights());
  return h;
}

// Bytes of weights one decode step of `batch` tokens reads, from the bytes the engine holds.
double WeightBytesRead(const ModelSpec& s, const ParamCounts& c, double held, const HeldLayout& h, int batch) {
  const double matrix_elem = h.matrix_elem;
  // The embedding table is read one row per token (tied models: it is the lm_head too, read whole).
  double read = held - h.embedding_elem * c.embedding;
  if (s.tie_word_embeddings) read += h.embedding_elem * c.embedding;
  if (s.IsMoe()) {
    const double e = static_cast<double>(s.moe.num_experts);
    const double k = static_cast<double>(s.moe.top_k);
    const double touched = e * (1 - std::pow(1 - k / e, batch));
    read -= static_cast<double>(s.num_layers) * (e - touched) * c.inactive_expert * matrix_elem;
  }
  return read;
}

struct DecodeFigures {
  double tok_s = 0;
  double step_ms = 0;
  double cpu_ms_per_step = 0;
  double bytes_per_step = 0;
  double roofline_tok_s = 0;
  int64_t graph_replays = 0;  // of the timed steps
};

// Tokens one step may hold: the longer of the prefill and the batched prompts.
int64_t MaxStepTokens() {
  return std::max<int64_t>(absl::GetFlag(FLAGS_prefill),
                           int64_t{absl::GetFlag(FLAGS_batch)} * absl::GetFlag(FLAGS_context));
}

// --mixed_prefill's chunk must fit the prompt the benchmark writes (--prefill tokens) and a step
// beside --batch - 1 decode rows. Checked before the device, so that a bad value fails anywhere.
absl::Status CheckMixedPrefill() {
  const int64_t chunk = absl::GetFlag(FLAGS_mixed_prefill), batch = absl::GetFlag(FLAGS_batch);
  if (chunk < 0 || chunk > absl::GetFlag(FLAGS_prefill) || (chunk > 0 && batch - 1 + chunk > MaxStepTokens())) {
    return absl::InvalidArgumentError(absl::StrCat("--mixed_prefill=", chunk, " must be in [0, --prefill (",
                                                   absl::GetFlag(FLAGS_prefill), ")] and leave room for ", batch - 1,
                                                   " decode rows in a step of ", MaxStepTokens(), " tokens"));
  }
  return absl::OkStatus();
}

absl::StatusOr<json> BenchModel(const std::string& name, const std::string& dir, double bw_gbps,
                                double gemm_tflops) {
  ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(dir));
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(dir));
  const int batch = absl::GetFlag(FLAGS_batch);
  const int steps1 = absl::GetFlag(FLAGS_tokens);
  const int steps_b = std::max(4, steps1 / 2);
  const int context = absl::GetFlag(FLAGS_context);
  const int prefill = absl::GetFlag(FLAGS_prefill);
  if (batch < 1 || steps1 < 1 || context < 1 || prefill < 1) {
    return absl::InvalidArgumentError("--batch, --tokens, --context and --prefill must be >= 1");
  }
  engine::ExecutorOptions options{.kind = kernels::DeviceKind::kCuda,
                                  .cuda_devices = {0},
                                  .cuda_pdl = absl::GetFlag(FLAGS_pdl),
                                  .cuda_mma_attention = absl::GetFlag(FLAGS_mma_attention),
                                  .cuda_fused_norm = absl::GetFlag(FLAGS_fused_norm)};
  const int64_t max_seq = std::max<int64_t>(prefill, context + steps1 + 8);
  if (max_seq > spec.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("--prefill/--context/--tokens need ", max_seq,
                                                   " positions; the model has ", spec.max_position_embeddings));
  }
  options.model = {.num_kv_blocks = batch * ((max_seq + 15) / 16),
                   .kv_block_size = 16,
                   .max_seq_len = max_seq,
                   .max_step_tokens = MaxStepTokens()};
  // After the aggregate above, which resets every other ModelOptions field.
  options.model.moe_device_offsets = absl::GetFlag(FLAGS_moe_device_offsets);
  ASSIGN_OR_RETURN(options.model.kv_cache, ParseKvCacheFormat(absl::GetFlag(FLAGS_kv_cache_dtype)));
  const double load0 = Now();
  ASSIGN_OR_RETURN(auto model, engine::TpExecutor::Create(spec, *ckpt, options));
  const double load_s = Now() - load0;

  const ParamCounts pc = CountParams(spec);
  const double held = static_cast<double>(model->WeightBytesPerRank()[0]);
  const HeldLayout layout = spec.fp8.has_value() ? Fp8Layout(spec, pc, held) : InferLayout(pc, held);
  const double kv_bytes_per_token =
      static_cast<double>(model->KvCacheBytesPerRank()[0]) /
      static_cast<double>(model->options().num_kv_blocks * model->options().kv_block_size);

  // Batched sequences: `batch` prompts of `context` tokens, prefilled in one step.
  std::vector<engine::StepSequence> seqs(static_cast<size_t>(batch));
  for (int i = 0; i < batch; ++i) {
    seqs[static_cast<size_t>(i)] = engine::StepSequence{
        .block_ids = engine::WholeContextBlocks(model->options(), i), .pos_begin = 0,
        .tokens = std::vector<int32_t>(static_cast<size_t>(context), 3 + i)};
  }
  RETURN_IF_ERROR(model->Step(seqs).status());
  for (auto& s : seqs) {
    s.pos_begin = context;
    s.tokens = {5};
  }

  // Times `steps` decode steps of the first `b` sequences after 2 untimed ones.
  auto decode = [&](int b, int steps) -> absl::StatusOr<DecodeFigures> {
    std::vector<engine::StepSequence> run(seqs.begin(), seqs.begin() + b);
    for (int i = 0; i < 2; ++i) {
      RETURN_IF_ERROR(model->Step(run).status());
      for (auto& s : run) ++s.pos_begin;
    }
    const double avg_ctx = run[0].pos_begin + steps / 2.0;
    const int64_t replays0 = model->GraphReplays();
    const double c0 = ProcessCpuSeconds();
    const double t0 = Now();
    for (int i = 0; i < steps; ++i) {
      RETURN_IF_ERROR(model->Step(run).status());
      for (auto& s : run) ++s.pos_begin;
    }
    const double wall = Now() - t0;
    DecodeFigures f;
    f.cpu_ms_per_step = (ProcessCpuSeconds() - c0) / steps * 1e3;
    f.graph_replays = model->GraphReplays() - replays0;
    f.step_ms = wall / steps * 1e3;
    f.tok_s = b * steps / wall;
    f.bytes_per_step = WeightBytesRead(spec, pc, held, layout, b) + b * kv_bytes_per_token * avg_ctx;
    f.roofline_tok_s = b * bw_gbps * 1e9 / f.bytes_per_step;
    return f;
  };
  ASSIGN_OR_RETURN(const DecodeFigures d1, decode(1, steps1));
  ASSIGN_OR_RETURN(const DecodeFigures db, decode(batch, steps_b));

  // Prefill: one prompt of `prefill` tokens in one step (sequence 0's blocks), best of 3.
  std::vector<int32_t> prompt(static_cast<size_t>(prefill));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + i % 200);
  double prefill_tok_s = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double p0 = Now();
    RETURN_IF_ERROR(model->Step({engine::StepSequence{.block_ids = engine::WholeContextBlocks(model->options(), 0),
                                                      .pos_begin = 0,
                                                      .tokens = prompt}})
                        .status());
    prefill_tok_s = std::max(prefill_tok_s, prefill / (Now() - p0));
  }
  // Linear layers only (2 flops per weight a token multiplies with); attention adds a little more.
  const double prefill_tflops = prefill_tok_s * 2 * pc.active_matrices_per_token / 1e12;

  // A mixed step, as continuous batching with chunked prefill makes them: sequences 1..batch-1
  // decoding one token each (at position `context`) and a prompt chunk of `chunk` tokens for
  // sequence 0 (from position 0), against the same two parts as steps of their own; each timed as
  // the best of 3 after an untimed run (a decode-only step may be captured as a graph on its first).
  json mixed = nullptr;
  if (const int chunk = absl::GetFlag(FLAGS_mixed_prefill); chunk > 0 && batch >= 2) {
    const std::vector<engine::StepSequence> decoding(seqs.begin() + 1, seqs.end());
    const engine::StepSequence chunk_seq{.block_ids = engine::WholeContextBlocks(model->options(), 0),
                                         .pos_begin = 0,
                                         .tokens = std::vector<int32_t>(prompt.begin(), prompt.begin() + chunk)};
    auto best_of_3 = [&](const std::vector<engine::StepSequence>& step) -> absl::StatusOr<double> {
      RETURN_IF_ERROR(model->Step(step).status());
      double best = 1e30;
      for (int rep = 0; rep < 3; ++rep) {
        const double t0 = Now();
        RETURN_IF_ERROR(model->Step(step).status());
        best = std::min(best, Now() - t0);
      }
      return best;
    };
    std::vector<engine::StepSequence> both = decoding;
    both.push_back(chunk_seq);
    ASSIGN_OR_RETURN(const double decode_s, best_of_3(decoding));
    ASSIGN_OR_RETURN(const double chunk_s, best_of_3({chunk_seq}));
    ASSIGN_OR_RETURN(const double mixed_s, best_of_3(both));
    mixed = json{{"decode_sequences", batch - 1},
                 {"prefill_tokens", chunk},
                 {"step_ms", mixed_s * 1e3},
                 {"decode_alone_ms", decode_s * 1e3},
                 {"prefill_alone_ms", chunk_s * 1e3},
                 {"over_separate_steps", mixed_s / (decode_s + chunk_s)}};
  }

  auto decode_json = [](const DecodeFigures& f, int b) {
    return json{{"batch", b},
                {"tok_s", f.tok_s},
                {"step_ms", f.step_ms},
                {"host_cpu_ms_per_step", f.cpu_ms_per_step},
                {"host_cpu_fraction_of_step", f.cpu_ms_per_step / f.step_ms},
                {"steps_replayed_as_graphs", f.graph_replays},
                {"bytes_read_per_step", f.bytes_per_step},
                {"roofline_tok_s", f.roofline_tok_s},
                {"fraction_of_roofline", f.tok_s / f.roofline_tok_s}};
  };
  json r{{"model", name},
         {"dir", dir},
         {"architecture", std::string(ArchitectureName(spec.arch))},
         {"parameters", static_cast<double>(spec.NumParameters())},
         {"checkpoint_matrix_dtype", spec.fp8.has_value() ? "F8_E4M3" : "BF16"},
         {"load_s", load_s},
         {"weight_bytes_held", held},
         {"weight_bytes_source", "TpExecutor::WeightBytesPerRank"},
         {"matrix_dtype_held", DtypeHeld(layout.matrix_elem)},
         {"matrix_bytes_per_element", layout.matrix_elem},
         {"embedding_bytes_per_element", layout.embedding_elem},
         {"kv_bytes_per_token", kv_bytes_per_token},
         {"decode_batch_1", decode_json(d1, 1)},
         {"decode_batch_n", decode_json(db, batch)},
         {"prefill",
          {{"prompt_tokens", prefill},
           {"tok_s", prefill_tok_s},
           {"linear_tflops", prefill_tflops},
           {"fraction_of_bf16_gemm", prefill_tflops / gemm_tflops}}},
         {"mixed_step", mixed}};
  if (spec.fp8.has_value()) {
    r["fp8_weight_block_size"] = {spec.fp8->block_rows, spec.fp8->block_cols};
    r["memory_model_weight_bytes"] = layout.predicted_bytes;  // equal to weight_bytes_held when FP8 is kept
  }
  return r;
}

// Mean microseconds of one in-place all-reduce of `count` floats over `devices` (the slowest
// rank's mean over 200 calls after 20 untimed ones).
absl::StatusOr<double> AllReduceMicros(const std::vector<int>& devices, size_t count) {
  ASSIGN_OR_RETURN(auto comms, comm::CreateCommGroup(comm::CommKind::kNccl, static_cast<int>(devices.size()), devices));
  const size_t n = devices.size();
  std::vector<absl::Status> results(n);
  std::vector<double> micros(n);
  std::vector<std::thread> threads;
  for (size_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      results[r] = [&]() -> absl::Status {
        ASSIGN_OR_RETURN(auto backend,
                         kernels::CreateBackend({.kind = kernels::DeviceKind::kCuda, .device_index = devices[r]}));
        ASSIGN_OR_RETURN(auto buf, backend->Allocate(count * sizeof(float)));
        for (int i = 0; i < 20; ++i) RETURN_IF_ERROR(comms[r]->AllReduceSum(buf.as<float>(), count));
        constexpr int kIters = 200;
        const double t0 = Now();
        for (int i = 0; i < kIters; ++i) RETURN_IF_ERROR(comms[r]->AllReduceSum(buf.as<float>(), count));
        micros[r] = (Now() - t0) / kIters * 1e6;
        return absl::OkStatus();
      }();
      if (!results[r].ok()) comms[r]->Abort(results[r]);
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& st : results) RETURN_IF_ERROR(st);
  return *std::max_element(micros.begin(), micros.end());
}

// A generated model's directory, and the seconds it took to write in this run (0: it was there).
struct GeneratedModel {
  std::string dir;
  double write_s = 0;
};

// Writes the generated model `name` under `scratch` unless it is there (config.json is written
// last, so a directory with it is complete).
absl::StatusOr<GeneratedModel> EnsureModel(const std::string& scratch, const std::string& name, bool quiet) {
  const std::string dir = absl::StrCat(scratch, "/", name == "llama_fp8" ? "llama-f8e4m3" : name + "-bf16");
  if (std::filesystem::exists(dir + "/config.json") && std::filesystem::exists(dir + "/model.safetensors")) {
    return GeneratedModel{dir, 0};
  }
  if (!quiet) std::printf("writing the generated %s model to %s ...\n", name.c_str(), dir.c_str());
  std::filesystem::remove(dir + "/config.json");  // a partial earlier write is redone
  const double t0 = Now();
  RETURN_IF_ERROR(testing::WriteRandomLlama(dir, ModelShape(name), 1234));
  return GeneratedModel{dir, Now() - t0};
}

// --write_only: every model of --models written (unless there), with its seconds.
int WriteOnly(bool as_json) {
  json written = json::array();
  for (const std::string& name : absl::GetFlag(FLAGS_models)) {
    auto m = EnsureModel(absl::GetFlag(FLAGS_scratch), name, as_json);
    if (!m.ok()) {
      std::fprintf(stderr, "shardserve-bench-gpu: %s: %s\n", name.c_str(), m.status().ToString().c_str());
      return 1;
    }
    std::error_code ec;
    const auto bytes = std::filesystem::file_size(m->dir + "/model.safetensors", ec);
    written.push_back({{"model", name}, {"dir", m->dir}, {"write_s", m->write_s}, {"bytes", ec ? 0 : bytes}});
    if (!as_json) {
      std::printf("%s: %s, %.2f GB, %s\n", name.c_str(), m->dir.c_str(), static_cast<double>(bytes) / 1e9,
                  m->write_s > 0 ? absl::StrCat("written in ", m->write_s, " s").c_str() : "already there");
    }
  }
  if (as_json) std::printf("%s\n", json{{"written", written}}.dump(2).c_str());
  return 0;
}

int Run() {
  const bool as_json = absl::GetFlag(FLAGS_json);
  for (const std::string& name : absl::GetFlag(FLAGS_models)) {
    if (!KnownModel(name)) {
      std::fprintf(stderr, "shardserve-bench-gpu: --models: unknown model \"%s\" (llama, moe, llama_fp8)\n",
                   name.c_str());
      return 1;
    }
  }
  if (absl::Status st = CheckMixedPrefill(); !st.ok()) {
    std::fprintf(stderr, "shardserve-bench-gpu: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_write_only)) return WriteOnly(as_json);
  if (!kernels::CudaCompiledIn() || kernels::CudaDeviceCount() < 1) {
    if (as_json) {
      std::printf("%s\n", json{{"skipped", "no CUDA device"}}.dump().c_str());
    } else {
      std::printf("shardserve-bench-gpu: no CUDA device on this machine; nothing to measure\n");
    }
    return 0;
  }
  if (absl::GetFlag(FLAGS_blocking_sync)) {
    if (absl::Status st = kernels::UseBlockingSync(); !st.ok()) {
      std::fprintf(stderr, "shardserve-bench-gpu: --blocking_sync: %s\n", std::string(st.message()).c_str());
      return 1;
    }
  }
  json report;
  auto fail = [&](const std::string& what, const absl::Status& st) {
    if (as_json) {
      report["error"] = absl::StrCat(what, ": ", st.ToString());
      std::printf("%s\n", report.dump(2).c_str());
    } else {
      std::fprintf(stderr, "shardserve-bench-gpu: %s: %s\n", what.c_str(), st.ToString().c_str());
    }
    return 1;
  };
  auto info = kernels::ProbeCudaDevice(0);
  if (!info.ok()) return fail("device 0", info.status());
  const int gpus = kernels::CudaDeviceCount();
  report["device"] = {{"name", info->name},
                      {"compute_capability", absl::StrCat(info->compute_major, ".", info->compute_minor)},
                      {"memory_bytes", info->total_bytes},
                      {"multiprocessors", info->multiprocessors},
                      {"gpus", gpus}};
  const size_t copy_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_copy_mib)) << 20;
  auto bw = kernels::MeasureCopyBandwidthGBps(0, copy_bytes);
  if (!bw.ok()) return fail("copy bandwidth", bw.status());
  // The widest prefill product of the 1.1B Llama: [intermediate, hidden] x [hidden, prompt].
  const testing::RandomLlamaShape llama = ModelShape("llama");
  auto gemm = kernels::MeasureBf16GemmTflops(0, static_cast<int>(llama.intermediate), absl::GetFlag(FLAGS_prefill),
                                             static_cast<int>(llama.hidden));
  if (!gemm.ok()) return fail("bf16 GEMM rate", gemm.status());
  report["ceilings"] = {{"copy_bandwidth_gbps", *bw},
                        {"copy_bytes", copy_bytes},
                        {"bf16_gemm_tflops", *gemm},
                        {"bf16_gemm_shape_mnk", {llama.intermediate, absl::GetFlag(FLAGS_prefill), llama.hidden}}};
  if (!as_json) {
    std::printf("device 0: %s (sm %d.%d, %.1f GiB), %d GPU(s)\n", info->name.c_str(), info->compute_major,
                info->compute_minor, static_cast<double>(info->total_bytes) / (1 << 30), gpus);
    std::printf("ceilings: copy bandwidth %.0f GB/s; bf16 GEMM %.1f TFLOP/s\n", *bw, *gemm);
  }
  if (gpus >= 2) {
    std::vector<int> devices;
    for (int d = 0; d < std::min(gpus, 8); ++d) devices.push_back(d);
    auto us = AllReduceMicros(devices, 8192);
    if (!us.ok()) return fail("NCCL all-reduce", us.status());
    report["all_reduce"] = {{"floats", 8192}, {"gpus", devices.size()}, {"us", *us}};
    if (!as_json) std::printf("NCCL all-reduce of 8192 floats over %zu GPUs: %.1f us\n", devices.size(), *us);
  } else {
    report["all_reduce"] = "skipped: 1 GPU";
    if (!as_json) std::printf("NCCL all-reduce: skipped: 1 GPU\n");
  }
  report["host_waits"] = absl::GetFlag(FLAGS_blocking_sync) ? "blocking" : "spinning";
  report["models"] = json::array();
  for (const std::string& name : absl::GetFlag(FLAGS_models)) {
    auto gen = EnsureModel(absl::GetFlag(FLAGS_scratch), name, as_json);
    if (!gen.ok()) return fail(name, gen.status());
    auto m = BenchModel(name, gen->dir, *bw, *gemm);
    if (!m.ok()) return fail(name, m.status());
    (*m)["write_s"] = gen->write_s;  // 0 when the model was already in --scratch
    report["models"].push_back(*m);
    if (!as_json) {
      const json& r = *m;
      std::printf("\nmodel %s (%s, %.2fB parameters, matrices held as %s, %.2f GB of weights held, loaded in %.1f s)\n",
                  name.c_str(), r["architecture"].get<std::string>().c_str(), r["parameters"].get<double>() / 1e9,
                  r["matrix_dtype_held"].get<std::string>().c_str(), r["weight_bytes_held"].get<double>() / 1e9,
                  r["load_s"].get<double>());
      for (const char* key : {"decode_batch_1", "decode_batch_n"}) {
        const json& d = r[key];
        std::printf("  decode batch %2d: %9.1f tok/s  roofline %9.1f tok/s  fraction %.3f  step %.2f ms  "
                    "host CPU %.2f ms/step\n",
                    d["batch"].get<int>(), d["tok_s"].get<double>(), d["roofline_tok_s"].get<double>(),
                    d["fraction_of_roofline"].get<double>(), d["step_ms"].get<double>(),
                    d["host_cpu_ms_per_step"].get<double>());
      }
      const json& p = r["prefill"];
      std::printf("  prefill %d tokens: %9.1f tok/s  %.2f TFLOP/s = %.3f of the bf16 GEMM rate\n",
                  p["prompt_tokens"].get<int>(), p["tok_s"].get<double>(), p["linear_tflops"].get<double>(),
                  p["fraction_of_bf16_gemm"].get<double>());
      if (const json& x = r["mixed_step"]; !x.is_null()) {
        std::printf("  mixed step (%d decoding + a %d-token chunk): %.2f ms against %.2f + %.2f ms as steps of "
                    "their own = %.3f\n",
                    x["decode_sequences"].get<int>(), x["prefill_tokens"].get<int>(), x["step_ms"].get<double>(),
                    x["decode_alone_ms"].get<double>(), x["prefill_alone_ms"].get<double>(),
                    x["over_separate_steps"].get<double>());
      }
    }
  }
  if (as_json) std::printf("%s\n", report.dump(2).c_str());
  return 0;
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return shardserve::Run();
}
