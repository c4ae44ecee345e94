// shardserve C++ client: the public Inference and Admin APIs of a shardserve cluster.
//
//   ASSIGN_OR_RETURN(auto client, shardserve::Client::Connect("127.0.0.1:7000", {}));
//   shardserve::GenerateOptions g{.max_tokens = 32};
//   absl::Status st = client->Generate(shardserve::Prompt::Text("Once upon a time"), g,
//                                      [](const shardserve::GenerateDelta& d) { std::cout << d.text; return true; });
//
// Every call has a deadline (ClientOptions::timeout). Errors are absl::Status values carrying the
// server's code and message. Thread-safety: a Client may be shared by threads; each call is
// independent.
#ifndef SHARDSERVE_SDK_CPP_INCLUDE_SHARDSERVE_CLIENT_H_
#define SHARDSERVE_SDK_CPP_INCLUDE_SHARDSERVE_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardserve {

struct ClientOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};  // per call, including streaming
};

struct Prompt {
  std::string text;
  std::vector<int32_t> ids;
  bool is_ids = false;
  static Prompt Text(std::string t) { return Prompt{.text = std::move(t)}; }
  static Prompt Ids(std::vector<int32_t> i) { return Prompt{.ids = std::move(i), .is_ids = true}; }
};

struct GenerateOptions {
  int32_t max_tokens = 64;
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
};

// A piece of the streamed answer. The last one has `finished` set with the reason and usage.
struct GenerateDelta {
  std::vector<int32_t> token_ids;
  std::string text;
  bool finished = false;
  std::string finish_reason;  // "length", "stop" or "cancelled" when finished
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
};

struct WorkerInfo {
  std::string worker_id, node_name, address, state, error, devices, assignment;
  std::string metrics_address;  // HOST:PORT of its /metrics endpoint; empty when it serves none
};

struct ClusterInfo {
  bool ready = false;
  std::string reason;
  std::string model_path;
  std::vector<WorkerInfo> workers;
  std::string plan;
  int64_t running_sequences = 0;
  int64_t waiting_sequences = 0;
};

class Client {
 public:
  // Creates a channel to `address` (HOST:PORT). Does not wait for the server.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& address, ClientOptions options);
  virtual ~Client() = default;

  // Streams the answer to `on_delta`; returning false from it cancels the request. Returns the
  // RPC's final status (OK after the last delta).
  virtual absl::Status Generate(const Prompt& prompt, const GenerateOptions& options,
                                const std::function<bool(const GenerateDelta&)>& on_delta) = 0;
  virtual absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text, bool add_special_tokens) = 0;
  virtual absl::StatusOr<ClusterInfo> ClusterStatus() = 0;
};

}  // namespace shardserve

#endif  // SHARDSERVE_SDK_CPP_INCLUDE_SHARDSERVE_CLIENT_H_
