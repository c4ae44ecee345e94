// ScriptReplica: a ReplicaClient for front-end tests that plays a model writing a given text: every
// sequence samples script[sample_index % script.size()], whatever its prompt, so an answer is the
// script's tokens in order (a resume continues where it was cut) and then the script again. With
// a `step_time`, each step takes at least that long, so that a front end's writes keep up with the
// tokens (a test of streaming in pieces), however busy the machine.
// Header-only: a test that includes it links the coordinator's scheduler library already.
#ifndef SHARDSERVE_TESTS_TESTING_SCRIPT_REPLICA_H_
#define SHARDSERVE_TESTS_TESTING_SCRIPT_REPLICA_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coordinator/scheduler/replica_client.h"

namespace shardserve::testing {

class ScriptReplica final : public coordinator::ReplicaClient {
 public:
  explicit ScriptReplica(std::vector<int32_t> script, absl::Duration step_time = absl::ZeroDuration())
      : script_(std::move(script)), step_time_(step_time) {}

  absl::StatusOr<coordinator::StepOutput> Step(const coordinator::StepInput& input) override {
    if (step_time_ > absl::ZeroDuration()) absl::SleepFor(step_time_);
    coordinator::StepOutput out;
    for (const coordinator::StepSequenceInput& s : input.sequences) {
      if (s.sample) out.token_ids.push_back(script_[s.sample_index % script_.size()]);
    }
    return out;
  }
  void Shutdown() override {}

 private:
  const std::vector<int32_t> script_;  // not empty
  const absl::Duration step_time_;
};

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_SCRIPT_REPLICA_H_
