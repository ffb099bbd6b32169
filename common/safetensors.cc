// safetensors: header validation, the memory-mapped reader with dtype conversion and slicing,
// and the streaming writer. Format: u64 little-endian header length N, N bytes of JSON, data.
#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bf16.h"
#include "common/status.h"

namespace tpserve {
namespace {

using Json = nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct StoredType {
  const char* name;
  int bytes;
  bool has_dtype;
  DType dtype;
};
constexpr StoredType kStoredTypes[] = {
    {"F32", 4, true, DType::kF32},      {"BF16", 2, true, DType::kBF16},
    {"F16", 2, true, DType::kF16},      {"I32", 4, true, DType::kI32},
    {"I64", 8, true, DType::kI64},      {"F64", 8, false, DType::kF32},
    {"I16", 2, false, DType::kF32},     {"U16", 2, false, DType::kF32},
    {"U32", 4, false, DType::kF32},     {"U64", 8, false, DType::kF32},
    {"I8", 1, false, DType::kF32},      {"U8", 1, false, DType::kF32},
    {"BOOL", 1, false, DType::kF32},    {"F8_E4M3", 1, false, DType::kF32},
    {"F8_E5M2", 1, false, DType::kF32},
};

const char* StoredName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kI8:
      return "I8";
    case DType::kI4:
      break;  // no safetensors name
  }
  return "?";
}

// Tensor names come from the file; keep them printable and short in messages.
std::string Quoted(std::string_view s) {
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < 120; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  if (s.size() > 120) out += "...";
  return out + "'";
}

std::string ShapeOf(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

bool IsFloatDType(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

absl::StatusOr<uint64_t> NonNegativeInt(const Json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0)
    return static_cast<uint64_t>(v.get<int64_t>());
  return absl::InvalidArgumentError("not a non-negative integer");
}

inline float LoadAsF32(DType t, const char* p) {
  switch (t) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return Bf16ToF32(h);
    }
    default: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return F16ToF32(h);
    }
  }
}

template <typename Fn>
void ConvertLoop(DType src_dtype, const char* src, int64_t n, Fn store) {
  const size_t step = DTypeSize(src_dtype);
  switch (src_dtype) {
    case DType::kF32:
      for (int64_t i = 0; i < n; ++i) store(i, LoadAsF32(DType::kF32, src + i * step));
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) store(i, LoadAsF32(DType::kBF16, src + i * step));
      break;
    default:
      for (int64_t i = 0; i < n; ++i) store(i, LoadAsF32(DType::kF16, src + i * step));
      break;
  }
}

absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, std::min<size_t>(bytes, 1 << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat(path, ": write failed: ", std::strerror(errno)));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

int64_t SafetensorsTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string SafetensorsTensorInfo::ShapeString() const { return ShapeOf(shape); }

absl::StatusOr<std::vector<SafetensorsTensorInfo>> ParseSafetensorsHeader(
    std::string_view header_json, uint64_t data_size, std::string_view source_name) {
  const absl::string_view source(source_name.data(), source_name.size());
  Json j;
  try {
    j = Json::parse(header_json.begin(), header_json.end());
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": safetensors header is not valid JSON: ", e.what()));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": safetensors header must be a JSON object, got ", j.type_name()));
  }
  std::vector<SafetensorsTensorInfo> out;
  out.reserve(j.size());
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") continue;
    auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": tensor ", Quoted(name), ": ", what));
    };
    const Json& v = it.value();
    if (!v.is_object()) return bad(absl::StrCat("entry must be an object, got ", v.type_name()));
    SafetensorsTensorInfo info;
    info.name = name;

    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) return bad("missing or non-string 'dtype'");
    info.dtype_name = dt->get<std::string>();
    int elem_bytes = 0;
    for (const StoredType& t : kStoredTypes) {
      if (info.dtype_name == t.name) {
        elem_bytes = t.bytes;
        info.has_dtype = t.has_dtype;
        info.dtype = t.dtype;
      }
    }
    if (elem_bytes == 0) {
      return bad(absl::StrCat("unsupported dtype ", Quoted(info.dtype_name),
                              " (known: F32, BF16, F16, F64, I8..I64, U8..U64, BOOL, F8_*)"));
    }

    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) return bad("missing or non-array 'shape'");
    if (sh->size() > 8) return bad(absl::StrCat("shape has ", sh->size(), " dims (at most 8)"));
    uint64_t numel = 1;
    for (const Json& d : *sh) {
      auto dim = NonNegativeInt(d);
      if (!dim.ok()) return bad("shape entries must be non-negative integers");
      if (*dim > (1ull << 62) || __builtin_mul_overflow(numel, *dim, &numel) ||
          numel > (1ull << 62)) {
        return bad("shape has too many elements");
      }
      info.shape.push_back(static_cast<int64_t>(*dim));
    }

    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2) {
      return bad("missing 'data_offsets' (a list of two integers)");
    }
    auto begin = NonNegativeInt((*off)[0]);
    auto end = NonNegativeInt((*off)[1]);
    if (!begin.ok() || !end.ok()) return bad("data_offsets must be non-negative integers");
    info.begin = *begin;
    info.end = *end;
    if (info.end < info.begin) {
      return bad(absl::StrCat("data_offsets [", info.begin, ", ", info.end, "] end before begin"));
    }
    if (info.end > data_size) {
      return bad(absl::StrCat("data_offsets [", info.begin, ", ", info.end,
                              "] run past the end of the data section (", data_size, " bytes)"));
    }
    if (numel > (1ull << 59)) return bad("shape has too many elements");
    const uint64_t bytes = numel * static_cast<uint64_t>(elem_bytes);  // < 2^62: no overflow
    if (info.end - info.begin != bytes) {
      return bad(absl::StrCat("shape ", info.ShapeString(), " of ", info.dtype_name, " needs ",
                              bytes, " bytes but data_offsets [", info.begin, ", ", info.end,
                              "] hold ", info.end - info.begin));
    }
    out.push_back(std::move(info));
  }

  // No two tensors may share bytes.
  std::vector<const SafetensorsTensorInfo*> by_offset;
  for (const auto& t : out) {
    if (t.end > t.begin) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto* a, const auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto* prev = by_offset[i - 1];
    const auto* cur = by_offset[i];
    if (cur->begin < prev->end) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": tensors ", Quoted(prev->name), " [", prev->begin, ", ", prev->end,
                       ") and ", Quoted(cur->name), " [", cur->begin, ", ", cur->end, ") overlap"));
    }
  }
  return out;
}

absl::StatusOr<std::vector<SafetensorsTensorInfo>> ParseSafetensorsBytes(
    const void* bytes, uint64_t size, std::string_view source_name) {
  const absl::string_view source(source_name.data(), source_name.size());
  if (size < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": file is ", size, " bytes, too short for a safetensors file (truncated?)"));
  }
  const unsigned char* p = static_cast<const unsigned char*>(bytes);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | p[i];
  if (n > size - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": header length ", n, " is larger than the file (", size,
                     " bytes; truncated or not a safetensors file?)"));
  }
  if (n > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": header length ", n, " exceeds the limit of ", kMaxHeaderBytes));
  }
  if (n < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": header length ", n, " is too small for a JSON object"));
  }
  std::string_view header(reinterpret_cast<const char*>(p + 8), n);
  return ParseSafetensorsHeader(header, size - 8 - n, source_name);
}

absl::Status ConvertElements(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                             int64_t n) {
  if (!IsFloatDType(src_dtype) || !IsFloatDType(dst_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot convert ",
                                                   std::string(DTypeName(src_dtype)), " to ",
                                                   std::string(DTypeName(dst_dtype))));
  }
  if (n <= 0) return absl::OkStatus();
  const char* s = static_cast<const char*>(src);
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, static_cast<size_t>(n) * DTypeSize(src_dtype));
    return absl::OkStatus();
  }
  switch (dst_dtype) {
    case DType::kF32: {
      float* d = static_cast<float*>(dst);
      ConvertLoop(src_dtype, s, n, [d](int64_t i, float v) { d[i] = v; });
      break;
    }
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      ConvertLoop(src_dtype, s, n, [d](int64_t i, float v) { d[i] = F32ToBf16(v); });
      break;
    }
    default: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      ConvertLoop(src_dtype, s, n, [d](int64_t i, float v) { d[i] = F32ToF16(v); });
      break;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return ParseSafetensorsBytes("", size, path).status();  // the "too short" error
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_ = static_cast<const char*>(map);
  f->map_size_ = size;
  TP_ASSIGN_OR_RETURN(f->tensors_, ParseSafetensorsBytes(f->map_, size, path));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(f->map_[i]);
  f->data_ = f->map_ + 8 + header_len;
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->index_[f->tensors_[i].name] = i;
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<char*>(map_), map_size_);
}

const SafetensorsTensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<const SafetensorsTensorInfo*> SafetensorsFile::Lookup(
    std::string_view name, absl::Span<const int64_t> expected_shape, DType out_dtype) const {
  const SafetensorsTensorInfo* t = Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor ", Quoted(name)));
  }
  if (!std::equal(t->shape.begin(), t->shape.end(), expected_shape.begin(), expected_shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor ", Quoted(name), " has shape ",
                                                   t->ShapeString(), ", expected ",
                                                   ShapeOf(expected_shape)));
  }
  if (!t->has_dtype || !IsFloatDType(t->dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor ", Quoted(name), " has dtype ",
                                                   t->dtype_name,
                                                   "; only F32, BF16 and F16 can be loaded"));
  }
  if (!IsFloatDType(out_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor ", Quoted(name),
                                                   ": cannot convert to ",
                                                   std::string(DTypeName(out_dtype))));
  }
  return t;
}

absl::Status SafetensorsFile::Read(std::string_view name, absl::Span<const int64_t> expected_shape,
                                   DType out_dtype, void* dst) const {
  TP_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* t, Lookup(name, expected_shape, out_dtype));
  return ConvertElements(t->dtype, data_ + t->begin, out_dtype, dst, t->numel());
}

absl::Status SafetensorsFile::ReadRows(std::string_view name,
                                       absl::Span<const int64_t> expected_shape, int64_t row_begin,
                                       int64_t row_count, DType out_dtype, void* dst) const {
  TP_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* t, Lookup(name, expected_shape, out_dtype));
  if (t->shape.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": tensor ", Quoted(name), " is a scalar; cannot slice rows"));
  }
  const int64_t rows = t->shape[0];
  if (row_begin < 0 || row_count < 0 || row_begin > rows || row_count > rows - row_begin) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": tensor ", Quoted(name), " rows [",
                                              row_begin, ", ", row_begin + row_count,
                                              ") outside shape ", t->ShapeString()));
  }
  const int64_t row_elems = rows == 0 ? 0 : t->numel() / rows;
  const char* src = data_ + t->begin + row_begin * row_elems * DTypeSize(t->dtype);
  return ConvertElements(t->dtype, src, out_dtype, dst, row_count * row_elems);
}

absl::Status SafetensorsFile::ReadCols(std::string_view name,
                                       absl::Span<const int64_t> expected_shape, int64_t col_begin,
                                       int64_t col_count, DType out_dtype, void* dst) const {
  TP_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* t, Lookup(name, expected_shape, out_dtype));
  if (t->shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor ", Quoted(name), " has shape ",
                                                   t->ShapeString(),
                                                   "; column slices need a 2-D tensor"));
  }
  const int64_t rows = t->shape[0];
  const int64_t cols = t->shape[1];
  if (col_begin < 0 || col_count < 0 || col_begin > cols || col_count > cols - col_begin) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": tensor ", Quoted(name), " columns [",
                                              col_begin, ", ", col_begin + col_count,
                                              ") outside shape ", t->ShapeString()));
  }
  const size_t in_elem = DTypeSize(t->dtype);
  const size_t out_elem = DTypeSize(out_dtype);
  for (int64_t r = 0; r < rows; ++r) {
    const char* src = data_ + t->begin + (r * cols + col_begin) * in_elem;
    char* d = static_cast<char*>(dst) + r * col_count * out_elem;
    TP_RETURN_IF_ERROR(ConvertElements(t->dtype, src, out_dtype, d, col_count));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string_view> SafetensorsFile::RawBytes(std::string_view name) const {
  const SafetensorsTensorInfo* t = Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat(path_, ": no tensor ", Quoted(name)));
  return std::string_view(data_ + t->begin, t->end - t->begin);
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<Entry> entries,
    const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const Entry& e : entries) {
    if (e.name.empty() || e.name == "__metadata__" || header.contains(e.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": bad or duplicate tensor name ", Quoted(e.name)));
    }
    uint64_t bytes = DTypeSize(e.dtype);
    for (int64_t d : e.shape) {
      if (d < 0)
        return absl::InvalidArgumentError(absl::StrCat(path, ": negative dim in ", e.name));
      bytes *= static_cast<uint64_t>(d);
    }
    header[e.name] = {{"dtype", StoredName(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data section 8-byte aligned

  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->path_ = path;
  w->data_size_ = offset;
  w->fd_ = ::open((path + ".tmp").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat(path, ".tmp: cannot create: ", std::strerror(errno)));
  }
  unsigned char len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  TP_RETURN_IF_ERROR(WriteAll(w->fd_, len, 8, path));
  TP_RETURN_IF_ERROR(WriteAll(w->fd_, text.data(), text.size(), path));
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink((path_ + ".tmp").c_str());
  }
}

absl::Status SafetensorsWriter::Append(const void* data, size_t bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": writer is closed"));
  if (bytes > data_size_ - written_) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": more data than the header declares (", data_size_, " bytes)"));
  }
  TP_RETURN_IF_ERROR(WriteAll(fd_, data, bytes, path_));
  written_ += bytes;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": writer is closed"));
  if (written_ != data_size_) {
    return absl::FailedPreconditionError(absl::StrCat(
        path_, ": wrote ", written_, " of the ", data_size_, " data bytes the header declares"));
  }
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    ::unlink((path_ + ".tmp").c_str());
    return absl::InternalError(absl::StrCat(path_, ": close failed: ", std::strerror(errno)));
  }
  if (std::rename((path_ + ".tmp").c_str(), path_.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(path_, ": rename failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [name, t] : tensors) {
    if (t.device != Device::kCpu) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", name, " is not on the host"));
    }
    entries.push_back({name, t.dtype, std::vector<int64_t>(t.shape, t.shape + t.ndim)});
  }
  TP_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::Create(path, std::move(entries), metadata));
  for (const auto& [name, t] : tensors) {
    TP_RETURN_IF_ERROR(writer->Append(t.data, t.bytes()));
  }
  return writer->Finish();
}

}  // namespace tpserve
