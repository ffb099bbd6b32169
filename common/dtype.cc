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
  }
  return 0;
}

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
  Tensor t = *this;
  int64_t row_elems = shape[0] == 0 ? 0 : numel() / shape[0];
  t.data = static_cast<char*>(data) + begin * row_elems * DTypeSize(dtype);
  t.shape[0] = count;
  return t;
}

Tensor Tensor::reshape(std::initializer_list<int64_t> dims) const {
  Tensor t(data, dims, dtype, device);
  TP_CHECK(t.numel() == numel()) << "reshape of " << ShapeString() << " to " << t.ShapeString();
  return t;
}

std::string Tensor::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, shape + ndim, ", "), "] ",
                      std::string(DTypeName(dtype)));
}

}  // namespace tpserve
