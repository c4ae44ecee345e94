#include "common/rpc/internal/call_end.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardserve::rpc::internal {

void DescribeEnd(const grpc::Status& status, std::string* problem) {
  if (problem->empty()) *problem = status.ok() ? "closed the stream" : "ended the stream";
  if (!status.ok()) {
    absl::StrAppend(problem, ": ", absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())), ": ",
                    status.error_message());
  }
}

bool WaitUntilDone(Mutex* mu, CondVar* cv, const bool* done, absl::Duration timeout) {
  const bool forever = timeout == absl::InfiniteDuration();
  const absl::Time deadline = forever ? absl::InfiniteFuture() : absl::Now() + timeout;
  while (!*done) {
    if (forever) {
      cv->Wait(mu);
    } else if (cv->WaitWithDeadline(mu, deadline) && !*done) {
      return false;
    }
  }
  return true;
}

}  // namespace shardserve::rpc::internal
