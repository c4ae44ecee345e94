// Programmatic dependent launch (PDL) for the kernels of a decode step. Internal to
// worker/kernels/cuda.
//
// A decode step is a chain of ~200 small kernels, each waiting for the one before: without PDL a
// kernel's launch, its blocks' start and its first loads all wait until the previous kernel has
// finished. With PDL (compute capability >= 9.0) a kernel launched through pdl::Launch may start
// while the previous one still runs, and its blocks stop at pdl::Wait() until every grid it depends
// on has completed and its memory is visible. So a kernel:
//   * calls LaunchDependents() early (the next kernel's blocks may then be scheduled once all of
//     this kernel's blocks have started, so they never take the place of blocks of this one);
//   * before Wait() reads only what no earlier kernel of the stream writes (weights) and writes
//     nothing: the GEMV prefetches its weight rows there, which is what overlaps the two kernels;
//   * after Wait() is an ordinary kernel.
// A kernel launched without the attribute (another GPU, PDL switched off, or a plain <<<>>> launch)
// runs as before: Wait() and LaunchDependents() are then no-ops. Both are captured into CUDA graphs
// as programmatic edges.
//
// PDL is used in a process once a backend was created with it asked for (BackendOptions::cuda_pdl;
// shardserve-bench-gpu --pdl) and no backend of the process runs on a device of compute capability
// below 9.0. It is off by default: on an H200 the 1.1B bf16 Llama decoded 547 tok/s with it and 549
// without (batch 1, CUDA graphs; `variants.sh spin pdl`), so what it overlaps is not what bounds a
// step yet. Every kernel launched through Launch() is correct either way (the GPU
// suite passes with it on and off; memcheck and racecheck report nothing in our kernels with it on).
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_PDL_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_PDL_CUH_

#include <cuda_runtime.h>

#include <utility>

namespace shardserve::kernels::cuda::pdl {

__device__ __forceinline__ void Wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void LaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Prefetches bytes [p, p + bytes) into L2, the threads of a warp taking 128-byte lines in turn
// (lane: this thread's index in the warp). Loads nothing into registers.
__device__ __forceinline__ void PrefetchL2(const void* p, long long bytes, int lane) {
  const char* c = static_cast<const char*>(p);
  for (long long off = static_cast<long long>(lane) * 128; off < bytes; off += 32 * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
  }
}

// Records that a backend runs on a device of compute capability `major` (PDL needs >= 9 on every
// device of the process) and whether it asked for PDL.
void NoteDevice(int major, bool wanted);

// Whether launches through Launch() carry the PDL attribute.
bool Enabled();

// kernel<<<grid, block, shared, stream>>>(args...), with the PDL attribute when Enabled().
template <typename... Params, typename... Args>
cudaError_t Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = Enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace shardserve::kernels::cuda::pdl

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_PDL_CUH_
