// Carving one device workspace into the parts of an op (sorted keys, CUB's temporary storage, ...).
// Internal to worker/kernels/cuda. Each part starts on a kAlign-byte boundary (CUB and vector loads
// want aligned pointers). Run with a null base to size the workspace, then with the real one to get
// the same parts' pointers.
#ifndef SHARDSERVE_WORKER_KERNELS_CUDA_WORKSPACE_CUH_
#define SHARDSERVE_WORKER_KERNELS_CUDA_WORKSPACE_CUH_

#include <cstddef>

namespace shardserve::kernels::cuda {

class WorkspaceCarver {
 public:
  static constexpr size_t kAlign = 256;

  // base: the workspace's device memory, or null to size one (every part is then null).
  explicit WorkspaceCarver(char* base) : base_(base) {}

  // The next part, of `count` elements of T.
  template <typename T>
  T* Take(size_t count) {
    char* ptr = base_ == nullptr ? nullptr : base_ + at_;
    at_ += (count * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    return reinterpret_cast<T*>(ptr);
  }

  // The bytes the parts taken so far span.
  size_t total() const { return at_; }

 private:
  char* const base_;
  size_t at_ = 0;
};

}  // namespace shardserve::kernels::cuda

#endif  // SHARDSERVE_WORKER_KERNELS_CUDA_WORKSPACE_CUH_
