#include "worker/engine/step_runner.h"

#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/status/macros.h"

namespace shardserve::engine {
namespace {

constexpr char kGroupIntactPayload[] = "shardserve.dev/engine/group-intact";

}  // namespace

absl::Status MarkGroupIntact(absl::Status status) {
  if (!status.ok()) status.SetPayload(kGroupIntactPayload, absl::Cord("1"));
  return status;
}

bool IsGroupIntact(const absl::Status& status) {
  return status.code() == absl::StatusCode::kInvalidArgument || status.GetPayload(kGroupIntactPayload).has_value();
}

absl::StatusOr<std::vector<int32_t>> RunDecodeSteps(StepRunner& runner, std::vector<StepSequence> batch,
                                                    int32_t steps, const PickToken& pick) {
  const ModelOptions& o = runner.options();
  if (steps < 1) return absl::InvalidArgumentError(absl::StrCat("decode steps must be >= 1, got ", steps));
  if (o.layer_begin != 0 || (o.layer_end != -1 && o.layer_end != runner.spec().num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("decode steps = ", steps,
                                                   " needs a stage with every layer (the embedding and the "
                                                   "sampling), this one holds layers [",
                                                   o.layer_begin, ", ", o.layer_end, ")"));
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepSequence& s = batch[i];
    if (s.tokens.size() != 1 || s.all_logits) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode steps: sequence ", i, " must decode exactly one given token"));
    }
    const int64_t need = (static_cast<int64_t>(s.pos_begin) + steps + o.kv_block_size - 1) / o.kv_block_size;
    if (static_cast<int64_t>(s.block_ids.size()) < need) {
      return absl::InvalidArgumentError(absl::StrCat("decode steps: sequence ", i, " has ", s.block_ids.size(),
                                                     " KV blocks, ", steps, " steps from position ", s.pos_begin,
                                                     " need ", need));
    }
  }
  std::vector<int32_t> ids(batch.size() * static_cast<size_t>(steps));
  for (int32_t j = 0; j < steps; ++j) {
    ASSIGN_OR_RETURN(StepResult result, runner.Step(batch));
    for (size_t i = 0; i < batch.size(); ++i) {
      const int32_t id = pick(i, j, result);
      ids[i * static_cast<size_t>(steps) + static_cast<size_t>(j)] = id;
      StepSequence& s = batch[i];
      s.tokens[0] = id;
      ++s.pos_begin;
      if (s.sampling.has_value()) ++s.sampling->step;
    }
  }
  return ids;
}

}  // namespace shardserve::engine
