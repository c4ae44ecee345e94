// shardserve-run: load a Hugging Face checkpoint and generate in one process, without gRPC.
//
//   shardserve-run --model DIR --prompt_ids 1,2,3 --max_tokens 32 --temperature 0 --print_ids
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "common/flags/usage.h"
#include "common/log/progress.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/status/macros.h"
#include "common/tokenizer/tokenizer.h"
#include "worker/engine/generator.h"
#include "worker/engine/executor.h"
#include "worker/kernels/registry.h"
#include "worker/run/run_options.h"

ABSL_FLAG(std::string, model, "", "Hugging Face model directory (config.json + safetensors)");
ABSL_FLAG(std::string, prompt, "", "prompt text (needs the model's tokenizer)");
ABSL_FLAG(std::string, prompt_ids, "", "prompt as comma-separated token ids, used exactly as given (no BOS)");
ABSL_FLAG(bool, print_ids, false, "print only the generated token ids, comma-separated, on one line");
ABSL_FLAG(int32_t, max_tokens, 64, "tokens to generate");
ABSL_FLAG(double, temperature, 0.0, "sampling temperature; 0 = greedy");
ABSL_FLAG(int32_t, top_k, 0, "sample from the k most likely tokens; 0 = all");
ABSL_FLAG(double, top_p, 1.0, "nucleus sampling threshold in (0, 1]");
ABSL_FLAG(uint64_t, seed, 0, "sampling seed");
ABSL_FLAG(double, presence_penalty, 0.0, "subtracted once from the logit of every token generated so far; [-2, 2]");
ABSL_FLAG(double, frequency_penalty, 0.0,
          "subtracted from a token's logit once per time it was generated so far; [-2, 2]");
ABSL_FLAG(double, repetition_penalty, 1.0,
          "divides the positive (multiplies the negative) logits of tokens in the prompt or generated; (0, 2]");
ABSL_FLAG(std::string, devices, "cpu", "cpu, cpu:N (N tensor-parallel CPU ranks), cuda:all or cuda:0,1,...");
ABSL_FLAG(int32_t, threads, 1, "BLAS threads for a single CPU rank");
ABSL_FLAG(std::string, quantize, "none",
          "int8: workers store the linear projections and lm_head as block int8 (64 weights per scale) on "
          "backends that take it (CPU); none: the checkpoint's dtype");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "auto (the checkpoint's bf16/f16 on GPUs, f32 on CPU ranks) or fp8 / fp8_e4m3 (1 byte per element, "
          "no scale: values saturate at +-448)");
ABSL_FLAG(bool, stop_at_eos, true, "stop when the model emits an EOS id from its config");

namespace shardserve {
namespace {

absl::Status Run() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) return absl::InvalidArgumentError("--model is required");
  engine::GenerationRequest req;
  req.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  req.sampling.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  req.sampling.top_k = absl::GetFlag(FLAGS_top_k);
  req.sampling.top_p = static_cast<float>(absl::GetFlag(FLAGS_top_p));
  req.sampling.seed = absl::GetFlag(FLAGS_seed);
  req.sampling.presence_penalty = static_cast<float>(absl::GetFlag(FLAGS_presence_penalty));
  req.sampling.frequency_penalty = static_cast<float>(absl::GetFlag(FLAGS_frequency_penalty));
  req.sampling.repetition_penalty = static_cast<float>(absl::GetFlag(FLAGS_repetition_penalty));
  RETURN_IF_ERROR(req.sampling.Validate());
  if (req.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--max_tokens must be >= 1, got ", req.max_tokens));
  }
  const std::string ids_text = absl::GetFlag(FLAGS_prompt_ids);
  const std::string text = absl::GetFlag(FLAGS_prompt);
  if (ids_text.empty() == text.empty()) {
    return absl::InvalidArgumentError("give exactly one of --prompt and --prompt_ids");
  }
  ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(dir));
  // The model's tokenizer, when its directory has one: needed for text prompts, and used to
  // print the answer as text.
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(dir);
  if (!text.empty()) {
    if (!tokenizer.ok()) return tokenizer.status();
    ASSIGN_OR_RETURN(req.prompt, (*tokenizer)->Encode(text, /*add_special_tokens=*/true));
  } else {
    ASSIGN_OR_RETURN(req.prompt, run::ParseTokenIds(ids_text));
  }
  ASSIGN_OR_RETURN(run::DeviceChoice dev, run::ParseDevices(absl::GetFlag(FLAGS_devices), absl::GetFlag(FLAGS_threads),
                                                            kernels::CudaDeviceCount()));

  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(dir));
  engine::ExecutorOptions options{.kind = dev.kind,
                                  .cpu_ranks = dev.cpu_ranks,
                                  .cpu_threads = dev.cpu_threads,
                                  .cuda_devices = dev.cuda_devices};
  ASSIGN_OR_RETURN(options.model.quantize, ParseQuantization(absl::GetFlag(FLAGS_quantize)));
  ASSIGN_OR_RETURN(options.model.kv_cache, ParseKvCacheFormat(absl::GetFlag(FLAGS_kv_cache_dtype)));
  // One sequence: KV blocks for the whole context.
  options.model.num_kv_blocks =
      (spec.max_position_embeddings + options.model.kv_block_size - 1) / options.model.kv_block_size;
  auto progress = std::make_shared<Progress>(Progress::Options{
      .what = "loading weights", .unit = "layers", .total = spec.num_layers, .bytes = true});
  options.model.on_load_progress = [progress](int64_t done, int64_t /*total*/, size_t bytes) {
    progress->Update(done, static_cast<int64_t>(bytes));
  };
  ASSIGN_OR_RETURN(auto model, engine::TpExecutor::Create(spec, *ckpt, options));
  progress->Finish();
  if (absl::GetFlag(FLAGS_stop_at_eos)) {
    for (int64_t id : spec.eos_token_ids) req.stop_ids.push_back(static_cast<int32_t>(id));
  }
  const bool as_text = !absl::GetFlag(FLAGS_print_ids) && tokenizer.ok();
  std::unique_ptr<StreamDecoder> decoder;
  if (as_text) {
    // The text printed is the prompt's continuation: a first word keeps its space.
    decoder = (*tokenizer)->NewStreamDecoder(/*skip_special_tokens=*/true);
    // An id outside the tokenizer's vocabulary is the engine's to refuse, naming the token.
    (void)decoder->Prime(req.prompt);
  }
  absl::Status decode_status;
  auto on_token = [&](size_t, int32_t id) {
    if (!as_text || !decode_status.ok()) return;
    absl::StatusOr<std::string> piece = decoder->Next(id);
    if (!piece.ok()) {
      decode_status = piece.status();
      return;
    }
    std::cout << *piece << std::flush;  // streamed as tokens arrive
  };
  ASSIGN_OR_RETURN(auto results, engine::Generate(*model, {req}, on_token));
  RETURN_IF_ERROR(decode_status);
  if (as_text) {
    std::cout << decoder->Finish() << "\n";
  } else {
    std::cout << absl::StrJoin(results[0].tokens, ",") << "\n";
  }
  if (!absl::GetFlag(FLAGS_print_ids)) {
    std::cerr << "finish_reason: " << engine::FinishReasonName(results[0].finish) << ", " << results[0].tokens.size()
              << " tokens\n";
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  shardserve::SetProgramUsage("Generate with a Hugging Face model in one process.\n"
                               "  shardserve-run --model DIR --prompt \"TEXT\" --max_tokens N --temperature 0");
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "shardserve-run: unexpected argument \"" << rest[1] << "\"\n";
    return 2;
  }
  if (absl::Status st = shardserve::Run(); !st.ok()) {
    std::cerr << "shardserve-run: " << st << "\n";
    return 1;
  }
  return 0;
}
