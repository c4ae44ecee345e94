#include "worker/run/run_options.h"

#include "common/flags/parse.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardserve::run {

absl::StatusOr<std::vector<int32_t>> ParseTokenIds(absl::string_view text) {
  return ParseTokenIdList(text, "--prompt_ids");
}


absl::StatusOr<DeviceChoice> ParseDevices(absl::string_view text, int threads, int cuda_device_count) {
  DeviceChoice c;
  if (threads < 1 || threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("--threads must be in [1, 1024], got ", threads));
  }
  c.cpu_threads = threads;
  if (text == "cpu") return c;
  if (absl::StartsWith(text, "cpu:")) {
    const absl::string_view n = text.substr(4);
    if (!absl::SimpleAtoi(n, &c.cpu_ranks) || c.cpu_ranks < 1 || c.cpu_ranks > 256) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices=", text, ": \"", n, "\" is not a rank count in [1, 256]"));
    }
    return c;
  }
  if (text == "cuda" || absl::StartsWith(text, "cuda:")) {
    c.kind = kernels::DeviceKind::kCuda;
    const absl::string_view list = text == "cuda" ? "0" : text.substr(5);
    if (list == "all") {
      if (cuda_device_count < 1) {
        return absl::FailedPreconditionError(absl::StrCat("--devices=", text, ": this machine has no CUDA device"));
      }
      for (int d = 0; d < cuda_device_count; ++d) c.cuda_devices.push_back(d);
      return c;
    }
    for (absl::string_view part : absl::StrSplit(list, ',')) {
      int d = 0;
      if (!absl::SimpleAtoi(part, &d) || d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--devices=", text, ": \"", part, "\" is not a CUDA device index"));
      }
      if (std::find(c.cuda_devices.begin(), c.cuda_devices.end(), d) != c.cuda_devices.end()) {
        return absl::InvalidArgumentError(absl::StrCat("--devices=", text, ": device ", d, " is listed twice"));
      }
      c.cuda_devices.push_back(d);
    }
    return c;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--devices=", text, " is not a device list (expected cpu, cpu:N, cuda:all or cuda:0,1,...)"));
}

}  // namespace shardserve::run
