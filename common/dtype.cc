// DType names and the Tensor view's shape helpers.
#include "common/dtype.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"

namespace tpserve {

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kI64:
      return 8;
    case DType::kF8E4M3:
    case DType::kI8:
      return 1;
    case DType::kI4:
      return 0;
  }
  return 0;
}

int DTypeBits(DType t) { return t == DType::kI4 ? 4 : static_cast<int>(DTypeSize(t)) * 8; }

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kF8E4M3:
      return "f8e4m3";
    case DType::kI8:
      return "i8";
    case DType::kI4:
      return "i4";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "bf16" || name == "bfloat16" || name == "BF16") return DType::kBF16;
  if (name == "f32" || name == "fp32" || name == "float32" || name == "F32") return DType::kF32;
  if (name == "f16" || name == "fp16" || name == "float16" || name == "F16") return DType::kF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", std::string(name), "' (expected bf16, fp16 or fp32)"));
}

absl::StatusOr<std::optional<DType>> ParseKvCacheDType(std::string_view name) {
  if (name == "auto") return std::optional<DType>();
  if (name == "bf16") return std::optional<DType>(DType::kBF16);
  if (name == "fp32") return std::optional<DType>(DType::kF32);
  if (name == "fp8") return std::optional<DType>(DType::kF8E4M3);
  if (name == "int8") return std::optional<DType>(DType::kI8);
  if (name == "int4") return std::optional<DType>(DType::kI4);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV-cache dtype '", std::string(name),
                   "' (expected auto, bf16, fp32, fp8, int8 or int4)"));
}

std::string_view KvCacheDTypeName(DType t) {
  switch (t) {
    case DType::kBF16:
      return "bf16";
    case DType::kF32:
      return "fp32";
    case DType::kF8E4M3:
      return "fp8";
    case DType::kI8:
      return "int8";
    case DType::kI4:
      return "int4";
    default:
      return DTypeName(t);
  }
}

Tensor::Tensor(void* d, std::initializer_list<int64_t> dims, DType t, Device dev)
    : data(d), dtype(t), device(dev) {
  TP_CHECK(dims.size() <= kMaxDims) << "too many dims";
  for (int64_t v : dims) shape[ndim++] = v;
}

int64_t Tensor::numel() const {
  if (ndim == 0) return 0;
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

Tensor Tensor::rows(int64_t begin, int64_t count) const {
  TP_CHECK(ndim >= 1 && begin >= 0 && begin + count <= shape[0])
      << "rows(" << begin << ", " << count << ") of " << ShapeString();
  TP_CHECK(scales == nullptr) << "rows() of a quantized tensor " << ShapeString();
  Tensor t = *this;
  int64_t row_elems = shape[0] == 0 ? 0 : numel() / shape[0];
  t.data = static_cast<char*>(data) + begin * row_elems * DTypeBits(dtype) / 8;
  t.shape[0] = count;
  return t;
}

Tensor Tensor::reshape(std::initializer_list<int64_t> dims) const {
  Tensor t(data, dims, dtype, device);
  t.scales = scales;
  TP_CHECK(t.numel() == numel()) << "reshape of " << ShapeString() << " to " << t.ShapeString();
  return t;
}

std::string Tensor::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, shape + ndim, ", "), "] ",
                      std::string(DTypeName(dtype)));
}

}  // namespace tpserve
