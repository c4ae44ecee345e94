// The coordinator's services in-process on 127.0.0.1:0, driven through real gRPC channels. Workers
// are played by the test: it registers and heartbeats over the Registry service, a fake
// WorkerClient records the assignments, and replicas run the engine in-process
// (tests/testing/engine_replica.h) through the injected ReplicaClient factory.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "common/safetensors/safetensors.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/client/proto_convert.h"
#include "coordinator/server/coordinator.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tests/testing/engine_replica.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/golden.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/engine/executor.h"
#include "worker/engine/generator.h"

namespace shardserve::coordinator {
namespace {

using ::shardserve::testing::EngineReplica;
using ::shardserve::testing::IsOk;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(60);

std::chrono::system_clock::time_point Deadline() { return absl::ToChronoTime(absl::Now() + kWait); }

// Records assignments; the test then plays the worker's heartbeats.
class FakeWorkerClient final : public WorkerClient {
 public:
  absl::Status Assign(const std::string& address, const WorkerAssignment& a) override {
    absl::MutexLock lock(&mu_);
    assigned_[address] = a;
    ++assign_calls_;
    return absl::OkStatus();
  }
  int assign_calls() {
    absl::MutexLock lock(&mu_);
    return assign_calls_;
  }
  absl::Status Release(const std::string& address, const std::string& /*reason*/) override {
    absl::MutexLock lock(&mu_);
    released_.push_back(address);
    return absl::OkStatus();
  }
  // Waits (bounded) until `address` has been released at least once.
  bool WaitForRelease(const std::string& address) {
    absl::MutexLock lock(&mu_);
    auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::find(released_.begin(), released_.end(), address) != released_.end();
    };
    return mu_.AwaitWithTimeout(absl::Condition(&has), kWait);
  }
  std::vector<std::string> released() {
    absl::MutexLock lock(&mu_);
    return released_;
  }
  // The latest assignment sent to `address` whose id differs from `not_id` (bounded wait).
  std::optional<WorkerAssignment> WaitFor(const std::string& address, const std::string& not_id = "") {
    absl::MutexLock lock(&mu_);
    auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto it = assigned_.find(address);
      return it != assigned_.end() && it->second.assignment_id != not_id;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&has), kWait)) return std::nullopt;
    return assigned_[address];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, WorkerAssignment> assigned_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> released_ ABSL_GUARDED_BY(mu_);
  int assign_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

// Makes EngineReplicas and remembers the last one (valid while its replica serves).
class EngineFactory {
 public:
  EngineFactory(std::string dir, int32_t max_step_tokens) : dir_(std::move(dir)), step_tokens_(max_step_tokens) {}
  ReplicaClientFactory Get() {
    return [this](const ReplicaEndpoint& e) -> absl::StatusOr<std::unique_ptr<ReplicaClient>> {
      auto r = EngineReplica::Create({.model_dir = dir_,
                                      .kv_blocks = e.kv_blocks,
                                      .kv_block_size = e.kv_block_size,
                                      .max_step_tokens = step_tokens_});
      if (!r.ok()) return r.status();
      absl::MutexLock lock(&mu_);
      if (on_make_) on_make_(r->get());
      last_ = r->get();
      return std::unique_ptr<ReplicaClient>(*std::move(r));
    };
  }
  // Runs on every replica made from now on (before it serves).
  void OnMake(std::function<void(EngineReplica*)> f) {
    absl::MutexLock lock(&mu_);
    on_make_ = std::move(f);
  }
  EngineReplica* last() {
    absl::MutexLock lock(&mu_);
    return last_;
  }

 private:
  const std::string dir_;
  const int32_t step_tokens_;
  absl::Mutex mu_;
  std::function<void(EngineReplica*)> on_make_ ABSL_GUARDED_BY(mu_);
  EngineReplica* last_ ABSL_GUARDED_BY(mu_) = nullptr;
};

struct GenerateResult {
  grpc::Status status;
  std::vector<v1::GenerateResponse> messages;
  std::vector<int32_t> ids;
  std::string text;
};

class CoordinatorApiTest : public ::testing::Test {
 protected:
  void StartCoordinator(const std::string& model, int expected_workers, CoordinatorOptions options = {}) {
    model_dir_ = model;
    factory_ = std::make_unique<EngineFactory>(model, options.max_step_tokens);
    auto workers = std::make_unique<FakeWorkerClient>();
    workers_ = workers.get();
    options.listen = "127.0.0.1:0";
    options.model_path = model;
    options.expected_workers = expected_workers;
    options.heartbeat_timeout = absl::Seconds(5);
    ASSERT_OK_AND_ASSIGN(coordinator_, Coordinator::Start(options, {.clock = &clock_,
                                                                   .worker_client = std::move(workers),
                                                                   .replica_factory = factory_->Get()}));
    channel_ = grpc::CreateChannel(coordinator_->address(), grpc::InsecureChannelCredentials());
    inference_ = v1::Inference::NewStub(channel_);
    // Workers register on the control port, not on the public one.
    registry_ = v1::Registry::NewStub(
        grpc::CreateChannel(coordinator_->control_address(), grpc::InsecureChannelCredentials()));
    admin_ = v1::Admin::NewStub(channel_);
  }

  void TearDown() override {
    if (coordinator_ != nullptr) coordinator_->Shutdown(absl::Seconds(5));
  }

  std::string Register(const std::string& node, const std::string& address, int devices = 1,
                       int64_t bytes_per_device = int64_t{4} << 30, const std::string& instance = "",
                       const std::optional<WorkerAssignment>& held = std::nullopt,
                       v1::WorkerState state = v1::WORKER_STATE_READY) {
    v1::RegisterRequest req;
    req.set_instance_id(instance);
    if (held.has_value()) {
      ToProto(*held, req.mutable_held());
      req.set_state(state);
      if (state == v1::WORKER_STATE_READY) req.set_kv_blocks(held->kv_blocks);
    }
    req.set_node_name(node);
    req.set_address(address);
    for (int i = 0; i < devices; ++i) {
      v1::Device* d = req.add_devices();
      d->set_kind(v1::DEVICE_KIND_CPU);
      d->set_index(i);
      d->set_total_bytes(bytes_per_device);
      d->set_free_bytes(bytes_per_device);
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    v1::RegisterResponse resp;
    const grpc::Status st = registry_->Register(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(resp.heartbeat_interval_ms(), 1000);
    return resp.worker_id();
  }

  grpc::Status Heartbeat(const std::string& id, v1::WorkerState state, const std::string& assignment_id,
                         const std::string& error = "", int64_t kv_blocks = 0) {
    v1::HeartbeatRequest req;
    req.set_worker_id(id);
    req.set_state(state);
    req.set_assignment_id(assignment_id);
    req.set_error(error);
    req.set_kv_blocks(kv_blocks);
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    v1::HeartbeatResponse resp;
    return registry_->Heartbeat(&ctx, req, &resp);
  }

  // Registers a worker, waits for its assignment, reports READY. Returns the worker id.
  std::string BringUpWorker(const std::string& node, const std::string& address) {
    const std::string id = Register(node, address);
    std::optional<WorkerAssignment> a = workers_->WaitFor(address);
    EXPECT_TRUE(a.has_value()) << "no assignment for " << address;
    if (!a.has_value()) return id;
    EXPECT_TRUE(Heartbeat(id, v1::WORKER_STATE_READY, a->assignment_id, "", a->kv_blocks).ok());
    return id;
  }

  // Every replica made from now on holds its steps, and `stepping` is notified at its first one.
  void HoldStepsAndNotifyOnFirst(absl::Notification* stepping) {
    factory_->OnMake([stepping](EngineReplica* r) {
      r->HoldStepsForTest();
      r->SetStepHookForTest([stepping](const StepInput&) {
        if (!stepping->HasBeenNotified()) stepping->Notify();
        return absl::OkStatus();
      });
    });
  }

  void BringUpOneWorker() {
    BringUpWorker("node-a", "127.0.0.1:1");
    ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait)) << coordinator_->cluster().ReadyStatus();
  }

  GenerateResult Generate(const v1::GenerateRequest& request, grpc::ClientContext* ctx_in = nullptr) {
    grpc::ClientContext own;
    grpc::ClientContext* ctx = ctx_in != nullptr ? ctx_in : &own;
    ctx->set_deadline(Deadline());
    GenerateResult r;
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = inference_->Generate(ctx, request);
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
      r.ids.insert(r.ids.end(), msg.token_ids().begin(), msg.token_ids().end());
      r.text += msg.text();
      r.messages.push_back(msg);
    }
    r.status = reader->Finish();
    return r;
  }

  v1::ClusterStatus Status() {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    v1::ClusterStatus status;
    EXPECT_TRUE(admin_->GetClusterStatus(&ctx, {}, &status).ok());
    return status;
  }

  // grpc.health.v1.Health/Check for the whole server, spoken in raw bytes (Debian ships no
  // generated health client): "" request, response field 1 = 1 SERVING / 2 NOT_SERVING.
  int HealthStatus() {
    grpc::GenericStub stub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    grpc::ByteBuffer request, response;
    grpc::Slice empty("");
    request = grpc::ByteBuffer(&empty, 1);
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                   [&](grpc::Status s) {
                     status = std::move(s);
                     done.Notify();
                   });
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(kWait));
    EXPECT_TRUE(status.ok()) << status.error_message();
    std::vector<grpc::Slice> slices;
    if (!response.Dump(&slices).ok()) return -1;
    std::string bytes;
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : -1;
  }

  // engine::Generate alone on `prompt`, as shardserve-run does it (EOS ids stop).
  std::vector<int32_t> Reference(const std::vector<int32_t>& prompt, int32_t max_tokens,
                                 const engine::SamplingParams& sampling = {}) {
    auto spec = LoadModelSpec(model_dir_);
    auto ckpt = Checkpoint::Open(model_dir_);
    EXPECT_TRUE(spec.ok() && ckpt.ok());
    auto ex = engine::TpExecutor::Create(*spec, **ckpt, engine::ExecutorOptions{});
    EXPECT_TRUE(ex.ok()) << ex.status();
    engine::GenerationRequest g{.prompt = prompt, .max_tokens = max_tokens, .sampling = sampling};
    for (int64_t id : spec->eos_token_ids) g.stop_ids.push_back(static_cast<int32_t>(id));
    auto res = engine::Generate(**ex, {g});
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? (*res)[0].tokens : std::vector<int32_t>{};
  }

  static v1::GenerateRequest IdsRequest(std::vector<int32_t> ids, int32_t max_tokens) {
    v1::GenerateRequest req;
    req.mutable_token_ids()->mutable_ids()->Add(ids.begin(), ids.end());
    req.set_max_tokens(max_tokens);
    return req;
  }

  testing::FakeClock clock_;
  std::string model_dir_;
  std::unique_ptr<EngineFactory> factory_;
  FakeWorkerClient* workers_ = nullptr;  // owned by the coordinator
  std::unique_ptr<Coordinator> coordinator_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Inference::Stub> inference_;
  std::unique_ptr<v1::Registry::Stub> registry_;
  std::unique_ptr<v1::Admin::Stub> admin_;
};

TEST_F(CoordinatorApiTest, UnavailableWithTheReasonUntilEveryWorkerIsReady) {
  StartCoordinator(testing::Stories260KDir(), 2);
  const v1::GenerateRequest req = IdsRequest({1, 2, 3}, 4);
  EXPECT_EQ(HealthStatus(), 2);  // NOT_SERVING
  const std::string w1 = Register("node-a", "127.0.0.1:1");
  coordinator_->cluster().Tick();
  GenerateResult r = Generate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(r.status.error_message(), HasSubstr("waiting for workers: 1 of 2 registered"));
  const std::string w2 = Register("node-b", "127.0.0.1:2");
  std::optional<WorkerAssignment> a1 = workers_->WaitFor("127.0.0.1:1");
  std::optional<WorkerAssignment> a2 = workers_->WaitFor("127.0.0.1:2");
  ASSERT_TRUE(a1.has_value() && a2.has_value());
  EXPECT_EQ(a1->model_path, testing::Stories260KDir());
  ASSERT_TRUE(Heartbeat(w1, v1::WORKER_STATE_READY, a1->assignment_id, "", a1->kv_blocks).ok());
  ASSERT_TRUE(Heartbeat(w2, v1::WORKER_STATE_LOADING, a2->assignment_id).ok());
  coordinator_->cluster().Tick();
  r = Generate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(r.status.error_message(), HasSubstr("is loading"));
  ASSERT_TRUE(Heartbeat(w2, v1::WORKER_STATE_READY, a2->assignment_id, "", a2->kv_blocks).ok());
  ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait));
  EXPECT_EQ(HealthStatus(), 1);  // SERVING
  r = Generate(req);
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids, Reference({1, 2, 3}, 4));
}

TEST_F(CoordinatorApiTest, GenerateFromTextMatchesTheEngineAndStreamsItsText) {
  StartCoordinator(testing::Stories260KDir(), 1, {.max_step_tokens = 4});  // chunked prefill
  BringUpOneWorker();
  ASSERT_OK_AND_ASSIGN(auto tokenizer, LoadTokenizer(testing::Stories260KDir()));
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> prompt, tokenizer->Encode("Once upon a time, there was a", true));
  v1::GenerateRequest req;
  req.set_text("Once upon a time, there was a");
  req.set_max_tokens(40);
  req.set_request_id("story-1");
  const GenerateResult r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids, Reference(prompt, 40));
  // The text is the prompt's continuation, cut from the decode of both as transformers' pipeline
  // does: the first word keeps its space (" little"), which decoding the answer's ids alone drops.
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), r.ids.begin(), r.ids.end());
  ASSERT_OK_AND_ASSIGN(std::string whole, tokenizer->Decode(all, true));
  ASSERT_OK_AND_ASSIGN(std::string head, tokenizer->Decode(prompt, true));
  ASSERT_TRUE(whole.starts_with(head));
  EXPECT_EQ(r.text, whole.substr(head.size()));
  EXPECT_THAT(r.text, ::testing::StartsWith(" "));
  ASSERT_FALSE(r.messages.empty());
  const v1::GenerateResponse& last = r.messages.back();
  EXPECT_NE(last.finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
  EXPECT_EQ(last.usage().prompt_tokens(), static_cast<int32_t>(prompt.size()));
  EXPECT_EQ(last.usage().completion_tokens(), static_cast<int32_t>(r.ids.size()));
  for (size_t i = 0; i + 1 < r.messages.size(); ++i) {
    EXPECT_EQ(r.messages[i].finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
  }
  for (const auto& m : r.messages) EXPECT_EQ(m.request_id(), "story-1");
}

TEST_F(CoordinatorApiTest, TextStopStringEndsGenerationWithStop) {
  StartCoordinator(testing::Stories260KDir(), 1);
  BringUpOneWorker();
  v1::GenerateRequest req;
  req.set_text("Once upon a time");
  req.set_max_tokens(40);
  const GenerateResult full = Generate(req);
  ASSERT_TRUE(full.status.ok()) << full.status.error_message();
  ASSERT_GT(full.text.size(), 20u);
  const std::string stop = full.text.substr(full.text.size() / 2, 5);  // likely spans tokens
  req.add_stop("never appears");
  req.add_stop(stop);
  const GenerateResult r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.text, full.text.substr(0, full.text.find(stop)));
  ASSERT_FALSE(r.messages.empty());
  EXPECT_EQ(r.messages.back().finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_LT(r.messages.back().usage().completion_tokens(), 40);
  // The ids returned end with the token that completed the stop string; usage counts those.
  EXPECT_EQ(r.messages.back().usage().completion_tokens(), static_cast<int32_t>(r.ids.size()));
  EXPECT_EQ(coordinator_->scheduler().Stats().running, 0);  // cancelled, slot freed

  req.add_stop("");
  const GenerateResult bad = Generate(req);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.status.error_message(), HasSubstr("stop[2] is empty"));
}

// Several decode steps per call (the worker feeds its samples back itself): the same greedy tokens
// as the engine alone, and a stop string inside a call ends the text there, with no token past it
// returned or counted in the usage.
TEST_F(CoordinatorApiTest, MultiStepDecodingKeepsTokensStopStringsAndUsageExact) {
  StartCoordinator(testing::Stories260KDir(), 1, {.decode_steps_per_call = 8});
  std::atomic<EngineReplica*> made{nullptr};
  factory_->OnMake([&made](EngineReplica* r) { made = r; });
  BringUpOneWorker();
  v1::GenerateRequest req;
  req.set_text("Once upon a time");
  req.set_max_tokens(40);
  req.set_ignore_eos(true);
  const GenerateResult full = Generate(req);
  ASSERT_TRUE(full.status.ok()) << full.status.error_message();
  ASSERT_EQ(full.ids.size(), 40u);
  EXPECT_EQ(full.messages.back().usage().completion_tokens(), 40);
  ASSERT_GT(full.text.size(), 20u);
  const std::string stop = full.text.substr(full.text.size() / 2, 5);
  req.add_stop(stop);
  const GenerateResult r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.text, full.text.substr(0, full.text.find(stop)));
  EXPECT_EQ(r.messages.back().finish_reason(), v1::FINISH_REASON_STOP);
  ASSERT_LT(r.ids.size(), full.ids.size());
  EXPECT_EQ(r.ids, std::vector<int32_t>(full.ids.begin(), full.ids.begin() + static_cast<std::ptrdiff_t>(r.ids.size())));
  EXPECT_EQ(r.messages.back().usage().completion_tokens(), static_cast<int32_t>(r.ids.size()));
  EXPECT_EQ(coordinator_->scheduler().Stats().running, 0);
  EXPECT_EQ(coordinator_->scheduler().Stats().replicas.at(0).kv_blocks_used, 0);
  ASSERT_NE(made.load(), nullptr);
  int32_t most = 0;
  for (const StepInput& in : made.load()->StepInputsForTest()) most = std::max(most, in.decode_steps);
  EXPECT_EQ(most, 8) << "the 1-stage replica never ran 8 decode steps in one call";
}

TEST_F(CoordinatorApiTest, ConcurrentSeededRequestsMatchTheEngine) {
  StartCoordinator(testing::Stories260KDir(), 1, {.max_slots = 3, .max_step_tokens = 16});
  BringUpOneWorker();
  constexpr int kClients = 6;
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < kClients; ++i) {
    std::vector<int32_t> prompt;
    for (int t = 0; t <= i * 3; ++t) prompt.push_back(1 + (t * 37 + i * 11) % 500);
    v1::GenerateRequest req = IdsRequest(prompt, 10 + i * 4);
    req.mutable_sampling()->set_temperature(0.9f);
    req.mutable_sampling()->set_top_k(i % 2 == 0 ? 0 : 40);
    req.mutable_sampling()->set_seed(100 + i);
    req.set_ignore_eos(false);
    requests.push_back(req);
  }
  std::vector<GenerateResult> results(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) clients.emplace_back([&, i] { results[i] = Generate(requests[i]); });
  for (std::thread& t : clients) t.join();
  for (int i = 0; i < kClients; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    const auto& ids = requests[i].token_ids().ids();
    EXPECT_EQ(results[i].ids, Reference(std::vector<int32_t>(ids.begin(), ids.end()), requests[i].max_tokens(),
                                        {.temperature = 0.9f, .top_k = i % 2 == 0 ? 0 : 40, .seed = 100u + i}))
        << "client " << i;
  }
}

TEST_F(CoordinatorApiTest, GenerateRejectsBadRequestsNamingTheField) {
  StartCoordinator(testing::Stories260KDir(), 1);  // vocab 512, context 512
  BringUpOneWorker();
  auto expect_invalid = [&](const v1::GenerateRequest& req, const std::string& what) {
    const GenerateResult r = Generate(req);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << what;
    EXPECT_THAT(r.status.error_message(), HasSubstr(what));
    EXPECT_TRUE(r.messages.empty());
  };
  v1::GenerateRequest none;
  none.set_max_tokens(3);
  expect_invalid(none, "prompt is empty");
  expect_invalid(IdsRequest({}, 3), "prompt is empty");
  expect_invalid(IdsRequest(std::vector<int32_t>(512, 5), 1), "prompt is too long: 512 tokens");
  expect_invalid(IdsRequest({1, 2}, 0), "max_tokens must be >= 1, got 0");
  expect_invalid(IdsRequest({1, 2}, 511), "max_tokens can be at most 510");
  expect_invalid(IdsRequest({1, 512}, 3), "prompt.token_ids[1] = 512 is outside the vocabulary");
  v1::GenerateRequest hot = IdsRequest({1, 2}, 3);
  hot.mutable_sampling()->set_temperature(-0.5f);
  expect_invalid(hot, "sampling.temperature");
  v1::GenerateRequest top_p = IdsRequest({1, 2}, 3);
  top_p.mutable_sampling()->set_top_p(1.5f);
  expect_invalid(top_p, "sampling.top_p must be in (0, 1]");
  // top_p 0 means unset.
  EXPECT_TRUE(Generate(IdsRequest({1, 2}, 2)).status.ok());
}

// logprobs against the log-softmax of transformers' logits (stories260K_reference.json), and the
// sampling extras: logit_bias moves the argmax, min_tokens holds back a stop id.
TEST_F(CoordinatorApiTest, LogprobsLogitBiasAndMinTokens) {
  StartCoordinator(testing::Stories260KDir(), 1);
  BringUpOneWorker();
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadStories260K());
  const testing::GoldenCase& c = golden.cases[1];  // "Once upon a time"
  const std::vector<float>& ref = c.last_logits;
  double mx = *std::max_element(ref.begin(), ref.end()), z = 0;
  for (float l : ref) z += std::exp(static_cast<double>(l) - mx);
  const double log_z = mx + std::log(z);

  v1::GenerateRequest req = IdsRequest(c.prompt_ids, 3);
  req.set_logprobs(true);
  req.set_top_logprobs(5);
  GenerateResult r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.ids.size(), 3u);
  EXPECT_EQ(r.ids[0], c.greedy_ids[0]);
  std::vector<v1::TokenLogprobs> lps;
  for (const auto& m : r.messages) {
    ASSERT_EQ(m.logprobs_size(), m.token_ids_size());
    lps.insert(lps.end(), m.logprobs().begin(), m.logprobs().end());
  }
  ASSERT_EQ(lps.size(), 3u);
  EXPECT_NEAR(lps[0].logprob(), ref[static_cast<size_t>(c.greedy_ids[0])] - log_z, 2e-3);
  ASSERT_EQ(lps[0].top_ids_size(), 5);
  EXPECT_EQ(lps[0].top_ids(0), c.greedy_ids[0]);  // greedy: the chosen token is the most likely
  EXPECT_EQ(lps[0].top_logprobs(0), lps[0].logprob());
  for (int i = 1; i < 5; ++i) {
    EXPECT_LE(lps[0].top_logprobs(i), lps[0].top_logprobs(i - 1));
    EXPECT_NEAR(lps[0].top_logprobs(i), ref[static_cast<size_t>(lps[0].top_ids(i))] - log_z, 2e-3);
  }
  for (const auto& lp : lps) EXPECT_LE(lp.logprob(), 0.0f);
  // Without asking, no logprobs.
  r = Generate(IdsRequest(c.prompt_ids, 2));
  for (const auto& m : r.messages) EXPECT_EQ(m.logprobs_size(), 0);

  // logit_bias -100 on the greedy token: the runner-up of the reference logits comes first.
  std::vector<int32_t> order(ref.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ref[static_cast<size_t>(a)] > ref[static_cast<size_t>(b)]; });
  ASSERT_EQ(order[0], c.greedy_ids[0]);
  v1::GenerateRequest biased = IdsRequest(c.prompt_ids, 1);
  (*biased.mutable_sampling()->mutable_logit_bias())[c.greedy_ids[0]] = -100.0f;
  r = Generate(biased);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids, std::vector<int32_t>{order[1]});

  // The second greedy token as a stop id ends generation there; with min_tokens 3 it cannot be
  // sampled before the third token.
  v1::GenerateRequest stop = IdsRequest(c.prompt_ids, 8);
  stop.add_stop_token_ids(c.greedy_ids[1]);
  r = Generate(stop);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{c.greedy_ids[0], c.greedy_ids[1]}));
  EXPECT_EQ(r.messages.back().finish_reason(), v1::FINISH_REASON_STOP);
  stop.set_min_tokens(3);
  r = Generate(stop);
  ASSERT_TRUE(r.status.ok());
  ASSERT_GE(r.ids.size(), 3u);
  EXPECT_EQ(r.ids[0], c.greedy_ids[0]);
  EXPECT_NE(r.ids[1], c.greedy_ids[1]);

  // Bad values name the field.
  v1::GenerateRequest bad = IdsRequest(c.prompt_ids, 2);
  bad.set_min_tokens(3);
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("min_tokens must be in [0, max_tokens = 2]"));
  bad = IdsRequest(c.prompt_ids, 2);
  bad.set_top_logprobs(21);
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("top_logprobs must be in [0, 20]"));
  bad = IdsRequest(c.prompt_ids, 2);
  (*bad.mutable_sampling()->mutable_logit_bias())[512] = 1.0f;
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("logit_bias token 512 is outside the vocabulary"));
  bad = IdsRequest(c.prompt_ids, 2);
  (*bad.mutable_sampling()->mutable_logit_bias())[5] = 101.0f;
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("must be in [-100, 100]"));
  bad = IdsRequest(c.prompt_ids, 2);
  bad.mutable_sampling()->set_min_p(2.0f);
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("sampling.min_p"));
}

// Penalties against transformers' logits (stories260K_reference.json) and, over many steps, against
// the raw logprobs the server reports with each token (themselves checked against transformers'
// above): a penalized greedy choice is the argmax of the logprobs minus the penalties.
TEST_F(CoordinatorApiTest, PresenceFrequencyAndRepetitionPenalties) {
  StartCoordinator(testing::Stories260KDir(), 1);
  BringUpOneWorker();
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadStories260K());

  // Repetition penalty 0.5 favours the prompt's tokens: the first token is the argmax of the
  // reference logits with the prompt's positive logits doubled and negative ones halved.
  const testing::GoldenCase& c = golden.cases[2];  // "Lily and Tom went to the park"
  std::vector<float> adjusted = c.last_logits;
  std::vector<int32_t> prompt_ids = c.prompt_ids;
  std::sort(prompt_ids.begin(), prompt_ids.end());
  prompt_ids.erase(std::unique(prompt_ids.begin(), prompt_ids.end()), prompt_ids.end());
  for (int32_t t : prompt_ids) {
    float& l = adjusted[static_cast<size_t>(t)];
    l = l > 0 ? l / 0.5f : l * 0.5f;
  }
  const int32_t want = static_cast<int32_t>(std::max_element(adjusted.begin(), adjusted.end()) - adjusted.begin());
  ASSERT_NE(want, c.greedy_ids[0]);  // the penalty must matter for this test to mean anything
  v1::GenerateRequest rep = IdsRequest(c.prompt_ids, 1);
  rep.mutable_sampling()->set_repetition_penalty(0.5f);
  GenerateResult r = Generate(rep);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids, std::vector<int32_t>{want});

  // Frequency and presence penalties over 40 greedy steps.
  const testing::GoldenCase& once = golden.cases[1];
  const int32_t n = 40;
  const GenerateResult plain = Generate(IdsRequest(once.prompt_ids, n));
  ASSERT_TRUE(plain.status.ok());
  for (const auto& [presence, frequency] : std::vector<std::pair<float, float>>{{1.5f, 0.f}, {0.f, 0.7f}, {0.5f, 0.5f}}) {
    SCOPED_TRACE(absl::StrCat("presence ", presence, " frequency ", frequency));
    v1::GenerateRequest req = IdsRequest(once.prompt_ids, n);
    req.set_ignore_eos(true);
    req.set_logprobs(true);
    req.set_top_logprobs(20);
    req.mutable_sampling()->set_presence_penalty(presence);
    req.mutable_sampling()->set_frequency_penalty(frequency);
    r = Generate(req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    ASSERT_EQ(r.ids.size(), static_cast<size_t>(n));
    std::vector<v1::TokenLogprobs> lps;
    for (const auto& m : r.messages) lps.insert(lps.end(), m.logprobs().begin(), m.logprobs().end());
    ASSERT_EQ(lps.size(), r.ids.size());
    EXPECT_EQ(r.ids[0], once.greedy_ids[0]);  // nothing generated yet: nothing to penalize
    std::map<int32_t, int> count;
    for (size_t k = 0; k < r.ids.size(); ++k) {
      auto penalized = [&](int32_t id, float lp) {
        const auto it = count.find(id);
        return it == count.end() ? lp : lp - frequency * static_cast<float>(it->second) - presence;
      };
      const float chosen = penalized(r.ids[k], lps[k].logprob());
      // Every token outside the top 20 has a raw logprob <= the 20th, and penalties only lower it.
      EXPECT_GE(chosen + 1e-4f, lps[k].top_logprobs(19)) << "step " << k;
      for (int j = 0; j < lps[k].top_ids_size(); ++j) {
        EXPECT_GE(chosen + 1e-4f, penalized(lps[k].top_ids(j), lps[k].top_logprobs(j)))
            << "step " << k << ": token " << lps[k].top_ids(j) << " beats the chosen " << r.ids[k];
      }
      ++count[r.ids[k]];
    }
    EXPECT_NE(r.ids, plain.ids);  // the penalties changed the greedy continuation
  }

  // Out of range values name the field.
  v1::GenerateRequest bad = IdsRequest(c.prompt_ids, 2);
  bad.mutable_sampling()->set_presence_penalty(2.5f);
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("sampling.presence_penalty must be in [-2, 2]"));
  bad = IdsRequest(c.prompt_ids, 2);
  bad.mutable_sampling()->set_frequency_penalty(-3.f);
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("sampling.frequency_penalty must be in [-2, 2]"));
  bad = IdsRequest(c.prompt_ids, 2);
  bad.mutable_sampling()->set_repetition_penalty(-1.f);
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("sampling.repetition_penalty must be in (0, 2]"));
}

// Prompt logprobs against transformers' logits at every prompt position (the golden llama model):
// in order, each once, over prefill chunks that split the prompt (max_step_tokens 4), and computed
// again (not taken from the prefix cache) when the same prompt comes twice.
TEST_F(CoordinatorApiTest, PromptLogprobsAreTheReferenceLogSoftmaxAtEveryPosition) {
  StartCoordinator("tests/golden/models/llama", 1, {.max_seq_len = 64, .kv_block_size = 4, .max_step_tokens = 4});
  BringUpOneWorker();
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("llama"));
  const testing::GoldenCase& c = golden.cases[2];  // 11 prompt tokens: 3 chunks
  ASSERT_EQ(c.logits.size(), c.prompt_ids.size());
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    v1::GenerateRequest req = IdsRequest(c.prompt_ids, 2);
    req.set_prompt_logprobs(true);
    req.set_top_logprobs(3);
    const GenerateResult r = Generate(req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.ids, (std::vector<int32_t>{c.greedy_ids[0], c.greedy_ids[1]}));
    std::vector<v1::TokenLogprobs> lps;
    bool tokens_seen = false;
    for (const auto& m : r.messages) {
      if (m.prompt_logprobs_size() > 0) {
        EXPECT_FALSE(tokens_seen) << "prompt logprobs after generated tokens";
      }
      tokens_seen = tokens_seen || m.token_ids_size() > 0;
      lps.insert(lps.end(), m.prompt_logprobs().begin(), m.prompt_logprobs().end());
      EXPECT_EQ(m.logprobs_size(), 0);  // generated tokens' logprobs were not asked for
    }
    ASSERT_EQ(lps.size(), c.prompt_ids.size() - 1);
    for (size_t i = 0; i + 1 < c.prompt_ids.size(); ++i) {
      const std::vector<float>& ref = c.logits[i];  // position i predicts prompt token i + 1
      const double mx = *std::max_element(ref.begin(), ref.end());
      double z = 0;
      for (float l : ref) z += std::exp(static_cast<double>(l) - mx);
      const double log_z = mx + std::log(z);
      EXPECT_NEAR(lps[i].logprob(), ref[static_cast<size_t>(c.prompt_ids[i + 1])] - log_z, 1e-3) << "position " << i;
      ASSERT_EQ(lps[i].top_ids_size(), 3);
      const int32_t best = static_cast<int32_t>(std::max_element(ref.begin(), ref.end()) - ref.begin());
      EXPECT_EQ(lps[i].top_ids(0), best);
      EXPECT_NEAR(lps[i].top_logprobs(0), mx - log_z, 1e-3);
    }
    // The second round found the prompt in the prefix cache but computed it anyway.
    EXPECT_EQ(r.messages.back().usage().cached_prompt_tokens(), 0);
  }
  // Without asking: the cache serves the prompt and no prompt logprobs come.
  const GenerateResult plain = Generate(IdsRequest(c.prompt_ids, 2));
  ASSERT_TRUE(plain.status.ok());
  EXPECT_GT(plain.messages.back().usage().cached_prompt_tokens(), 0);
  for (const auto& m : plain.messages) EXPECT_EQ(m.prompt_logprobs_size(), 0);
}

// n choices: choice i is the request alone with seed + i; each ends with its own finish reason and
// usage; choices after the first find the prompt's full blocks in the prefix cache.
TEST_F(CoordinatorApiTest, NChoicesAreSeededRequestsThatShareThePrompt) {
  StartCoordinator(testing::Stories260KDir(), 1);
  BringUpOneWorker();
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadStories260K());
  const testing::GoldenCase& c = golden.cases[1];
  std::vector<int32_t> prompt = c.prompt_ids;  // 5 + 40 tokens: two full KV blocks of 16
  prompt.insert(prompt.end(), c.greedy_ids.begin(), c.greedy_ids.begin() + 40);
  auto request = [&](int n, uint64_t seed) {
    v1::GenerateRequest req = IdsRequest(prompt, 12);
    req.set_n(n);
    req.set_ignore_eos(true);
    req.mutable_sampling()->set_temperature(1.0f);
    req.mutable_sampling()->set_seed(seed);
    return req;
  };
  const GenerateResult r = Generate(request(3, 7));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  std::map<int, std::vector<int32_t>> ids;
  std::map<int, v1::GenerateResponse> last;
  for (const auto& m : r.messages) {
    ids[m.index()].insert(ids[m.index()].end(), m.token_ids().begin(), m.token_ids().end());
    if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      EXPECT_EQ(last.count(m.index()), 0u) << "two ends for choice " << m.index();
      last[m.index()] = m;
    }
  }
  ASSERT_EQ(ids.size(), 3u);
  ASSERT_EQ(last.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(absl::StrCat("choice ", i));
    const GenerateResult alone = Generate(request(1, 7 + static_cast<uint64_t>(i)));
    ASSERT_TRUE(alone.status.ok());
    EXPECT_EQ(ids[i], alone.ids);
    for (const auto& m : alone.messages) EXPECT_EQ(m.index(), 0);
    EXPECT_EQ(last[i].finish_reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(last[i].usage().prompt_tokens(), static_cast<int32_t>(prompt.size()));
    EXPECT_EQ(last[i].usage().completion_tokens(), 12);
    if (i > 0) {
      EXPECT_EQ(last[i].usage().cached_prompt_tokens(), 32);  // the prompt's two full blocks
    }
  }
  EXPECT_NE(ids[0], ids[1]);  // distinct seeds
  EXPECT_NE(ids[1], ids[2]);
  // n 0 is 1; more than 16 is refused naming the field.
  const GenerateResult one = Generate(request(0, 7));
  ASSERT_TRUE(one.status.ok());
  EXPECT_EQ(one.ids, ids[0]);
  EXPECT_THAT(Generate(request(17, 7)).status.error_message(), HasSubstr("n must be in [1, 16]"));
}

// Chat messages through the gRPC API: rendered with the model's chat template (added to a copy of
// stories260K), the answer is the one for the rendered prompt's ids; bad roles and models without a
// template are INVALID_ARGUMENT saying why.
TEST_F(CoordinatorApiTest, ChatMessagesAreRenderedWithTheModelsTemplate) {
  testing::TempDir dir;
  for (const char* name : {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                           "tokenizer.model", "special_tokens_map.json"}) {
    dir.Write(name, testing::ReadFileOrEmpty(absl::StrCat(testing::Stories260KDir(), "/", name)));
  }
  nlohmann::json config = nlohmann::json::parse(
      testing::ReadFileOrEmpty(absl::StrCat(testing::Stories260KDir(), "/tokenizer_config.json")));
  config["chat_template"] =
      "{{ bos_token }}{% if greeting is defined %}{{ greeting }}{% endif %}"
      "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
      "{% if add_generation_prompt %}Assistant:{% endif %}";
  dir.Write("tokenizer_config.json", config.dump());
  StartCoordinator(dir.path(), 1);
  BringUpOneWorker();
  ASSERT_OK_AND_ASSIGN(auto tokenizer, LoadTokenizer(dir.path()));
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> rendered,
                       tokenizer->Encode("<s>System: Be brief.\nUser: Tell a story\nAssistant:", false));
  v1::GenerateRequest chat;
  auto add = [&](const char* role, const char* content) {
    v1::ChatMessage* m = chat.mutable_chat()->add_messages();
    m->set_role(role);
    m->set_content(content);
  };
  add("system", "Be brief.");
  add("user", "Tell a story");
  chat.set_max_tokens(12);
  const GenerateResult r = Generate(chat);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  const GenerateResult ids = Generate(IdsRequest(rendered, 12));
  ASSERT_TRUE(ids.status.ok());
  EXPECT_EQ(r.ids, ids.ids);
  EXPECT_EQ(r.text, ids.text);
  EXPECT_EQ(r.messages.back().usage().prompt_tokens(), static_cast<int32_t>(rendered.size()));

  // continue_final_message: the prompt ends right after the final message's content (this template
  // closes each message with "\n"), and no "Assistant:" follows.
  add("assistant", "Once upon a time");
  v1::GenerateRequest prefilled = chat;
  prefilled.mutable_chat()->set_continue_final_message(true);
  ASSERT_OK_AND_ASSIGN(
      std::vector<int32_t> open,
      tokenizer->Encode("<s>System: Be brief.\nUser: Tell a story\nAssistant: Once upon a time", false));
  const GenerateResult continued = Generate(prefilled);
  ASSERT_TRUE(continued.status.ok()) << continued.status.error_message();
  EXPECT_EQ(continued.messages.back().usage().prompt_tokens(), static_cast<int32_t>(open.size()));
  const GenerateResult open_ids = Generate(IdsRequest(open, 12));
  ASSERT_TRUE(open_ids.status.ok());
  EXPECT_EQ(continued.ids, open_ids.ids);
  chat.mutable_chat()->mutable_messages()->RemoveLast();

  v1::GenerateRequest bad = chat;
  bad.mutable_chat()->mutable_messages(1)->set_role("robot");
  EXPECT_THAT(Generate(bad).status.error_message(),
              HasSubstr("prompt.chat: messages[1].role must be system, user, assistant, tool or developer, got 'robot'"));
  bad.mutable_chat()->clear_messages();
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("prompt.chat: messages is empty"));

  // template_kwargs (vLLM's chat_template_kwargs): more variables for the template.
  v1::GenerateRequest greeted = chat;
  greeted.mutable_chat()->set_template_kwargs(R"({"greeting": "Hello. "})");
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> hello,
                       tokenizer->Encode("<s>Hello. System: Be brief.\nUser: Tell a story\nAssistant:", false));
  const GenerateResult g = Generate(greeted);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.messages.back().usage().prompt_tokens(), static_cast<int32_t>(hello.size()));
  greeted.mutable_chat()->set_template_kwargs("[1]");
  EXPECT_THAT(Generate(greeted).status.error_message(),
              HasSubstr("prompt.chat.template_kwargs: must be the JSON text of an object"));
  greeted.mutable_chat()->set_template_kwargs(R"({"eos_token": "x"})");
  EXPECT_THAT(Generate(greeted).status.error_message(),
              HasSubstr("prompt.chat.template_kwargs: 'eos_token' is set by the server"));
  // JSON text nested deeper than 64 levels is refused before it is parsed (copying and rendering a
  // parsed value recurse once per level).
  const std::string deep = std::string(65, '[') + std::string(65, ']');
  greeted.mutable_chat()->set_template_kwargs(absl::StrCat(R"({"a": )", deep, "}"));
  EXPECT_THAT(Generate(greeted).status.error_message(),
              HasSubstr("prompt.chat.template_kwargs: nests more than 64 levels of arrays and objects"));
  greeted.mutable_chat()->clear_template_kwargs();
  greeted.mutable_chat()->set_tools(deep);
  EXPECT_THAT(Generate(greeted).status.error_message(),
              HasSubstr("prompt.chat.tools: nests more than 64 levels of arrays and objects"));
  // 64 levels are taken as far as the depth goes (then refused for what they are).
  greeted.mutable_chat()->set_tools(std::string(64, '[') + std::string(64, ']'));
  EXPECT_THAT(Generate(greeted).status.error_message(), ::testing::Not(HasSubstr("nests more than")));
}

TEST_F(CoordinatorApiTest, ChatNeedsAChatTemplate) {
  StartCoordinator(testing::Stories260KDir(), 1);
  BringUpOneWorker();
  v1::GenerateRequest chat;
  v1::ChatMessage* m = chat.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content("Hi");
  chat.set_max_tokens(4);
  const GenerateResult r = Generate(chat);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("has no chat template"));
}

// Chat with tools over gRPC: the tools and an earlier call reach the template; TOOL_CHOICE_FUNCTION
// constrains the answer to a call of that function, parsed into the last message's tool_calls with
// FINISH_REASON_TOOL_CALLS (the template mentions <tool_call>: hermes); bad tool fields are
// INVALID_ARGUMENT naming them.
TEST_F(CoordinatorApiTest, ChatWithToolsReturnsParsedToolCalls) {
  testing::TempDir dir;
  for (const char* name : {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                           "tokenizer.model", "special_tokens_map.json"}) {
    dir.Write(name, testing::ReadFileOrEmpty(absl::StrCat(testing::Stories260KDir(), "/", name)));
  }
  nlohmann::json config = nlohmann::json::parse(
      testing::ReadFileOrEmpty(absl::StrCat(testing::Stories260KDir(), "/tokenizer_config.json")));
  config["chat_template"] =
      "{% for t in tools %}T:{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
      "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}({{ c.function.arguments.x }})"
      "</tool_call>{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}A:";
  dir.Write("tokenizer_config.json", config.dump());
  StartCoordinator(dir.path(), 1);
  BringUpOneWorker();
  ASSERT_OK_AND_ASSIGN(auto tokenizer, LoadTokenizer(dir.path()));
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> rendered,
                       tokenizer->Encode("T:add;T:mul;user: Sum?\nassistant: <tool_call>add(7)</tool_call>\n"
                                         "tool: 9\nA:", false));
  v1::GenerateRequest req;
  v1::ChatMessages* chat = req.mutable_chat();
  chat->set_tools(R"([{"type": "function", "function": {"name": "add", "parameters": {"type": "object",
      "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}},
      {"type": "function", "function": {"name": "mul"}}])");
  auto add = [&](const char* role, const char* content) {
    v1::ChatMessage* m = chat->add_messages();
    m->set_role(role);
    m->set_content(content);
    return m;
  };
  add("user", "Sum?");
  v1::ToolCall* earlier = add("assistant", "")->add_tool_calls();
  earlier->set_id("c1");
  earlier->set_name("add");
  earlier->set_arguments(R"({"x": 7, "y": 2})");
  add("tool", "9")->set_tool_call_id("c1");
  chat->set_tool_choice(v1::TOOL_CHOICE_FUNCTION);
  chat->set_tool_name("add");
  req.set_max_tokens(200);
  req.mutable_sampling()->set_temperature(1.0f);
  req.mutable_sampling()->set_seed(3);
  const GenerateResult r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.messages.back().usage().prompt_tokens(), static_cast<int32_t>(rendered.size()));
  EXPECT_EQ(r.messages.back().finish_reason(), v1::FINISH_REASON_TOOL_CALLS) << r.text;
  ASSERT_EQ(r.messages.back().tool_calls_size(), 1) << r.text;
  const v1::ToolCall& call = r.messages.back().tool_calls(0);
  EXPECT_EQ(call.name(), "add");
  EXPECT_FALSE(call.id().empty());
  const nlohmann::json args = nlohmann::json::parse(call.arguments());
  EXPECT_TRUE(args["x"].is_number_integer()) << call.arguments();
  EXPECT_TRUE(args["y"].is_number_integer()) << call.arguments();
  EXPECT_THAT(r.text, ::testing::StartsWith("<tool_call>\n{\"name\":\"add\",\"arguments\":"));

  // TOOL_CHOICE_NONE: the same tools, no parsing.
  v1::GenerateRequest none = req;
  none.mutable_chat()->set_tool_choice(v1::TOOL_CHOICE_NONE);
  none.set_max_tokens(4);
  const GenerateResult n = Generate(none);
  ASSERT_TRUE(n.status.ok()) << n.status.error_message();
  EXPECT_EQ(n.messages.back().tool_calls_size(), 0);

  v1::GenerateRequest bad = req;
  bad.mutable_chat()->set_tool_name("div");
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("no tool is named 'div'"));
  bad = req;
  bad.mutable_chat()->set_tools("[{\"type\": \"function\"}]");
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("prompt.chat.tools[0].function"));
  bad = req;
  bad.mutable_chat()->clear_tools();
  EXPECT_THAT(Generate(bad).status.error_message(), HasSubstr("prompt.chat.tool_choice: needs prompt.chat.tools"));
}

// GenerateRequest's constraint: a JSON Schema and a regex constrain the text (stories260K at
// temperature 1); an unsupported keyword is INVALID_ARGUMENT naming it.
TEST_F(CoordinatorApiTest, StructuredOutputJsonSchemaAndRegex) {
  StartCoordinator(testing::Stories260KDir(), 1);
  BringUpOneWorker();
  v1::GenerateRequest req;
  req.set_text("Once upon a time");
  req.set_max_tokens(300);
  req.mutable_sampling()->set_temperature(1.0f);
  req.mutable_sampling()->set_seed(11);
  req.set_json_schema(
      R"({"type":"object","properties":{"color":{"enum":["red","green"]},"n":{"type":"integer"}},"required":["color","n"]})");
  const GenerateResult r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.messages.back().finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_THAT(r.text, ::testing::MatchesRegex(R"re(\{"color":"(red|green)","n":-?[0-9]+\})re")) << r.text;

  v1::GenerateRequest re = req;
  re.set_regex("[a-z]{2,5}-[0-9]{3}");
  const GenerateResult rr = Generate(re);
  ASSERT_TRUE(rr.status.ok()) << rr.status.error_message();
  EXPECT_EQ(rr.messages.back().finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_THAT(rr.text, ::testing::MatchesRegex("[a-z]{2,5}-[0-9]{3}")) << rr.text;

  v1::GenerateRequest bad = req;
  bad.set_json_schema(R"({"type":"object","properties":{"n":{"type":"integer","multipleOf":2}}})");
  const GenerateResult b = Generate(bad);
  EXPECT_EQ(b.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(b.status.error_message(), HasSubstr("json_schema: unsupported JSON Schema keyword \"multipleOf\""));
  v1::GenerateRequest bad_regex = req;
  bad_regex.set_regex("(a");
  EXPECT_EQ(Generate(bad_regex).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::GenerateRequest off = req;
  off.set_json_object(false);
  EXPECT_THAT(Generate(off).status.error_message(), HasSubstr("json_object: must be true"));
}

TEST_F(CoordinatorApiTest, TokenizeAndModelInfo) {
  StartCoordinator(testing::Stories260KDir(), 1);
  ASSERT_OK_AND_ASSIGN(auto tokenizer, LoadTokenizer(testing::Stories260KDir()));
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  v1::TokenizeRequest treq;
  treq.set_text("Hello world");
  treq.set_add_special_tokens(true);
  v1::TokenizeResponse tresp;
  ASSERT_TRUE(inference_->Tokenize(&ctx, treq, &tresp).ok());  // needs no ready cluster
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> want, tokenizer->Encode("Hello world", true));
  EXPECT_EQ(std::vector<int32_t>(tresp.ids().begin(), tresp.ids().end()), want);
  grpc::ClientContext ctx2;
  ctx2.set_deadline(Deadline());
  v1::ModelInfo info;
  ASSERT_TRUE(inference_->GetModelInfo(&ctx2, {}, &info).ok());
  EXPECT_EQ(info.model_path(), testing::Stories260KDir());
  EXPECT_EQ(info.architecture(), "LlamaForCausalLM");
  EXPECT_EQ(info.vocab_size(), 512);
  EXPECT_EQ(info.max_position_embeddings(), 512);
  EXPECT_EQ(info.num_layers(), 5);
  EXPECT_GT(info.num_parameters(), 0);
  EXPECT_THAT(info.eos_token_ids(), ::testing::ElementsAre(2));
  EXPECT_TRUE(info.has_tokenizer());
}

TEST_F(CoordinatorApiTest, ModelWithoutTokenizerServesIdsOnly) {
  // The golden llama model without its tokenizer files.
  testing::TempDir dir;
  for (const char* name : {"config.json", "generation_config.json", "model.safetensors"}) {
    dir.Write(name, testing::ReadFileOrEmpty(absl::StrCat("tests/golden/models/llama/", name)));
  }
  StartCoordinator(dir.path(), 1, {.max_seq_len = 64});
  BringUpOneWorker();
  v1::GenerateRequest text;
  text.set_text("hello");
  text.set_max_tokens(3);
  const GenerateResult r = Generate(text);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("model has no tokenizer"));
  const GenerateResult ids = Generate(IdsRequest({5, 6, 7}, 8));
  ASSERT_TRUE(ids.status.ok()) << ids.status.error_message();
  EXPECT_EQ(ids.ids, Reference({5, 6, 7}, 8));
  EXPECT_TRUE(ids.text.empty());
  grpc::ClientContext ctx;
  v1::TokenizeResponse resp;
  v1::TokenizeRequest treq;
  treq.set_text("x");
  const grpc::Status st = inference_->Tokenize(&ctx, treq, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext ctx2;
  v1::ModelInfo info;
  ASSERT_TRUE(inference_->GetModelInfo(&ctx2, {}, &info).ok());
  EXPECT_FALSE(info.has_tokenizer());
  EXPECT_EQ(info.max_position_embeddings(), 64);
}

TEST_F(CoordinatorApiTest, ClusterStatusShowsWorkersAssignmentsAndThePlan) {
  StartCoordinator(testing::Stories260KDir(), 1);
  BringUpOneWorker();
  const v1::ClusterStatus st = Status();
  EXPECT_TRUE(st.ready());
  EXPECT_EQ(st.model_path(), testing::Stories260KDir());
  ASSERT_EQ(st.workers_size(), 1);
  const v1::WorkerStatus& w = st.workers(0);
  // "w-<incarnation>-1": 8 hex digits that differ between coordinator runs.
  EXPECT_THAT(w.worker_id(), ::testing::MatchesRegex("w-[0-9a-f]{8}-1"));
  EXPECT_THAT(st.plan(), HasSubstr(w.worker_id()));
  EXPECT_EQ(w.node_name(), "node-a");
  EXPECT_EQ(w.state(), v1::WORKER_STATE_READY);
  EXPECT_EQ(w.devices_size(), 1);
  EXPECT_EQ(w.assignment().layer_begin(), 0);
  EXPECT_EQ(w.assignment().layer_end(), 5);
  EXPECT_EQ(w.assignment().num_stages(), 1);
  EXPECT_EQ(w.assignment().next_address(), "");
  EXPECT_EQ(w.assignment().max_seq_len(), 512);
  // max_slots is sized from the KV budget by default: the 4 GiB budget holds far more than 256
  // (kMaxAutoSlots) sequences of 512 tokens, which use 256 x 32 blocks.
  EXPECT_EQ(w.assignment().kv_block_size(), 16);
  EXPECT_EQ(w.assignment().kv_blocks(), kMaxAutoSlots * 32);
  EXPECT_EQ(coordinator_->scheduler().Stats().replicas.at(0).max_slots, kMaxAutoSlots);
  // The plan says what the worker allocates, not only the capacity: 131,072 tokens x 5 layers x K
  // and V x 4 KV heads x head_dim 8 x 4 bytes (f32 on CPU ranks) = 167,772,160 bytes.
  EXPECT_THAT(st.plan(), HasSubstr("replica 0: KV allocated 8192 blocks x 16 tokens = 131072 tokens, up to 167.8 MB "
                                   "per rank (at most 256 sequences (max_slots auto) x max_seq_len 512)"));
  EXPECT_EQ(st.running_sequences(), 0);
  EXPECT_EQ(st.waiting_sequences(), 0);
  EXPECT_EQ(st.scheduling_policy(), "fcfs");  // the default
  // One stage: nothing to pipeline.
  ASSERT_EQ(st.pipelining_size(), 1);
  EXPECT_EQ(st.pipelining(0).replica(), 0);
  EXPECT_EQ(st.pipelining(0).micro_batches(), 1);
  EXPECT_EQ(st.pipelining(0).explanation(), "1 micro-batch (pipeline depth 1; 1 CPU stage)");
  // Decode steps per call: auto by default, one step until decode calls are timed (this test's
  // in-process replica reports no compute time, so it stays there).
  ASSERT_EQ(st.decode_steps_size(), 1);
  EXPECT_EQ(st.decode_steps(0).replica(), 0);
  EXPECT_EQ(st.decode_steps(0).decode_steps(), 1);
  // Its calls of plain decodes overlap (the in-process replica takes them, as a worker does).
  EXPECT_EQ(st.decode_steps(0).explanation(),
            "1 (auto: measuring, 0 of 8 decode calls timed so far); decode calls overlapped (the next is sent while "
            "one runs)");
}

// With the KV blocks capped (--kv_blocks), the default max_slots is as many whole 512-token
// contexts (32 blocks) as they hold; an explicit max_slots is kept.
TEST_F(CoordinatorApiTest, DefaultMaxSlotsIsSizedFromTheKvBlocks) {
  StartCoordinator(testing::Stories260KDir(), 1, {.max_kv_blocks = 100});
  BringUpOneWorker();
  EXPECT_EQ(Status().workers(0).assignment().kv_blocks(), 100);
  EXPECT_EQ(coordinator_->scheduler().Stats().replicas.at(0).max_slots, 3);  // 100 / 32
  EXPECT_EQ(SlotsForKvBlocks(31, 32), 1);  // always one sequence
  EXPECT_EQ(SlotsForKvBlocks(int64_t{1} << 40, 32), kMaxAutoSlots);
}

TEST_F(CoordinatorApiTest, ExplicitMaxSlotsIsKept) {
  StartCoordinator(testing::Stories260KDir(), 1, {.max_slots = 5});
  BringUpOneWorker();
  EXPECT_EQ(Status().workers(0).assignment().kv_blocks(), 5 * 32);
  EXPECT_EQ(coordinator_->scheduler().Stats().replicas.at(0).max_slots, 5);
}

TEST_F(CoordinatorApiTest, ClusterStatusListsOnePageOfWorkersAndCountsThemAll) {
  StartCoordinator(testing::Stories260KDir(), 1);
  for (int i = 0; i < 300; ++i) Register(absl::StrCat("node-", i), absl::StrCat("127.0.0.1:", 1000 + i));
  const v1::ClusterStatus first = Status();
  EXPECT_EQ(first.total_workers(), 300);
  EXPECT_EQ(first.workers_size(), 256);  // the default page
  ASSERT_FALSE(first.next_page_token().empty());
  int64_t counted = 0;
  for (const v1::WorkerStateCount& c : first.worker_counts()) counted += c.count();
  EXPECT_EQ(counted, 300);
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  v1::GetClusterStatusRequest next;
  next.set_page_token(first.next_page_token());
  next.set_max_workers(100);
  v1::ClusterStatus second;
  ASSERT_TRUE(admin_->GetClusterStatus(&ctx, next, &second).ok());
  EXPECT_EQ(second.workers_size(), 44);
  EXPECT_TRUE(second.next_page_token().empty());
  std::set<std::string> ids;
  for (const v1::ClusterStatus* page : {&first, static_cast<const v1::ClusterStatus*>(&second)}) {
    for (const v1::WorkerStatus& w : page->workers()) ids.insert(w.worker_id());
  }
  EXPECT_EQ(ids.size(), 300u);  // every worker once
}

TEST_F(CoordinatorApiTest, SpilledExpertsGoToAnExpertHostThatMustBeReadyBeforeServing) {
  // qwen2_moe (layers 0 and 2 MoE, 8 experts) on three workers of 2 x 190 KB: a stage holding layer
  // 2 cannot keep all its experts, so the third worker hosts 6 of them (see tests/integration).
  StartCoordinator("tests/golden/models/qwen2_moe", 3, {.pp = 2, .max_seq_len = 64});
  const std::vector<std::string> addresses = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
  std::vector<std::string> ids;
  for (size_t i = 0; i < addresses.size(); ++i) {
    ids.push_back(Register(absl::StrCat("node-", i), addresses[i], 2, 190'000));
  }
  std::vector<WorkerAssignment> a;
  for (const std::string& address : addresses) {
    std::optional<WorkerAssignment> got = workers_->WaitFor(address);
    ASSERT_TRUE(got.has_value()) << address;
    a.push_back(*got);
  }
  size_t host = a.size(), last = a.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].expert_host) host = i;
    if (!a[i].expert_host && a[i].layer_end == 3) last = i;
  }
  ASSERT_LT(host, a.size());
  ASSERT_LT(last, a.size());
  std::vector<std::pair<int64_t, int32_t>> hosted;
  for (const HostedExpert& e : a[host].hosted_experts) hosted.emplace_back(e.layer, e.expert);
  EXPECT_EQ(hosted, (std::vector<std::pair<int64_t, int32_t>>{{2, 2}, {2, 3}, {2, 4}, {2, 5}, {2, 6}, {2, 7}}));
  EXPECT_EQ(a[host].devices, (std::vector<int>{0, 1}));
  const WorkerAssignment& stage = a[last];
  ASSERT_EQ(stage.experts.size(), 1u);
  EXPECT_EQ(stage.experts[0].layer, 2);
  EXPECT_EQ(stage.experts[0].ranks, (std::vector<int32_t>{0, 1, -1, -1, -1, -1, -1, -1}));
  for (size_t e = 0; e < 8; ++e) EXPECT_EQ(stage.experts[0].addresses[e], e < 2 ? "" : addresses[host]) << e;
  // The stages are ready, the host is not: no replica serves yet, and the reason names the host.
  for (size_t i = 0; i < a.size(); ++i) {
    if (i == host) continue;
    ASSERT_TRUE(Heartbeat(ids[i], v1::WORKER_STATE_READY, a[i].assignment_id, "", a[i].kv_blocks).ok());
  }
  coordinator_->cluster().Tick();
  EXPECT_THAT(coordinator_->cluster().ReadyStatus(),
              testing::StatusIs(absl::StatusCode::kUnavailable,
                                HasSubstr(absl::StrCat("worker ", ids[host], " is loading"))));
  ASSERT_TRUE(Heartbeat(ids[host], v1::WORKER_STATE_READY, a[host].assignment_id).ok());
  ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait)) << coordinator_->cluster().ReadyStatus();
  const v1::ClusterStatus st = Status();
  EXPECT_THAT(st.plan(), HasSubstr("expert hosts:"));
  bool seen_host = false;
  for (const v1::WorkerStatus& w : st.workers()) {
    if (w.assignment().role() != v1::ASSIGNMENT_ROLE_EXPERT_HOST) continue;
    seen_host = true;
    EXPECT_EQ(w.assignment().hosted_experts_size(), 6);
  }
  EXPECT_TRUE(seen_host);
}

TEST_F(CoordinatorApiTest, ClientCancellingMidStreamFreesItsSequence) {
  StartCoordinator(testing::Stories260KDir(), 1, {.max_slots = 1});
  absl::Notification client_cancelled;
  // Step 3 of the first replica waits until the client has cancelled, so the cancel lands mid-stream.
  factory_->OnMake([&client_cancelled](EngineReplica* r) {
    r->SetStepHookForTest([&client_cancelled](const StepInput& in) {
      if (in.step_id == 3) client_cancelled.WaitForNotificationWithTimeout(kWait);
      return absl::OkStatus();
    });
  });
  BringUpOneWorker();
  v1::GenerateRequest long_req = IdsRequest({1, 2, 3}, 400);
  long_req.set_ignore_eos(true);
  long_req.set_request_id("to-cancel");
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = inference_->Generate(&ctx, long_req);
  v1::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first));
  EXPECT_EQ(first.token_ids_size(), 1);
  ctx.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  client_cancelled.Notify();
  // The only slot must come free for this one to run.
  const GenerateResult next = Generate(IdsRequest({4, 5}, 5));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.ids, Reference({4, 5}, 5));
  int steps_of_cancelled = 0;
  for (const StepInput& in : factory_->last()->StepInputsForTest()) {
    for (const StepSequenceInput& s : in.sequences) steps_of_cancelled += s.request_id == "to-cancel" ? 1 : 0;
  }
  EXPECT_LT(steps_of_cancelled, 400) << "the cancelled request ran to completion";
  EXPECT_GE(steps_of_cancelled, 1);
  const v1::ClusterStatus st = Status();
  EXPECT_EQ(st.running_sequences(), 0);
  EXPECT_EQ(st.waiting_sequences(), 0);
}

TEST_F(CoordinatorApiTest, QueueFullIsResourceExhausted) {
  StartCoordinator(testing::Stories260KDir(), 1, {.max_slots = 1, .max_queued = 0});
  absl::Notification stepping;
  HoldStepsAndNotifyOnFirst(&stepping);
  BringUpOneWorker();
  GenerateResult held;
  std::thread first([&] { held = Generate(IdsRequest({1, 2}, 3)); });
  ASSERT_TRUE(stepping.WaitForNotificationWithTimeout(kWait));  // it holds the only slot
  const GenerateResult r = Generate(IdsRequest({3, 4}, 3));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(r.status.error_message(), HasSubstr("max_queued = 0"));
  factory_->last()->ReleaseStepsForTest();
  first.join();
  EXPECT_TRUE(held.status.ok()) << held.status.error_message();
}

TEST_F(CoordinatorApiTest, AFailedWorkerIsReportedAndTheOtherReplicaServes) {
  StartCoordinator(testing::Stories260KDir(), 2, {.replicas = 2});
  const std::string w1 = Register("node-a", "127.0.0.1:1");
  const std::string w2 = Register("node-b", "127.0.0.1:2");
  std::optional<WorkerAssignment> a1 = workers_->WaitFor("127.0.0.1:1");
  std::optional<WorkerAssignment> a2 = workers_->WaitFor("127.0.0.1:2");
  ASSERT_TRUE(a1.has_value() && a2.has_value());
  EXPECT_NE(a1->replica, a2->replica);
  ASSERT_TRUE(Heartbeat(w2, v1::WORKER_STATE_FAILED, a2->assignment_id, "model.safetensors: truncated").ok());
  coordinator_->cluster().Tick();
  GenerateResult r = Generate(IdsRequest({1, 2}, 3));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);  // w1 is still loading
  ASSERT_TRUE(Heartbeat(w1, v1::WORKER_STATE_READY, a1->assignment_id, "", a1->kv_blocks).ok());
  ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait));
  r = Generate(IdsRequest({1, 2}, 3));
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  const v1::ClusterStatus st = Status();
  EXPECT_TRUE(st.ready());
  EXPECT_THAT(st.reason(), HasSubstr("worker " + w2 + " failed to load: model.safetensors: truncated"));
  ASSERT_EQ(st.workers_size(), 2);
  EXPECT_EQ(st.workers(1).state(), v1::WORKER_STATE_FAILED);
  EXPECT_EQ(st.workers(1).error(), "model.safetensors: truncated");
}

TEST_F(CoordinatorApiTest, TheOnlyWorkerFailingIsUnavailableWithWhy) {
  StartCoordinator(testing::Stories260KDir(), 1);
  const std::string w1 = Register("node-a", "127.0.0.1:1");
  std::optional<WorkerAssignment> a1 = workers_->WaitFor("127.0.0.1:1");
  ASSERT_TRUE(a1.has_value());
  ASSERT_TRUE(Heartbeat(w1, v1::WORKER_STATE_FAILED, a1->assignment_id, "out of memory").ok());
  coordinator_->cluster().Tick();
  const GenerateResult r = Generate(IdsRequest({1, 2}, 3));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(r.status.error_message(), HasSubstr("worker " + w1 + " failed to load: out of memory"));
  EXPECT_EQ(HealthStatus(), 2);
}

TEST_F(CoordinatorApiTest, ADeadWorkerStopsItsReplicaAndTakesItBackAfterARestart) {
  // Without recovery, requests fail at once while the only replica is down.
  StartCoordinator(testing::Stories260KDir(), 1, {.recovery_timeout = absl::ZeroDuration()});
  BringUpOneWorker();
  const std::string first_assignment = workers_->WaitFor("127.0.0.1:1")->assignment_id;
  clock_.Advance(absl::Seconds(6));  // no heartbeat for longer than the 5 s timeout
  coordinator_->cluster().Tick();
  GenerateResult r = Generate(IdsRequest({1, 2}, 3));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  const std::string w1 = Status().workers(0).worker_id();
  EXPECT_THAT(r.status.error_message(), HasSubstr("worker " + w1 + " is dead"));
  EXPECT_EQ(Status().workers(0).state(), v1::WORKER_STATE_DEAD);
  EXPECT_EQ(Heartbeat(w1, v1::WORKER_STATE_READY, first_assignment).error_code(), grpc::StatusCode::NOT_FOUND);
  // The worker restarts: same node and address, new id; it gets its stage back.
  const std::string w2 = Register("node-a", "127.0.0.1:1");
  EXPECT_THAT(w2, ::testing::MatchesRegex("w-[0-9a-f]{8}-2"));
  std::optional<WorkerAssignment> again = workers_->WaitFor("127.0.0.1:1", first_assignment);
  ASSERT_TRUE(again.has_value());
  EXPECT_THAT(again->assignment_id, HasSubstr(w2));
  ASSERT_TRUE(Heartbeat(w2, v1::WORKER_STATE_READY, again->assignment_id, "", again->kv_blocks).ok());
  ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait));
  r = Generate(IdsRequest({1, 2}, 3));
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
}

// ---- Coordinator restarts: identity and adoption (cluster.h "Adoption") --------------------------

// Worker processes with instance ids: two stages, brought up by a first coordinator.
class CoordinatorRestartTest : public CoordinatorApiTest {
 protected:
  static constexpr const char* kA = "aaaaaaaa00000001";
  static constexpr const char* kB = "bbbbbbbb00000002";
  void BringUpTwoStages(const CoordinatorOptions& options) {
    StartCoordinator(testing::Stories260KDir(), 2, options);
    ids_[0] = Register("node-a", "127.0.0.1:1", 1, int64_t{4} << 30, kA);
    ids_[1] = Register("node-b", "127.0.0.1:2", 1, int64_t{4} << 30, kB);
    for (int i = 0; i < 2; ++i) {
      std::optional<WorkerAssignment> a = workers_->WaitFor(absl::StrCat("127.0.0.1:", i + 1));
      ASSERT_TRUE(a.has_value());
      held_[i] = *a;
      ASSERT_TRUE(Heartbeat(ids_[i], v1::WORKER_STATE_READY, a->assignment_id, "", a->kv_blocks).ok());
    }
    ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait)) << coordinator_->cluster().ReadyStatus();
  }
  void RestartCoordinator(const CoordinatorOptions& options) {
    coordinator_->Shutdown(absl::Seconds(5));
    coordinator_.reset();
    StartCoordinator(testing::Stories260KDir(), 2, options);
  }
  std::string ids_[2];
  WorkerAssignment held_[2];
};

TEST_F(CoordinatorRestartTest, ANewCoordinatorAdoptsTheStagesTheWorkersHoldWithoutAssigningAnything) {
  ASSERT_NO_FATAL_FAILURE(BringUpTwoStages({.pp = 2}));
  EXPECT_EQ(ids_[0], absl::StrCat("w-", kA));
  EXPECT_NE(held_[0].layer_begin, held_[1].layer_begin);
  const std::vector<int32_t> expected = Reference({1, 2, 3}, 8);
  RestartCoordinator({.pp = 2});
  // They come back in the other order, each with the id it had and what it holds.
  EXPECT_EQ(Register("node-b", "127.0.0.1:2", 1, int64_t{4} << 30, kB, held_[1]), ids_[1]);
  EXPECT_EQ(Register("node-a", "127.0.0.1:1", 1, int64_t{4} << 30, kA, held_[0]), ids_[0]);
  ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait)) << coordinator_->cluster().ReadyStatus();
  EXPECT_EQ(workers_->assign_calls(), 0) << "nothing is reloaded";
  EXPECT_THAT(Status().plan(), HasSubstr("adopted"));
  // Each stage's line states the KV its ranks allocate: blocks x tokens x its layers x K and V x 4
  // KV heads x head_dim 8 x 4 bytes (f32 on CPU ranks).
  for (const WorkerAssignment& h : held_) {
    const int64_t bytes = h.kv_blocks * h.kv_block_size * (h.layer_end - h.layer_begin) * 2 * 4 * 8 * 4;
    EXPECT_THAT(Status().plan(), HasSubstr(absl::StrCat(h.kv_blocks, " KV blocks (", FormatBytes(bytes), " per rank)")));
  }
  const v1::ClusterStatus status = Status();
  for (const v1::WorkerStatus& w : status.workers()) {
    const WorkerAssignment& h = w.worker_id() == ids_[0] ? held_[0] : held_[1];
    EXPECT_EQ(w.assignment().assignment_id(), h.assignment_id) << "the stage keeps its assignment id";
  }
  GenerateResult r = Generate(IdsRequest({1, 2, 3}, 8));
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids, expected);
}

// --pipeline_depth 0 (auto): the replica's two stages (workers listening on one host) are priced
// as sharing a machine, and the status says how the split is chosen; a fixed depth says so.
TEST_F(CoordinatorRestartTest, TheStatusExplainsHowTheReplicaPipelines) {
  ASSERT_NO_FATAL_FAILURE(BringUpTwoStages({.pp = 2}));
  v1::ClusterStatus status = Status();
  ASSERT_EQ(status.pipelining_size(), 1);
  EXPECT_EQ(status.pipelining(0).explanation(),
            "up to 2 micro-batches, chosen per step from the load (2 CPU stages on one machine; idle now)");
  GenerateResult r = Generate(IdsRequest({1, 2, 3}, 4));
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  status = Status();
  EXPECT_EQ(status.pipelining(0).micro_batches(), 1);
  EXPECT_THAT(status.pipelining(0).explanation(),
              HasSubstr("1 micro-batch for 1 running sequence (2 CPU stages on one machine, "));
  ASSERT_EQ(status.decode_steps_size(), 1);
  EXPECT_EQ(status.decode_steps(0).explanation(),
            "1 (several decode steps per call need a 1-stage replica; this one has 2 stages)");
  RestartCoordinator({.pp = 2, .pipeline_depth = 2});
  Register("node-b", "127.0.0.1:2", 1, int64_t{4} << 30, kB, held_[1]);
  Register("node-a", "127.0.0.1:1", 1, int64_t{4} << 30, kA, held_[0]);
  ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait)) << coordinator_->cluster().ReadyStatus();
  EXPECT_EQ(Status().pipelining(0).explanation(), "2 micro-batches in flight at most (fixed pipeline depth)");
}

// A coordinator started with another setting (here the KV block size) cannot serve what the
// workers hold: it plans afresh and assigns, under ids no earlier coordinator made.
TEST_F(CoordinatorRestartTest, AnIncompatibleCoordinatorPlansAfreshWithNewAssignmentIds) {
  ASSERT_NO_FATAL_FAILURE(BringUpTwoStages({.pp = 2}));
  RestartCoordinator({.pp = 2, .kv_block_size = 32});
  // In the other order than the first time.
  Register("node-b", "127.0.0.1:2", 1, int64_t{4} << 30, kB, held_[1]);
  Register("node-a", "127.0.0.1:1", 1, int64_t{4} << 30, kA, held_[0]);
  for (int i = 0; i < 2; ++i) {
    std::optional<WorkerAssignment> a = workers_->WaitFor(absl::StrCat("127.0.0.1:", i + 1));
    ASSERT_TRUE(a.has_value());
    EXPECT_NE(a->assignment_id, held_[i].assignment_id);
    EXPECT_EQ(a->kv_block_size, 32);
    // The same layers go to the same worker: the ids, and so the planner's order, are the same.
    EXPECT_EQ(a->layer_begin, held_[i].layer_begin);
    ASSERT_TRUE(Heartbeat(ids_[i], v1::WORKER_STATE_READY, a->assignment_id, "", a->kv_blocks).ok());
  }
  ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait)) << coordinator_->cluster().ReadyStatus();
  EXPECT_TRUE(Generate(IdsRequest({1, 2, 3}, 4)).status.ok());
}

// The finding behind the identity rules: a process registering with a live worker's node name and
// address kept the cluster unavailable. Now it gets ALREADY_EXISTS and the cluster keeps serving.
TEST_F(CoordinatorRestartTest, AnImpostorOfALiveWorkerIsRefusedAndTheClusterKeepsServing) {
  ASSERT_NO_FATAL_FAILURE(BringUpTwoStages({.pp = 2}));
  for (const std::string& instance : {std::string("eeeeeeee00000005"), std::string()}) {
    for (int i = 0; i < 3; ++i) {
      v1::RegisterRequest req;
      req.set_node_name("node-a");
      req.set_address("127.0.0.1:1");
      req.set_instance_id(instance);
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline());
      v1::RegisterResponse resp;
      const grpc::Status st = registry_->Register(&ctx, req, &resp);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS) << st.error_message();
      EXPECT_THAT(st.error_message(), HasSubstr(ids_[0]));
    }
  }
  coordinator_->cluster().Tick();
  EXPECT_THAT(coordinator_->cluster().ReadyStatus(), IsOk());
  EXPECT_EQ(Status().workers_size(), 2);
  EXPECT_TRUE(Generate(IdsRequest({1, 2, 3}, 4)).status.ok());
}

// The coordinator went away while a stage loaded: the stage is adopted too, and the replica serves
// once that worker reports READY (its load is not started over).
TEST_F(CoordinatorRestartTest, AStageStillLoadingIsAdoptedAndServesOnceReady) {
  ASSERT_NO_FATAL_FAILURE(BringUpTwoStages({.pp = 2}));
  RestartCoordinator({.pp = 2});
  Register("node-a", "127.0.0.1:1", 1, int64_t{4} << 30, kA, held_[0]);
  Register("node-b", "127.0.0.1:2", 1, int64_t{4} << 30, kB, held_[1], v1::WORKER_STATE_LOADING);
  coordinator_->cluster().Tick();
  EXPECT_THAT(Status().plan(), HasSubstr("adopted"));
  EXPECT_FALSE(coordinator_->cluster().ReadyStatus().ok());
  ASSERT_TRUE(Heartbeat(ids_[1], v1::WORKER_STATE_READY, held_[1].assignment_id, "", held_[1].kv_blocks).ok());
  ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait)) << coordinator_->cluster().ReadyStatus();
  EXPECT_EQ(workers_->assign_calls(), 0);
  EXPECT_TRUE(Generate(IdsRequest({1, 2, 3}, 4)).status.ok());
}

// A coordinator with another --hidden_wire_dtype does not adopt the stages as they are: it plans
// afresh and assigns every stage the same layers with the new dtype (which a worker takes without
// reloading, WorkerServer::Assign); its plan says how hidden states travel.
TEST_F(CoordinatorRestartTest, AnotherHiddenWireDtypeIsAssignedAfreshAndShownInThePlan) {
  ASSERT_NO_FATAL_FAILURE(BringUpTwoStages({.pp = 2}));
  for (const WorkerAssignment& h : held_) EXPECT_EQ(h.hidden_wire_dtype, DType::kF32);
  EXPECT_THAT(Status().plan(), HasSubstr("hidden states between stages: f32 (exact), --hidden_wire_dtype"));
  RestartCoordinator({.pp = 2, .hidden_wire_dtype = DType::kBF16});
  Register("node-a", "127.0.0.1:1", 1, int64_t{4} << 30, kA, held_[0]);
  Register("node-b", "127.0.0.1:2", 1, int64_t{4} << 30, kB, held_[1]);
  for (int i = 0; i < 2; ++i) {
    std::optional<WorkerAssignment> a = workers_->WaitFor(absl::StrCat("127.0.0.1:", i + 1));
    ASSERT_TRUE(a.has_value()) << "stage " << i << " was not assigned afresh";
    EXPECT_EQ(a->hidden_wire_dtype, DType::kBF16);
    EXPECT_EQ(a->layer_begin, held_[i].layer_begin);
    EXPECT_EQ(a->layer_end, held_[i].layer_end);
    EXPECT_EQ(a->kv_blocks, held_[i].kv_blocks);
  }
  const std::string plan = Status().plan();
  EXPECT_THAT(plan, ::testing::Not(HasSubstr("adopted")));
  EXPECT_THAT(plan, HasSubstr("hidden states between stages: bf16 (half the bytes; each value rounded once per hop)"));
}

// Half a replica is not adopted: one worker reports its stage, the other comes back idle.
TEST_F(CoordinatorRestartTest, AnIncompleteReplicaIsNotAdopted) {
  ASSERT_NO_FATAL_FAILURE(BringUpTwoStages({.pp = 2}));
  RestartCoordinator({.pp = 2});
  Register("node-a", "127.0.0.1:1", 1, int64_t{4} << 30, kA, held_[0]);
  Register("node-b", "127.0.0.1:2", 1, int64_t{4} << 30, kB);
  std::optional<WorkerAssignment> b = workers_->WaitFor("127.0.0.1:2");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->layer_begin, held_[1].layer_begin);
  EXPECT_THAT(Status().plan(), ::testing::Not(HasSubstr("adopted")));
}

// ---- One replica, no lost request (scheduler.h "Recovery", cluster.h "Spares") -----------------

TEST_F(CoordinatorApiTest, InFlightAndNewRequestsWaitForTheOnlyWorkerToRestartAndGetTheReferenceTokens) {
  StartCoordinator(testing::Stories260KDir(), 1);
  absl::Notification stepping;
  HoldStepsAndNotifyOnFirst(&stepping);
  BringUpOneWorker();
  const std::string first_assignment = workers_->WaitFor("127.0.0.1:1")->assignment_id;
  const std::vector<int32_t> prompt = {1, 2, 3};
  const std::vector<int32_t> expected = Reference(prompt, 24);
  GenerateResult in_flight, later;
  std::thread client([&] { in_flight = Generate(IdsRequest(prompt, 24)); });
  ASSERT_TRUE(stepping.WaitForNotificationWithTimeout(kWait));
  // The worker dies mid-generation: the replica stops serving, the request parks.
  factory_->OnMake([](EngineReplica*) {});  // the next replica steps freely
  clock_.Advance(absl::Seconds(6));
  coordinator_->cluster().Tick();
  EXPECT_FALSE(coordinator_->cluster().ReadyStatus().ok());
  EXPECT_THAT(coordinator_->cluster().AdmissionStatus(), IsOk()) << "it takes requests while recovering";
  EXPECT_EQ(coordinator_->scheduler().Stats().recovering, 1);
  std::thread client2([&] { later = Generate(IdsRequest(prompt, 24)); });  // arrives while it is down
  // The scheduler reports no event for a parked request, so this waits on its counters (bounded).
  for (const absl::Time deadline = absl::Now() + kWait;
       coordinator_->scheduler().Stats().recovering < 2 && absl::Now() < deadline;) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(coordinator_->scheduler().Stats().recovering, 2);
  // The worker restarts (same node and address, new id) in whatever state: its stage comes back.
  const std::string w2 = Register("node-a", "127.0.0.1:1");
  std::optional<WorkerAssignment> again = workers_->WaitFor("127.0.0.1:1", first_assignment);
  ASSERT_TRUE(again.has_value());
  ASSERT_TRUE(Heartbeat(w2, v1::WORKER_STATE_READY, again->assignment_id, "", again->kv_blocks).ok());
  client.join();
  client2.join();
  EXPECT_TRUE(in_flight.status.ok()) << in_flight.status.error_message();
  EXPECT_EQ(in_flight.ids, expected);
  EXPECT_TRUE(later.status.ok()) << later.status.error_message();
  EXPECT_EQ(later.ids, expected);
}

TEST_F(CoordinatorApiTest, ASpareWorkerTakesTheStageOfADeadOneAndTheComebackIsReleased) {
  StartCoordinator(testing::Stories260KDir(), 1);
  absl::Notification stepping;
  HoldStepsAndNotifyOnFirst(&stepping);
  BringUpOneWorker();
  const WorkerAssignment planned = *workers_->WaitFor("127.0.0.1:1");
  // A spare registers after the plan: it stays idle while the stage's worker lives.
  const std::string spare = Register("node-b", "127.0.0.1:2");
  ASSERT_TRUE(Heartbeat(spare, v1::WORKER_STATE_IDLE, "").ok());
  coordinator_->cluster().Tick();
  const std::vector<int32_t> prompt = {5, 6};
  const std::vector<int32_t> expected = Reference(prompt, 20);
  GenerateResult r;
  std::thread client([&] { r = Generate(IdsRequest(prompt, 20)); });
  ASSERT_TRUE(stepping.WaitForNotificationWithTimeout(kWait));
  factory_->OnMake([](EngineReplica*) {});
  // The stage's worker goes silent for good; the spare keeps heartbeating.
  for (int i = 0; i < 2; ++i) {
    clock_.Advance(absl::Seconds(3));
    ASSERT_TRUE(Heartbeat(spare, v1::WORKER_STATE_IDLE, "").ok());
  }
  coordinator_->cluster().Tick();
  std::optional<WorkerAssignment> taken = workers_->WaitFor("127.0.0.1:2");
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(taken->layer_begin, planned.layer_begin);
  EXPECT_EQ(taken->layer_end, planned.layer_end);
  EXPECT_EQ(taken->replica, planned.replica);
  EXPECT_THAT(taken->assignment_id, HasSubstr(spare));
  ASSERT_TRUE(Heartbeat(spare, v1::WORKER_STATE_READY, taken->assignment_id, "", taken->kv_blocks).ok());
  client.join();
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids, expected);
  // The old worker comes back still holding its old stage (it was only stopped): it is in no
  // stage of the plan now, so it is told to drop it, and becomes the spare.
  const std::string back = Register("node-a", "127.0.0.1:1");
  ASSERT_TRUE(Heartbeat(back, v1::WORKER_STATE_READY, planned.assignment_id, "", planned.kv_blocks).ok());
  coordinator_->cluster().Tick();
  EXPECT_TRUE(workers_->WaitForRelease("127.0.0.1:1"));
  EXPECT_THAT(workers_->released(), ::testing::Not(::testing::Contains("127.0.0.1:2")));
  const GenerateResult after = Generate(IdsRequest(prompt, 20));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.ids, expected);
}

// ---- Drain (cluster.h "Drain") ------------------------------------------------------------------

TEST_F(CoordinatorApiTest, DrainingAWorkerMovesItsSequencesToTheOtherReplicaAndReleasesIt) {
  StartCoordinator(testing::Stories260KDir(), 2, {.replicas = 2});
  absl::Mutex mu;
  std::vector<EngineReplica*> made;
  EngineReplica* first = nullptr;  // the replica that stepped first: the one running the request
  absl::Notification stepping;
  factory_->OnMake([&](EngineReplica* r) {
    r->HoldStepsForTest();
    r->SetStepHookForTest([&, r](const StepInput&) {
      absl::MutexLock lock(&mu);
      if (first == nullptr) {
        first = r;
        stepping.Notify();
      }
      return absl::OkStatus();
    });
    absl::MutexLock lock(&mu);
    made.push_back(r);
  });
  const std::string w1 = Register("node-a", "127.0.0.1:1");
  const std::string w2 = Register("node-b", "127.0.0.1:2");
  for (const auto& [id, address] : {std::pair{w1, "127.0.0.1:1"}, std::pair{w2, "127.0.0.1:2"}}) {
    std::optional<WorkerAssignment> a = workers_->WaitFor(address);
    ASSERT_TRUE(a.has_value());
    ASSERT_TRUE(Heartbeat(id, v1::WORKER_STATE_READY, a->assignment_id, "", a->kv_blocks).ok());
  }
  ASSERT_TRUE(coordinator_->cluster().WaitUntilReady(kWait));
  const std::vector<int32_t> prompt = {7, 8, 9};
  const std::vector<int32_t> expected = Reference(prompt, 16);
  GenerateResult r;
  std::thread client([&] { r = Generate(IdsRequest(prompt, 16)); });
  ASSERT_TRUE(stepping.WaitForNotificationWithTimeout(kWait));
  int busy = -1;
  for (const ReplicaStats& rs : coordinator_->scheduler().Stats().replicas) busy = rs.running > 0 ? rs.replica : busy;
  ASSERT_GE(busy, 0);
  const bool first_is_busy = workers_->WaitFor("127.0.0.1:1")->replica == busy;
  const std::string drained = first_is_busy ? w1 : w2;
  const std::string drained_address = first_is_busy ? "127.0.0.1:1" : "127.0.0.1:2";
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  v1::DrainWorkerRequest req;
  req.set_worker_id(drained);
  req.set_timeout_ms(60000);
  v1::DrainWorkerResponse resp;
  const grpc::Status st = admin_->DrainWorker(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  coordinator_->cluster().Tick();  // the other replica serves: the busy one stops at once
  EXPECT_THAT(coordinator_->scheduler().Replicas(), ::testing::ElementsAre(1 - busy));
  {
    absl::MutexLock lock(&mu);
    for (EngineReplica* e : made) {
      if (e != first) e->ReleaseStepsForTest();  // `first` was removed with its replica
    }
  }
  client.join();
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids, expected);
  EXPECT_TRUE(workers_->WaitForRelease(drained_address));
  bool shown = false;
  const v1::ClusterStatus status = Status();
  for (const v1::WorkerStatus& w : status.workers()) shown |= w.worker_id() == drained && w.draining();
  EXPECT_TRUE(shown) << "the cluster status shows the drain";
  // Unknown workers and bad timeouts are refused, naming what is wrong.
  grpc::ClientContext ctx2;
  ctx2.set_deadline(Deadline());
  req.set_worker_id("w-nobody");
  EXPECT_EQ(admin_->DrainWorker(&ctx2, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx3;
  ctx3.set_deadline(Deadline());
  req.set_worker_id(drained);
  req.set_timeout_ms(-1);
  const grpc::Status bad = admin_->DrainWorker(&ctx3, req, &resp);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), HasSubstr("timeout_ms"));
}

TEST_F(CoordinatorApiTest, DrainingTheOnlyWorkerLetsItsSequencesFinishThenReleasesIt) {
  StartCoordinator(testing::Stories260KDir(), 1);
  absl::Notification stepping;
  HoldStepsAndNotifyOnFirst(&stepping);
  BringUpOneWorker();
  EngineReplica* replica = factory_->last();
  const std::string w1 = Status().workers(0).worker_id();
  const std::vector<int32_t> prompt = {3, 4};
  const std::vector<int32_t> expected = Reference(prompt, 16);
  GenerateResult r;
  std::thread client([&] { r = Generate(IdsRequest(prompt, 16)); });
  ASSERT_TRUE(stepping.WaitForNotificationWithTimeout(kWait));
  ASSERT_THAT(coordinator_->cluster().Drain(w1, absl::Seconds(60)), IsOk());
  coordinator_->cluster().Tick();
  // No other replica: it keeps serving its sequence (and takes no new one).
  EXPECT_THAT(coordinator_->scheduler().Replicas(), ::testing::ElementsAre(0));
  EXPECT_TRUE(coordinator_->scheduler().Stats().replicas[0].draining);
  EXPECT_TRUE(workers_->released().empty());
  replica->ReleaseStepsForTest();
  client.join();
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids, expected);
  EXPECT_TRUE(workers_->WaitForRelease("127.0.0.1:1"));
  EXPECT_THAT(coordinator_->scheduler().Replicas(), ::testing::IsEmpty());
}

TEST_F(CoordinatorApiTest, ShutdownFailsOutstandingRequestsWithUnavailable) {
  StartCoordinator(testing::Stories260KDir(), 1);
  absl::Notification stepping;
  HoldStepsAndNotifyOnFirst(&stepping);
  BringUpOneWorker();
  GenerateResult r;
  std::thread client([&] { r = Generate(IdsRequest({1, 2}, 30)); });
  ASSERT_TRUE(stepping.WaitForNotificationWithTimeout(kWait));
  coordinator_->Shutdown(absl::Seconds(5));
  client.join();
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(r.status.error_message(), HasSubstr("shutting down"));
}

TEST_F(CoordinatorApiTest, ServerReflectionListsTheServices) {
  StartCoordinator(testing::Stories260KDir(), 1);
  // grpc.reflection.v1alpha.ServerReflection in raw bytes: list_services (field 7) = "".
  grpc::GenericStub stub(channel_);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto await = [&cq](intptr_t want) {
    void* tag = nullptr;
    bool ok = false;
    const auto got = cq.AsyncNext(&tag, &ok, Deadline());
    return got == grpc::CompletionQueue::GOT_EVENT && tag == reinterpret_cast<void*>(want) && ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(await(1));
  grpc::Slice request(std::string("\x3a\x00", 2));
  call->Write(grpc::ByteBuffer(&request, 1), reinterpret_cast<void*>(2));
  ASSERT_TRUE(await(2));
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(3));
  ASSERT_TRUE(await(3));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  for (const char* service : {"shardserve.v1.Inference", "shardserve.v1.Admin", "grpc.health.v1.Health"}) {
    EXPECT_THAT(bytes, HasSubstr(service));
  }
  // Registry is served on the control port only.
  EXPECT_THAT(bytes, ::testing::Not(HasSubstr("shardserve.v1.Registry")));
  call->WritesDone(reinterpret_cast<void*>(4));
  ASSERT_TRUE(await(4));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  ASSERT_TRUE(await(5));
  EXPECT_TRUE(status.ok()) << status.error_message();
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
}

// ---- Resume (GenerateRequest.resume) ----------------------------------------------------------

class ResumeTest : public CoordinatorApiTest {
 protected:
  // The coordinator with one worker whose steps take 3 ms each, so that the stream writes keep up
  // and most messages carry one token (each message boundary is a place to cut the stream).
  void StartWithSlowSteps(CoordinatorOptions options = {}) {
    StartCoordinator(testing::Stories260KDir(), 1, options);
    factory_->OnMake([](EngineReplica* r) {
      r->SetStepHookForTest([](const StepInput&) {
        absl::SleepFor(absl::Milliseconds(3));
        return absl::OkStatus();
      });
    });
    BringUpOneWorker();
  }

  static std::vector<v1::TokenLogprobs> Logprobs(const GenerateResult& r) {
    std::vector<v1::TokenLogprobs> out;
    for (const auto& m : r.messages) out.insert(out.end(), m.logprobs().begin(), m.logprobs().end());
    return out;
  }

  static v1::GenerateRequest Resumed(v1::GenerateRequest req, const std::vector<int32_t>& have) {
    req.mutable_resume()->mutable_token_ids()->Add(have.begin(), have.end());
    return req;
  }

  // The uninterrupted answer of `req`. Then, as if the stream broke after one of its messages (at
  // most 12 cuts, spread over them), `req` resumed with the tokens received by then must send
  // exactly the rest: the same tokens, text, logprobs, finish_reason and usage.
  GenerateResult ExpectResumesMatchUninterrupted(const v1::GenerateRequest& req) {
    const GenerateResult full = Generate(req);
    EXPECT_TRUE(full.status.ok()) << full.status.error_message();
    if (!full.status.ok()) return full;
    const std::vector<v1::TokenLogprobs> full_lps = Logprobs(full);
    const v1::GenerateResponse& last = full.messages.back();
    const size_t stride = std::max<size_t>(1, (full.messages.size() - 1) / 12);
    std::vector<int32_t> have;
    std::string text;
    int cuts = 0;
    for (size_t m = 0; m + 1 < full.messages.size(); ++m) {
      have.insert(have.end(), full.messages[m].token_ids().begin(), full.messages[m].token_ids().end());
      text += full.messages[m].text();
      if (have.empty() || m % stride != 0) continue;
      ++cuts;
      SCOPED_TRACE(absl::StrCat("resumed after ", have.size(), " tokens"));
      v1::GenerateRequest again = Resumed(req, have);
      again.set_request_id(full.messages[0].request_id());
      const GenerateResult r = Generate(again);
      EXPECT_TRUE(r.status.ok()) << r.status.error_message();
      if (!r.status.ok() || r.messages.empty()) continue;
      std::vector<int32_t> joined = have;
      joined.insert(joined.end(), r.ids.begin(), r.ids.end());
      EXPECT_EQ(joined, full.ids);
      EXPECT_EQ(text + r.text, full.text);
      const std::vector<v1::TokenLogprobs> lps = Logprobs(r);
      EXPECT_EQ(lps.size(), req.logprobs() ? r.ids.size() : 0u);
      for (size_t i = 0; i < lps.size() && have.size() + i < full_lps.size(); ++i) {
        EXPECT_NEAR(lps[i].logprob(), full_lps[have.size() + i].logprob(), 1e-5f) << "token " << have.size() + i;
        EXPECT_EQ(std::vector<int32_t>(lps[i].top_ids().begin(), lps[i].top_ids().end()),
                  std::vector<int32_t>(full_lps[have.size() + i].top_ids().begin(),
                                       full_lps[have.size() + i].top_ids().end()));
      }
      EXPECT_EQ(r.messages.back().finish_reason(), last.finish_reason());
      EXPECT_EQ(r.messages.back().usage().prompt_tokens(), last.usage().prompt_tokens());
      EXPECT_EQ(r.messages.back().usage().completion_tokens(), last.usage().completion_tokens());
      for (const auto& msg : r.messages) {
        EXPECT_EQ(msg.request_id(), full.messages[0].request_id());
        EXPECT_EQ(msg.prompt_logprobs_size(), 0);
      }
    }
    EXPECT_GE(cuts, 3) << "too few messages to cut: " << full.messages.size();
    return full;
  }
};

TEST_F(ResumeTest, GreedyTextResumesWithTheRestOfTheTokensAndText) {
  StartWithSlowSteps({.max_step_tokens = 4});
  v1::GenerateRequest req;
  req.set_text("Once upon a time, there was a");
  req.set_max_tokens(40);
  const GenerateResult full = ExpectResumesMatchUninterrupted(req);
  ASSERT_GT(full.ids.size(), 10u);
}

TEST_F(ResumeTest, SeededSamplingWithLogprobsResumesExactly) {
  StartWithSlowSteps();
  v1::GenerateRequest req;
  req.set_text("Lily and Tom went to the park");
  req.set_max_tokens(48);
  req.mutable_sampling()->set_temperature(0.9f);
  req.mutable_sampling()->set_top_k(40);
  req.mutable_sampling()->set_seed(7);
  req.set_logprobs(true);
  req.set_top_logprobs(3);
  ExpectResumesMatchUninterrupted(req);
  // Seed 0 (unset) is a seed like any other: the resumed stream is the same.
  req.mutable_sampling()->set_seed(0);
  ExpectResumesMatchUninterrupted(req);
}

TEST_F(ResumeTest, PenaltiesAndMinTokensCountTheResumedTokens) {
  StartWithSlowSteps();
  v1::GenerateRequest req;
  req.set_text("Once upon a time");
  req.set_max_tokens(40);
  req.set_min_tokens(30);
  req.mutable_sampling()->set_temperature(0.8f);
  req.mutable_sampling()->set_seed(3);
  req.mutable_sampling()->set_presence_penalty(0.5f);
  req.mutable_sampling()->set_frequency_penalty(0.5f);
  req.mutable_sampling()->set_repetition_penalty(1.3f);
  const GenerateResult full = ExpectResumesMatchUninterrupted(req);
  EXPECT_GE(full.ids.size(), 30u);
}

TEST_F(ResumeTest, StopStringsAndAnAlreadyEndedResume) {
  StartWithSlowSteps();
  v1::GenerateRequest req;
  req.set_text("Once upon a time");
  req.set_max_tokens(40);
  req.set_ignore_eos(true);
  const GenerateResult plain = Generate(req);
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  ASSERT_GT(plain.text.size(), 30u);
  // A stop string spanning tokens, late in the text: the text held back around it must come out
  // once, on the right side of the cut.
  v1::GenerateRequest stopped = req;
  stopped.add_stop(plain.text.substr(plain.text.size() * 2 / 3, 4));
  const GenerateResult full = ExpectResumesMatchUninterrupted(stopped);
  ASSERT_EQ(full.messages.back().finish_reason(), v1::FINISH_REASON_STOP);
  ASSERT_EQ(plain.messages.back().finish_reason(), v1::FINISH_REASON_LENGTH);

  // Every token of an ended answer (by length, by a stop string): the final message at once, the
  // same twice (idempotent).
  for (const auto& [request, done] : {std::pair(req, &plain), std::pair(stopped, &full)}) {
    v1::GenerateRequest again = Resumed(request, done->ids);
    again.set_request_id("resumed-twice");
    const GenerateResult first = Generate(again);
    const GenerateResult second = Generate(again);
    ASSERT_TRUE(first.status.ok()) << first.status.error_message();
    ASSERT_EQ(first.messages.size(), 1u);
    EXPECT_TRUE(first.ids.empty());
    EXPECT_EQ(first.messages[0].finish_reason(), done->messages.back().finish_reason());
    EXPECT_EQ(first.messages[0].usage().completion_tokens(), static_cast<int32_t>(done->ids.size()));
    EXPECT_EQ(first.messages[0].usage().prompt_tokens(), done->messages.back().usage().prompt_tokens());
    ASSERT_TRUE(second.status.ok());
    ASSERT_EQ(second.messages.size(), 1u);
    EXPECT_EQ(second.messages[0].SerializeAsString(), first.messages[0].SerializeAsString());
  }
}

TEST_F(ResumeTest, JsonConstraintResumesInTheConstraintsState) {
  StartWithSlowSteps();
  v1::GenerateRequest req;
  req.set_text("Once upon a time");
  req.set_max_tokens(300);
  req.mutable_sampling()->set_temperature(1.0f);
  req.mutable_sampling()->set_seed(11);
  req.set_json_schema(
      R"({"type":"object","properties":{"color":{"enum":["red","green"]},"n":{"type":"integer"}},"required":["color","n"]})");
  const GenerateResult full = ExpectResumesMatchUninterrupted(req);
  ASSERT_EQ(full.messages.back().finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_THAT(full.text, ::testing::MatchesRegex(R"re(\{"color":"(red|green)","n":-?[0-9]+\})re")) << full.text;
  // The whole answer (its last token completes the constraint): STOP at once.
  const GenerateResult done = Generate(Resumed(req, full.ids));
  ASSERT_TRUE(done.status.ok()) << done.status.error_message();
  ASSERT_EQ(done.messages.size(), 1u);
  EXPECT_EQ(done.messages[0].finish_reason(), v1::FINISH_REASON_STOP);
  // A token the constraint does not allow where it comes.
  ASSERT_OK_AND_ASSIGN(auto tokenizer, LoadTokenizer(testing::Stories260KDir()));
  ASSERT_OK_AND_ASSIGN(std::vector<int32_t> word, tokenizer->Encode("Once", false));
  const GenerateResult bad = Generate(Resumed(req, {word[0]}));
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.status.error_message(), HasSubstr("resume.token_ids[0] = "));
  EXPECT_THAT(bad.status.error_message(), HasSubstr("not allowed there by the output constraint"));
}

// Characters of two bytes, written with byte tokens (the regex forces them): a cut between the
// two bytes of one character must neither repeat nor lose it.
TEST_F(ResumeTest, AUtf8CharacterSplitAcrossTokensComesOutOnce) {
  StartWithSlowSteps();
  v1::GenerateRequest req;
  req.set_text("Once upon a time");
  req.set_max_tokens(40);
  req.mutable_sampling()->set_temperature(1.0f);
  req.mutable_sampling()->set_seed(5);
  req.set_regex("(é|ü|ß){6}");
  const GenerateResult full = ExpectResumesMatchUninterrupted(req);
  ASSERT_EQ(full.messages.back().finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_THAT(full.text, ::testing::MatchesRegex("(é|ü|ß)+")) << full.text;
  // Some message carried the first byte of a character and no text: a cut there splits it.
  EXPECT_TRUE(std::any_of(full.messages.begin(), full.messages.end(),
                          [](const v1::GenerateResponse& m) { return m.token_ids_size() > 0 && m.text().empty(); }));
}

TEST_F(ResumeTest, InvalidResumesNameTheField) {
  StartCoordinator(testing::Stories260KDir(), 1);  // vocab 512
  BringUpOneWorker();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(testing::Stories260KDir()));
  ASSERT_FALSE(spec.eos_token_ids.empty());
  const int32_t eos = static_cast<int32_t>(spec.eos_token_ids[0]);
  auto expect_invalid = [&](const v1::GenerateRequest& req, const std::string& what) {
    const GenerateResult r = Generate(req);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << what;
    EXPECT_THAT(r.status.error_message(), HasSubstr(what));
    EXPECT_TRUE(r.messages.empty());
  };
  expect_invalid(Resumed(IdsRequest({1, 2}, 5), {3, 512}), "resume.token_ids[1] = 512 is outside the vocabulary");
  expect_invalid(Resumed(IdsRequest({1, 2}, 2), {3, 4, 5}), "resume.token_ids has 3 tokens, more than max_tokens = 2");
  expect_invalid(Resumed(IdsRequest({1, 2}, 5), {3, eos, 4}), "ends the request, yet more tokens follow it");
  v1::GenerateRequest stop_id = Resumed(IdsRequest({1, 2}, 5), {3, 9, 4});
  stop_id.add_stop_token_ids(9);
  expect_invalid(stop_id, "resume.token_ids[1] = 9 ends the request");
  v1::GenerateRequest two = Resumed(IdsRequest({1, 2}, 5), {3});
  two.set_n(2);
  expect_invalid(two, "only a request with n = 1 can be resumed");
  // With ignore_eos an EOS id is an ordinary token, and an empty resume is a plain request.
  v1::GenerateRequest ignore = Resumed(IdsRequest({1, 2}, 5), {3, eos, 4});
  ignore.set_ignore_eos(true);
  const GenerateResult ok = Generate(ignore);
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.ids.size(), 2u);
  EXPECT_EQ(ok.messages.back().usage().completion_tokens(), 5);
  v1::GenerateRequest empty = IdsRequest({1, 2}, 3);
  empty.mutable_resume();
  EXPECT_EQ(Generate(empty).ids, Generate(IdsRequest({1, 2}, 3)).ids);
}

// A policy the model cannot take is refused when the coordinator starts, before any worker
// registers (it would otherwise fail every planning attempt).
TEST(CoordinatorStartTest, AnFp8KvCacheIsRefusedAtStartForMultiHeadLatentAttention) {
  CoordinatorOptions options;
  options.listen = "127.0.0.1:0";
  options.model_path = "tests/golden/models/deepseek_v2_lite";
  options.kv_cache = KvCacheFormat::kFp8E4M3;
  EXPECT_THAT(Coordinator::Start(options, {}),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--kv_cache_dtype=fp8_e4m3")));
  // The same model with the default cache starts.
  options.kv_cache = KvCacheFormat::kAuto;
  absl::StatusOr<std::unique_ptr<Coordinator>> c = Coordinator::Start(options, {});
  ASSERT_THAT(c.status(), IsOk());
  (*c)->Shutdown(absl::Seconds(5));
}

// A wire dtype other than F32 or BF16 (from a caller of the library; the flag's parser admits only
// those) is refused when the coordinator starts, naming the option.
TEST(CoordinatorStartTest, AHiddenWireDtypeOtherThanF32OrBf16IsRefused) {
  CoordinatorOptions options;
  options.listen = "127.0.0.1:0";
  options.model_path = testing::Stories260KDir();
  options.hidden_wire_dtype = DType::kF16;
  EXPECT_THAT(Coordinator::Start(options, {}),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("--hidden_wire_dtype must be f32 or bf16, got F16")));
}

}  // namespace
}  // namespace shardserve::coordinator
