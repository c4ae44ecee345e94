#include "worker/engine/step_runner.h"

#include "absl/strings/cord.h"

namespace shardserve::engine {
namespace {

constexpr char kGroupIntactPayload[] = "shardserve.dev/engine/group-intact";

}  // namespace

absl::Status MarkGroupIntact(absl::Status status) {
  if (!status.ok()) status.SetPayload(kGroupIntactPayload, absl::Cord("1"));
  return status;
}

bool IsGroupIntact(const absl::Status& status) {
  return status.code() == absl::StatusCode::kInvalidArgument || status.GetPayload(kGroupIntactPayload).has_value();
}

}  // namespace shardserve::engine
