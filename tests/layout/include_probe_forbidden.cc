// Compiled only by include_probe_test: the same target shape as include_probe_allowed.cc (links
// worker_kernels only) including a coordinator header it does not depend on. Must fail to compile
// with "No such file or directory": include paths follow declared dependencies.
#include "worker/kernels/backend.h"
#include "coordinator/scheduler/scheduler.h"

int IncludeProbeForbidden() { return 0; }
