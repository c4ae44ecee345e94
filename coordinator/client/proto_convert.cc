#include "coordinator/client/proto_convert.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace shardserve::coordinator {

v1::DeviceKind ToProto(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu: return v1::DEVICE_KIND_CPU;
    case DeviceKind::kCuda: return v1::DEVICE_KIND_CUDA;
  }
  return v1::DEVICE_KIND_UNSPECIFIED;
}

absl::StatusOr<DeviceKind> FromProto(v1::DeviceKind kind) {
  switch (kind) {
    case v1::DEVICE_KIND_CPU: return DeviceKind::kCpu;
    case v1::DEVICE_KIND_CUDA: return DeviceKind::kCuda;
    default: break;  // a proto enum: open, with values we do not list
  }
  return absl::InvalidArgumentError(absl::StrCat("kind: unsupported device kind ", static_cast<int>(kind)));
}

void ToProto(const Device& device, v1::Device* out) {
  out->set_kind(ToProto(device.kind));
  out->set_index(device.index);
  out->set_total_bytes(device.total_bytes);
  out->set_free_bytes(device.free_bytes);
}

absl::StatusOr<Device> FromProto(const v1::Device& device) {
  absl::StatusOr<DeviceKind> kind = FromProto(device.kind());
  if (!kind.ok()) return kind.status();
  return Device{.kind = *kind, .index = device.index(), .total_bytes = device.total_bytes(),
                .free_bytes = device.free_bytes()};
}

void ToProto(const WorkerAssignment& a, v1::Assignment* out) {
  out->set_assignment_id(a.assignment_id);
  out->set_model_path(a.model_path);
  out->set_replica(a.replica);
  out->set_stage(a.stage);
  out->set_num_stages(a.num_stages);
  out->set_layer_begin(static_cast<int32_t>(a.layer_begin));
  out->set_layer_end(static_cast<int32_t>(a.layer_end));
  out->set_device_kind(ToProto(a.device_kind));
  out->clear_devices();
  for (int d : a.devices) out->add_devices(d);
  out->set_kv_blocks(a.kv_blocks);
  out->set_kv_block_size(a.kv_block_size);
  out->set_max_seq_len(a.max_seq_len);
  out->set_max_step_tokens(a.max_step_tokens);
  out->set_next_address(a.next_address);
  out->set_role(a.expert_host ? v1::ASSIGNMENT_ROLE_EXPERT_HOST : v1::ASSIGNMENT_ROLE_STAGE);
  out->set_quantize(a.quantize == Quantization::kInt8 ? v1::WEIGHT_QUANTIZATION_INT8 : v1::WEIGHT_QUANTIZATION_NONE);
  out->set_kv_cache_dtype(a.kv_cache == KvCacheFormat::kFp8E4M3 ? v1::KV_CACHE_DTYPE_FP8_E4M3
                                                                 : v1::KV_CACHE_DTYPE_AUTO);
  out->set_hidden_wire_dtype(a.hidden_wire_dtype == DType::kBF16 ? v1::DTYPE_BF16 : v1::DTYPE_F32);
  out->clear_experts();
  for (const LayerExpertPlacement& le : a.experts) {
    v1::LayerExperts* l = out->add_experts();
    l->set_layer(static_cast<int32_t>(le.layer));
    l->mutable_ranks()->Add(le.ranks.begin(), le.ranks.end());
    for (const std::string& address : le.addresses) l->add_addresses(address);
  }
  out->clear_hosted_experts();
  for (const HostedExpert& e : a.hosted_experts) {
    v1::HostedExpert* h = out->add_hosted_experts();
    h->set_layer(static_cast<int32_t>(e.layer));
    h->set_expert(e.expert);
    h->set_device(e.device);
  }
}

absl::StatusOr<WorkerAssignment> FromProto(const v1::Assignment& in) {
  WorkerAssignment a;
  switch (in.role()) {
    case v1::ASSIGNMENT_ROLE_UNSPECIFIED:
    case v1::ASSIGNMENT_ROLE_STAGE: break;
    case v1::ASSIGNMENT_ROLE_EXPERT_HOST: a.expert_host = true; break;
    default: return absl::InvalidArgumentError(absl::StrCat("role: unknown assignment role ", in.role()));
  }
  switch (in.quantize()) {
    case v1::WEIGHT_QUANTIZATION_NONE: a.quantize = Quantization::kNone; break;
    case v1::WEIGHT_QUANTIZATION_INT8: a.quantize = Quantization::kInt8; break;
    default: return absl::InvalidArgumentError(absl::StrCat("quantize: unknown weight quantization ", in.quantize()));
  }
  switch (in.kv_cache_dtype()) {
    case v1::KV_CACHE_DTYPE_AUTO: a.kv_cache = KvCacheFormat::kAuto; break;
    case v1::KV_CACHE_DTYPE_FP8_E4M3: a.kv_cache = KvCacheFormat::kFp8E4M3; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("kv_cache_dtype: unknown KV cache dtype ", in.kv_cache_dtype()));
  }
  switch (in.hidden_wire_dtype()) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::DTYPE_F32: a.hidden_wire_dtype = DType::kF32; break;
    case v1::DTYPE_BF16: a.hidden_wire_dtype = DType::kBF16; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "hidden_wire_dtype: ",
          v1::DType_IsValid(in.hidden_wire_dtype()) ? v1::DType_Name(in.hidden_wire_dtype())
                                                    : absl::StrCat(in.hidden_wire_dtype()),
          " is not F32 or BF16"));
  }
  absl::StatusOr<DeviceKind> kind = FromProto(in.device_kind());
  if (!kind.ok()) return absl::InvalidArgumentError(absl::StrCat("device_", kind.status().message()));
  a.device_kind = *kind;
  a.assignment_id = in.assignment_id();
  a.model_path = in.model_path();
  a.replica = in.replica();
  a.stage = in.stage();
  a.num_stages = in.num_stages();
  a.layer_begin = in.layer_begin();
  a.layer_end = in.layer_end();
  a.devices.assign(in.devices().begin(), in.devices().end());
  a.kv_blocks = in.kv_blocks();
  a.kv_block_size = in.kv_block_size();
  a.max_seq_len = in.max_seq_len();
  a.max_step_tokens = in.max_step_tokens();
  a.next_address = in.next_address();
  for (const v1::LayerExperts& le : in.experts()) {
    if (le.ranks_size() != le.addresses_size()) {
      return absl::InvalidArgumentError(absl::StrCat("experts of layer ", le.layer(), ": ", le.ranks_size(),
                                                     " ranks but ", le.addresses_size(), " addresses"));
    }
    LayerExpertPlacement& p = a.experts.emplace_back();
    p.layer = le.layer();
    p.ranks.assign(le.ranks().begin(), le.ranks().end());
    p.addresses.assign(le.addresses().begin(), le.addresses().end());
  }
  for (const v1::HostedExpert& e : in.hosted_experts()) {
    a.hosted_experts.push_back({.layer = e.layer(), .expert = e.expert(), .device = e.device()});
  }
  return a;
}

void ToProto(const StepInput& input, v1::StepRequest* out) {
  out->Clear();
  out->set_step_id(input.step_id);
  if (input.decode_steps > 1) out->set_decode_steps(static_cast<uint32_t>(input.decode_steps));
  out->mutable_sequences()->Reserve(static_cast<int>(input.sequences.size()));
  for (const StepSequenceInput& in : input.sequences) {
    v1::StepSequence* s = out->add_sequences();
    s->mutable_block_ids()->Add(in.block_ids.begin(), in.block_ids.end());
    s->set_pos_begin(in.pos_begin);
    s->set_num_tokens(static_cast<int32_t>(in.NumTokens()));
    if (in.from_previous) s->set_from_previous(true);
    if (input.remember_samples && in.sample && in.sequence_id != 0) s->set_sample_key(in.sequence_id);
    s->mutable_token_ids()->Add(in.token_ids.begin(), in.token_ids.end());
    s->set_sample(in.sample);
    if (in.sample) {
      v1::SamplingParams* p = s->mutable_sampling();
      p->set_temperature(in.sampling.temperature);
      p->set_top_k(in.sampling.top_k);
      p->set_top_p(in.sampling.top_p);
      p->set_seed(in.sampling.seed);
      p->set_min_p(in.sampling.min_p);
      for (const auto& [id, bias] : in.sampling.logit_bias) (*p->mutable_logit_bias())[id] = bias;
      p->set_presence_penalty(in.sampling.presence_penalty);
      p->set_frequency_penalty(in.sampling.frequency_penalty);
      p->set_repetition_penalty(in.sampling.repetition_penalty);
      s->mutable_penalty_token_ids()->Add(in.penalty_token_ids.begin(), in.penalty_token_ids.end());
      s->mutable_penalty_token_counts()->Add(in.penalty_token_counts.begin(), in.penalty_token_counts.end());
      s->set_sample_index(in.sample_index);
      s->mutable_suppress_token_ids()->Add(in.suppress_token_ids.begin(), in.suppress_token_ids.end());
      s->set_logprobs(in.logprobs);
      s->set_top_logprobs(in.top_logprobs);
      if (in.allowed_token_mask != nullptr) s->set_allowed_token_mask(*in.allowed_token_mask);
    }
    s->set_request_id(in.request_id);
    s->set_key(in.sequence_id);
    s->mutable_prompt_logprob_targets()->Add(in.prompt_logprob_targets.begin(), in.prompt_logprob_targets.end());
  }
}

absl::StatusOr<StepOutput> FromProto(const v1::StepResponse& response) {
  if (response.error_code() != 0) {
    const int code = response.error_code();
    const absl::StatusCode c = (code > 0 && code <= 16) ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
    return absl::Status(c, response.error_message().empty() ? absl::StrCat("step failed with code ", code)
                                                            : response.error_message());
  }
  StepOutput out;
  out.token_ids.assign(response.token_ids().begin(), response.token_ids().end());
  // (Bounded, so that a peer's nonsense cannot overflow the conversion: 2^40 us is 12 days.)
  out.compute_time =
      absl::Microseconds(static_cast<int64_t>(std::min<uint64_t>(response.compute_us(), uint64_t{1} << 40)));
  for (const v1::TokenLogprobs& lp : response.logprobs()) {
    out.logprobs.push_back(TokenLogprobs{.logprob = lp.logprob(),
                                         .top_ids = {lp.top_ids().begin(), lp.top_ids().end()},
                                         .top_logprobs = {lp.top_logprobs().begin(), lp.top_logprobs().end()}});
  }
  for (const v1::TokenLogprobs& lp : response.prompt_logprobs()) {
    out.prompt_logprobs.push_back(TokenLogprobs{.logprob = lp.logprob(),
                                                .top_ids = {lp.top_ids().begin(), lp.top_ids().end()},
                                                .top_logprobs = {lp.top_logprobs().begin(), lp.top_logprobs().end()}});
  }
  return out;
}

}  // namespace shardserve::coordinator
