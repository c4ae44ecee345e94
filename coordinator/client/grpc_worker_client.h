// GrpcWorkerClient: WorkerClient over gRPC (Worker.Assign), one cached channel per worker address.
#ifndef SHARDSERVE_COORDINATOR_CLIENT_GRPC_WORKER_CLIENT_H_
#define SHARDSERVE_COORDINATOR_CLIENT_GRPC_WORKER_CLIENT_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/client/worker_client.h"

namespace grpc {
class Channel;
class ChannelCredentials;
}  // namespace grpc

namespace shardserve::coordinator {

class GrpcWorkerClient final : public WorkerClient {
 public:
  struct Options {
    absl::Duration timeout = absl::Seconds(10);  // deadline of each Assign and Release call, > 0
    // Credentials of the channels to the workers (mutual TLS expecting the worker role when the
    // cluster runs TLS); null = plaintext.
    std::shared_ptr<grpc::ChannelCredentials> credentials;
  };
  explicit GrpcWorkerClient(const Options& options);
  ~GrpcWorkerClient() override;

  // See WorkerClient. Thread-safe.
  absl::Status Assign(const std::string& address, const WorkerAssignment& assignment) override;
  absl::Status Release(const std::string& address, const std::string& reason) override;

 private:
  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address);

  const Options options_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_CLIENT_GRPC_WORKER_CLIENT_H_
