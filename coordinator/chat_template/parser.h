// Parser of chat templates: tokens to a syntax tree. Everything the interpreter cannot render
// (an unknown tag, filter, test, method or function) is an error here, naming it and its line.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "coordinator/chat_template/ast.h"

namespace tpserve::jinja {

struct Program {
  Body body;
};

absl::StatusOr<Program> ParseTemplate(const std::string& source);

}  // namespace tpserve::jinja
