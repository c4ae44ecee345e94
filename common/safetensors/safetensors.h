// Reading Hugging Face safetensors checkpoints: one `model.safetensors` file, or several shards
// listed by `model.safetensors.index.json`. Files are memory-mapped read-only; tensors are copied
// out (and converted to f32) on request, whole or as a row or column range of a 2-D tensor, so a
// tensor-parallel rank touches only the pages of its own slice.
//
// Every header is validated before any data is read: JSON shape, dtypes, non-negative shapes,
// offsets inside the data section, byte sizes that agree with dtype x shape (overflow-checked), and
// no two tensors overlapping. Errors name the file and the tensor. Nothing here crashes on a bad
// file.
//
// Thread-safety: a `Checkpoint` is immutable after Open(); all const methods may be called from
// several threads at once.
#ifndef SHARDSERVE_COMMON_SAFETENSORS_SAFETENSORS_H_
#define SHARDSERVE_COMMON_SAFETENSORS_SAFETENSORS_H_

#include <cstdint>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tensor/dtype.h"
#include "common/tensor/tensor.h"

namespace shardserve {

// One tensor's entry in a safetensors header.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
};

// Parses and validates the JSON header of a safetensors file whose data section is `data_size`
// bytes. Returns the entries sorted by `begin`. InvalidArgument (naming `file_label` and the
// tensor) on any malformed or inconsistent header; DataLoss when a tensor ends past `data_size`
// (a truncated file). Pure; used directly by the fuzzer.
absl::StatusOr<std::vector<SafetensorsEntry>> ParseSafetensorsHeader(absl::string_view header,
                                                                     uint64_t data_size,
                                                                     absl::string_view file_label);

// Parses `model.safetensors.index.json` text into tensor name -> shard file name. Shard names must
// be plain file names (no '/' and not "." or ".."). Pure.
absl::StatusOr<absl::flat_hash_map<std::string, std::string>> ParseSafetensorsIndex(
    absl::string_view json, absl::string_view file_label);

class Checkpoint {
 public:
  // Opens the safetensors weights in directory `dir`: `model.safetensors.index.json` when present,
  // else `model.safetensors`. NotFound when neither exists; InvalidArgument for a malformed file
  // (naming it); DataLoss for a truncated one.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);
  // Opens exactly one safetensors file.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> OpenFile(const std::string& path);

  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  bool Has(absl::string_view name) const;
  // NotFound naming the tensor and the checkpoint when absent.
  absl::StatusOr<const SafetensorsEntry*> Find(absl::string_view name) const;
  // All tensor names, sorted.
  std::vector<std::string> Names() const;

  // Reads the whole tensor as f32. `expected_shape` is checked first (InvalidArgument naming the
  // tensor, the expected and the stored shape).
  absl::StatusOr<HostTensor> Read(absl::string_view name, const Shape& expected_shape) const;
  // Rows [row_begin, row_end) of a tensor of rank >= 1 (a slice along dim 0; for a 2-D weight
  // [out, in] these are output features). The full tensor's shape must equal `expected_shape`.
  absl::StatusOr<HostTensor> ReadRows(absl::string_view name, const Shape& expected_shape,
                                      int64_t row_begin, int64_t row_end) const;
  // Columns [col_begin, col_end) of a 2-D tensor (input features of a weight [out, in]).
  absl::StatusOr<HostTensor> ReadCols(absl::string_view name, const Shape& expected_shape,
                                      int64_t col_begin, int64_t col_end) const;
  // The stored bytes of rows [row_begin, row_end) (as ReadRows), unconverted: little-endian
  // elements of the tensor's dtype, a view of the mapped file valid while the checkpoint lives. For
  // tensors read as raw bytes (an MXFP4 checkpoint's U8 blocks and scales).
  absl::StatusOr<absl::Span<const uint8_t>> RowBytes(absl::string_view name, const Shape& expected_shape,
                                                     int64_t row_begin, int64_t row_end) const;

  // Where the checkpoint was opened from, for messages.
  const std::string& label() const { return label_; }

 private:
  struct MappedFile;
  struct Located {
    const SafetensorsEntry* entry;
    const MappedFile* file;
  };
  Checkpoint() = default;
  absl::StatusOr<Located> Locate(absl::string_view name, const Shape& expected_shape) const;
  absl::Status AddFile(const std::string& path, const std::vector<std::string>* only);

  std::string label_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  absl::flat_hash_map<std::string, Located> tensors_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COMMON_SAFETENSORS_SAFETENSORS_H_
