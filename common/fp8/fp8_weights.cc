#include "common/fp8/fp8_weights.h"

#include <algorithm>
#include <bit>
#include <vector>
#include <cmath>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status/macros.h"

namespace shardserve {
namespace {

// The scales of one weight [out, in] as a grid of blocks: element (r, c) of the weight is scaled by
// values[(r / block_rows) * grid_cols + c / block_cols]. A per-tensor scale is one block covering
// the whole matrix.
struct ScaleGrid {
  HostTensor values;
  int64_t block_rows = 1;
  int64_t block_cols = 1;
  int64_t grid_cols = 1;
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

absl::Status WeightError(const Checkpoint& ckpt, absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(ckpt.label(), ": FP8 weight \"", name, "\" ", what));
}

// Reads and validates the scales of the F8_E4M3 weight `name` of `shape` ([out, in]).
absl::StatusOr<ScaleGrid> ReadScales(const Checkpoint& ckpt, const Fp8Quantization& fp8, absl::string_view name,
                                     const Shape& shape) {
  const int64_t out = shape[0], in = shape[1];
  const std::string inv_name = absl::StrCat(name, "_scale_inv");
  const std::string plain_name = absl::StrCat(name, "_scale");
  std::string scale_name = inv_name;
  ScaleGrid grid;
  Shape expected;
  if (fp8.IsBlockWise()) {
    if (!ckpt.Has(inv_name)) {
      return absl::NotFoundError(absl::StrCat(ckpt.label(), ": FP8 weight \"", name, "\" has no scale tensor \"",
                                              inv_name, "\" (weight_block_size [", fp8.block_rows, ", ",
                                              fp8.block_cols, "])"));
    }
    grid.block_rows = fp8.block_rows;
    grid.block_cols = fp8.block_cols;
    grid.grid_cols = CeilDiv(in, fp8.block_cols);
    expected = {CeilDiv(out, fp8.block_rows), grid.grid_cols};
  } else {
    const bool has_inv = ckpt.Has(inv_name), has_plain = ckpt.Has(plain_name);
    if (has_inv && has_plain) {
      return WeightError(ckpt, name, absl::StrCat("has both \"", inv_name, "\" and \"", plain_name,
                                                  "\"; a per-tensor scale must be one of them"));
    }
    if (!has_inv && !has_plain) {
      return absl::NotFoundError(absl::StrCat(ckpt.label(), ": FP8 weight \"", name, "\" has no scale tensor (\"",
                                              inv_name, "\" or \"", plain_name, "\")"));
    }
    if (has_plain) scale_name = plain_name;
    // One block covering the whole matrix (at least 1 x 1, so that empty matrices divide safely).
    grid.block_rows = std::max<int64_t>(out, 1);
    grid.block_cols = std::max<int64_t>(in, 1);
    grid.grid_cols = 1;
  }
  ASSIGN_OR_RETURN(const SafetensorsEntry* e, ckpt.Find(scale_name));
  if (e->dtype != DType::kF32 && e->dtype != DType::kBF16) {
    return WeightError(ckpt, name, absl::StrCat("has scale tensor \"", scale_name, "\" stored as ",
                                                DTypeName(e->dtype), "; expected F32 or BF16"));
  }
  if (fp8.IsBlockWise()) {
    if (e->shape != expected) {
      return WeightError(ckpt, name, absl::StrCat(ShapeToString(shape), " has scale tensor \"", scale_name,
                                                  "\" of shape ", ShapeToString(e->shape), "; weight_block_size [",
                                                  fp8.block_rows, ", ", fp8.block_cols, "] needs ",
                                                  ShapeToString(expected)));
    }
  } else if (NumElements(e->shape) != 1 || e->shape.size() > 2) {
    return WeightError(ckpt, name, absl::StrCat("has scale tensor \"", scale_name, "\" of shape ",
                                                ShapeToString(e->shape),
                                                "; a per-tensor scale (no weight_block_size) has shape [], [1] or "
                                                "[1, 1]"));
  }
  ASSIGN_OR_RETURN(grid.values, ckpt.Read(scale_name, e->shape));
  const float* s = grid.values.data();
  for (int64_t i = 0; i < grid.values.size(); ++i) {
    if (!std::isfinite(s[i]) || s[i] <= 0.f) {
      const std::string where = fp8.IsBlockWise()
                                    ? absl::StrCat(" at block [", i / grid.grid_cols, ", ", i % grid.grid_cols, "]")
                                    : std::string();
      return WeightError(ckpt, name, absl::StrCat("has scale ", s[i], where, " in \"", scale_name,
                                                  "\"; scales must be finite and > 0"));
    }
  }
  return grid;
}

// Scales `t` in place, a [rows, cols] slice of weight `name` whose element (0, 0) is element
// (row0, col0) of the full matrix; rejects NaN codes.
absl::Status ApplyScales(const Checkpoint& ckpt, absl::string_view name, const ScaleGrid& grid, int64_t row0,
                         int64_t col0, HostTensor& t) {
  const int64_t rows = t.dim(0), cols = t.dim(1);
  const float* scales = grid.values.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t gr = row0 + r;
    const float* block_row = scales + (gr / grid.block_rows) * grid.grid_cols;
    float* x = t.data() + r * cols;
    // Walk the row one scale block at a time.
    for (int64_t c = 0; c < cols;) {
      const int64_t gc = col0 + c;
      const int64_t block_end = std::min(cols, (gc / grid.block_cols + 1) * grid.block_cols - col0);
      const float scale = block_row[gc / grid.block_cols];
      for (; c < block_end; ++c) {
        if (std::isnan(x[c])) {
          return WeightError(ckpt, name, absl::StrCat("holds a NaN code (0x7f or 0xff) at [", gr, ", ", col0 + c,
                                                      "]"));
        }
        x[c] *= scale;
      }
    }
  }
  return absl::OkStatus();
}

// The stored entry of `name` when it is an F8_E4M3 matrix to dequantize; nullptr for any other
// dtype (read as stored).
absl::StatusOr<const SafetensorsEntry*> Fp8Entry(const Checkpoint& ckpt, const std::optional<Fp8Quantization>& fp8,
                                                 absl::string_view name) {
  ASSIGN_OR_RETURN(const SafetensorsEntry* e, ckpt.Find(name));
  if (e->dtype != DType::kF8E4M3) return nullptr;
  if (!fp8.has_value()) {
    return WeightError(ckpt, name, "is stored as F8_E4M3 but config.json has no quantization_config with "
                                   "quant_method \"fp8\" (no scales to apply)");
  }
  if (e->shape.size() != 2) {
    return WeightError(ckpt, name, absl::StrCat("has shape ", ShapeToString(e->shape),
                                                "; F8_E4M3 weights must be 2-D matrices [out, in]"));
  }
  return e;
}

// The e4m3 code of `v`, a value E4M3ToFloat gives for some code other than NaN (so exact): the
// codes sorted by their values' bits, searched.
uint8_t EncodeExactE4M3(float v) {
  struct Entry {
    uint32_t bits;
    uint8_t code;
  };
  static const std::vector<Entry>* const table = [] {
    auto* t = new std::vector<Entry>();
    for (int c = 0; c < 256; ++c) {
      const float f = E4M3ToFloat(static_cast<uint8_t>(c));
      if (!std::isnan(f)) t->push_back({std::bit_cast<uint32_t>(f), static_cast<uint8_t>(c)});
    }
    std::sort(t->begin(), t->end(), [](const Entry& a, const Entry& b) { return a.bits < b.bits; });
    return t;
  }();
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  const auto it = std::lower_bound(table->begin(), table->end(), bits,
                                   [](const Entry& e, uint32_t b) { return e.bits < b; });
  return it != table->end() && it->bits == bits ? it->code : 0;
}

}  // namespace

absl::StatusOr<Fp8Slice> ReadFp8Slice(const Checkpoint& ckpt, const std::optional<Fp8Quantization>& fp8,
                                      absl::string_view name, const Shape& expected_shape, int64_t row_begin,
                                      int64_t row_end, int64_t col_begin, int64_t col_end) {
  ASSIGN_OR_RETURN(const SafetensorsEntry* e, Fp8Entry(ckpt, fp8, name));
  if (e == nullptr) return WeightError(ckpt, name, "is not stored as F8_E4M3");
  if (expected_shape.size() != 2 || col_begin < 0 || col_begin > col_end || col_end > expected_shape[1]) {
    return WeightError(ckpt, name, absl::StrCat("columns [", col_begin, ", ", col_end, ") are not a range of ",
                                                ShapeToString(expected_shape)));
  }
  // The codes widen exactly to f32 (Checkpoint's reads check shape and ranges); they are encoded
  // back below. A whole-row read when the columns are all of them, else a column read, cropped.
  const bool all_cols = col_begin == 0 && col_end == expected_shape[1];
  HostTensor t;
  int64_t t_row0 = row_begin, t_col0 = 0;
  if (all_cols) {
    ASSIGN_OR_RETURN(t, ckpt.ReadRows(name, expected_shape, row_begin, row_end));
  } else {
    ASSIGN_OR_RETURN(t, ckpt.ReadCols(name, expected_shape, col_begin, col_end));
    t_row0 = 0;
    t_col0 = col_begin;
    if (row_begin < 0 || row_begin > row_end || row_end > expected_shape[0]) {
      return WeightError(ckpt, name, absl::StrCat("rows [", row_begin, ", ", row_end, ") are not a range of ",
                                                  ShapeToString(expected_shape)));
    }
  }
  ASSIGN_OR_RETURN(ScaleGrid grid, ReadScales(ckpt, *fp8, name, e->shape));
  Fp8Slice s;
  s.rows = row_end - row_begin;
  s.cols = col_end - col_begin;
  s.codes.resize(static_cast<size_t>(s.rows * s.cols));
  const int64_t t_cols = t.dim(1);
  for (int64_t r = 0; r < s.rows; ++r) {
    const float* src = t.data() + (row_begin - t_row0 + r) * t_cols + (col_begin - t_col0);
    for (int64_t c = 0; c < s.cols; ++c) {
      if (std::isnan(src[c])) {
        return WeightError(ckpt, name, absl::StrCat("holds a NaN code (0x7f or 0xff) at [", row_begin + r, ", ",
                                                    col_begin + c, "]"));
      }
      s.codes[static_cast<size_t>(r * s.cols + c)] = EncodeExactE4M3(src[c]);
    }
  }
  if (!fp8->IsBlockWise()) {
    s.scales = {grid.values.data()[0]};
    s.block_rows = std::max<int64_t>(s.rows, 1);
    s.block_cols = std::max<int64_t>(s.cols, 1);
    s.grid_cols = 1;
    return s;
  }
  s.block_rows = grid.block_rows;
  s.block_cols = grid.block_cols;
  s.row_offset = row_begin % grid.block_rows;
  s.col_offset = col_begin % grid.block_cols;
  s.grid_cols = CeilDiv(s.col_offset + s.cols, grid.block_cols);
  const int64_t grid_rows = CeilDiv(s.row_offset + s.rows, grid.block_rows);
  const int64_t first_row = row_begin / grid.block_rows, first_col = col_begin / grid.block_cols;
  s.scales.resize(static_cast<size_t>(grid_rows * s.grid_cols));
  for (int64_t gr = 0; gr < grid_rows; ++gr) {
    for (int64_t gc = 0; gc < s.grid_cols; ++gc) {
      s.scales[static_cast<size_t>(gr * s.grid_cols + gc)] =
          grid.values.data()[(first_row + gr) * grid.grid_cols + first_col + gc];
    }
  }
  return s;
}

absl::StatusOr<HostTensor> ReadWeight(const Checkpoint& ckpt, const std::optional<Fp8Quantization>& fp8,
                                      absl::string_view name, const Shape& expected_shape) {
  ASSIGN_OR_RETURN(const SafetensorsEntry* e, Fp8Entry(ckpt, fp8, name));
  if (e == nullptr) return ckpt.Read(name, expected_shape);
  return ReadWeightRows(ckpt, fp8, name, expected_shape, 0, e->shape[0]);
}

absl::StatusOr<HostTensor> ReadWeightRows(const Checkpoint& ckpt, const std::optional<Fp8Quantization>& fp8,
                                          absl::string_view name, const Shape& expected_shape, int64_t row_begin,
                                          int64_t row_end) {
  ASSIGN_OR_RETURN(const SafetensorsEntry* e, Fp8Entry(ckpt, fp8, name));
  // Checkpoint checks the shape and the range first, so that the scales are read for a valid slice.
  ASSIGN_OR_RETURN(HostTensor t, ckpt.ReadRows(name, expected_shape, row_begin, row_end));
  if (e == nullptr) return t;
  ASSIGN_OR_RETURN(ScaleGrid grid, ReadScales(ckpt, *fp8, name, e->shape));
  RETURN_IF_ERROR(ApplyScales(ckpt, name, grid, row_begin, 0, t));
  return t;
}

absl::StatusOr<HostTensor> ReadWeightCols(const Checkpoint& ckpt, const std::optional<Fp8Quantization>& fp8,
                                          absl::string_view name, const Shape& expected_shape, int64_t col_begin,
                                          int64_t col_end) {
  ASSIGN_OR_RETURN(const SafetensorsEntry* e, Fp8Entry(ckpt, fp8, name));
  ASSIGN_OR_RETURN(HostTensor t, ckpt.ReadCols(name, expected_shape, col_begin, col_end));
  if (e == nullptr) return t;
  ASSIGN_OR_RETURN(ScaleGrid grid, ReadScales(ckpt, *fp8, name, e->shape));
  RETURN_IF_ERROR(ApplyScales(ckpt, name, grid, 0, col_begin, t));
  return t;
}

}  // namespace shardserve
