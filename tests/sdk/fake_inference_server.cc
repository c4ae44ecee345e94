#include "tests/sdk/fake_inference_server.h"

#include <algorithm>
#include <cstddef>

#include "common/log/log.h"

namespace shardserve::testing {
namespace {

// Streams the scripted responses, then finishes with the scripted status, or (hold) waits for the
// client to cancel. gRPC allows one outstanding write and one Finish, so both are decided under mu_.
class ScriptedWriter final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  ScriptedWriter(FakeInferenceServer* server, std::vector<v1::GenerateResponse> responses, grpc::Status end,
                 bool hold)
      : server_(server), responses_(std::move(responses)), end_(std::move(end)), hold_(hold) {
    absl::MutexLock lock(&mu_);
    Step();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) cancelled_ = true;
    Step();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (!writing_) Step();
  }

  void OnDone() override { delete this; }

 private:
  void Step() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    if (cancelled_) {
      finished_ = true;
      server_->CountCancelledGenerate();
      Finish(grpc::Status::CANCELLED);
    } else if (next_ < responses_.size()) {
      writing_ = true;
      StartWrite(&responses_[next_++]);
    } else if (!hold_) {
      finished_ = true;
      Finish(end_);
    }
  }

  FakeInferenceServer* const server_;
  const std::vector<v1::GenerateResponse> responses_;
  const grpc::Status end_;
  const bool hold_;
  absl::Mutex mu_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::Status Unavailable() { return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake server: warming up"); }

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

class FakeInference final : public v1::Inference::CallbackService {
 public:
  explicit FakeInference(FakeInferenceServer* server) : server_(server) {}

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* ctx,
                                                           const v1::GenerateRequest* request) override {
    if (server_->Arrive(ctx)) return new ScriptedWriter(server_, {}, Unavailable(), false);
    const size_t call = static_cast<size_t>(server_->RecordGenerateRequest(*request));
    if (request->max_tokens() < 1) {
      return new ScriptedWriter(server_, 
          {}, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "max_tokens must be >= 1, got 0"), false);
    }
    const FakeScript& s = server_->script();
    // Skip the responses whose tokens the resume holds.
    const auto& resumed = request->resume().token_ids();
    size_t first = 0;
    int matched = 0;
    while (matched < resumed.size() && first < s.responses.size()) {
      for (int32_t id : s.responses[first].token_ids()) {
        if (matched >= resumed.size() || resumed[matched] != id) {
          return new ScriptedWriter(server_, {}, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                                              "fake server: resume.token_ids do not match the answer"),
                                    false);
        }
        ++matched;
      }
      ++first;
    }
    if (matched != resumed.size()) {
      return new ScriptedWriter(server_, {}, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                                          "fake server: resume.token_ids run past the answer"),
                                false);
    }
    std::vector<v1::GenerateResponse> rest(s.responses.begin() + static_cast<std::ptrdiff_t>(first), s.responses.end());
    if (call < s.cuts.size()) {
      rest.resize(std::min(rest.size(), static_cast<size_t>(s.cuts[call])));
      return new ScriptedWriter(server_, std::move(rest),
                                grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake server: the coordinator restarted"),
                                false);
    }
    return new ScriptedWriter(server_, std::move(rest), s.end, s.hold);
  }

  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* ctx, const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override {
    if (server_->Arrive(ctx)) return Done(ctx, Unavailable());
    if (request->add_special_tokens()) response->add_ids(1);
    for (unsigned char c : request->text()) response->add_ids(c);
    return Done(ctx, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx, const v1::GetModelInfoRequest*,
                                         v1::ModelInfo* response) override {
    if (server_->Arrive(ctx)) return Done(ctx, Unavailable());
    response->set_model_path("/models/fake");
    response->set_architecture("LlamaForCausalLM");
    response->set_vocab_size(512);
    response->set_max_position_embeddings(256);
    response->set_num_layers(5);
    response->set_num_parameters(260032);
    response->add_eos_token_ids(2);
    response->set_has_tokenizer(true);
    return Done(ctx, grpc::Status::OK);
  }

 private:
  FakeInferenceServer* const server_;
};

class FakeAdmin final : public v1::Admin::CallbackService {
 public:
  explicit FakeAdmin(FakeInferenceServer* server) : server_(server) {}

  grpc::ServerUnaryReactor* GetClusterStatus(grpc::CallbackServerContext* ctx, const v1::GetClusterStatusRequest*,
                                             v1::ClusterStatus* response) override {
    if (server_->Arrive(ctx)) return Done(ctx, Unavailable());
    response->set_ready(true);
    response->set_model_path("/models/fake");
    response->set_running_sequences(3);
    v1::WorkerStatus* w = response->add_workers();
    w->set_worker_id("w-1");
    w->set_address("127.0.0.1:9");
    w->set_state(v1::WORKER_STATE_READY);
    v1::Device* d = w->add_devices();
    d->set_kind(v1::DEVICE_KIND_CUDA);
    d->set_index(1);
    v1::Assignment* a = w->mutable_assignment();
    a->set_assignment_id("a-1");
    a->set_num_stages(2);
    a->set_layer_begin(0);
    a->set_layer_end(3);
    return Done(ctx, grpc::Status::OK);
  }

 private:
  FakeInferenceServer* const server_;
};

}  // namespace

FakeInferenceServer::FakeInferenceServer(FakeScript script, std::shared_ptr<grpc::ServerCredentials> credentials)
    : script_(std::move(script)),
      inference_(std::make_unique<FakeInference>(this)),
      admin_(std::make_unique<FakeAdmin>(this)) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", credentials ? credentials : grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(inference_.get());
  builder.RegisterService(admin_.get());
  server_ = builder.BuildAndStart();
  CHECK(server_ != nullptr && port_ != 0) << "the fake server could not start";
}

FakeInferenceServer::~FakeInferenceServer() {
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server_->Wait();
}

std::string FakeInferenceServer::last_authorization() const {
  absl::MutexLock lock(&mu_);
  return last_authorization_;
}

v1::GenerateRequest FakeInferenceServer::last_generate_request() const {
  absl::MutexLock lock(&mu_);
  return generate_requests_.empty() ? v1::GenerateRequest() : generate_requests_.back();
}

std::vector<v1::GenerateRequest> FakeInferenceServer::generate_requests() const {
  absl::MutexLock lock(&mu_);
  return generate_requests_;
}

int FakeInferenceServer::RecordGenerateRequest(const v1::GenerateRequest& request) {
  absl::MutexLock lock(&mu_);
  generate_requests_.push_back(request);
  return static_cast<int>(generate_requests_.size()) - 1;
}

void FakeInferenceServer::CountCancelledGenerate() {
  absl::MutexLock lock(&mu_);
  ++cancelled_generates_;
}

bool FakeInferenceServer::AwaitCancelledGenerates(int n, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return cancelled_generates_ >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&reached), timeout);
}

bool FakeInferenceServer::Arrive(grpc::CallbackServerContext* ctx) {
  const int n = calls_.fetch_add(1);
  {
    absl::MutexLock lock(&mu_);
    auto it = ctx->client_metadata().find("authorization");
    last_authorization_ =
        it == ctx->client_metadata().end() ? "" : std::string(it->second.data(), it->second.size());
  }
  return n < script_.unavailable_first;
}

}  // namespace shardserve::testing
