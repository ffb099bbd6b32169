// libFuzzer entry point for the safetensors header parser (optional; see CMakeLists.txt):
// the input is a whole file image; accepted images are read tensor by tensor, so ASan catches
// any read past the input.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto tensors = tpserve::ParseSafetensorsBytes(data, size, "fuzz.safetensors");
  if (!tensors.ok()) return 0;
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | data[i];
  const uint8_t* base = data + 8 + header;
  std::vector<float> out;
  for (const auto& t : *tensors) {
    if (!t.has_dtype || (t.dtype != tpserve::DType::kF32 && t.dtype != tpserve::DType::kBF16 &&
                         t.dtype != tpserve::DType::kF16)) {
      continue;
    }
    out.resize(static_cast<size_t>(t.numel()));
    (void)tpserve::ConvertElements(t.dtype, base + t.begin, tpserve::DType::kF32, out.data(),
                                   t.numel());
  }
  return 0;
}
