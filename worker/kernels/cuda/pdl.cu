// Host side of pdl.cuh: whether launches carry the programmatic-dependent-launch attribute.
#include <atomic>

#include "worker/kernels/cuda/pdl.cuh"

namespace shardserve::kernels::cuda::pdl {
namespace {

// -1: no device noted yet; 0: off; 1: on.
std::atomic<int> g_state{-1};

}  // namespace

void NoteDevice(int major, bool wanted) {
  if (major < 9) {
    g_state.store(0);
    return;
  }
  if (!wanted) return;
  int expected = -1;
  g_state.compare_exchange_strong(expected, 1);
}

bool Enabled() { return g_state.load(std::memory_order_relaxed) == 1; }

}  // namespace shardserve::kernels::cuda::pdl
