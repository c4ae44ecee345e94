// Host tensors. `HostTensor` owns a 64-byte-aligned f32 buffer with a row-major shape; it is the
// unit in which the CPU engine stores weights and activations. Not thread-safe; move-only.
#ifndef SHARDSERVE_COMMON_TENSOR_TENSOR_H_
#define SHARDSERVE_COMMON_TENSOR_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace shardserve {

using Shape = std::vector<int64_t>;

// Number of elements of `shape` (1 for a scalar shape {}).
int64_t NumElements(const Shape& shape);
// "[2, 3]".
std::string ShapeToString(const Shape& shape);

class HostTensor {
 public:
  HostTensor() = default;
  // Zero-filled tensor of `shape`. Every dimension must be >= 0 (CHECKed: a programmer error).
  explicit HostTensor(Shape shape);

  HostTensor(HostTensor&&) noexcept = default;
  HostTensor& operator=(HostTensor&&) noexcept = default;
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;

  const Shape& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_[i]; }
  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  absl::Span<float> span() { return {data_.get(), static_cast<size_t>(size_)}; }
  absl::Span<const float> span() const { return {data_.get(), static_cast<size_t>(size_)}; }
  // Bytes held by the buffer.
  size_t bytes() const { return static_cast<size_t>(size_) * sizeof(float); }

 private:
  struct FreeDeleter {
    void operator()(float* p) const;
  };
  Shape shape_;
  int64_t size_ = 0;
  std::unique_ptr<float[], FreeDeleter> data_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_TENSOR_TENSOR_H_
