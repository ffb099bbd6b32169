// absl::Status helpers shared by every library: early-return macros and error constructors.
#pragma once

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define TP_STATUS_CONCAT_INNER(a, b) a##b
#define TP_STATUS_CONCAT(a, b) TP_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define TP_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status _tp_status = (expr);      \
    if (!_tp_status.ok()) return _tp_status; \
  } while (0)

// `lhs = value of expr` where expr is an absl::StatusOr<T>; returns its status on error.
#define TP_ASSIGN_OR_RETURN(lhs, expr) \
  TP_ASSIGN_OR_RETURN_IMPL(TP_STATUS_CONCAT(_tp_statusor_, __LINE__), lhs, expr)
#define TP_ASSIGN_OR_RETURN_IMPL(var, lhs, expr) \
  auto var = (expr);                             \
  if (!var.ok()) return var.status();            \
  lhs = std::move(var).value()

namespace tpserve {

// Adds context in front of a status message, keeping its code: "reading x: <original>".
inline absl::Status Annotate(const absl::Status& s, absl::string_view context) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

}  // namespace tpserve
