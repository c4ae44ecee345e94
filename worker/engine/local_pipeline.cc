#include "worker/engine/local_pipeline.h"

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"

namespace shardserve::engine {

absl::StatusOr<std::unique_ptr<LocalPipeline>> LocalPipeline::Create(std::vector<std::unique_ptr<StepRunner>> stages) {
  if (stages.empty()) return absl::InvalidArgumentError("a pipeline needs at least one stage");
  int64_t next = 0;
  for (size_t i = 0; i < stages.size(); ++i) {
    const ModelOptions& o = stages[i]->options();
    if (o.layer_begin != next) {
      return absl::InvalidArgumentError(absl::StrCat("stage ", i, " starts at layer ", o.layer_begin, ", expected ", next));
    }
    next = o.layer_end;
  }
  if (next != stages.front()->spec().num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("the stages end at layer ", next, " of ",
                                                   stages.front()->spec().num_layers));
  }
  return std::unique_ptr<LocalPipeline>(new LocalPipeline(std::move(stages)));
}

absl::StatusOr<StepResult> LocalPipeline::Step(const std::vector<StepSequence>& batch,
                                               absl::Span<const float> hidden_in) {
  ASSIGN_OR_RETURN(StepResult r, stages_[0]->Step(batch, hidden_in));
  if (stages_.size() == 1) return r;
  // Later stages see only token counts, as over the wire.
  std::vector<StepSequence> counts = batch;
  for (StepSequence& s : counts) {
    s.num_tokens = s.NumTokens();
    s.tokens.clear();
  }
  for (size_t i = 1; i < stages_.size(); ++i) {
    std::vector<float> hidden = std::move(r.hidden);
    ASSIGN_OR_RETURN(r, stages_[i]->Step(counts, hidden));
  }
  return r;
}

}  // namespace shardserve::engine
