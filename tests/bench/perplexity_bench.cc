// Perplexity of a model on a fixed text with its weights as stored (f32), rounded to bfloat16, and
// quantized to int8 (--quantize=int8), and with an FP8 KV cache (--kv_cache_dtype=fp8_e4m3): what
// each storage costs in accuracy, on a trained model. Also prints how often each variant's most
// likely next token is the f32 model's. Times each variant's prefill of the text against f32's.
// Usage: shardserve-bench-perplexity [--model=../shared/models/stories260K]
//        [--scratch=/tmp/shardserve-ppl-bf16]  (where the bfloat16 copy is written)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/status/macros.h"
#include "common/tensor/dtype.h"
#include "common/tokenizer/tokenizer.h"
#include "tests/testing/safetensors_file.h"
#include "worker/engine/executor.h"

ABSL_FLAG(std::string, model, "../shared/models/stories260K", "model directory (f32 or bf16 safetensors + tokenizer)");
ABSL_FLAG(std::string, scratch, "/tmp/shardserve-ppl-bf16", "directory for the bfloat16 copy of the model");

namespace shardserve {
namespace {

// A short story in the simple style of the small models' training data.
constexpr char kText[] =
    "Once upon a time, there was a little girl named Lily. She liked to play in the garden with her dog, Max. "
    "One day, Lily saw a big red ball under a tree. She wanted to play with it, but the ball was stuck in a bush. "
    "Lily asked Max to help her. Max pulled the ball with his teeth and it came out. Lily was very happy. She "
    "said, \"Thank you, Max! You are a good dog.\" They played with the ball all day. When the sun went down, "
    "Lily and Max went inside. Mom gave them a warm bowl of soup. Lily hugged Max and said, \"Today was the best "
    "day.\" Then they went to sleep, and they dreamed about the big red ball.";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Writes every tensor of `ckpt` rounded to bfloat16 into dir/model.safetensors, and config.json
// with its dtype said to be bfloat16.
absl::Status WriteBf16Copy(const std::string& src, const Checkpoint& ckpt, const std::string& dir) {
  std::filesystem::create_directories(dir);
  std::vector<testing::StoredTensor> tensors;
  for (const std::string& name : ckpt.Names()) {
    ASSIGN_OR_RETURN(const SafetensorsEntry* e, ckpt.Find(name));
    ASSIGN_OR_RETURN(HostTensor t, ckpt.Read(name, e->shape));
    std::string bytes(static_cast<size_t>(t.size()) * 2, '\0');
    for (int64_t i = 0; i < t.size(); ++i) {
      const uint16_t b = FloatToBFloat16(t.data()[i]);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    }
    tensors.push_back({.name = name, .dtype = "BF16", .shape = e->shape, .bytes = std::move(bytes)});
  }
  std::ofstream out(dir + "/model.safetensors", std::ios::binary);
  out << testing::SafetensorsFile(tensors);
  std::ofstream(dir + "/config.json") << absl::StrReplaceAll(ReadFile(src + "/config.json"),
                                                             {{"\"float32\"", "\"bfloat16\""}});
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", dir, "/model.safetensors"));
  return absl::OkStatus();
}

struct Scores {
  double perplexity = 0;
  std::vector<int32_t> top1;  // most likely next token at every position
  double prefill_ms = 0;      // the whole text's prefill step, the best of kTimedSteps
};

constexpr int kTimedSteps = 5;

absl::StatusOr<Scores> Score(const std::string& dir, Quantization q, const std::vector<int32_t>& ids,
                             KvCacheFormat kv = KvCacheFormat::kAuto) {
  ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(dir));
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(dir));
  engine::ExecutorOptions eo;
  eo.model.max_step_tokens = static_cast<int64_t>(ids.size());
  eo.model.quantize = q;
  eo.model.kv_cache = kv;
  ASSIGN_OR_RETURN(auto model, engine::TpExecutor::Create(spec, *ckpt, eo));
  // The same prefill several times (each rewrites the same cache rows); the last one is scored.
  Scores s;
  s.prefill_ms = 1e300;
  engine::StepResult r;
  for (int i = 0; i < kTimedSteps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(r, model->Step({engine::StepSequence{.block_ids = engine::WholeContextBlocks(model->options(), 0),
                                                          .pos_begin = 0,
                                                          .tokens = ids,
                                                          .all_logits = true}}));
    s.prefill_ms = std::min(s.prefill_ms, std::chrono::duration<double, std::milli>(
                                              std::chrono::steady_clock::now() - t0).count());
  }
  const size_t v = static_cast<size_t>(spec.vocab_size);
  double nll = 0;
  for (size_t t = 0; t + 1 < ids.size(); ++t) {
    const float* l = r.logits[0].data() + t * v;
    const double mx = *std::max_element(l, l + v);
    double sum = 0;
    for (size_t i = 0; i < v; ++i) sum += std::exp(static_cast<double>(l[i]) - mx);
    nll -= static_cast<double>(l[ids[t + 1]]) - mx - std::log(sum);
    s.top1.push_back(static_cast<int32_t>(std::max_element(l, l + v) - l));
  }
  s.perplexity = std::exp(nll / static_cast<double>(ids.size() - 1));
  return s;
}

absl::Status Run() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  ASSIGN_OR_RETURN(auto tokenizer, LoadTokenizer(dir));
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer->Encode(kText, /*add_special_tokens=*/true));
  ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(dir));
  if (static_cast<int64_t>(ids.size()) > spec.max_position_embeddings) ids.resize(static_cast<size_t>(spec.max_position_embeddings));
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(dir));
  const std::string bf16_dir = absl::GetFlag(FLAGS_scratch);
  RETURN_IF_ERROR(WriteBf16Copy(dir, *ckpt, bf16_dir));
  ASSIGN_OR_RETURN(Scores f32, Score(dir, Quantization::kNone, ids));
  ASSIGN_OR_RETURN(Scores bf16, Score(bf16_dir, Quantization::kNone, ids));
  ASSIGN_OR_RETURN(Scores int8, Score(dir, Quantization::kInt8, ids));
  ASSIGN_OR_RETURN(Scores bf16_int8, Score(bf16_dir, Quantization::kInt8, ids));
  ASSIGN_OR_RETURN(Scores fp8_kv, Score(dir, Quantization::kNone, ids, KvCacheFormat::kFp8E4M3));
  auto agree = [&](const Scores& s) {
    size_t n = 0;
    for (size_t i = 0; i < s.top1.size(); ++i) n += s.top1[i] == f32.top1[i] ? 1 : 0;
    return 100.0 * static_cast<double>(n) / static_cast<double>(s.top1.size());
  };
  std::printf("%s: %zu tokens of a fixed story\n", dir.c_str(), ids.size());
  std::printf("  %-22s perplexity %8.4f\n", "f32 (as stored)", f32.perplexity);
  std::printf("  %-22s perplexity %8.4f (%+.2f%%), next-token top-1 equal to f32 at %.1f%% of positions\n",
              "bf16 weights", bf16.perplexity, 100.0 * (bf16.perplexity / f32.perplexity - 1), agree(bf16));
  std::printf("  %-22s perplexity %8.4f (%+.2f%%), next-token top-1 equal to f32 at %.1f%% of positions\n",
              "int8 (from f32)", int8.perplexity, 100.0 * (int8.perplexity / f32.perplexity - 1), agree(int8));
  std::printf("  %-22s perplexity %8.4f (%+.2f%%), next-token top-1 equal to f32 at %.1f%% of positions\n",
              "int8 (from bf16)", bf16_int8.perplexity, 100.0 * (bf16_int8.perplexity / f32.perplexity - 1),
              agree(bf16_int8));
  std::printf("  %-22s perplexity %8.4f (%+.2f%%), next-token top-1 equal to f32 at %.1f%% of positions\n",
              "f32, fp8 KV cache", fp8_kv.perplexity, 100.0 * (fp8_kv.perplexity / f32.perplexity - 1), agree(fp8_kv));
  // One thread's prefill of the whole text (best of kTimedSteps), against f32 in the same run.
  std::printf("prefill of the text, best of %d: f32 %.3f ms; bf16 %.2fx, int8 %.2fx, fp8 KV cache %.2fx of f32's time\n",
              kTimedSteps, f32.prefill_ms, bf16.prefill_ms / f32.prefill_ms, int8.prefill_ms / f32.prefill_ms,
              fp8_kv.prefill_ms / f32.prefill_ms);
  return absl::OkStatus();
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::Status st = shardserve::Run(); !st.ok()) {
    std::fprintf(stderr, "shardserve-bench-perplexity: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
