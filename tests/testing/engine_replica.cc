#include "tests/testing/engine_replica.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/status/macros.h"
#include "worker/engine/executor.h"
#include "worker/engine/local_pipeline.h"
#include "worker/engine/sampling.h"

namespace shardserve::testing {

absl::StatusOr<std::unique_ptr<EngineReplica>> EngineReplica::Create(const EngineReplicaOptions& options) {
  ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(options.model_dir));
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(options.model_dir));
  std::vector<int64_t> begins = {0};
  begins.insert(begins.end(), options.stage_starts.begin(), options.stage_starts.end());
  std::vector<std::unique_ptr<engine::StepRunner>> stages;
  for (size_t i = 0; i < begins.size(); ++i) {
    engine::ExecutorOptions eo;
    eo.cpu_ranks = options.tp;
    eo.model.num_kv_blocks = options.kv_blocks;
    eo.model.kv_block_size = options.kv_block_size;
    eo.model.max_seq_len = options.max_seq_len;
    eo.model.max_step_tokens = options.max_step_tokens;
    eo.model.layer_begin = begins[i];
    eo.model.layer_end = i + 1 < begins.size() ? begins[i + 1] : spec.num_layers;
    ASSIGN_OR_RETURN(std::unique_ptr<engine::TpExecutor> ex, engine::TpExecutor::Create(spec, *ckpt, eo));
    stages.push_back(std::move(ex));
  }
  std::unique_ptr<EngineReplica> replica(new EngineReplica());
  if (stages.size() == 1) {
    replica->runner_ = std::move(stages.front());
  } else {
    ASSIGN_OR_RETURN(replica->runner_, engine::LocalPipeline::Create(std::move(stages)));
  }
  replica->sampler_ = std::make_unique<engine::Sampler>();
  return replica;
}

EngineReplica::~EngineReplica() = default;

void EngineReplica::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
}

void EngineReplica::SetStepHookForTest(StepHook hook) {
  absl::MutexLock lock(&mu_);
  hook_ = std::move(hook);
}

void EngineReplica::HoldStepsForTest() {
  absl::MutexLock lock(&mu_);
  held_ = true;
}

void EngineReplica::ReleaseStepsForTest() {
  absl::MutexLock lock(&mu_);
  held_ = false;
}

std::vector<coordinator::StepInput> EngineReplica::StepInputsForTest() const {
  absl::MutexLock lock(&mu_);
  return inputs_;
}

int64_t EngineReplica::NumStepsForTest() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(inputs_.size());
}

bool EngineReplica::WaitForStepsForTest(int64_t n, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto recorded = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return static_cast<int64_t>(inputs_.size()) >= n;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&recorded), timeout);
}

int64_t EngineReplica::kv_blocks() const { return runner_->options().num_kv_blocks; }

bool EngineReplica::OverlapsDecodeCalls() const {
  absl::MutexLock lock(&mu_);
  return overlaps_;
}

void EngineReplica::SetOverlapsDecodeCallsForTest(bool on) {
  absl::MutexLock lock(&mu_);
  overlaps_ = on;
}

absl::StatusOr<coordinator::StepOutput> EngineReplica::Step(const coordinator::StepInput& input) {
  return StepOverlapping(input, [] {});
}

absl::StatusOr<coordinator::StepOutput> EngineReplica::StepOverlapping(const coordinator::StepInput& input,
                                                                       absl::FunctionRef<void()> while_waiting) {
  StepHook hook;
  size_t turn = 0;
  bool shut = false;
  {
    absl::MutexLock lock(&mu_);
    shut = shutdown_;
    if (!shut) {
      turn = inputs_.size();
      inputs_.push_back(input);
      hook = hook_;
    }
  }
  while_waiting();  // recorded: in its place in the order
  if (shut) return absl::UnavailableError("engine replica is shut down");
  // Steps run in the order they were recorded, one at a time; each takes its turn also when it
  // fails before running, so that the later ones go on.
  const auto in_turn = [&](const std::function<absl::StatusOr<coordinator::StepOutput>()>& body) {
    {
      absl::MutexLock lock(&mu_);
      auto my_turn = [this, turn]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return next_run_ == turn; };
      mu_.Await(absl::Condition(&my_turn));
    }
    absl::StatusOr<coordinator::StepOutput> out = body();
    absl::MutexLock lock(&mu_);
    ++next_run_;
    return out;
  };
  if (hook) {
    if (absl::Status st = hook(input); !st.ok()) {
      return in_turn([&]() -> absl::StatusOr<coordinator::StepOutput> { return st; });
    }
  }
  absl::Status ready = absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !held_ || shutdown_; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&released), absl::Seconds(120))) {
      ready = absl::DeadlineExceededError("engine replica: steps held for 120 s");
    } else if (shutdown_) {
      ready = absl::UnavailableError("engine replica is shut down");
    }
  }
  return in_turn([&]() -> absl::StatusOr<coordinator::StepOutput> {
    if (!ready.ok()) return ready;
    absl::MutexLock run_lock(&run_mu_);
    return Run(input);
  });
}

absl::StatusOr<coordinator::StepOutput> EngineReplica::Run(const coordinator::StepInput& input) {
  // Overlapped decode calls: the samples of the step before are for this one only.
  absl::flat_hash_map<uint64_t, int32_t> previous;
  previous.swap(previous_samples_);
  std::vector<engine::StepSequence> batch;
  batch.reserve(input.sequences.size());
  for (const coordinator::StepSequenceInput& s : input.sequences) {
    std::vector<int32_t> tokens = s.token_ids;
    if (s.from_previous) {
      auto it = previous.find(s.sequence_id);
      if (it == previous.end()) {
        return absl::UnavailableError(absl::StrCat("engine replica: sequence ", s.sequence_id,
                                                   " continues a step that did not sample it"));
      }
      tokens = {it->second};
    }
    batch.push_back(engine::StepSequence{.block_ids = s.block_ids,
                                         .pos_begin = s.pos_begin,
                                         .tokens = std::move(tokens),
                                         .all_logits = !s.prompt_logprob_targets.empty()});
  }
  absl::StatusOr<coordinator::StepOutput> out = Compute(input, std::move(batch));
  if (out.ok() && input.remember_samples) {
    const size_t per_sequence = static_cast<size_t>(std::max(input.decode_steps, 1));
    size_t k = 0;
    for (const coordinator::StepSequenceInput& s : input.sequences) {
      if (!s.sample) continue;
      k += per_sequence;
      previous_samples_[s.sequence_id] = out->token_ids[k - 1];
    }
  }
  return out;
}

absl::StatusOr<coordinator::StepOutput> EngineReplica::Compute(const coordinator::StepInput& input,
                                                              std::vector<engine::StepSequence> batch) {
  if (input.decode_steps > 1) {
    // Multi-step decoding as a 1-stage worker runs it (engine::RunDecodeSteps), sampling plainly.
    const size_t vocab = static_cast<size_t>(runner_->spec().vocab_size);
    const engine::PickToken pick = [&](size_t i, int32_t j, const engine::StepResult& result) {
      const coordinator::StepSequenceInput& s = input.sequences[i];
      const engine::SamplingParams params{.temperature = s.sampling.temperature,
                                          .top_k = s.sampling.top_k,
                                          .top_p = s.sampling.top_p,
                                          .seed = s.sampling.seed,
                                          .min_p = s.sampling.min_p};
      return sampler_->Sample(absl::MakeConstSpan(result.logits[i].data() + result.logits[i].size() - vocab, vocab),
                              params, s.sample_index + static_cast<uint64_t>(j));
    };
    coordinator::StepOutput out;
    ASSIGN_OR_RETURN(out.token_ids, engine::RunDecodeSteps(*runner_, std::move(batch), input.decode_steps, pick));
    return out;
  }
  ASSIGN_OR_RETURN(engine::StepResult result, runner_->Step(batch));
  coordinator::StepOutput out;
  bool any_logprobs = false;
  for (const coordinator::StepSequenceInput& s : input.sequences) any_logprobs = any_logprobs || (s.sample && s.logprobs);
  const size_t vocab = static_cast<size_t>(runner_->spec().vocab_size);
  for (size_t b = 0; b < input.sequences.size(); ++b) {
    const std::vector<int32_t>& targets = input.sequences[b].prompt_logprob_targets;
    for (size_t r = 0; r < targets.size(); ++r) {
      if (targets[r] < 0) continue;
      engine::TokenLogprobs e = engine::ComputeLogprobs(
          absl::Span<const float>(result.logits[b].data() + r * vocab, vocab), targets[r], input.sequences[b].top_logprobs);
      out.prompt_logprobs.push_back(
          {.logprob = e.logprob, .top_ids = std::move(e.top_ids), .top_logprobs = std::move(e.top_logprobs)});
    }
  }
  for (size_t b = 0; b < input.sequences.size(); ++b) {
    const coordinator::StepSequenceInput& s = input.sequences[b];
    if (!s.sample) continue;
    const engine::SamplingParams params{.temperature = s.sampling.temperature,
                                        .top_k = s.sampling.top_k,
                                        .top_p = s.sampling.top_p,
                                        .seed = s.sampling.seed,
                                        .min_p = s.sampling.min_p,
                                        .logit_bias = s.sampling.logit_bias,
                                        .suppress_ids = s.suppress_token_ids,
                                        .repetition_penalty = s.sampling.repetition_penalty,
                                        .frequency_penalty = s.sampling.frequency_penalty,
                                        .presence_penalty = s.sampling.presence_penalty,
                                        .history_ids = s.penalty_token_ids,
                                        .history_counts = s.penalty_token_counts,
                                        .allowed_token_mask = s.allowed_token_mask != nullptr ? *s.allowed_token_mask
                                                                                              : std::string()};
    if (absl::Status st = params.Validate(); !st.ok()) return st;
    // The last row: the logits of the sequence's last new token.
    const absl::Span<const float> row(result.logits[b].data() + result.logits[b].size() - vocab, vocab);
    const int32_t token = sampler_->Sample(row, params, s.sample_index);
    out.token_ids.push_back(token);
    if (any_logprobs) {
      coordinator::TokenLogprobs& lp = out.logprobs.emplace_back();
      if (s.logprobs) {
        engine::TokenLogprobs e = engine::ComputeLogprobs(row, token, s.top_logprobs);
        lp = {.logprob = e.logprob, .top_ids = std::move(e.top_ids), .top_logprobs = std::move(e.top_logprobs)};
      }
    }
  }
  return out;
}

}  // namespace shardserve::testing
