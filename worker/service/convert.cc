#include "worker/service/convert.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status/macros.h"
#include "common/tensor/dtype.h"

namespace shardserve::service {
namespace {

// Fills `s` from `p`, reusing the capacity of its vectors and strings (FromProto runs every step).
void SamplingFromProto(const v1::StepSequence& p, engine::SamplingParams* s) {
  s->temperature = p.sampling().temperature();
  s->top_k = p.sampling().top_k();
  s->top_p = p.sampling().top_p() == 0.0f ? 1.0f : p.sampling().top_p();
  s->seed = p.sampling().seed();
  s->min_p = p.sampling().min_p();
  // Sorted by id: the map's iteration order is unspecified, the sum is not order-dependent, but a
  // fixed order keeps the forwarded message byte-identical.
  s->logit_bias.clear();
  for (const auto& [id, bias] : p.sampling().logit_bias()) s->logit_bias.emplace_back(id, bias);
  std::sort(s->logit_bias.begin(), s->logit_bias.end());
  s->suppress_ids.assign(p.suppress_token_ids().begin(), p.suppress_token_ids().end());
  s->presence_penalty = p.sampling().presence_penalty();
  s->frequency_penalty = p.sampling().frequency_penalty();
  s->repetition_penalty = p.sampling().repetition_penalty() == 0.0f ? 1.0f : p.sampling().repetition_penalty();
  s->history_ids.assign(p.penalty_token_ids().begin(), p.penalty_token_ids().end());
  s->history_counts.assign(p.penalty_token_counts().begin(), p.penalty_token_counts().end());
  s->allowed_token_mask.assign(p.allowed_token_mask());
}

void SamplingToProto(const StageSequence& s, v1::StepSequence* p) {
  v1::SamplingParams* o = p->mutable_sampling();
  o->set_temperature(s.sampling.temperature);
  o->set_top_k(s.sampling.top_k);
  o->set_top_p(s.sampling.top_p);
  o->set_seed(s.sampling.seed);
  o->set_min_p(s.sampling.min_p);
  for (const auto& [id, bias] : s.sampling.logit_bias) (*o->mutable_logit_bias())[id] = bias;
  p->mutable_suppress_token_ids()->Add(s.sampling.suppress_ids.begin(), s.sampling.suppress_ids.end());
  o->set_presence_penalty(s.sampling.presence_penalty);
  o->set_frequency_penalty(s.sampling.frequency_penalty);
  o->set_repetition_penalty(s.sampling.repetition_penalty);
  p->mutable_penalty_token_ids()->Add(s.sampling.history_ids.begin(), s.sampling.history_ids.end());
  p->mutable_penalty_token_counts()->Add(s.sampling.history_counts.begin(), s.sampling.history_counts.end());
  p->set_logprobs(s.logprobs);
  p->set_top_logprobs(s.top_logprobs);
  p->set_allowed_token_mask(s.sampling.allowed_token_mask);
}

// Whether every sequence of `batch` (decode_steps > 1) can take its next tokens from its own
// samples: one given token, sampled plainly, nothing returned but the ids.
absl::Status CheckMultiStep(const StageBatch& batch) {
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const StageSequence& s = batch.sequences[i];
    const char* why = nullptr;
    if (s.step.tokens.size() != 1 && !s.from_previous) {
      why = "does not decode exactly one given token (token_ids)";
    } else if (!s.sample) {
      why = "does not sample";
    } else if (!s.sampling.IsPlain()) {
      why = "has logit_bias, suppress_token_ids, penalties or an allowed_token_mask";
    } else if (s.logprobs || !s.prompt_logprob_targets.empty()) {
      why = "asks for logprobs";
    }
    if (why != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode_steps = ", batch.decode_steps, " but sequence ", i, " ", why,
                       "; several decode steps per request need plain decode-only sequences"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StageBatch> FromProto(const v1::StepRequest& request, int64_t hidden_size) {
  StageBatch batch;
  RETURN_IF_ERROR(FromProto(request, hidden_size, &batch));
  return batch;
}

absl::Status FromProto(const v1::StepRequest& request, int64_t hidden_size, StageBatch* out) {
  StageBatch& batch = *out;
  batch.step_id = request.step_id();
  batch.answer_route.assign(request.answer_route());
  batch.hidden.clear();
  batch.hidden_in = {};
  // Resized, not rebuilt: the sequences keep their vectors' capacity from the last step.
  batch.sequences.resize(static_cast<size_t>(request.sequences_size()));
  int64_t total = 0;
  for (int i = 0; i < request.sequences_size(); ++i) {
    const v1::StepSequence& p = request.sequences(i);
    StageSequence& s = batch.sequences[static_cast<size_t>(i)];
    s.step.block_ids.assign(p.block_ids().begin(), p.block_ids().end());
    s.step.pos_begin = p.pos_begin();
    s.step.tokens.assign(p.token_ids().begin(), p.token_ids().end());
    s.step.num_tokens = p.num_tokens();
    s.step.all_logits = false;
    s.step.greedy = false;
    s.step.sampling.reset();
    if (!s.step.tokens.empty() && s.step.num_tokens != 0 && s.step.num_tokens != s.step.NumTokens()) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": num_tokens ", p.num_tokens(), " but ",
                                                     p.token_ids_size(), " token ids"));
    }
    s.sample_key = p.sample_key();
    s.from_previous = p.from_previous();
    if (s.from_previous) {
      // The one new token is the stage's own last sample for the key (StageRuntime fills it in).
      if (p.sample_key() == 0 || !p.token_ids().empty() || p.num_tokens() > 1 || !p.prompt_logprob_targets().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", i, ": from_previous needs a sample_key, no token_ids, num_tokens 0 or 1 and no "
                         "prompt_logprob_targets (sample_key ", p.sample_key(), ", ", p.token_ids_size(),
                         " token ids, num_tokens ", p.num_tokens(), ")"));
      }
      s.step.num_tokens = 1;
    }
    if (s.step.NumTokens() < 1) return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": no tokens"));
    s.sample = p.sample();
    SamplingFromProto(p, &s.sampling);
    if (s.sample) RETURN_IF_ERROR(s.sampling.Validate());
    s.logprobs = p.logprobs();
    s.top_logprobs = p.top_logprobs();
    if (s.top_logprobs < 0 || s.top_logprobs > engine::kMaxTopLogprobs) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": top_logprobs must be in [0, ",
                                                     engine::kMaxTopLogprobs, "], got ", s.top_logprobs));
    }
    s.sample_index = p.sample_index();
    s.request_id.assign(p.request_id());
    s.key = p.key();
    s.prompt_logprob_targets.assign(p.prompt_logprob_targets().begin(), p.prompt_logprob_targets().end());
    if (!s.prompt_logprob_targets.empty() &&
        static_cast<int32_t>(s.prompt_logprob_targets.size()) != s.step.NumTokens()) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": ", s.prompt_logprob_targets.size(),
                                                     " prompt_logprob_targets for ", s.step.NumTokens(), " tokens"));
    }
    for (int32_t t : s.prompt_logprob_targets) {
      if (t < -1) return absl::InvalidArgumentError(absl::StrCat("sequence ", i, ": prompt_logprob_targets has ", t));
    }
    total += s.step.NumTokens();
  }
  batch.decode_steps = std::max<uint32_t>(request.decode_steps(), 1);
  if (batch.decode_steps > kMaxDecodeSteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode_steps must be in [0, ", kMaxDecodeSteps, "], got ", batch.decode_steps));
  }
  if (batch.decode_steps > 1) RETURN_IF_ERROR(CheckMultiStep(batch));
  if (request.has_hidden()) {
    const v1::Tensor& t = request.hidden();
    const std::optional<DType> dtype = FromWireDtype(t.dtype());
    if (!dtype.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("hidden states must be F32 or BF16, got dtype ", t.dtype()));
    }
    if (t.shape_size() != 2 || t.shape(0) != total || t.shape(1) != hidden_size) {
      return absl::InvalidArgumentError(absl::StrCat("hidden states must have shape [", total, ", ", hidden_size,
                                                     "] for this batch"));
    }
    const size_t count = static_cast<size_t>(total * hidden_size);
    const size_t bytes = count * DTypeSize(*dtype);
    if (t.data().size() != bytes) {
      return absl::InvalidArgumentError(absl::StrCat("hidden states carry ", t.data().size(), " bytes; ", bytes,
                                                     " expected for ", DTypeName(*dtype)));
    }
    const char* data = t.data().data();
    if (*dtype == DType::kBF16) {
      // Widened once, into the batch's own buffer (which keeps its capacity from the last step).
      batch.hidden.resize(count);
      ConvertToFloat(DType::kBF16, data, count, batch.hidden.data());
    } else if (bytes > 0 && reinterpret_cast<uintptr_t>(data) % alignof(float) == 0) {
      // Read in place: no copy of the activations beyond gRPC's into the parsed message.
      batch.hidden_in = absl::MakeConstSpan(reinterpret_cast<const float*>(data), count);
    } else {
      batch.hidden.resize(count);
      std::memcpy(batch.hidden.data(), data, bytes);
    }
  }
  return absl::OkStatus();
}

v1::DType ToWireDtype(DType dtype) { return dtype == DType::kBF16 ? v1::DTYPE_BF16 : v1::DTYPE_F32; }

std::optional<DType> FromWireDtype(v1::DType dtype) {
  if (dtype == v1::DTYPE_F32) return DType::kF32;
  if (dtype == v1::DTYPE_BF16) return DType::kBF16;
  return std::nullopt;
}

void AppendAs(DType dtype, absl::Span<const float> values, std::string* bytes) {
  const size_t at = bytes->size();
  bytes->resize(at + values.size() * DTypeSize(dtype));
  // Cannot fail for kF32 and kBF16, the dtypes callers pass.
  ConvertFromFloat(dtype, values.data(), values.size(), bytes->data() + at).IgnoreError();
}

v1::StepResponse ErrorResponse(uint64_t step_id, const absl::Status& st) {
  v1::StepResponse failed;
  failed.set_step_id(step_id);
  failed.set_error_code(static_cast<int32_t>(st.code()));
  failed.set_error_message(std::string(st.message()));
  return failed;
}

rpc::StageStreamClient::Messages ToNextStage(const StageBatch& batch, std::vector<float> hidden_states,
                                             int64_t hidden_size, rpc::MessagePool<v1::StepRequest>& pool,
                                             DType wire_dtype) {
  const DType wire = wire_dtype == DType::kBF16 ? DType::kBF16 : DType::kF32;
  const size_t count = hidden_states.size();
  const size_t size = count * DTypeSize(wire);
  const uint32_t chunks = static_cast<uint32_t>(std::max<size_t>(1, (size + kMaxChunkBytes - 1) / kMaxChunkBytes));
  // One slice owns the bytes; each chunk's is a view of it (sharing its reference count).
  grpc::Slice all;
  if (wire == DType::kBF16 && size > 0) {
    // A fresh slice of `size` bytes is ours to fill (as gRPC's serializer fills one); not zeroed.
    all = grpc::Slice(size);
    // Cannot fail for kBF16.
    ConvertFromFloat(DType::kBF16, hidden_states.data(), count, const_cast<uint8_t*>(all.begin())).IgnoreError();
    std::vector<float>().swap(hidden_states);  // the f32 states are not needed past this point
  } else {
    all = rpc::StageStreamClient::OwningSlice(std::move(hidden_states));
  }
  rpc::StageStreamClient::Messages out;
  for (uint32_t c = 0; c < chunks; ++c) {
    const size_t begin = static_cast<size_t>(c) * kMaxChunkBytes;
    const size_t end = std::min(size, begin + kMaxChunkBytes);
    out.push_back(pool.Take(), begin < end ? all.sub(begin, end) : grpc::Slice());
  }
  v1::StepRequest& first = *out[0];
  first.set_answer_route(batch.answer_route);
  int64_t total = 0;
  for (const StageSequence& s : batch.sequences) {
    v1::StepSequence* p = first.add_sequences();
    p->mutable_block_ids()->Add(s.step.block_ids.begin(), s.step.block_ids.end());
    p->set_pos_begin(s.step.pos_begin);
    p->set_num_tokens(s.step.NumTokens());
    p->set_sample(s.sample);
    SamplingToProto(s, p);
    p->set_sample_index(s.sample_index);
    p->set_request_id(s.request_id);
    p->set_key(s.key);
    p->mutable_prompt_logprob_targets()->Add(s.prompt_logprob_targets.begin(), s.prompt_logprob_targets.end());
    total += s.step.NumTokens();
  }
  v1::Tensor* t = first.mutable_hidden();
  t->set_dtype(ToWireDtype(wire));
  t->add_shape(total);
  t->add_shape(hidden_size);
  for (uint32_t c = 0; c < chunks; ++c) {
    v1::StepRequest& msg = *out[c];
    msg.set_step_id(batch.step_id);
    msg.set_chunk_index(c);
    msg.set_chunk_count(chunks);
  }
  return out;
}

absl::StatusOr<bool> ChunkAssembler::Add(PooledStepRequest chunk) {
  const uint32_t count = std::max<uint32_t>(chunk->chunk_count(), 1);
  if (chunk->chunk_index() != expected_) {
    return absl::InvalidArgumentError(absl::StrCat("step ", chunk->step_id(), ": chunk ", chunk->chunk_index(),
                                                   " arrived, chunk ", expected_, " expected"));
  }
  if (expected_ == 0) {
    pending_ = std::move(chunk);
  } else {
    if (chunk->step_id() != pending_->step_id() || count != pending_->chunk_count()) {
      return absl::InvalidArgumentError(absl::StrCat("chunk of step ", chunk->step_id(), " interleaved with step ",
                                                     pending_->step_id()));
    }
    pending_->mutable_hidden()->mutable_data()->append(chunk->hidden().data());
  }
  if (pending_->hidden().data().size() > max_bytes_) {
    expected_ = 0;
    return absl::InvalidArgumentError(absl::StrCat("step ", pending_->step_id(), ": hidden states exceed ",
                                                   max_bytes_, " bytes"));
  }
  ++expected_;
  if (expected_ < count) return false;
  expected_ = 0;
  return true;
}

}  // namespace shardserve::service
