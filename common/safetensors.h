// One .safetensors file: a validated, memory-mapped (read-only) reader that converts bf16/fp16/
// fp32 to the caller's dtype, whole or as a row/column slice; and a streaming writer.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace tpserve {

// One tensor of a safetensors header. Offsets are relative to the start of the data section.
struct SafetensorsTensorInfo {
  std::string name;
  std::string dtype_name;  // as stored: "BF16", "F16", "F32", "I64", ...
  bool has_dtype = false;  // whether `dtype` maps the stored type (F32, BF16, F16, I32, I64)
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;

  int64_t numel() const;
  std::string ShapeString() const;  // "[4096, 11008]"
};

// Parses and validates a safetensors header against a data section of `data_size` bytes:
// dtypes, shapes against byte sizes, offsets in range, no overlaps. `source` names the file.
absl::StatusOr<std::vector<SafetensorsTensorInfo>> ParseSafetensorsHeader(
    std::string_view header_json, uint64_t data_size, std::string_view source);

// Validates a whole file image (8-byte length, header, data) held in memory; returns the
// tensors. Never reads outside [bytes, bytes + size).
absl::StatusOr<std::vector<SafetensorsTensorInfo>> ParseSafetensorsBytes(const void* bytes,
                                                                         uint64_t size,
                                                                         std::string_view source);

// Converts `n` elements from `src_dtype` to `dst_dtype` (each F32, BF16 or F16). `src` may be
// unaligned.
absl::Status ConvertElements(DType src_dtype, const void* src, DType dst_dtype, void* dst,
                             int64_t n);

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  const SafetensorsTensorInfo* Find(std::string_view name) const;

  // The whole tensor, converted to `out_dtype` (F32, BF16 or F16) into `dst`
  // (numel * DTypeSize(out_dtype) bytes). The stored shape must equal `expected_shape`.
  absl::Status Read(std::string_view name, absl::Span<const int64_t> expected_shape,
                    DType out_dtype, void* dst) const;
  // Rows [row_begin, row_begin + row_count) along dim 0 (any rank), contiguous in `dst`.
  absl::Status ReadRows(std::string_view name, absl::Span<const int64_t> expected_shape,
                        int64_t row_begin, int64_t row_count, DType out_dtype, void* dst) const;
  // Columns [col_begin, col_begin + col_count) of a 2-D tensor: dst is [rows, col_count].
  absl::Status ReadCols(std::string_view name, absl::Span<const int64_t> expected_shape,
                        int64_t col_begin, int64_t col_count, DType out_dtype, void* dst) const;
  // The stored bytes of one tensor (inside the mapping).
  absl::StatusOr<std::string_view> RawBytes(std::string_view name) const;

 private:
  SafetensorsFile() = default;
  absl::StatusOr<const SafetensorsTensorInfo*> Lookup(std::string_view name,
                                                      absl::Span<const int64_t> expected_shape,
                                                      DType out_dtype) const;

  std::string path_;
  const char* map_ = nullptr;
  uint64_t map_size_ = 0;
  const char* data_ = nullptr;  // start of the data section
  std::vector<SafetensorsTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
};

// Streaming writer: the header (names, dtypes, shapes) is written first, then the tensors'
// bytes are appended in the declared order, in as many pieces as the caller likes.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<Entry> entries,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();

  // Appends the next bytes of the data section (tensor after tensor, in declared order).
  absl::Status Append(const void* data, size_t bytes);
  // Checks that every declared byte was written, then closes the file.
  absl::Status Finish();

 private:
  SafetensorsWriter() = default;
  std::string path_;
  int fd_ = -1;
  uint64_t data_size_ = 0;
  uint64_t written_ = 0;
};

// Writes host tensors (F32, BF16, F16, I32, I64) to one file; `metadata` goes to __metadata__.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace tpserve
