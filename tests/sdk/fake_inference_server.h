// An in-process Inference + Admin server on 127.0.0.1 (port 0) whose answers a test scripts: how
// many calls fail with UNAVAILABLE first, which messages Generate streams, how it ends, and whether
// it then holds the stream open until the client goes away. It records how many calls arrived and
// the last "authorization" header. Thread-safe; uses the gRPC callback API.
#ifndef SHARDSERVE_TESTS_SDK_FAKE_INFERENCE_SERVER_H_
#define SHARDSERVE_TESTS_SDK_FAKE_INFERENCE_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "shardserve/v1/control.grpc.pb.h"
#include "shardserve/v1/inference.grpc.pb.h"

namespace shardserve::testing {

struct FakeScript {
  int unavailable_first = 0;  // the first N calls of any method fail with UNAVAILABLE
  std::vector<v1::GenerateResponse> responses;  // what Generate streams
  grpc::Status end = grpc::Status::OK;          // how Generate ends after the responses
  bool hold = false;                            // after the responses, wait for the client to cancel
  // Broken streams, for resume: Generate call i (counting only calls that get past
  // unavailable_first) with i < cuts.size() ends with UNAVAILABLE after cuts[i] responses. Every
  // call starts after the responses whose tokens its resume.token_ids hold (they must be a prefix
  // of the scripted tokens ending at a response boundary: INVALID_ARGUMENT otherwise).
  std::vector<int> cuts;
};

class FakeInferenceServer final {
 public:
  // Starts on 127.0.0.1:0 with `credentials` (insecure when null).
  explicit FakeInferenceServer(FakeScript script, std::shared_ptr<grpc::ServerCredentials> credentials = nullptr);
  ~FakeInferenceServer();

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int calls() const { return calls_.load(); }
  std::string last_authorization() const;
  v1::GenerateRequest last_generate_request() const;  // what the last Generate call asked
  // Records a Generate request; returns its index among the recorded ones.
  int RecordGenerateRequest(const v1::GenerateRequest& request);
  std::vector<v1::GenerateRequest> generate_requests() const;  // every recorded one, in order
  // Waits until `n` Generate calls have seen the client cancel (or go away); false on timeout.
  bool AwaitCancelledGenerates(int n, absl::Duration timeout) const;
  void CountCancelledGenerate();  // for the Generate reactor

  // Counts a call and records its metadata; true when the script makes it fail with UNAVAILABLE.
  bool Arrive(grpc::CallbackServerContext* ctx);
  const FakeScript& script() const { return script_; }

 private:
  const FakeScript script_;
  std::unique_ptr<grpc::Service> inference_;  // Generate: the script; Tokenize: one id per byte
  std::unique_ptr<grpc::Service> admin_;      // GetClusterStatus: one fixed worker
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::atomic<int> calls_{0};
  mutable absl::Mutex mu_;
  std::string last_authorization_ ABSL_GUARDED_BY(mu_);
  int cancelled_generates_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<v1::GenerateRequest> generate_requests_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_SDK_FAKE_INFERENCE_SERVER_H_
