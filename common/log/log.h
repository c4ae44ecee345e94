// The only logging include of the project. glog 0.6 (Debian 12) spells LOG(INFO), VLOG(n),
// CHECK(cond) and DCHECK(cond) as absl/log does, so moving to absl/log later is a one-file change.
// CHECK is for broken invariants only (programmer errors), never for input from outside.
#ifndef SHARDSERVE_COMMON_LOG_LOG_H_
#define SHARDSERVE_COMMON_LOG_LOG_H_

#include <glog/logging.h>

#endif  // SHARDSERVE_COMMON_LOG_LOG_H_
