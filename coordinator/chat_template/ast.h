// Syntax tree of a parsed chat template: expressions and statements, each with its source line.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "coordinator/chat_template/value.h"

namespace tpserve::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,  // value
    kName,     // name
    kList,     // items
    kTuple,    // items
    kDict,     // items (key, value pairs flattened: k0, v0, k1, v1 ...)
    kAttr,     // items[0] . name
    kIndex,    // items[0] [ items[1] ]
    kSlice,    // items[0] [ items[1] : items[2] : items[3] ] (null entries are omitted bounds)
    kCall,     // items[0] ( args )
    kFilter,   // items[0] | name ( args )
    kTest,     // items[0] is [not] name ( args )
    kUnary,    // op items[0]  (op: "-", "+", "not")
    kBinary,   // items[0] op items[1]
    kCond,     // items[1] if items[0] else items[2] (items[2] may be null)
  };
  Kind kind;
  int line = 0;
  Value value;
  std::string name;  // name, attribute, filter, test, or operator
  bool negated = false;
  std::vector<ExprPtr> items;
  std::vector<ExprPtr> args;  // call / filter / test positional arguments
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind {
    kText,    // text
    kOutput,  // {{ expr }}
    kIf,      // conds[i] -> bodies[i]; else_body
    kFor,     // targets in expr [if cond] body; else_body
    kSet,     // targets (or target_object.attr) = expr, or a block set (body)
    kMacro,   // name(params) body
    kBreak,
    kContinue,
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  std::vector<ExprPtr> conds;
  std::vector<Body> bodies;
  Body body;
  Body else_body;
  bool has_else = false;
  std::vector<std::string> targets;                     // for / set names
  std::string attr;                                     // set ns.attr: targets[0] is the object
  std::string name;                                     // macro name
  std::vector<std::pair<std::string, ExprPtr>> params;  // macro parameters with defaults
};

}  // namespace tpserve::jinja
