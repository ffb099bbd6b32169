// UTF-8 helpers and the PCRE2 regex wrapper used by the tokenizer pipeline (internal).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tpserve::tok {

// Debian's abseil has its own string_view type: convert for absl containers and StrCat.
inline absl::string_view AbslView(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

// Byte length of the UTF-8 sequence starting with lead byte `c` (input assumed valid).
inline int Utf8SeqLen(unsigned char c) { return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }
// Decodes the code point at s[i] (valid UTF-8 assumed); sets *len to its byte length.
int32_t DecodeCodePoint(std::string_view s, size_t i, int* len);
void AppendCodePoint(std::string* out, int32_t cp);
bool IsValidUtf8(std::string_view s);
// Replaces each maximal ill-formed subsequence by U+FFFD (like Rust's from_utf8_lossy).
std::string Utf8Lossy(std::string_view s);
// True when `s` ends with U+FFFD (what an incomplete trailing character decodes to).
bool EndsWithReplacementChar(std::string_view s);

// Unicode predicates matching Rust's char methods (utf8proc categories).
bool IsWhitespace(int32_t cp);    // char::is_whitespace (White_Space property)
bool IsNumeric(int32_t cp);       // char::is_numeric (Nd, Nl, No)
bool IsPunctuation(int32_t cp);   // ASCII punctuation or a P* category
bool IsAlphanumeric(int32_t cp);  // char::is_alphanumeric (L*, N*)
bool IsWordChar(int32_t cp);      // regex \w: L*, M*, Nd, Pc (+ Nl, No via alphanumeric)

// A compiled PCRE2 pattern (UTF, UCP, JIT). Matching is thread-safe.
class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal);
  ~Regex();
  // All non-overlapping matches, left to right, as byte ranges (empty matches included; after an
  // empty match the search resumes one character later). `s` must be valid UTF-8.
  void FindAll(std::string_view s, std::vector<std::pair<size_t, size_t>>* out) const;

 private:
  Regex() = default;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

}  // namespace tpserve::tok
