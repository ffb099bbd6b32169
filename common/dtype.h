// Element types, devices and the non-owning tensor view every op takes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tpserve {

// kF8E4M3, kI8 and kI4 are the quantized KV-cache types (kernels/kv_quant.h): kI4 packs two
// elements a byte (element 2i in the low nibble).
enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kI64, kF8E4M3, kI8, kI4 };
enum class Device : uint8_t { kCpu, kCuda };

size_t DTypeSize(DType t);            // bytes an element; 0 for kI4 (use DTypeBits)
int DTypeBits(DType t);               // bits an element
std::string_view DTypeName(DType t);  // "f32", "bf16", ...
absl::StatusOr<DType> ParseDType(std::string_view name);  // accepts bf16/fp32/f32/fp16/f16/...
// --kv-cache-dtype: "auto" (nullopt: the compute dtype), "bf16", "fp32", "fp8" (e4m3), "int8",
// "int4". Anything else is an error that lists the choices.
absl::StatusOr<std::optional<DType>> ParseKvCacheDType(std::string_view name);
// The flag's name of a KV-cache dtype: "bf16", "fp32", "fp8", "int8", "int4".
std::string_view KvCacheDTypeName(DType t);

// A tensor view: pointer, shape (row-major, contiguous), dtype, device. No ownership.
struct Tensor {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int ndim = 0;
  DType dtype = DType::kF32;
  Device device = Device::kCpu;
  // Quantized KV pools only (kF8E4M3, kI8, kI4): their f32 scales, laid out as
  // kernels/kv_quant.h says. Null for every other tensor.
  void* scales = nullptr;

  Tensor() = default;
  Tensor(void* d, std::initializer_list<int64_t> dims, DType t, Device dev = Device::kCpu);

  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  int64_t numel() const;
  size_t bytes() const { return static_cast<size_t>(numel()) * DTypeBits(dtype) / 8; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  // Rows [begin, begin+count) along the first dimension.
  Tensor rows(int64_t begin, int64_t count) const;
  // Same data, new shape with the same element count.
  Tensor reshape(std::initializer_list<int64_t> dims) const;
  std::string ShapeString() const;  // "[2, 3] bf16"
};

}  // namespace tpserve
