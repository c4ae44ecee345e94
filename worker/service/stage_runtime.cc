#include "worker/service/stage_runtime.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log/fields.h"
#include "common/log/log.h"
#include "common/status/macros.h"
#include "worker/service/convert.h"
#include "worker/service/worker_metrics.h"

namespace shardserve::service {
namespace {

// "req-1,req-2": the request ids of a micro-batch's sequences, for its log lines.
std::string RequestIds(const v1::StepRequest& request) {
  std::string ids;
  for (const v1::StepSequence& s : request.sequences()) {
    absl::StrAppend(&ids, ids.empty() ? "" : ",", s.request_id().empty() ? "-" : LogValue(s.request_id()));
  }
  return ids;
}

// Whole microseconds since `start` (StepResponse.compute_us), at least 1 so that a reported time
// is never read as "not reported".
uint64_t MicrosSince(std::chrono::steady_clock::time_point start) {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start);
  return std::max<uint64_t>(1, static_cast<uint64_t>(us.count()));
}

// The tokens a micro-batch computes: its sequences' new tokens, times its decode steps.
int64_t NewTokens(const v1::StepRequest& request) {
  int64_t tokens = 0;
  for (const v1::StepSequence& s : request.sequences()) tokens += std::max<int64_t>(s.num_tokens(), 1);
  return tokens * std::max<int64_t>(request.decode_steps(), 1);
}

}  // namespace

StageRuntime::StageRuntime(std::shared_ptr<engine::StepRunner> runner, StageConfig config)
    : remote_experts_(config.remote_experts), runner_(std::move(runner)), config_(std::move(config)) {}

StageRuntime::~StageRuntime() {
  Cancel();
  std::shared_ptr<rpc::StageStreamClient> link;
  {
    MutexLock lock(&mu_);
    link = std::move(link_);
  }
  if (link != nullptr) link->WaitDone();
}

void StageRuntime::Cancel() {
  std::shared_ptr<rpc::StageStreamClient> link;
  {
    MutexLock lock(&mu_);
    cancelled_ = true;
    link = link_;
  }
  if (link != nullptr) link->Close("was cancelled");
}

void StageRuntime::Run(const v1::StepRequest& request, Done done, Caller caller) {
  absl::StatusOr<std::optional<v1::StepResponse>> r = RunOrForward(request, done, caller);
  if (!r.ok()) {
    // A structured line naming the requests (common/log/fields.h), so that one request can be
    // followed from the coordinator's log through every stage's. Failures of later stages are
    // logged by those stages.
    LOG(WARNING) << "event=step_failed stage=" << config_.stage << " assignment=" << LogValue(config_.assignment_id)
                 << " step_id=" << request.step_id() << " request_ids=" << RequestIds(request)
                 << " status=" << absl::StatusCodeToString(r.status().code())
                 << " error=" << LogValue(r.status().message());
    Answer(request, ErrorResponse(request.step_id(), r.status()), done);
  } else if (r->has_value()) {
    Answer(request, **std::move(r), done);
  }
}

void StageRuntime::Answer(const v1::StepRequest& request, v1::StepResponse response, Done& done) {
  if (is_last() && !request.answer_route().empty() && config_.answer_routes != nullptr &&
      config_.answer_routes->Send(request.answer_route(), response)) {
    v1::StepResponse ack;
    ack.set_step_id(request.step_id());
    ack.set_answered_direct(true);
    done(std::move(ack));
    return;
  }
  done(std::move(response));
}

bool StageRuntime::MayRunOnReader(const v1::StepRequest& request, absl::Duration budget) {
  if (remote_experts_ != nullptr) return false;  // its calls wait on gRPC
  if (!is_last()) {
    MutexLock lock(&mu_);
    if (cancelled_ || link_ == nullptr || link_->closing()) return false;  // the link would be (re)opened
  }
  const int64_t last_ns = last_step_ns_.load(std::memory_order_relaxed);
  const int64_t last_tokens = last_step_tokens_.load(std::memory_order_relaxed);
  if (last_ns <= 0 || last_tokens <= 0) return false;
  const int64_t tokens = NewTokens(request);
  const double predicted_ns =
      static_cast<double>(last_ns) * std::max(1.0, static_cast<double>(tokens) / static_cast<double>(last_tokens));
  return predicted_ns <= absl::ToDoubleNanoseconds(budget);
}

void StageRuntime::RecordStep(int64_t tokens, std::chrono::steady_clock::duration elapsed) {
  last_step_tokens_.store(std::max<int64_t>(tokens, 1), std::memory_order_relaxed);
  last_step_ns_.store(std::max<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count(), 1),
                      std::memory_order_relaxed);
}

absl::StatusOr<std::optional<v1::StepResponse>> StageRuntime::RunOrForward(const v1::StepRequest& request,
                                                                           Done& done, Caller caller) {
  const int64_t hidden = runner_->spec().hidden_size;
  StageBatch& batch = batch_;
  RETURN_IF_ERROR(FromProto(request, hidden, &batch));
  // Overlapped decode calls: what the micro-batch before this one sampled is for this one only (a
  // failure below leaves nothing, so that a sequence continued past a failure is refused).
  absl::flat_hash_map<uint64_t, int32_t>& previous = previous_;
  {
    MutexLock lock(&mu_);
    previous.swap(previous_samples_);
    previous_samples_.clear();
  }
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    StageSequence& s = batch.sequences[i];
    if (!s.from_previous) continue;
    if (!is_last() || runner_->options().layer_begin != 0) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": from_previous but stage ", config_.stage,
                                                     " is not the only one of its pipeline (it must embed the token "
                                                     "it sampled)"));
    }
    auto it = previous.find(s.sample_key);
    if (it == previous.end()) {
      return absl::UnavailableError(absl::StrCat("sequence ", i, " (request ", s.request_id, "): from_previous, but the "
                                                 "micro-batch this stage ran before step ", batch.step_id,
                                                 " sampled nothing under sample_key ", s.sample_key,
                                                 " (it failed, or the sequence's last call ran elsewhere)"));
    }
    s.step.tokens = {it->second};
  }
  std::vector<engine::StepSequence>& steps = steps_;
  steps.resize(batch.sequences.size());
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const StageSequence& s = batch.sequences[i];
    engine::StepSequence& step = steps[i];
    step = s.step;  // copy-assigned: the vectors keep their capacity
    // Greedy sequences get their id from the last stage's device, not a logits row.
    step.greedy = is_last() && s.sample && s.sampling.IsGreedy() && !s.logprobs;
    // Plain sampling too, where the last stage's device can draw (the engine decides).
    if (is_last() && s.sample && !s.logprobs && !step.greedy && s.sampling.IsPlain()) {
      step.sampling = kernels::RowSamplingParams{.temperature = s.sampling.temperature,
                                                 .top_k = s.sampling.top_k,
                                                 .top_p = s.sampling.top_p,
                                                 .min_p = s.sampling.min_p,
                                                 .seed = s.sampling.seed,
                                                 .step = s.sample_index};
    }
    step.all_logits = is_last() && !s.prompt_logprob_targets.empty();
  }
  if (batch.decode_steps > 1) return RunDecodeSteps(batch, steps);
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(engine::StepResult result, runner_->Step(steps, batch.input()));
  RecordStep(NewTokens(request), std::chrono::steady_clock::now() - start);
  VLOG(1) << "event=step stage=" << config_.stage << " step_id=" << request.step_id()
          << " sequences=" << request.sequences_size() << " request_ids=" << RequestIds(request) << " ms="
          << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (config_.metrics != nullptr) {
    int64_t tokens = 0;
    bool prefill = false;
    for (const auto& s : steps) {
      tokens += s.NumTokens();
      prefill = prefill || s.NumTokens() > 1;
    }
    config_.metrics->ObserveStep(config_.stage, prefill,
                                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), tokens);
  }
  if (!is_last()) {
    Forward(batch.step_id,
            ToNextStage(batch, std::move(result.hidden), hidden, *message_pool_, config_.hidden_wire_dtype),
            std::move(done), caller);
    return std::nullopt;
  }
  v1::StepResponse response;
  response.set_step_id(batch.step_id);
  bool any_logprobs = false;
  for (const StageSequence& s : batch.sequences) any_logprobs = any_logprobs || (s.sample && s.logprobs);
  const size_t vocab = static_cast<size_t>(runner_->spec().vocab_size);
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const StageSequence& s = batch.sequences[i];
    // Prompt logprobs first: row r's logits give the logprob of the prompt token after it.
    for (size_t r = 0; r < s.prompt_logprob_targets.size(); ++r) {
      const int32_t target = s.prompt_logprob_targets[r];
      if (target < 0) continue;
      if (static_cast<size_t>(target) >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": prompt_logprob_targets[", r, "] = ", target,
                                                       " is outside the vocabulary [0, ", vocab, ")"));
      }
      const absl::Span<const float> row(result.logits[i].data() + r * vocab, vocab);
      const engine::TokenLogprobs lp = engine::ComputeLogprobs(row, target, s.top_logprobs);
      v1::TokenLogprobs* out = response.add_prompt_logprobs();
      out->set_logprob(lp.logprob);
      out->mutable_top_ids()->Add(lp.top_ids.begin(), lp.top_ids.end());
      out->mutable_top_logprobs()->Add(lp.top_logprobs.begin(), lp.top_logprobs.end());
    }
  }
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const StageSequence& s = batch.sequences[i];
    if (!s.sample) continue;
    if (i < result.sampled_ids.size() && result.sampled_ids[i] >= 0) {
      response.add_token_ids(result.sampled_ids[i]);
      if (any_logprobs) response.add_logprobs();  // this one did not ask (it would have had its row)
      continue;
    }
    const std::vector<float>& logits = result.logits[i];
    // The last row holds the logits of the sequence's last new token.
    absl::Span<const float> row(logits.data() + logits.size() - vocab, vocab);
    const int32_t token = sampler_.Sample(row, s.sampling, s.sample_index);
    response.add_token_ids(token);
    if (any_logprobs) {
      v1::TokenLogprobs* out = response.add_logprobs();
      if (s.logprobs) {
        const engine::TokenLogprobs lp = engine::ComputeLogprobs(row, token, s.top_logprobs);
        out->set_logprob(lp.logprob);
        out->mutable_top_ids()->Add(lp.top_ids.begin(), lp.top_ids.end());
        out->mutable_top_logprobs()->Add(lp.top_logprobs.begin(), lp.top_logprobs.end());
      }
    }
  }
  response.set_compute_us(MicrosSince(start));
  RememberSamples(batch, response);
  return response;
}

void StageRuntime::RememberSamples(const StageBatch& batch, const v1::StepResponse& response) {
  const size_t per_sequence = batch.decode_steps;
  size_t k = 0;  // the sequence's first entry of token_ids
  MutexLock lock(&mu_);
  previous_samples_.clear();  // RunOrForward left it empty; a table this small keeps its capacity
  for (const StageSequence& s : batch.sequences) {
    if (!s.sample) continue;
    k += per_sequence;
    if (s.sample_key != 0 && k <= static_cast<size_t>(response.token_ids_size())) {
      previous_samples_[s.sample_key] = response.token_ids(static_cast<int>(k - 1));
    }
  }
}

absl::StatusOr<v1::StepResponse> StageRuntime::RunDecodeSteps(const StageBatch& batch,
                                                              const std::vector<engine::StepSequence>& steps) {
  if (!is_last() || runner_->options().layer_begin != 0) {
    return absl::InvalidArgumentError(absl::StrCat("decode_steps = ", batch.decode_steps, " but stage ", config_.stage,
                                                   " is not the only one of its pipeline (several decode steps per "
                                                   "request need a 1-stage pipeline)"));
  }
  const size_t vocab = static_cast<size_t>(runner_->spec().vocab_size);
  const engine::PickToken pick = [&](size_t i, int32_t j, const engine::StepResult& result) {
    if (i < result.sampled_ids.size() && result.sampled_ids[i] >= 0) return result.sampled_ids[i];
    const std::vector<float>& logits = result.logits[i];
    const StageSequence& s = batch.sequences[i];
    return sampler_.Sample(absl::MakeConstSpan(logits.data() + logits.size() - vocab, vocab), s.sampling,
                           s.sample_index + static_cast<uint64_t>(j));
  };
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                   engine::RunDecodeSteps(*runner_, steps, static_cast<int32_t>(batch.decode_steps), pick));
  RecordStep(static_cast<int64_t>(batch.sequences.size()) * batch.decode_steps, std::chrono::steady_clock::now() - start);
  if (config_.metrics != nullptr) {
    // One observation per decode step (their mean time), as k single steps would make.
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (uint32_t j = 0; j < batch.decode_steps; ++j) {
      config_.metrics->ObserveStep(config_.stage, false, seconds / batch.decode_steps,
                                   static_cast<int64_t>(batch.sequences.size()));
    }
  }
  v1::StepResponse response;
  response.set_step_id(batch.step_id);
  response.mutable_token_ids()->Add(ids.begin(), ids.end());
  response.set_compute_us(MicrosSince(start));
  RememberSamples(batch, response);
  return response;
}

std::shared_ptr<rpc::StageStreamClient> StageRuntime::OpenLink() {
  std::shared_ptr<rpc::StageStreamClient> old;
  {
    MutexLock lock(&mu_);
    if (link_ != nullptr && !link_->closing()) return link_;
    old = std::move(link_);
  }
  // The old stream is closing: its end answers (or has answered) what was waiting on it.
  if (old != nullptr) {
    old->Close("was replaced");
    old->WaitDone();
  }
  if (channel_ == nullptr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    args.SetMaxSendMessageSize(kMaxMessageBytes);
    channel_ = grpc::CreateCustomChannel(
        config_.next_address,
        config_.peer_credentials != nullptr ? config_.peer_credentials : grpc::InsecureChannelCredentials(), args);
  }
  rpc::StageStreamClient::Options options{.peer = absl::StrCat("next stage at ", config_.next_address),
                                          .step_deltas = config_.step_deltas};
  if (WorkerMetrics* metrics = config_.metrics; metrics != nullptr) {
    options.on_sent = [metrics](size_t bytes) { metrics->ObserveStream("tx", "downstream", bytes); };
    options.on_received = [metrics](size_t bytes) { metrics->ObserveStream("rx", "downstream", bytes); };
  }
  std::shared_ptr<rpc::StageStreamClient> link = rpc::StageStreamClient::Open(channel_, std::move(options));
  bool cancelled = false;
  {
    MutexLock lock(&mu_);
    cancelled = cancelled_;
    link_ = link;
  }
  if (cancelled) link->Close("was cancelled");
  return link;
}

void StageRuntime::Forward(uint64_t step_id, rpc::StageStreamClient::Messages messages, Done done, Caller caller) {
  std::shared_ptr<rpc::StageStreamClient> link;
  if (caller == Caller::kReader) {
    MutexLock lock(&mu_);
    link = link_;  // MayRunOnReader saw it open; if it closed since, Send refuses
  } else {
    link = OpenLink();
  }
  if (link == nullptr) {
    done(ErrorResponse(step_id, absl::UnavailableError(absl::StrCat("no open stream to the next stage at ",
                                                                    config_.next_address))));
    return;
  }
  rpc::StageStreamClient::Answer answer = [step_id, done](absl::StatusOr<v1::StepResponse> response) {
    done(response.ok() ? *std::move(response) : ErrorResponse(step_id, response.status()));
  };
  if (absl::Status st = link->Send(step_id, std::move(messages), answer); !st.ok()) {
    done(ErrorResponse(step_id, st));
  }
}

}  // namespace shardserve::service
