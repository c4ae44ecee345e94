// Compiled only by include_probe_test: a file of a target that links worker_kernels includes that
// library's header. Must compile (the control for include_probe_forbidden.cc).
#include "worker/kernels/backend.h"

int IncludeProbeAllowed() { return 0; }
