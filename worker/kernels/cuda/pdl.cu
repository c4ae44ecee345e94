// Host side of pdl.cuh: whether launches carry the programmatic-dependent-launch attribute.
#include <atomic>

#include "worker/kernels/cuda/pdl.cuh"

namespace shardserve::kernels::cuda::pdl {
namespace {

// -1: no device noted yet; 0: off; 1: on.
std::atomic<int> g_state{-1};

// Compiled like every kernel of this library: its PTX version is the virtual architecture the
// device runs our kernels from.
__global__ void ArchProbeKernel() {}

// Whether the code the device runs has Wait() and LaunchDependents() in it: they compile to nothing
// below compute_90, and a build without compute_90 (e.g. CMAKE_CUDA_ARCHITECTURES=80) JIT-compiles
// compute_80 PTX on an H100. Launching those kernels with the PDL attribute would let a successor
// start without waiting for what its predecessor writes.
bool KernelsWaitForPredecessors() {
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, ArchProbeKernel) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; leave no error for the next call to report
    return false;
  }
  return attributes.ptxVersion >= 90;
}

}  // namespace

void NoteDevice(int major, bool wanted) {
  if (major < 9 || (wanted && !KernelsWaitForPredecessors())) {
    g_state.store(0);
    return;
  }
  if (!wanted) return;
  int expected = -1;
  g_state.compare_exchange_strong(expected, 1);
}

bool Enabled() { return g_state.load(std::memory_order_relaxed) == 1; }

}  // namespace shardserve::kernels::cuda::pdl
