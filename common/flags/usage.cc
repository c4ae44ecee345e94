#include "common/flags/usage.h"

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"

namespace shardserve {
namespace {

bool OurFlag(absl::string_view file) { return !absl::StrContains(file, "absl/"); }

}  // namespace

void SetProgramUsage(absl::string_view message) {
  absl::SetProgramUsageMessage(message);
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = &OurFlag;
  config.contains_help_flags = &OurFlag;
  absl::SetFlagsUsageConfig(config);
}

}  // namespace shardserve
