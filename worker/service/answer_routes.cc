#include "worker/service/answer_routes.h"

#include "absl/strings/str_cat.h"

namespace shardserve::service {

absl::Status AnswerRoutes::Add(const std::string& route, Sink* sink) {
  if (route.empty() || route.size() > kMaxRouteBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("route must be 1 to ", kMaxRouteBytes, " bytes, got ", route.size()));
  }
  MutexLock lock(&mu_);
  if (!sinks_.try_emplace(route, sink).second) {
    return absl::AlreadyExistsError(absl::StrCat("a return stream with route \"", route, "\" is already open"));
  }
  return absl::OkStatus();
}

void AnswerRoutes::Remove(const std::string& route, Sink* sink) {
  MutexLock lock(&mu_);
  auto it = sinks_.find(route);
  if (it != sinks_.end() && it->second == sink) sinks_.erase(it);
}

bool AnswerRoutes::Send(const std::string& route, v1::StepResponse& response) {
  MutexLock lock(&mu_);
  auto it = sinks_.find(route);
  return it != sinks_.end() && it->second->Push(response);
}

bool AnswerRoutes::HasRouteForTest(const std::string& route) {
  MutexLock lock(&mu_);
  return sinks_.contains(route);
}

}  // namespace shardserve::service
