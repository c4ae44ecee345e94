// Parsing of command-line values shared by the project's programs (shardserve-run, shardserve).
// Every function returns InvalidArgument naming the offending part; none crashes on bad input.
#ifndef SHARDSERVE_COMMON_FLAGS_PARSE_H_
#define SHARDSERVE_COMMON_FLAGS_PARSE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve {

// "1, 2,3" -> {1, 2, 3}: comma-separated non-negative 32-bit integers. `flag` names the flag in
// messages (e.g. "--prompt_ids").
absl::StatusOr<std::vector<int32_t>> ParseTokenIdList(absl::string_view text, absl::string_view flag);

// "512MiB", "8GiB", "80GB", "1.5TiB", "1000" (bytes).
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_FLAGS_PARSE_H_
