// Conversions between the coordinator's plain structs and shardserve.v1 messages, for the calls the
// coordinator makes (Worker.Assign, Stage.StepStream) and the registrations and status it serves.
// Pure and thread-safe.
#ifndef SHARDSERVE_COORDINATOR_CLIENT_PROTO_CONVERT_H_
#define SHARDSERVE_COORDINATOR_CLIENT_PROTO_CONVERT_H_

#include "absl/status/statusor.h"
#include "common/plan/plan.h"
#include "coordinator/client/worker_client.h"
#include "coordinator/scheduler/replica_client.h"
#include "shardserve/v1/common.pb.h"
#include "shardserve/v1/control.pb.h"
#include "shardserve/v1/stage.pb.h"

namespace shardserve::coordinator {

v1::DeviceKind ToProto(DeviceKind kind);
// InvalidArgument for DEVICE_KIND_UNSPECIFIED or an unknown value.
absl::StatusOr<DeviceKind> FromProto(v1::DeviceKind kind);

void ToProto(const Device& device, v1::Device* out);
// InvalidArgument (naming the kind) as above; bytes are checked by the registry.
absl::StatusOr<Device> FromProto(const v1::Device& device);

void ToProto(const WorkerAssignment& assignment, v1::Assignment* out);
// InvalidArgument naming the field: an unknown role, device kind or quantization, or expert
// placements whose ranks and addresses differ in length. The rest is checked where it is used.
absl::StatusOr<WorkerAssignment> FromProto(const v1::Assignment& assignment);

// A StepRequest for the first stage: token ids, no hidden states; each sequence's key is its
// sequence_id (the stream codes it as deltas, common/rpc/stage_stream_client.h).
void ToProto(const StepInput& input, v1::StepRequest* out);

// The sampled tokens, or the failure the stages reported (error_code / error_message as an
// absl::Status with the same code; Unknown when error_code is not a valid code).
absl::StatusOr<StepOutput> FromProto(const v1::StepResponse& response);

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_CLIENT_PROTO_CONVERT_H_
