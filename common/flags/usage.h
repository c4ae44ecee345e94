// The usage text of the project's programs: `--help` lists the flags the project defines (the
// program's own and those of the libraries it links from this repository), not Abseil's.
#ifndef SHARDSERVE_COMMON_FLAGS_USAGE_H_
#define SHARDSERVE_COMMON_FLAGS_USAGE_H_

#include "absl/strings/string_view.h"

namespace shardserve {

// absl::SetProgramUsageMessage(message), and --help / --helpshort showing every flag defined
// outside Abseil's own sources (Abseil's default matches only files named after the binary, and
// shardserve-run's flags live in shardserve_run_main.cc). Call once, before ParseCommandLine.
void SetProgramUsage(absl::string_view message);

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_FLAGS_USAGE_H_
