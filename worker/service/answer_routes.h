// AnswerRoutes: the coordinator's return streams open on this worker (Stage.AnswerStream,
// proto/shardserve/v1/stage.proto), by route id, so that the last stage can write a micro-batch's
// answer straight to the coordinator instead of relaying it up the pipeline.
//
// Each open return stream registers a Sink under its route for as long as it can take answers;
// the last stage's runtime calls Send() with the request's answer_route. Send() reports whether a
// sink took the answer, so that an answer with no stream to take it (not opened yet, or gone) goes
// up the StepStreams instead and is never lost.
//
// Thread-safety: every method may be called from any thread. Sink::Push runs under the routes'
// lock, so after Remove() returns no Push to that sink runs or will run (a sink may then be freed).
#ifndef SHARDSERVE_WORKER_SERVICE_ANSWER_ROUTES_H_
#define SHARDSERVE_WORKER_SERVICE_ANSWER_ROUTES_H_

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/concurrency/mutex.h"
#include "shardserve/v1/stage.pb.h"

namespace shardserve::service {

class AnswerRoutes {
 public:
  // One return stream's writer.
  class Sink {
   public:
    virtual ~Sink() = default;
    // Queues `response` for writing and moves it out; false (and `response` untouched) when the
    // stream is finishing. Must not block and must not call back into AnswerRoutes.
    virtual bool Push(v1::StepResponse& response) = 0;
  };

  // Longest route id accepted (AnswerStreamRequest.route).
  static constexpr size_t kMaxRouteBytes = 128;

  // Registers `sink` (not owned; it must stay valid until Remove) under `route`. InvalidArgument
  // for an empty route or one over kMaxRouteBytes; AlreadyExists when the route is open.
  absl::Status Add(const std::string& route, Sink* sink);
  // Unregisters `sink` from `route` (nothing when another sink holds the route).
  void Remove(const std::string& route, Sink* sink);
  // Hands `response` to the sink of `route`: true when one took it (and `response` was moved out);
  // false when there is none or it is finishing (`response` is untouched).
  bool Send(const std::string& route, v1::StepResponse& response);
  // Whether a return stream is open under `route` (tests wait for a stream's registration).
  bool HasRouteForTest(const std::string& route);

 private:
  Mutex mu_;
  absl::flat_hash_map<std::string, Sink*> sinks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::service

#endif  // SHARDSERVE_WORKER_SERVICE_ANSWER_ROUTES_H_
