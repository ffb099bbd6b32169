// Normalizers, pre-tokenizers, decoders and post-processors of tokenizer.json (internal).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tpserve::tok {

// A piece of text flowing through the pre-tokenizers. `at_start` is true when the piece begins at
// offset 0 of the original input (Metaspace prepend_scheme "first" needs it).
struct Piece {
  std::string_view text;  // points into the input or into the Arena
  bool at_start = false;
};

// Owns the strings that pre-tokenizers create (stable addresses).
using Arena = std::deque<std::string>;

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void Normalize(std::string* s) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Rewrites `pieces` in place (split, transform); empty pieces are dropped. New strings go to
  // `arena`.
  virtual void PreTokenize(std::vector<Piece>* pieces, Arena* arena) const = 0;
  // True for a ByteLevel pre-tokenizer: the tokenizer may then skip its byte -> unicode mapping
  // and let the BPE model work on raw bytes (see ByteLevelPreTokenizer::set_map_bytes).
  virtual bool IsByteLevel() const { return false; }
  virtual PreTokenizer* Last() { return this; }
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void DecodeChain(std::vector<std::string>* tokens) const = 0;
};

// Post-processing for a single sequence: ids before and after the encoded text.
struct PostProcessor {
  std::vector<int32_t> prefix;
  std::vector<int32_t> suffix;
};

absl::StatusOr<std::unique_ptr<Normalizer>> MakeNormalizer(const nlohmann::json& j,
                                                           const std::string& where);
absl::StatusOr<std::unique_ptr<PreTokenizer>> MakePreTokenizer(const nlohmann::json& j,
                                                               const std::string& where);
absl::StatusOr<std::unique_ptr<Decoder>> MakeDecoder(const nlohmann::json& j,
                                                     const std::string& where);
// `token_to_id` resolves token strings named by the processor.
absl::StatusOr<PostProcessor> MakePostProcessor(
    const nlohmann::json& j, const std::string& where,
    const std::function<std::optional<int32_t>(const std::string&)>& token_to_id);

// Tells a ByteLevel pre-tokenizer whether to map bytes to GPT-2 unicode characters.
void SetByteLevelMapping(PreTokenizer* byte_level, bool map_bytes);

}  // namespace tpserve::tok
