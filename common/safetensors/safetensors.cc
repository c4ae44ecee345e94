#include "common/safetensors/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status/macros.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

using json = nlohmann::json;

// A header larger than this is rejected before it is read (real checkpoints use < 1 MiB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

absl::Status HeaderError(absl::string_view file, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": invalid safetensors header: ", what));
}

bool MulOverflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

}  // namespace

absl::StatusOr<std::vector<SafetensorsEntry>> ParseSafetensorsHeader(absl::string_view header,
                                                                     uint64_t data_size,
                                                                     absl::string_view file_label) {
  json doc = json::parse(header.begin(), header.end(), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return HeaderError(file_label, "not valid JSON");
  if (!doc.is_object()) return HeaderError(file_label, "not a JSON object");
  std::vector<SafetensorsEntry> entries;
  entries.reserve(doc.size());
  for (const auto& [name, value] : doc.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return HeaderError(file_label, "__metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) {
          return HeaderError(file_label, absl::StrCat("__metadata__ value of \"", k, "\" is not a string"));
        }
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor \"", name, "\"");
    if (!value.is_object()) return HeaderError(file_label, absl::StrCat(where, " is not an object"));
    auto dt = value.find("dtype");
    auto sh = value.find("shape");
    auto off = value.find("data_offsets");
    if (dt == value.end() || !dt->is_string()) {
      return HeaderError(file_label, absl::StrCat(where, " has no string \"dtype\""));
    }
    if (sh == value.end() || !sh->is_array()) {
      return HeaderError(file_label, absl::StrCat(where, " has no array \"shape\""));
    }
    if (off == value.end() || !off->is_array() || off->size() != 2) {
      return HeaderError(file_label, absl::StrCat(where, " has no [begin, end] \"data_offsets\""));
    }
    SafetensorsEntry e;
    e.name = name;
    auto dtype = ParseDType(dt->get<std::string>());
    if (!dtype.ok()) return HeaderError(file_label, absl::StrCat(where, ": ", dtype.status().message()));
    e.dtype = *dtype;
    uint64_t elements = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) {
        return HeaderError(file_label, absl::StrCat(where, " has a shape entry that is not a non-negative integer"));
      }
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          MulOverflows(elements, dim, &elements)) {
        return HeaderError(file_label, absl::StrCat(where, " has a shape whose size overflows"));
      }
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    if (!(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned()) {
      return HeaderError(file_label, absl::StrCat(where, " has data_offsets that are not non-negative integers"));
    }
    e.begin = (*off)[0].get<uint64_t>();
    e.end = (*off)[1].get<uint64_t>();
    if (e.begin > e.end) {
      return HeaderError(file_label, absl::StrCat(where, " has data_offsets with begin ", e.begin, " > end ", e.end));
    }
    if (e.end > data_size) {
      // The header is consistent but the data is short: the file was cut off.
      return absl::DataLossError(absl::StrCat(file_label, ": truncated safetensors file: ", where,
                                              " ends at byte ", e.end, " of a data section of ",
                                              data_size, " bytes"));
    }
    uint64_t bytes = 0;
    if (MulOverflows(elements, DTypeSize(e.dtype), &bytes) || bytes != e.end - e.begin) {
      return HeaderError(file_label, absl::StrCat(where, " occupies ", e.end - e.begin, " bytes but ",
                                                  DTypeName(e.dtype), " ", ShapeToString(e.shape),
                                                  " needs ", elements, " x ", DTypeSize(e.dtype)));
    }
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  for (size_t i = 1; i < entries.size(); ++i) {
    const auto& prev = entries[i - 1];
    const auto& cur = entries[i];
    // Empty tensors occupy no bytes and cannot overlap anything.
    if (cur.begin < prev.end && cur.begin != cur.end) {
      return HeaderError(file_label, absl::StrCat("tensors \"", prev.name, "\" and \"", cur.name,
                                                  "\" overlap in the data section"));
    }
  }
  return entries;
}

absl::StatusOr<absl::flat_hash_map<std::string, std::string>> ParseSafetensorsIndex(
    absl::string_view text, absl::string_view file_label) {
  json doc = json::parse(text.begin(), text.end(), nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file_label, ": not a JSON object"));
  }
  auto wm = doc.find("weight_map");
  if (wm == doc.end() || !wm->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file_label, ": no \"weight_map\" object"));
  }
  absl::flat_hash_map<std::string, std::string> map;
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(file_label, ": weight_map entry \"", name, "\" is not a file name"));
    }
    std::string f = file.get<std::string>();
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos ||
        f.find('\\') != std::string::npos || f.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(file_label, ": weight_map entry \"", name,
                                                     "\" names \"", f, "\", which is not a plain file name"));
    }
    map.emplace(name, std::move(f));
  }
  return map;
}

struct Checkpoint::MappedFile {
  std::string path;
  const unsigned char* base = nullptr;  // the whole file
  size_t size = 0;
  const unsigned char* data = nullptr;  // start of the data section
  std::vector<SafetensorsEntry> entries;

  ~MappedFile() {
    if (base != nullptr && size > 0) munmap(const_cast<unsigned char*>(base), size);
  }
};

Checkpoint::~Checkpoint() = default;

absl::Status Checkpoint::AddFile(const std::string& path, const std::vector<std::string>* only) {
  auto file = std::make_unique<MappedFile>();
  file->path = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    std::string msg = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::PermissionDeniedError(msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  file->size = static_cast<size_t>(st.st_size);
  if (file->size < 8) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, ": truncated safetensors file (", file->size,
                                            " bytes; the 8-byte header length is missing)"));
  }
  void* p = ::mmap(nullptr, file->size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
  }
  file->base = static_cast<const unsigned char*>(p);
  uint64_t header_len = 0;
  std::memcpy(&header_len, file->base, 8);  // little-endian on every supported host
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": safetensors header length ", header_len,
                                                   " is implausible (limit ", kMaxHeaderBytes, ")"));
  }
  if (header_len > file->size - 8) {
    return absl::DataLossError(absl::StrCat(path, ": truncated safetensors file: header of ", header_len,
                                            " bytes but only ", file->size - 8, " bytes follow"));
  }
  absl::string_view header(reinterpret_cast<const char*>(file->base + 8), header_len);
  file->data = file->base + 8 + header_len;
  const uint64_t data_size = file->size - 8 - header_len;
  ASSIGN_OR_RETURN(file->entries, ParseSafetensorsHeader(header, data_size, path));
  for (const auto& e : file->entries) {
    if (only != nullptr && std::find(only->begin(), only->end(), e.name) == only->end()) continue;
    if (!tensors_.emplace(e.name, Located{&e, file.get()}).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor \"", e.name, "\" appears in more than one shard"));
    }
  }
  files_.push_back(std::move(file));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::OpenFile(const std::string& path) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->label_ = path;
  RETURN_IF_ERROR(ckpt->AddFile(path, nullptr));
  return ckpt;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir) / "model.safetensors";
  std::error_code ec;
  if (!fs::exists(index_path, ec)) {
    if (!fs::exists(single_path, ec)) {
      return absl::NotFoundError(absl::StrCat(dir, ": no model.safetensors or model.safetensors.index.json"));
    }
    return OpenFile(single_path.string());
  }
  std::ifstream in(index_path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  if (!in) return absl::DataLossError(absl::StrCat(index_path.string(), ": cannot read"));
  ASSIGN_OR_RETURN(auto map, ParseSafetensorsIndex(ss.str(), index_path.string()));
  absl::flat_hash_map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : map) by_file[file].push_back(name);
  std::vector<std::string> files;
  for (const auto& [file, names] : by_file) files.push_back(file);
  std::sort(files.begin(), files.end());
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->label_ = dir;
  for (const auto& f : files) {
    const auto& names = by_file[f];
    RETURN_IF_ERROR(ckpt->AddFile((fs::path(dir) / f).string(), &names));
    for (const auto& n : names) {
      if (!ckpt->tensors_.contains(n)) {
        return absl::InvalidArgumentError(absl::StrCat(index_path.string(), ": tensor \"", n,
                                                       "\" is mapped to ", f, ", which does not contain it"));
      }
    }
  }
  return ckpt;
}

bool Checkpoint::Has(absl::string_view name) const { return tensors_.contains(name); }

absl::StatusOr<const SafetensorsEntry*> Checkpoint::Find(absl::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(label_, ": tensor \"", name, "\" not found"));
  }
  return it->second.entry;
}

std::vector<std::string> Checkpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [n, loc] : tensors_) names.push_back(n);
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<Checkpoint::Located> Checkpoint::Locate(absl::string_view name,
                                                       const Shape& expected_shape) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(label_, ": tensor \"", name, "\" not found"));
  }
  const SafetensorsEntry& e = *it->second.entry;
  if (e.shape != expected_shape) {
    return absl::InvalidArgumentError(absl::StrCat(it->second.file->path, ": tensor \"", name, "\" has shape ",
                                                   ShapeToString(e.shape), " but the model config implies ",
                                                   ShapeToString(expected_shape)));
  }
  return it->second;
}

absl::StatusOr<HostTensor> Checkpoint::Read(absl::string_view name, const Shape& expected_shape) const {
  ASSIGN_OR_RETURN(Located loc, Locate(name, expected_shape));
  HostTensor t(loc.entry->shape);
  ConvertToFloat(loc.entry->dtype, loc.file->data + loc.entry->begin, static_cast<size_t>(t.size()), t.data());
  return t;
}

absl::StatusOr<HostTensor> Checkpoint::ReadRows(absl::string_view name, const Shape& expected_shape,
                                                int64_t row_begin, int64_t row_end) const {
  ASSIGN_OR_RETURN(const absl::Span<const uint8_t> bytes, RowBytes(name, expected_shape, row_begin, row_end));
  ASSIGN_OR_RETURN(const SafetensorsEntry* e, Find(name));
  Shape out_shape = e->shape;
  out_shape[0] = row_end - row_begin;
  HostTensor t(out_shape);
  ConvertToFloat(e->dtype, bytes.data(), static_cast<size_t>(t.size()), t.data());
  return t;
}

absl::StatusOr<absl::Span<const uint8_t>> Checkpoint::RowBytes(absl::string_view name, const Shape& expected_shape,
                                                               int64_t row_begin, int64_t row_end) const {
  ASSIGN_OR_RETURN(Located loc, Locate(name, expected_shape));
  const Shape& shape = loc.entry->shape;
  if (shape.empty() || row_begin < 0 || row_end < row_begin || row_end > shape[0]) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" ", ShapeToString(shape),
                                                   ": row range [", row_begin, ", ", row_end, ") is out of bounds"));
  }
  const size_t row_bytes =
      static_cast<size_t>(NumElements(shape) / std::max<int64_t>(shape[0], 1)) * DTypeSize(loc.entry->dtype);
  return absl::Span<const uint8_t>(loc.file->data + loc.entry->begin + static_cast<size_t>(row_begin) * row_bytes,
                                   static_cast<size_t>(row_end - row_begin) * row_bytes);
}

absl::StatusOr<HostTensor> Checkpoint::ReadCols(absl::string_view name, const Shape& expected_shape,
                                                int64_t col_begin, int64_t col_end) const {
  ASSIGN_OR_RETURN(Located loc, Locate(name, expected_shape));
  const Shape& shape = loc.entry->shape;
  if (shape.size() != 2 || col_begin < 0 || col_end < col_begin || col_end > shape[1]) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" ", ShapeToString(shape),
                                                   ": column range [", col_begin, ", ", col_end,
                                                   ") is out of bounds (needs a 2-D tensor)"));
  }
  const int64_t rows = shape[0];
  const int64_t cols = col_end - col_begin;
  HostTensor t({rows, cols});
  const size_t esize = DTypeSize(loc.entry->dtype);
  const unsigned char* base = loc.file->data + loc.entry->begin;
  for (int64_t r = 0; r < rows; ++r) {
    ConvertToFloat(loc.entry->dtype, base + (r * shape[1] + col_begin) * esize, static_cast<size_t>(cols),
                   t.data() + r * cols);
  }
  return t;
}

}  // namespace shardserve
