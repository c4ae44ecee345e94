// Generation in one process: runs a set of requests to completion on one Model with continuous
// batching (sequences join and leave the batch between steps; prompts are prefilled in chunks
// under the model's per-step token budget). A request is admitted, in order, once the model's KV
// cache has free blocks for its whole sequence (prompt + max_tokens, within the context length);
// they are freed when it ends, so nothing is ever preempted. This is the single-process reference every cluster
// layout is compared with, and the engine of `shardserve-run`.
#ifndef SHARDSERVE_WORKER_ENGINE_GENERATOR_H_
#define SHARDSERVE_WORKER_ENGINE_GENERATOR_H_

#include <cstdint>
#include <functional>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/step_runner.h"
#include "worker/engine/sampling.h"

namespace shardserve::engine {

enum class FinishReason : uint8_t {
  kLength,  // max_tokens generated, or the context is full
  kStop,    // a stop token was generated (it is included in the output)
};

absl::string_view FinishReasonName(FinishReason reason);

struct GenerationRequest {
  std::vector<int32_t> prompt;    // token ids, used exactly as given (no BOS added)
  int32_t max_tokens = 16;        // >= 1
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated tokens only
  FinishReason finish = FinishReason::kLength;
};

// Called once per generated token, in generation order for each request.
using TokenCallback = std::function<void(size_t request_index, int32_t token)>;

// InvalidArgument naming the problem: empty prompt, token ids outside the vocabulary, max_tokens
// < 1, a prompt that leaves no room to generate within the context length, a sequence that needs
// more KV blocks than the model has, bad sampling params.
absl::Status ValidateRequest(const StepRunner& model, const GenerationRequest& request);

// Runs every request to completion on `model` (one Model or a TpExecutor). All requests are
// validated before any work is done.
absl::StatusOr<std::vector<GenerationResult>> Generate(StepRunner& model, const std::vector<GenerationRequest>& requests,
                                                       const TokenCallback& on_token = nullptr);

}  // namespace shardserve::engine

#endif  // SHARDSERVE_WORKER_ENGINE_GENERATOR_H_
