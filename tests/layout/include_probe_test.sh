#!/usr/bin/env bash
# Include paths follow declared dependencies (cmake/ShardserveHelpers.cmake): builds a probe that
# includes a header of a library it links (must compile) and one that includes a header of a
# library it does not link (must fail to compile, naming the header). Usage: include_probe_test.sh BUILD_DIR
set -uo pipefail
build=$1
if ! out=$(cmake --build "$build" --target include_probe_allowed 2>&1); then
  echo "FAIL: the allowed include does not compile:"; echo "$out"; exit 1
fi
if out=$(cmake --build "$build" --target include_probe_forbidden 2>&1); then
  echo "FAIL: a file linking only worker_kernels compiled an include of coordinator/scheduler/scheduler.h"
  exit 1
fi
if ! grep -q 'coordinator/scheduler/scheduler.h: No such file or directory' <<<"$out"; then
  echo "FAIL: the forbidden include failed for another reason:"; echo "$out"; exit 1
fi
echo "ok: the forbidden include is a compile error:"
grep 'No such file or directory' <<<"$out"
