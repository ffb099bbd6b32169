// libFuzzer target of the tokenizer on arbitrary bytes: models/tiny-coder's tokenizer.json
// encodes any byte string (with and without special tokens) to ids inside the vocabulary, and
// decodes any id sequence, without a crash or sanitizer report.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "coordinator/tokenizer/tokenizer.h"

namespace {

const tpserve::Tokenizer& TheTokenizer() {
  static const tpserve::Tokenizer* const t = [] {
    const char* src = std::getenv("TPSERVE_SOURCE_DIR");
    const std::string dir = std::string(src ? src : ".") + "/models/tiny-coder";
    auto loaded = tpserve::Tokenizer::Load(dir);
    if (!loaded.ok()) {
      std::fprintf(stderr, "cannot load %s: %s\n", dir.c_str(),
                   std::string(loaded.status().message()).c_str());
      std::abort();
    }
    return loaded->release();
  }();
  return *t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const tpserve::Tokenizer& t = TheTokenizer();
  if (size == 0) return 0;
  const int32_t vocab = t.vocab_size();
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] % 2 == 0) {
    for (bool special : {false, true}) {
      const std::vector<int32_t> ids = t.Encode(rest, special);
      for (int32_t id : ids) {
        if (id < 0 || id >= vocab) {
          std::fprintf(stderr, "Encode gave id %d outside [0, %d)\n", id, vocab);
          std::abort();
        }
      }
      (void)t.Decode(ids, /*skip_special_tokens=*/false);
    }
  } else {
    // Pairs of bytes as ids inside the vocabulary.
    std::vector<int32_t> ids;
    for (size_t i = 0; i + 1 < rest.size(); i += 2) {
      const int32_t v = static_cast<uint8_t>(rest[i]) | (static_cast<uint8_t>(rest[i + 1]) << 8);
      ids.push_back(v % vocab);
    }
    (void)t.Decode(ids, /*skip_special_tokens=*/data[0] % 4 == 1);
  }
  return 0;
}
