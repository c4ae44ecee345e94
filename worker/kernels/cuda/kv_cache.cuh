// The element types of a paged KV cache as the CUDA kernels read and write them (KvLayerView::dtype):
// the C++ type of each dtype, how a kernel widens one element to f32 (Widen) and how it stores an
// f32 value into one (ToCache). Shared by the cache write (ops.cu) and the attention (attention.cu),
// so both agree on every byte. Internal to worker/kernels/cuda; device code only.
//
//   kF32      float           stored as is
//   kBF16     __nv_bfloat16   rounded to nearest even
//   kF16      __half          rounded to nearest even
//   kF8E4M3   E4M3            a float8 e4m3fn code, no scale: E4M3Encode / E4M3Decode of
//                             kernels/shared/fp8_math.h, integer-only, so a CUDA rank writes the
//                             bytes the CPU backend writes and reads back the same f32 values (not
//                             cuda_fp8.h's conversions: the two backends share one definition)
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_KV_CACHE_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_KV_CACHE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "worker/kernels/shared/fp8_math.h"

namespace shardserve::kernels::cuda {

// One element of an FP8 KV cache: a distinct type (not uint8_t) so that the kernels templated on the
// cache element pick its Widen/ToCache by overload, and 1 byte like the code it wraps, so that a
// cache row of head_dim elements is head_dim bytes and a 16-byte vector load holds 16 of them.
struct E4M3 {
  uint8_t code;
};
static_assert(sizeof(E4M3) == 1 && alignof(E4M3) == 1, "an FP8 cache element is its code");

__device__ __forceinline__ float Widen(float x) { return x; }
__device__ __forceinline__ float Widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float Widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float Widen(E4M3 x) { return E4M3Decode(x.code); }

template <typename T>
__device__ __forceinline__ T ToCache(float x);
template <>
__device__ __forceinline__ float ToCache<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 ToCache<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half ToCache<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ E4M3 ToCache<E4M3>(float x) {
  return E4M3{E4M3Encode(x)};
}

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_KV_CACHE_CUH_
