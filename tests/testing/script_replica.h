// ScriptReplica: a ReplicaClient for front-end tests that plays a model writing a given text: every
// sequence samples script[sample_index % script.size()], whatever its prompt, so an answer is the
// script's tokens in order (a resume continues where it was cut) and then the script again.
// Header-only: a test that includes it links the coordinator's scheduler library already.
#ifndef SHARDSERVE_TESTS_TESTING_SCRIPT_REPLICA_H_
#define SHARDSERVE_TESTS_TESTING_SCRIPT_REPLICA_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/scheduler/replica_client.h"

namespace shardserve::testing {

class ScriptReplica final : public coordinator::ReplicaClient {
 public:
  explicit ScriptReplica(std::vector<int32_t> script) : script_(std::move(script)) {}

  absl::StatusOr<coordinator::StepOutput> Step(const coordinator::StepInput& input) override {
    coordinator::StepOutput out;
    for (const coordinator::StepSequenceInput& s : input.sequences) {
      if (s.sample) out.token_ids.push_back(script_[s.sample_index % script_.size()]);
    }
    return out;
  }
  void Shutdown() override {}

 private:
  const std::vector<int32_t> script_;  // not empty
};

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_SCRIPT_REPLICA_H_
