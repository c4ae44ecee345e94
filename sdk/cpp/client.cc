#include "shardserve/client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "shardserve/v1/inference.grpc.pb.h"

namespace shardserve {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

std::string ReasonName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_LENGTH: return "length";
    case v1::FINISH_REASON_STOP: return "stop";
    case v1::FINISH_REASON_CANCELLED: return "cancelled";
    default: return "";
  }
}

std::string StateName(v1::WorkerState s) {
  std::string name = v1::WorkerState_Name(s);
  const std::string prefix = "WORKER_STATE_";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

class GrpcClient final : public Client {
 public:
  GrpcClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
      : options_(options), inference_(v1::Inference::NewStub(channel)), admin_(v1::Admin::NewStub(channel)) {}

  absl::Status Generate(const Prompt& prompt, const GenerateOptions& o,
                        const std::function<bool(const GenerateDelta&)>& on_delta) override {
    v1::GenerateRequest req;
    if (prompt.is_ids) {
      for (int32_t id : prompt.ids) req.mutable_token_ids()->add_ids(id);
    } else {
      req.set_text(prompt.text);
    }
    req.set_max_tokens(o.max_tokens);
    req.mutable_sampling()->set_temperature(o.temperature);
    req.mutable_sampling()->set_top_k(o.top_k);
    req.mutable_sampling()->set_top_p(o.top_p);
    req.mutable_sampling()->set_seed(o.seed);
    for (int32_t id : o.stop_token_ids) req.add_stop_token_ids(id);
    req.set_ignore_eos(o.ignore_eos);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + options_.timeout);
    auto reader = inference_->Generate(&ctx, req);
    v1::GenerateResponse resp;
    bool cancelled = false;
    while (reader->Read(&resp)) {
      GenerateDelta d;
      d.token_ids.assign(resp.token_ids().begin(), resp.token_ids().end());
      d.text = resp.text();
      d.finished = resp.finish_reason() != v1::FINISH_REASON_UNSPECIFIED;
      d.finish_reason = ReasonName(resp.finish_reason());
      d.prompt_tokens = resp.usage().prompt_tokens();
      d.completion_tokens = resp.usage().completion_tokens();
      if (!on_delta(d)) {
        ctx.TryCancel();
        cancelled = true;
        break;
      }
    }
    grpc::Status st = reader->Finish();
    if (cancelled) return absl::CancelledError("cancelled by the caller");
    return FromGrpc(st);
  }

  absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text, bool add_special_tokens) override {
    v1::TokenizeRequest req;
    req.set_text(text);
    req.set_add_special_tokens(add_special_tokens);
    v1::TokenizeResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + options_.timeout);
    grpc::Status st = inference_->Tokenize(&ctx, req, &resp);
    if (!st.ok()) return FromGrpc(st);
    return std::vector<int32_t>(resp.ids().begin(), resp.ids().end());
  }

  absl::StatusOr<ClusterInfo> ClusterStatus() override {
    v1::ClusterStatus resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + options_.timeout);
    grpc::Status st = admin_->GetClusterStatus(&ctx, v1::GetClusterStatusRequest(), &resp);
    if (!st.ok()) return FromGrpc(st);
    ClusterInfo info;
    info.ready = resp.ready();
    info.reason = resp.reason();
    info.model_path = resp.model_path();
    info.plan = resp.plan();
    info.running_sequences = resp.running_sequences();
    info.waiting_sequences = resp.waiting_sequences();
    for (const v1::WorkerStatus& w : resp.workers()) {
      WorkerInfo wi{.worker_id = w.worker_id(), .node_name = w.node_name(), .address = w.address(),
                    .state = StateName(w.state()), .error = w.error()};
      wi.metrics_address = w.metrics_address();
      std::vector<std::string> devs;
      for (const v1::Device& d : w.devices()) {
        devs.push_back(absl::StrCat(d.kind() == v1::DEVICE_KIND_CUDA ? "cuda:" : "cpu:", d.index()));
      }
      wi.devices = absl::StrJoin(devs, ",");
      if (w.has_assignment() && !w.assignment().assignment_id().empty()) {
        const v1::Assignment& a = w.assignment();
        wi.assignment = absl::StrCat("replica ", a.replica(), " stage ", a.stage(), "/", a.num_stages(), " layers [",
                                     a.layer_begin(), ", ", a.layer_end(), ")");
      }
      info.workers.push_back(std::move(wi));
    }
    return info;
  }

 private:
  const ClientOptions options_;
  std::unique_ptr<v1::Inference::Stub> inference_;
  std::unique_ptr<v1::Admin::Stub> admin_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address, ClientOptions options) {
  if (address.empty() || address.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("server address \"", address, "\" is not HOST:PORT"));
  }
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  return std::unique_ptr<Client>(new GrpcClient(std::move(channel), options));
}

}  // namespace shardserve
