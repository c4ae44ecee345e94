#include "common/tensor/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardserve {

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(const Shape& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

void HostTensor::FreeDeleter::operator()(float* p) const { std::free(p); }

HostTensor::HostTensor(Shape shape) : shape_(std::move(shape)) {
  for (int64_t d : shape_) {
    if (d < 0) std::abort();  // programmer error: negative dimension
  }
  size_ = NumElements(shape_);
  if (size_ == 0) return;
  constexpr size_t kAlign = 64;
  const size_t bytes = (static_cast<size_t>(size_) * sizeof(float) + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, bytes);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  data_.reset(static_cast<float*>(p));
}

}  // namespace shardserve
