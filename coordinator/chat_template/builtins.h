// The filters, tests, methods and global functions chat templates may use. The parser checks
// names against these lists so that a template using anything else fails when it is loaded.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "coordinator/chat_template/value.h"

namespace tpserve::jinja {

bool IsKnownFilter(const std::string& name);
bool IsKnownTest(const std::string& name);
// Methods of str, dict and list values (`s.strip()`, `d.items()`, ...).
bool IsKnownMethod(const std::string& name);
// raise_exception, range, namespace, dict, strftime_now.
bool IsKnownGlobalFunction(const std::string& name);

// Each returns InvalidArgument with a message (no line: the caller adds it) on a bad operand.
absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& input, CallArgs& args);
absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& input, CallArgs& args);
absl::StatusOr<Value> CallMethod(const Value& object, const std::string& name, CallArgs& args);
// The global functions as values (raise_exception's error message is exactly its argument).
Value MakeGlobalFunction(const std::string& name);

// Python's str.strip() whitespace set, used by trim and the strip methods.
std::string StripChars(const std::string& s, const std::string* chars, bool left, bool right);

}  // namespace tpserve::jinja
