// Parsing helpers of the `shardserve` CLI, separate from main so tests cover them.
#ifndef SHARDSERVE_SDK_CLI_CLI_PARSE_H_
#define SHARDSERVE_SDK_CLI_CLI_PARSE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/plan/plan.h"

namespace shardserve::cli {

// "512MiB", "8GiB", "80GB", "1.5TiB", "1000" (bytes). InvalidArgument naming the text.
absl::StatusOr<int64_t> ParseBytes(absl::string_view text);

// A hypothetical inventory for `shardserve plan`: comma-separated NAME=KIND:COUNTxSIZE entries,
// e.g. "node-a=cuda:8x80GiB,node-b=cpu:2x16GiB". Each entry is one worker with COUNT devices of
// SIZE bytes each (all free).
absl::StatusOr<std::vector<WorkerInventory>> ParseWorkers(absl::string_view text);

// "1,2,3" -> ids (non-negative 32-bit). InvalidArgument naming the bad element.
absl::StatusOr<std::vector<int32_t>> ParseIds(absl::string_view text);

}  // namespace shardserve::cli

#endif  // SHARDSERVE_SDK_CLI_CLI_PARSE_H_
