// A compiled Jinja template of the subset Hugging Face chat templates use: parsed once (all
// unsupported constructs are load errors), rendered many times against a dict of variables.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/chat_template/parser.h"
#include "coordinator/chat_template/value.h"

namespace tpserve::jinja {

// Bounds of one render: a template that loops or grows without end fails instead of hanging.
struct RenderLimits {
  size_t max_output_bytes = 64u << 20;
  int64_t max_steps = 10'000'000;  // statements run, loop iterations and calls
  int max_call_depth = 64;         // macro recursion
};

// Whether a Render error is the template's own raise_exception(msg) (its message is exactly msg).
bool IsRaisedError(const absl::Status& status);

class Template {
 public:
  // InvalidArgument "line N: ..." naming what cannot be parsed or is unsupported.
  static absl::StatusOr<std::unique_ptr<Template>> Parse(const std::string& source);

  // `variables` is a dict (Value::NewObject()). Errors: raise_exception(msg) gives
  // InvalidArgument with exactly msg; other render errors are InvalidArgument "line N: ...".
  absl::StatusOr<std::string> Render(const Value& variables,
                                     const RenderLimits& limits = RenderLimits()) const;

 private:
  explicit Template(Program program) : program_(std::move(program)) {}
  Program program_;
};

}  // namespace tpserve::jinja
