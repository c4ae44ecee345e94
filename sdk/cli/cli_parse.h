// Parsing of `shardserve plan --workers` and of generate's text lists, separate from main so tests
// cover them. Token ids and byte sizes are parsed by common/flags.
#ifndef SHARDSERVE_SDK_CLI_CLI_PARSE_H_
#define SHARDSERVE_SDK_CLI_CLI_PARSE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/plan/plan.h"

namespace shardserve::cli {

// A hypothetical inventory for `shardserve plan` and `shardserve simulate`: comma-separated
// NAME=KIND:COUNTxSIZE entries, e.g. "node-a=cuda:8x80GiB,node-b=cpu:2x16GiB". Each entry is one
// worker with COUNT devices of SIZE bytes each (all free). NAME*N=... stands for N such workers
// named NAME-0 .. NAME-(N-1) (N in [1, 100000]), e.g. "h100*16=cuda:8x80GiB".
absl::StatusOr<std::vector<WorkerInventory>> ParseWorkers(absl::string_view text);

struct FaultSpec {
  std::string worker;
  double at_s = 0;
};

// `shardserve simulate --fail`: comma-separated WORKER@SECONDS entries (seconds >= 0).
absl::StatusOr<std::vector<FaultSpec>> ParseFaults(absl::string_view text);

// How a plain (not JSON) text list flag splits: `--stop` is one string, `--bad_words` a
// comma-separated list.
enum class PlainText { kOne, kCommaSeparated };

// A text list flag (generate's --stop and --bad_words): a JSON list of non-empty strings when the
// value starts with '[' (so that an entry may hold commas, or be a whole line: '["\n\n", "a, b"]'),
// else `plain`'s reading of it; empty = none. InvalidArgument naming `flag` for a '[' value that is
// not such a list.
absl::StatusOr<std::vector<std::string>> ParseTextList(absl::string_view value, absl::string_view flag,
                                                       PlainText plain);

}  // namespace shardserve::cli

#endif  // SHARDSERVE_SDK_CLI_CLI_PARSE_H_
