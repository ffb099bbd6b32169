// Renders a parsed chat template: Jinja scoping (for loops and macros open a scope, if does not;
// namespaces carry values out of loops), Python operator semantics, and bounded work.
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "coordinator/chat_template/builtins.h"
#include "coordinator/chat_template/jinja.h"

namespace tpserve::jinja {
namespace {

struct Scope {
  explicit Scope(std::shared_ptr<Scope> p) : parent(std::move(p)) {}
  const Value* Lookup(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
  absl::flat_hash_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
};
using ScopePtr = std::shared_ptr<Scope>;

enum class Flow { kNormal, kBreak, kContinue };

constexpr int kMaxValueDepth = 128;
constexpr char kRaisedPayload[] = "tpserve.jinja.raise_exception";

bool CheckedMul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

class Interpreter {
 public:
  explicit Interpreter(const RenderLimits& limits) : limits_(limits) {}

  absl::Status Run(const Body& body, const Value& variables, std::string& out) {
    auto globals = std::make_shared<Scope>(nullptr);
    for (const char* f : {"range", "namespace", "dict", "strftime_now"}) {
      globals->vars[f] = MakeGlobalFunction(f);
    }
    globals->vars["raise_exception"] = Value::Function([](CallArgs& args) -> absl::StatusOr<Value> {
      std::string msg = args.positional.empty() ? "" : args.positional[0].ToString();
      absl::Status s = absl::InvalidArgumentError(msg);
      s.SetPayload(kRaisedPayload, absl::Cord("1"));
      return s;
    });
    auto top = std::make_shared<Scope>(globals);
    if (variables.is_object()) {
      for (const auto& [k, v] : variables.object().items()) top->vars[k] = v;
    }
    return Exec(body, top, out);
  }

 private:
  absl::Status Err(int line, const std::string& msg) const {
    return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", msg));
  }
  // Adds the line to errors of builtins; an error raised by the template passes unchanged.
  absl::Status AtLine(int line, const absl::Status& s) const {
    if (s.ok() || IsRaisedError(s)) return s;
    if (absl::StartsWith(s.message(), "line ")) return s;
    return Err(line, std::string(s.message()));
  }
  absl::Status Step(int line) {
    if (++steps_ > limits_.max_steps) return Err(line, "template exceeded its step limit");
    return absl::OkStatus();
  }
  absl::Status Append(std::string& out, const std::string& s, int line) {
    if (out.size() + s.size() > limits_.max_output_bytes) {
      return Err(line, "rendered text exceeds its size limit");
    }
    out += s;
    return absl::OkStatus();
  }

  absl::Status Exec(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const StmtPtr& s : body) {
      TP_RETURN_IF_ERROR(ExecOne(*s, scope, out));
      if (flow_ != Flow::kNormal) return absl::OkStatus();
    }
    return absl::OkStatus();
  }

  absl::Status ExecOne(const Stmt& s, const ScopePtr& scope, std::string& out) {
    TP_RETURN_IF_ERROR(Step(s.line));
    switch (s.kind) {
      case Stmt::Kind::kText:
        return Append(out, s.text, s.line);
      case Stmt::Kind::kOutput: {
        TP_ASSIGN_OR_RETURN(Value v, Eval(*s.expr, scope));
        return Append(out, v.ToString(), s.line);
      }
      case Stmt::Kind::kIf: {
        for (size_t i = 0; i < s.conds.size(); ++i) {
          TP_ASSIGN_OR_RETURN(Value c, Eval(*s.conds[i], scope));
          if (c.Truthy()) return Exec(s.bodies[i], scope, out);
        }
        if (s.has_else) return Exec(s.else_body, scope, out);
        return absl::OkStatus();
      }
      case Stmt::Kind::kFor:
        return ExecFor(s, scope, out);
      case Stmt::Kind::kSet:
        return ExecSet(s, scope);
      case Stmt::Kind::kMacro:
        scope->vars[s.name] = MakeMacro(s, scope);
        return absl::OkStatus();
      case Stmt::Kind::kBreak:
        flow_ = Flow::kBreak;
        return absl::OkStatus();
      case Stmt::Kind::kContinue:
        flow_ = Flow::kContinue;
        return absl::OkStatus();
    }
    return absl::OkStatus();
  }

  absl::Status Bind(const std::vector<std::string>& targets, const Value& v, Scope& scope,
                    int line) {
    if (targets.size() == 1) {
      scope.vars[targets[0]] = v;
      return absl::OkStatus();
    }
    if (!v.is_array()) {
      return Err(line, absl::StrCat("cannot unpack a '", v.TypeName(), "' into ", targets.size(),
                                    " names"));
    }
    if (v.array().size() != targets.size()) {
      return Err(line, absl::StrCat("cannot unpack ", v.array().size(), " values into ",
                                    targets.size(), " names"));
    }
    for (size_t i = 0; i < targets.size(); ++i) scope.vars[targets[i]] = v.array()[i];
    return absl::OkStatus();
  }

  absl::Status ExecFor(const Stmt& s, const ScopePtr& scope, std::string& out) {
    TP_ASSIGN_OR_RETURN(Value seq, Eval(*s.expr, scope));
    Value::Array items;
    switch (seq.kind()) {
      case Value::Kind::kArray:
        items = seq.array();  // a copy: the body may not change what is iterated
        break;
      case Value::Kind::kObject:
        if (seq.is_namespace()) return Err(s.line, "a namespace is not iterable");
        for (const auto& kv : seq.object().items()) items.push_back(Value::String(kv.first));
        break;
      case Value::Kind::kString:
        for (auto& c : Utf8Chars(seq.str())) items.push_back(Value::String(std::move(c)));
        break;
      case Value::Kind::kUndefined:
        break;
      default:
        return Err(s.line, absl::StrCat("'", seq.TypeName(), "' object is not iterable"));
    }
    auto loop_scope = std::make_shared<Scope>(scope);
    if (s.cond) {  // `for x in xs if cond`: filtered before the loop, so loop.* counts kept items
      Value::Array kept;
      for (const Value& item : items) {
        TP_RETURN_IF_ERROR(Step(s.line));
        TP_RETURN_IF_ERROR(Bind(s.targets, item, *loop_scope, s.line));
        TP_ASSIGN_OR_RETURN(Value c, Eval(*s.cond, loop_scope));
        if (c.Truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (s.has_else) return Exec(s.else_body, scope, out);
      return absl::OkStatus();
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      TP_RETURN_IF_ERROR(Step(s.line));
      auto iter_scope = std::make_shared<Scope>(scope);
      TP_RETURN_IF_ERROR(Bind(s.targets, items[i], *iter_scope, s.line));
      Value loop = Value::NewObject();
      ObjectData& l = loop.object();
      l.Set("index", Value::Int(i + 1));
      l.Set("index0", Value::Int(i));
      l.Set("revindex", Value::Int(n - i));
      l.Set("revindex0", Value::Int(n - i - 1));
      l.Set("first", Value::Bool(i == 0));
      l.Set("last", Value::Bool(i == n - 1));
      l.Set("length", Value::Int(n));
      l.Set("previtem", i > 0 ? items[i - 1] : Value());
      l.Set("nextitem", i + 1 < n ? items[i + 1] : Value());
      iter_scope->vars["loop"] = loop;
      TP_RETURN_IF_ERROR(Exec(s.body, iter_scope, out));
      if (flow_ == Flow::kBreak) {
        flow_ = Flow::kNormal;
        break;
      }
      flow_ = Flow::kNormal;
    }
    return absl::OkStatus();
  }

  absl::Status ExecSet(const Stmt& s, const ScopePtr& scope) {
    Value v;
    if (s.expr) {
      TP_ASSIGN_OR_RETURN(v, Eval(*s.expr, scope));
    } else {
      std::string captured;
      TP_RETURN_IF_ERROR(Exec(s.body, scope, captured));
      v = Value::String(std::move(captured));
    }
    if (!s.attr.empty()) {
      const Value* target = scope->Lookup(s.targets[0]);
      if (target == nullptr || !target->is_namespace()) {
        return Err(s.line, absl::StrCat("cannot assign attribute '", s.attr, "' of '", s.targets[0],
                                        "': it is not a namespace"));
      }
      if (v.ContainsNamespace()) {  // would let a namespace reach itself
        return Err(s.line, "a namespace cannot be stored in a namespace attribute");
      }
      if (v.depth() >= kMaxValueDepth) return Err(s.line, "value nested too deeply");
      target->object().Set(s.attr, std::move(v));
      return absl::OkStatus();
    }
    return Bind(s.targets, v, *scope, s.line);
  }

  Value MakeMacro(const Stmt& s, const ScopePtr& defining_scope) {
    // The macro keeps its defining scope alive; it cannot outlive this render.
    const Stmt* stmt = &s;
    std::weak_ptr<Scope> weak = defining_scope;
    return Value::Function([this, stmt, weak](CallArgs& args) -> absl::StatusOr<Value> {
      ScopePtr parent = weak.lock();
      if (++call_depth_ > limits_.max_call_depth) {
        --call_depth_;
        return Err(stmt->line, "macro calls nested too deeply");
      }
      auto scope = std::make_shared<Scope>(parent);
      if (args.positional.size() > stmt->params.size()) {
        --call_depth_;
        return Err(stmt->line, absl::StrCat("macro '", stmt->name, "' takes ", stmt->params.size(),
                                            " arguments"));
      }
      for (size_t i = 0; i < stmt->params.size(); ++i) {
        const auto& [pname, def] = stmt->params[i];
        const Value* given = i < args.positional.size() ? &args.positional[i] : nullptr;
        for (const auto& [k, v] : args.keyword) {
          if (k == pname) given = &v;
        }
        if (given) {
          scope->vars[pname] = *given;
        } else if (def) {
          absl::StatusOr<Value> d = Eval(*def, scope);
          if (!d.ok()) {
            --call_depth_;
            return d.status();
          }
          scope->vars[pname] = *d;
        } else {
          scope->vars[pname] = Value();
        }
      }
      for (const auto& [k, v] : args.keyword) {
        bool known = false;
        for (const auto& p : stmt->params) known |= p.first == k;
        if (!known) {
          --call_depth_;
          return Err(stmt->line,
                     absl::StrCat("macro '", stmt->name, "' has no parameter '", k, "'"));
        }
      }
      std::string out;
      absl::Status st = Exec(stmt->body, scope, out);
      flow_ = Flow::kNormal;
      --call_depth_;
      if (!st.ok()) return st;
      return Value::String(std::move(out));
    });
  }

  absl::StatusOr<CallArgs> EvalArgs(const Expr& e, const ScopePtr& scope) {
    CallArgs args;
    for (const ExprPtr& a : e.args) {
      TP_ASSIGN_OR_RETURN(Value v, Eval(*a, scope));
      args.positional.push_back(std::move(v));
    }
    for (const auto& [k, a] : e.kwargs) {
      TP_ASSIGN_OR_RETURN(Value v, Eval(*a, scope));
      args.keyword.emplace_back(k, std::move(v));
    }
    return args;
  }

  // How an error names the expression: `messages[0].x`, or "a value" when it has no short name.
  static std::string Describe(const Expr& e) {
    std::string d = Path(e);
    return d.empty() ? "a value" : "'" + d + "'";
  }
  static std::string Path(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::kName:
        return e.name;
      case Expr::Kind::kAttr: {
        std::string base = Path(*e.items[0]);
        return base.empty() ? "" : base + "." + e.name;
      }
      case Expr::Kind::kIndex: {
        std::string base = Path(*e.items[0]);
        const Expr& key = *e.items[1];
        if (base.empty() || key.kind != Expr::Kind::kLiteral) return "";
        return base + "[" + key.value.Repr() + "]";
      }
      default:
        return "";
    }
  }

  absl::StatusOr<Value> Eval(const Expr& e, const ScopePtr& scope) {
    if (++eval_depth_ > 400) {
      --eval_depth_;
      return Err(e.line, "expression nested too deeply");
    }
    absl::StatusOr<Value> r = EvalInner(e, scope);
    --eval_depth_;
    // Values nested deeper than this are refused so that recursion over them (str, ==, tojson,
    // destruction) stays shallow.
    if (r.ok() && r->depth() > kMaxValueDepth) {
      return Err(e.line, "value nested too deeply");
    }
    return r;
  }

  absl::StatusOr<Value> EvalInner(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.value;
      case Expr::Kind::kName: {
        const Value* v = scope->Lookup(e.name);
        return v ? *v : Value();
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        Value::Array items;
        for (const ExprPtr& x : e.items) {
          TP_ASSIGN_OR_RETURN(Value v, Eval(*x, scope));
          items.push_back(std::move(v));
        }
        if (e.kind == Expr::Kind::kTuple) return Value::NewTuple(std::move(items));
        return Value::NewArray(std::move(items));
      }
      case Expr::Kind::kDict: {
        Value d = Value::NewObject();
        for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
          TP_ASSIGN_OR_RETURN(Value k, Eval(*e.items[i], scope));
          if (!k.is_string()) return Err(e.line, "dict keys must be strings");
          TP_ASSIGN_OR_RETURN(Value v, Eval(*e.items[i + 1], scope));
          d.object().Set(k.str(), std::move(v));
        }
        return d;
      }
      case Expr::Kind::kAttr: {
        TP_ASSIGN_OR_RETURN(Value obj, Eval(*e.items[0], scope));
        if (obj.is_undefined()) {
          return Err(e.line, absl::StrCat(Describe(*e.items[0]), " is undefined (reading '.",
                                          e.name, "')"));
        }
        if (obj.is_object()) {
          const Value* f = obj.object().Find(e.name);
          return f ? *f : Value();
        }
        return Value();
      }
      case Expr::Kind::kIndex: {
        TP_ASSIGN_OR_RETURN(Value obj, Eval(*e.items[0], scope));
        TP_ASSIGN_OR_RETURN(Value key, Eval(*e.items[1], scope));
        if (obj.is_undefined()) {
          return Err(e.line, absl::StrCat(Describe(*e.items[0]), " is undefined (indexing it)"));
        }
        return Index(obj, key);
      }
      case Expr::Kind::kSlice:
        return EvalSlice(e, scope);
      case Expr::Kind::kCall:
        return EvalCall(e, scope);
      case Expr::Kind::kFilter: {
        TP_ASSIGN_OR_RETURN(Value input, Eval(*e.items[0], scope));
        TP_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, scope));
        absl::StatusOr<Value> r = ApplyFilter(e.name, input, args);
        if (!r.ok()) return AtLine(e.line, r.status());
        return r;
      }
      case Expr::Kind::kTest: {
        TP_ASSIGN_OR_RETURN(Value input, Eval(*e.items[0], scope));
        TP_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, scope));
        absl::StatusOr<bool> r = ApplyTest(e.name, input, args);
        if (!r.ok()) return AtLine(e.line, r.status());
        return Value::Bool(*r != e.negated);
      }
      case Expr::Kind::kUnary: {
        TP_ASSIGN_OR_RETURN(Value v, Eval(*e.items[0], scope));
        if (e.name == "not") return Value::Bool(!v.Truthy());
        if (v.is_int()) {
          if (e.name == "-" && v.int_value() == INT64_MIN) return Err(e.line, "integer overflow");
          return Value::Int(e.name == "-" ? -v.int_value() : v.int_value());
        }
        if (v.is_float()) return Value::Float(e.name == "-" ? -v.float_value() : v.float_value());
        if (v.is_bool())
          return Value::Int(e.name == "-" ? -int64_t{v.bool_value()} : v.bool_value());
        return Err(e.line,
                   absl::StrCat("bad operand type for unary ", e.name, ": '", v.TypeName(), "'"));
      }
      case Expr::Kind::kBinary:
        return EvalBinary(e, scope);
      case Expr::Kind::kCond: {
        TP_ASSIGN_OR_RETURN(Value c, Eval(*e.items[0], scope));
        if (c.Truthy()) return Eval(*e.items[1], scope);
        if (e.items[2]) return Eval(*e.items[2], scope);
        return Value();
      }
    }
    return Err(e.line, "unknown expression");
  }

  static Value Index(const Value& obj, const Value& key) {
    if (obj.is_array() && (key.is_int() || key.is_bool())) {
      int64_t i = key.is_bool() ? key.bool_value() : key.int_value();
      const int64_t n = static_cast<int64_t>(obj.array().size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value();
      return obj.array()[i];
    }
    if (obj.is_object() && key.is_string()) {
      const Value* f = obj.object().Find(key.str());
      return f ? *f : Value();
    }
    if (obj.is_string() && key.is_int()) {
      auto chars = Utf8Chars(obj.str());
      int64_t i = key.int_value();
      const int64_t n = static_cast<int64_t>(chars.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value();
      return Value::String(chars[i]);
    }
    return Value();
  }

  absl::StatusOr<Value> EvalSlice(const Expr& e, const ScopePtr& scope) {
    TP_ASSIGN_OR_RETURN(Value obj, Eval(*e.items[0], scope));
    int64_t bound[3] = {0, 0, 1};
    bool given[3] = {false, false, false};
    for (int k = 0; k < 3; ++k) {
      if (!e.items[k + 1]) continue;
      TP_ASSIGN_OR_RETURN(Value b, Eval(*e.items[k + 1], scope));
      if (b.is_none()) continue;
      if (!b.is_int()) return Err(e.line, "slice indices must be integers or none");
      bound[k] = b.int_value();
      given[k] = true;
    }
    const int64_t step = bound[2];
    if (step == 0) return Err(e.line, "slice step cannot be zero");
    std::vector<std::string> chars;
    int64_t n;
    if (obj.is_array()) {
      n = static_cast<int64_t>(obj.array().size());
    } else if (obj.is_string()) {
      chars = Utf8Chars(obj.str());
      n = static_cast<int64_t>(chars.size());
    } else if (obj.is_undefined()) {
      return Err(e.line, absl::StrCat(Describe(*e.items[0]), " is undefined (slicing it)"));
    } else {
      return Err(e.line, absl::StrCat("'", obj.TypeName(), "' object cannot be sliced"));
    }
    // Python's slice.indices().
    auto adjust = [&](int64_t v, bool is_given, int64_t def) {
      if (!is_given) return def;
      if (v < 0) {
        v += n;
        if (v < 0) v = step < 0 ? -1 : 0;
      } else if (v >= n) {
        v = step < 0 ? n - 1 : n;
      }
      return v;
    };
    int64_t start = adjust(bound[0], given[0], step < 0 ? n - 1 : 0);
    int64_t stop = adjust(bound[1], given[1], step < 0 ? -1 : n);
    Value::Array items;
    std::string s;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (obj.is_array()) {
        items.push_back(obj.array()[i]);
      } else {
        s += chars[i];
      }
    }
    if (obj.is_array()) return Value::NewArray(std::move(items));
    return Value::String(std::move(s));
  }

  absl::StatusOr<Value> EvalCall(const Expr& e, const ScopePtr& scope) {
    const Expr& callee = *e.items[0];
    TP_RETURN_IF_ERROR(Step(e.line));
    if (callee.kind == Expr::Kind::kAttr) {
      TP_ASSIGN_OR_RETURN(Value obj, Eval(*callee.items[0], scope));
      if (obj.is_undefined()) {
        return Err(e.line, absl::StrCat(Describe(*callee.items[0]), " is undefined (calling .",
                                        callee.name, "())"));
      }
      TP_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, scope));
      if (obj.is_namespace()) {  // a macro stored in a namespace
        const Value* f = obj.object().Find(callee.name);
        if (f && f->is_function()) return CallFunction(*f, args, e.line);
      }
      absl::StatusOr<Value> r = CallMethod(obj, callee.name, args);
      if (!r.ok()) return AtLine(e.line, r.status());
      return r;
    }
    TP_ASSIGN_OR_RETURN(Value f, Eval(callee, scope));
    TP_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, scope));
    if (!f.is_function()) {
      return Err(e.line, absl::StrCat(Describe(callee), " is not callable (it is ",
                                      f.is_undefined() ? "undefined" : f.TypeName(), ")"));
    }
    return CallFunction(f, args, e.line);
  }

  absl::StatusOr<Value> CallFunction(const Value& f, CallArgs& args, int line) {
    absl::StatusOr<Value> r = f.function()(args);
    if (!r.ok()) return AtLine(line, r.status());
    return r;
  }

  absl::StatusOr<Value> EvalBinary(const Expr& e, const ScopePtr& scope) {
    const std::string& op = e.name;
    TP_ASSIGN_OR_RETURN(Value l, Eval(*e.items[0], scope));
    if (op == "and") return l.Truthy() ? Eval(*e.items[1], scope) : l;
    if (op == "or") return l.Truthy() ? l : Eval(*e.items[1], scope);
    TP_ASSIGN_OR_RETURN(Value r, Eval(*e.items[1], scope));
    if (op == "==") return Value::Bool(l.Equals(r));
    if (op == "!=") return Value::Bool(!l.Equals(r));
    if (op == "~") {
      std::string s = l.ToString() + r.ToString();
      if (s.size() > limits_.max_output_bytes) return Err(e.line, "string too large");
      return Value::String(std::move(s));
    }
    if (op == "in" || op == "not in") {
      bool found;
      if (r.is_string()) {
        if (!l.is_string()) {
          return Err(e.line, absl::StrCat("'in <string>' requires a string as left operand, not '",
                                          l.TypeName(), "'"));
        }
        found = r.str().find(l.str()) != std::string::npos;
      } else if (r.is_array()) {
        found = false;
        for (const Value& x : r.array()) found = found || x.Equals(l);
      } else if (r.is_object() && !r.is_namespace()) {
        found = l.is_string() && r.object().Find(l.str()) != nullptr;
      } else if (r.is_undefined()) {
        found = false;
      } else {
        return Err(e.line, absl::StrCat("argument of type '", r.TypeName(), "' is not iterable"));
      }
      return Value::Bool(op == "in" ? found : !found);
    }
    const bool numeric = (l.is_number() || l.is_bool()) && (r.is_number() || r.is_bool());
    auto num = [](const Value& v) {
      return v.is_bool() ? (v.bool_value() ? 1.0 : 0.0) : v.number();
    };
    auto as_int = [](const Value& v) {
      return v.is_bool() ? int64_t{v.bool_value()} : v.int_value();
    };
    const bool ints = numeric && !l.is_float() && !r.is_float();
    if (op == "<" || op == "<=" || op == ">" || op == ">=") {
      int c;
      if (numeric) {
        double a = num(l), b = num(r);
        c = a < b ? -1 : a > b ? 1 : 0;
      } else if (l.is_string() && r.is_string()) {
        c = l.str().compare(r.str());
      } else {
        return Err(e.line, absl::StrCat("'", op, "' not supported between '", l.TypeName(),
                                        "' and '", r.TypeName(), "'"));
      }
      bool res = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
      return Value::Bool(res);
    }
    if (op == "+") {
      if (l.is_string() && r.is_string()) {
        if (l.str().size() + r.str().size() > limits_.max_output_bytes) {
          return Err(e.line, "string too large");
        }
        return Value::String(l.str() + r.str());
      }
      if (l.is_array() && r.is_array()) {
        Value::Array items = l.array();
        items.insert(items.end(), r.array().begin(), r.array().end());
        return Value::NewArray(std::move(items));
      }
      if (ints) {
        int64_t out;
        if (__builtin_add_overflow(as_int(l), as_int(r), &out))
          return Err(e.line, "integer overflow");
        return Value::Int(out);
      }
      if (numeric) return Value::Float(num(l) + num(r));
    } else if (op == "-") {
      if (ints) {
        int64_t out;
        if (__builtin_sub_overflow(as_int(l), as_int(r), &out))
          return Err(e.line, "integer overflow");
        return Value::Int(out);
      }
      if (numeric) return Value::Float(num(l) - num(r));
    } else if (op == "*") {
      if (ints) {
        int64_t out;
        if (!CheckedMul(as_int(l), as_int(r), &out)) return Err(e.line, "integer overflow");
        return Value::Int(out);
      }
      if (numeric) return Value::Float(num(l) * num(r));
      const Value* seq = l.is_string() || l.is_array() ? &l : &r;
      const Value* count = seq == &l ? &r : &l;
      if ((seq->is_string() || seq->is_array()) && count->is_int()) {
        const int64_t k = std::max<int64_t>(0, count->int_value());
        const size_t unit = seq->is_string() ? seq->str().size() : seq->array().size();
        if (unit != 0 && static_cast<uint64_t>(k) > limits_.max_output_bytes / unit) {
          return Err(e.line, "repetition too large");
        }
        if (seq->is_string()) {
          std::string s;
          for (int64_t i = 0; i < k; ++i) s += seq->str();
          return Value::String(std::move(s));
        }
        Value::Array items;
        for (int64_t i = 0; i < k; ++i) {
          items.insert(items.end(), seq->array().begin(), seq->array().end());
        }
        return Value::NewArray(std::move(items));
      }
    } else if (op == "/") {
      if (numeric) {
        if (num(r) == 0) return Err(e.line, "division by zero");
        return Value::Float(num(l) / num(r));
      }
    } else if (op == "//" || op == "%") {
      if (numeric && num(r) == 0) return Err(e.line, "integer division or modulo by zero");
      if (ints) {
        int64_t a = as_int(l), b = as_int(r);
        if (a == INT64_MIN && b == -1) return Err(e.line, "integer overflow");
        int64_t q = a / b, m = a % b;
        if (m != 0 && ((m < 0) != (b < 0))) {  // Python floors
          --q;
          m += b;
        }
        return Value::Int(op == "//" ? q : m);
      }
      if (numeric) {
        double a = num(l), b = num(r);
        if (op == "//") return Value::Float(std::floor(a / b));
        double m = std::fmod(a, b);
        if (m != 0 && ((m < 0) != (b < 0))) m += b;
        return Value::Float(m);
      }
      if (op == "%" && l.is_string()) {
        return Err(e.line, "string formatting with '%' is not supported");
      }
    } else if (op == "**") {
      if (ints && as_int(r) >= 0) {
        int64_t result = 1, base = as_int(l);
        for (int64_t i = 0; i < as_int(r); ++i) {
          if (!CheckedMul(result, base, &result)) return Err(e.line, "integer overflow");
          if (result == 0 || result == 1) break;
        }
        return Value::Int(result);
      }
      if (numeric) {
        if (num(l) == 0 && num(r) < 0) return Err(e.line, "zero to a negative power");
        return Value::Float(std::pow(num(l), num(r)));
      }
    }
    return Err(e.line, absl::StrCat("unsupported operand types for ", op, ": '", l.TypeName(),
                                    "' and '", r.TypeName(), "'"));
  }

  const RenderLimits& limits_;
  Flow flow_ = Flow::kNormal;
  int64_t steps_ = 0;
  int call_depth_ = 0;
  int eval_depth_ = 0;
};

}  // namespace

bool IsRaisedError(const absl::Status& status) {
  return status.GetPayload(kRaisedPayload).has_value();
}

absl::StatusOr<std::unique_ptr<Template>> Template::Parse(const std::string& source) {
  TP_ASSIGN_OR_RETURN(Program program, ParseTemplate(source));
  return std::unique_ptr<Template>(new Template(std::move(program)));
}

absl::StatusOr<std::string> Template::Render(const Value& variables,
                                             const RenderLimits& limits) const {
  Interpreter interp(limits);
  std::string out;
  TP_RETURN_IF_ERROR(interp.Run(program_.body, variables, out));
  return out;
}

}  // namespace tpserve::jinja
