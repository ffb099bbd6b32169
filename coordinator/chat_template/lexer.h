// Tokenizer of chat templates: text, {{ }}, {% %}, {# #} with whitespace control and the
// trim_blocks / lstrip_blocks behaviour Hugging Face renders with; tokens carry their line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tpserve::jinja {

struct Token {
  enum class Kind {
    kText,
    kExprOpen,   // {{
    kExprClose,  // }}
    kStmtOpen,   // {%
    kStmtClose,  // %}
    kName,
    kString,
    kInt,
    kFloat,
    kOp,  // operators and punctuation: + - * / // % ** ~ == != < <= > >= = ( ) [ ] { } , . : |
    kEnd,
  };
  Kind kind;
  std::string text;  // text, name, operator, or the decoded string literal
  int line = 1;
  int64_t int_value = 0;
  double float_value = 0;
};

// Splits `source` into tokens. trim_blocks: the first newline after a block tag or comment is
// dropped; lstrip_blocks: spaces and tabs from the start of a line up to a block tag or comment
// are dropped; a single trailing newline of the template is dropped (keep_trailing_newline off).
absl::StatusOr<std::vector<Token>> Tokenize(const std::string& source);

}  // namespace tpserve::jinja
