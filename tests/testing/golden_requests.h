// Generation requests for the golden cases of tests/golden: one greedy request per case, of the
// reference's length. Shared by the engine tests that check greedy tokens on every backend.
#ifndef SHARDSERVE_TESTS_TESTING_GOLDEN_REQUESTS_H_
#define SHARDSERVE_TESTS_TESTING_GOLDEN_REQUESTS_H_

#include <vector>

#include "tests/testing/golden.h"
#include "worker/engine/generator.h"

namespace shardserve::testing {

inline std::vector<engine::GenerationRequest> GreedyRequests(const GoldenModel& g) {
  std::vector<engine::GenerationRequest> reqs;
  for (const GoldenCase& c : g.cases) {
    engine::GenerationRequest r;
    r.prompt = c.prompt_ids;
    r.max_tokens = static_cast<int32_t>(c.greedy_ids.size());
    reqs.push_back(r);
  }
  return reqs;
}

}  // namespace shardserve::testing

#endif  // SHARDSERVE_TESTS_TESTING_GOLDEN_REQUESTS_H_
