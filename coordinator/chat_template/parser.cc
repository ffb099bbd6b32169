// Recursive-descent parser of the Jinja subset chat templates use, with Jinja's precedence:
// cond-expr < or < and < not < comparisons/in < + - < ~ < * / // % < ** < unary < filters/tests
// < postfix (attribute, subscript, call).
#include "coordinator/chat_template/parser.h"

#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "coordinator/chat_template/builtins.h"
#include "coordinator/chat_template/lexer.h"

namespace tpserve::jinja {
namespace {

constexpr int kMaxDepth = 200;  // nesting of expressions and blocks: bounds the C++ stack

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  absl::StatusOr<Program> Run() {
    Program p;
    std::string ended;
    absl::StatusOr<Body> body = ParseBody({}, &ended);
    if (!body.ok()) return body.status();
    p.body = std::move(*body);
    for (const auto& [name, line] : called_functions_) {
      if (!IsKnownGlobalFunction(name) && !macros_.count(name)) {
        return Error(line, absl::StrCat("unknown function '", name, "'"));
      }
    }
    return p;
  }

 private:
  const Token& Peek(size_t ahead = 0) const {
    size_t k = std::min(i_ + ahead, t_.size() - 1);
    return t_[k];
  }
  const Token& Next() {
    const Token& t = t_[i_];
    if (i_ + 1 < t_.size()) ++i_;
    return t;
  }
  bool IsOp(const char* op, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::Kind::kOp && Peek(ahead).text == op;
  }
  bool IsName(const char* name, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::Kind::kName && Peek(ahead).text == name;
  }
  static absl::Status Error(int line, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", what));
  }
  static std::string Describe(const Token& t) {
    switch (t.kind) {
      case Token::Kind::kEnd:
        return "end of template";
      case Token::Kind::kText:
        return "text";
      case Token::Kind::kString:
        return "string literal";
      case Token::Kind::kStmtClose:
        return "'%}'";
      case Token::Kind::kExprClose:
        return "'}}'";
      default:
        return "'" + t.text + "'";
    }
  }
  absl::Status Expect(const char* op) {
    if (!IsOp(op)) {
      return Error(Peek().line, absl::StrCat("expected '", op, "', found ", Describe(Peek())));
    }
    Next();
    return absl::OkStatus();
  }
  absl::Status ExpectKind(Token::Kind kind, const char* what) {
    if (Peek().kind != kind) {
      return Error(Peek().line, absl::StrCat("expected ", what, ", found ", Describe(Peek())));
    }
    Next();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectName() {
    if (Peek().kind != Token::Kind::kName) {
      return Error(Peek().line, absl::StrCat("expected a name, found ", Describe(Peek())));
    }
    return Next().text;
  }

  // Parses statements until one of `end_tags` opens a {% %} (left consumed up to the tag name,
  // which is stored in *ended) or until the end of the template when end_tags is empty.
  absl::StatusOr<Body> ParseBody(const std::vector<std::string>& end_tags, std::string* ended) {
    if (++depth_ > kMaxDepth) return Error(Peek().line, "blocks nested too deeply");
    Body body;
    while (true) {
      const Token& tok = Peek();
      if (tok.kind == Token::Kind::kEnd) {
        if (!end_tags.empty()) {
          return Error(tok.line, absl::StrCat("unexpected end of template, expected ",
                                              absl::StrJoin(end_tags, " or ")));
        }
        break;
      }
      if (tok.kind == Token::Kind::kText) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kText;
        s->line = tok.line;
        s->text = tok.text;
        body.push_back(std::move(s));
        Next();
        continue;
      }
      if (tok.kind == Token::Kind::kExprOpen) {
        Next();
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kOutput;
        s->line = tok.line;
        TP_ASSIGN_OR_RETURN(s->expr, ParseExpression(true));
        TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kExprClose, "'}}'"));
        body.push_back(std::move(s));
        continue;
      }
      if (tok.kind != Token::Kind::kStmtOpen) {
        return Error(tok.line, absl::StrCat("unexpected ", Describe(tok)));
      }
      const Token& name_tok = Peek(1);
      if (name_tok.kind != Token::Kind::kName) {
        return Error(name_tok.line,
                     absl::StrCat("expected a tag name, found ", Describe(name_tok)));
      }
      for (const std::string& e : end_tags) {
        if (name_tok.text == e) {
          Next();
          Next();
          *ended = e;
          --depth_;
          return body;
        }
      }
      Next();
      absl::Status s = ParseStatement(body);
      if (!s.ok()) return s;
    }
    --depth_;
    return body;
  }

  absl::Status ParseStatement(Body& body) {
    const Token name = Next();
    const std::string& tag = name.text;
    auto s = std::make_unique<Stmt>();
    s->line = name.line;
    if (tag == "if") {
      s->kind = Stmt::Kind::kIf;
      TP_ASSIGN_OR_RETURN(ExprPtr cond, ParseExpression(true));
      s->conds.push_back(std::move(cond));
      TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
      while (true) {
        std::string ended;
        TP_ASSIGN_OR_RETURN(Body b, ParseBody({"elif", "else", "endif"}, &ended));
        if (s->has_else) {
          s->else_body = std::move(b);
        } else {
          s->bodies.push_back(std::move(b));
        }
        if (ended == "endif") break;
        if (s->has_else) return Error(Peek().line, "'" + ended + "' after 'else' in an if block");
        if (ended == "elif") {
          TP_ASSIGN_OR_RETURN(ExprPtr c, ParseExpression(true));
          s->conds.push_back(std::move(c));
        } else {
          s->has_else = true;
        }
        TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
      }
      TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
    } else if (tag == "for") {
      s->kind = Stmt::Kind::kFor;
      do {
        TP_ASSIGN_OR_RETURN(std::string target, ExpectName());
        s->targets.push_back(target);
      } while (IsOp(",") && (Next(), true));
      if (!IsName("in")) {
        return Error(Peek().line,
                     absl::StrCat("expected 'in' in for loop, found ", Describe(Peek())));
      }
      Next();
      TP_ASSIGN_OR_RETURN(s->expr, ParseExpression(false));
      if (IsName("if")) {
        Next();
        TP_ASSIGN_OR_RETURN(s->cond, ParseExpression(false));
      }
      if (IsName("recursive")) return Error(Peek().line, "recursive for loops are not supported");
      TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
      ++loop_depth_;
      std::string ended;
      TP_ASSIGN_OR_RETURN(s->body, ParseBody({"else", "endfor"}, &ended));
      --loop_depth_;
      if (ended == "else") {
        s->has_else = true;
        TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
        TP_ASSIGN_OR_RETURN(s->else_body, ParseBody({"endfor"}, &ended));
      }
      TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
    } else if (tag == "set") {
      s->kind = Stmt::Kind::kSet;
      TP_ASSIGN_OR_RETURN(std::string target, ExpectName());
      s->targets.push_back(target);
      if (IsOp(".")) {
        Next();
        TP_ASSIGN_OR_RETURN(s->attr, ExpectName());
      } else {
        while (IsOp(",")) {
          Next();
          TP_ASSIGN_OR_RETURN(std::string t, ExpectName());
          s->targets.push_back(t);
        }
      }
      if (IsOp("=")) {
        Next();
        TP_ASSIGN_OR_RETURN(s->expr, ParseTupleExpression());
        TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
      } else {
        if (!s->attr.empty() || s->targets.size() != 1) {
          return Error(Peek().line, "a block set assigns one plain name");
        }
        TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
        std::string ended;
        TP_ASSIGN_OR_RETURN(s->body, ParseBody({"endset"}, &ended));
        TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
      }
    } else if (tag == "macro") {
      s->kind = Stmt::Kind::kMacro;
      TP_ASSIGN_OR_RETURN(s->name, ExpectName());
      TP_RETURN_IF_ERROR(Expect("("));
      while (!IsOp(")")) {
        TP_ASSIGN_OR_RETURN(std::string param, ExpectName());
        ExprPtr def;
        if (IsOp("=")) {
          Next();
          TP_ASSIGN_OR_RETURN(def, ParseExpression(true));
        }
        s->params.emplace_back(param, std::move(def));
        if (!IsOp(",")) break;
        Next();
      }
      TP_RETURN_IF_ERROR(Expect(")"));
      TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
      macros_.insert(s->name);
      const int saved_loops = loop_depth_;
      loop_depth_ = 0;
      std::string ended;
      TP_ASSIGN_OR_RETURN(s->body, ParseBody({"endmacro"}, &ended));
      loop_depth_ = saved_loops;
      if (Peek().kind == Token::Kind::kName) Next();  // {% endmacro name %}
      TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) return Error(name.line, "'" + tag + "' outside a for loop");
      s->kind = tag == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
    } else if (tag == "generation") {
      // transformers' {% generation %} marks assistant tokens; it renders its body unchanged.
      TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
      std::string ended;
      TP_ASSIGN_OR_RETURN(Body inner, ParseBody({"endgeneration"}, &ended));
      TP_RETURN_IF_ERROR(ExpectKind(Token::Kind::kStmtClose, "'%}'"));
      for (auto& st : inner) body.push_back(std::move(st));
      return absl::OkStatus();
    } else if (tag == "elif" || tag == "else" || tag.rfind("end", 0) == 0) {
      return Error(name.line, absl::StrCat("unexpected '", tag, "' without a matching block"));
    } else {
      return Error(name.line, absl::StrCat("unsupported tag '", tag, "'"));
    }
    body.push_back(std::move(s));
    return absl::OkStatus();
  }

  static ExprPtr NewExpr(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // `a, b` without parentheses (the right side of set).
  absl::StatusOr<ExprPtr> ParseTupleExpression() {
    const int line = Peek().line;
    TP_ASSIGN_OR_RETURN(ExprPtr first, ParseExpression(true));
    if (!IsOp(",")) return first;
    ExprPtr tuple = NewExpr(Expr::Kind::kTuple, line);
    tuple->items.push_back(std::move(first));
    while (IsOp(",")) {
      Next();
      if (Peek().kind == Token::Kind::kStmtClose) break;
      TP_ASSIGN_OR_RETURN(ExprPtr e, ParseExpression(true));
      tuple->items.push_back(std::move(e));
    }
    return tuple;
  }

  absl::StatusOr<ExprPtr> ParseExpression(bool allow_cond) {
    if (++depth_ > kMaxDepth) return Error(Peek().line, "expression nested too deeply");
    auto r = ParseCondition(allow_cond);
    --depth_;
    return r;
  }

  absl::StatusOr<ExprPtr> ParseCondition(bool allow_cond) {
    TP_ASSIGN_OR_RETURN(ExprPtr e, ParseOr());
    while (allow_cond && IsName("if")) {
      const int line = Next().line;
      ExprPtr c = NewExpr(Expr::Kind::kCond, line);
      TP_ASSIGN_OR_RETURN(ExprPtr test, ParseOr());
      ExprPtr otherwise;
      if (IsName("else")) {
        Next();
        TP_ASSIGN_OR_RETURN(otherwise, ParseExpression(true));
      }
      c->items.push_back(std::move(test));
      c->items.push_back(std::move(e));
      c->items.push_back(std::move(otherwise));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr Binary(const std::string& op, ExprPtr l, ExprPtr r, int line) {
    ExprPtr b = NewExpr(Expr::Kind::kBinary, line);
    b->name = op;
    b->items.push_back(std::move(l));
    b->items.push_back(std::move(r));
    return b;
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    TP_ASSIGN_OR_RETURN(ExprPtr l, ParseAnd());
    while (IsName("or")) {
      int line = Next().line;
      TP_ASSIGN_OR_RETURN(ExprPtr r, ParseAnd());
      l = Binary("or", std::move(l), std::move(r), line);
    }
    return l;
  }
  absl::StatusOr<ExprPtr> ParseAnd() {
    TP_ASSIGN_OR_RETURN(ExprPtr l, ParseNot());
    while (IsName("and")) {
      int line = Next().line;
      TP_ASSIGN_OR_RETURN(ExprPtr r, ParseNot());
      l = Binary("and", std::move(l), std::move(r), line);
    }
    return l;
  }
  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName("not")) {
      if (++depth_ > kMaxDepth) return Error(Peek().line, "expression nested too deeply");
      int line = Next().line;
      ExprPtr u = NewExpr(Expr::Kind::kUnary, line);
      u->name = "not";
      TP_ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
      u->items.push_back(std::move(operand));
      --depth_;
      return u;
    }
    return ParseCompare();
  }
  absl::StatusOr<ExprPtr> ParseCompare() {
    TP_ASSIGN_OR_RETURN(ExprPtr l, ParseMath1());
    while (true) {
      std::string op;
      if (Peek().kind == Token::Kind::kOp &&
          (Peek().text == "==" || Peek().text == "!=" || Peek().text == "<" ||
           Peek().text == "<=" || Peek().text == ">" || Peek().text == ">=")) {
        op = Peek().text;
        Next();
      } else if (IsName("in")) {
        op = "in";
        Next();
      } else if (IsName("not") && IsName("in", 1)) {
        op = "not in";
        Next();
        Next();
      } else {
        return l;
      }
      int line = Peek().line;
      TP_ASSIGN_OR_RETURN(ExprPtr r, ParseMath1());
      l = Binary(op, std::move(l), std::move(r), line);
    }
  }
  absl::StatusOr<ExprPtr> ParseMath1() {
    TP_ASSIGN_OR_RETURN(ExprPtr l, ParseConcat());
    while (IsOp("+") || IsOp("-")) {
      const Token& op = Next();
      std::string o = op.text;
      TP_ASSIGN_OR_RETURN(ExprPtr r, ParseConcat());
      l = Binary(o, std::move(l), std::move(r), op.line);
    }
    return l;
  }
  absl::StatusOr<ExprPtr> ParseConcat() {
    TP_ASSIGN_OR_RETURN(ExprPtr l, ParseMath2());
    while (IsOp("~")) {
      int line = Next().line;
      TP_ASSIGN_OR_RETURN(ExprPtr r, ParseMath2());
      l = Binary("~", std::move(l), std::move(r), line);
    }
    return l;
  }
  absl::StatusOr<ExprPtr> ParseMath2() {
    TP_ASSIGN_OR_RETURN(ExprPtr l, ParsePow());
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const Token& op = Next();
      std::string o = op.text;
      TP_ASSIGN_OR_RETURN(ExprPtr r, ParsePow());
      l = Binary(o, std::move(l), std::move(r), op.line);
    }
    return l;
  }
  absl::StatusOr<ExprPtr> ParsePow() {
    TP_ASSIGN_OR_RETURN(ExprPtr l, ParseUnary(true));
    while (IsOp("**")) {
      int line = Next().line;
      TP_ASSIGN_OR_RETURN(ExprPtr r, ParseUnary(true));
      l = Binary("**", std::move(l), std::move(r), line);
    }
    return l;
  }
  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    if (++depth_ > kMaxDepth) return Error(Peek().line, "expression nested too deeply");
    ExprPtr e;
    if (IsOp("-") || IsOp("+")) {
      const Token& op = Next();
      e = NewExpr(Expr::Kind::kUnary, op.line);
      e->name = op.text;
      TP_ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
      e->items.push_back(std::move(operand));
    } else {
      TP_ASSIGN_OR_RETURN(e, ParsePrimary());
      TP_ASSIGN_OR_RETURN(e, ParsePostfix(std::move(e)));
    }
    if (with_filter) {
      TP_ASSIGN_OR_RETURN(e, ParseFilterExpr(std::move(e)));
    }
    --depth_;
    return e;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token& tok = Peek();
    switch (tok.kind) {
      case Token::Kind::kName: {
        Next();
        ExprPtr e = NewExpr(Expr::Kind::kLiteral, tok.line);
        const std::string& n = tok.text;
        if (n == "true" || n == "True") {
          e->value = Value::Bool(true);
        } else if (n == "false" || n == "False") {
          e->value = Value::Bool(false);
        } else if (n == "none" || n == "None") {
          e->value = Value::None();
        } else {
          e->kind = Expr::Kind::kName;
          e->name = n;
        }
        return e;
      }
      case Token::Kind::kString: {
        ExprPtr e = NewExpr(Expr::Kind::kLiteral, tok.line);
        std::string s;
        while (Peek().kind == Token::Kind::kString) s += Next().text;  // adjacent literals join
        e->value = Value::String(std::move(s));
        return e;
      }
      case Token::Kind::kInt: {
        Next();
        ExprPtr e = NewExpr(Expr::Kind::kLiteral, tok.line);
        e->value = Value::Int(tok.int_value);
        return e;
      }
      case Token::Kind::kFloat: {
        Next();
        ExprPtr e = NewExpr(Expr::Kind::kLiteral, tok.line);
        e->value = Value::Float(tok.float_value);
        return e;
      }
      case Token::Kind::kOp:
        if (tok.text == "(") {
          Next();
          if (IsOp(")")) {
            Next();
            return NewExpr(Expr::Kind::kTuple, tok.line);
          }
          TP_ASSIGN_OR_RETURN(ExprPtr first, ParseExpression(true));
          if (IsOp(")")) {
            Next();
            return first;
          }
          ExprPtr tuple = NewExpr(Expr::Kind::kTuple, tok.line);
          tuple->items.push_back(std::move(first));
          while (IsOp(",")) {
            Next();
            if (IsOp(")")) break;
            TP_ASSIGN_OR_RETURN(ExprPtr e, ParseExpression(true));
            tuple->items.push_back(std::move(e));
          }
          TP_RETURN_IF_ERROR(Expect(")"));
          return tuple;
        }
        if (tok.text == "[") {
          Next();
          ExprPtr list = NewExpr(Expr::Kind::kList, tok.line);
          while (!IsOp("]")) {
            TP_ASSIGN_OR_RETURN(ExprPtr e, ParseExpression(true));
            list->items.push_back(std::move(e));
            if (!IsOp(",")) break;
            Next();
          }
          TP_RETURN_IF_ERROR(Expect("]"));
          return list;
        }
        if (tok.text == "{") {
          Next();
          ExprPtr dict = NewExpr(Expr::Kind::kDict, tok.line);
          while (!IsOp("}")) {
            TP_ASSIGN_OR_RETURN(ExprPtr k, ParseExpression(true));
            TP_RETURN_IF_ERROR(Expect(":"));
            TP_ASSIGN_OR_RETURN(ExprPtr v, ParseExpression(true));
            dict->items.push_back(std::move(k));
            dict->items.push_back(std::move(v));
            if (!IsOp(",")) break;
            Next();
          }
          TP_RETURN_IF_ERROR(Expect("}"));
          return dict;
        }
        break;
      default:
        break;
    }
    return Error(tok.line, absl::StrCat("unexpected ", Describe(tok), " in expression"));
  }

  absl::Status ParseCallArgs(Expr& call) {
    TP_RETURN_IF_ERROR(Expect("("));
    while (!IsOp(")")) {
      if (IsOp("*") || IsOp("**")) {
        return Error(Peek().line, "*args and **kwargs in calls are not supported");
      }
      if (Peek().kind == Token::Kind::kName && IsOp("=", 1)) {
        std::string key = Next().text;
        Next();
        TP_ASSIGN_OR_RETURN(ExprPtr v, ParseExpression(true));
        call.kwargs.emplace_back(key, std::move(v));
      } else {
        if (!call.kwargs.empty()) {
          return Error(Peek().line, "positional argument after a keyword argument");
        }
        TP_ASSIGN_OR_RETURN(ExprPtr v, ParseExpression(true));
        call.args.push_back(std::move(v));
      }
      if (!IsOp(",")) break;
      Next();
    }
    return Expect(")");
  }

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr object, int line) {
    // After '[': an index, or a slice start:stop:step with any part omitted.
    ExprPtr parts[3];
    int colons = 0;
    if (!IsOp(":")) {
      TP_ASSIGN_OR_RETURN(parts[0], ParseExpression(true));
    }
    while (IsOp(":") && colons < 2) {
      Next();
      ++colons;
      if (!IsOp(":") && !IsOp("]")) {
        TP_ASSIGN_OR_RETURN(parts[colons], ParseExpression(true));
      }
    }
    TP_RETURN_IF_ERROR(Expect("]"));
    ExprPtr e = NewExpr(colons == 0 ? Expr::Kind::kIndex : Expr::Kind::kSlice, line);
    e->items.push_back(std::move(object));
    if (colons == 0) {
      e->items.push_back(std::move(parts[0]));
    } else {
      for (auto& p : parts) e->items.push_back(std::move(p));
    }
    return e;
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr e) {
    while (true) {
      if (IsOp(".")) {
        int line = Next().line;
        if (Peek().kind == Token::Kind::kInt) {  // x.0 is x[0]
          ExprPtr idx = NewExpr(Expr::Kind::kIndex, line);
          ExprPtr lit = NewExpr(Expr::Kind::kLiteral, line);
          lit->value = Value::Int(Next().int_value);
          idx->items.push_back(std::move(e));
          idx->items.push_back(std::move(lit));
          e = std::move(idx);
          continue;
        }
        TP_ASSIGN_OR_RETURN(std::string attr, ExpectName());
        ExprPtr a = NewExpr(Expr::Kind::kAttr, line);
        a->name = attr;
        a->items.push_back(std::move(e));
        e = std::move(a);
      } else if (IsOp("[")) {
        int line = Next().line;
        TP_ASSIGN_OR_RETURN(e, ParseSubscript(std::move(e), line));
      } else if (IsOp("(")) {
        int line = Peek().line;
        if (e->kind == Expr::Kind::kAttr && !IsKnownMethod(e->name)) {
          return Error(line, absl::StrCat("unknown method '", e->name, "'"));
        }
        if (e->kind == Expr::Kind::kName) called_functions_.emplace_back(e->name, line);
        ExprPtr call = NewExpr(Expr::Kind::kCall, line);
        call->items.push_back(std::move(e));
        TP_RETURN_IF_ERROR(ParseCallArgs(*call));
        e = std::move(call);
      } else {
        return e;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr e) {
    while (true) {
      if (IsOp("|")) {
        Next();
        const Token& name = Peek();
        TP_ASSIGN_OR_RETURN(std::string filter, ExpectName());
        if (!IsKnownFilter(filter)) {
          return Error(name.line, absl::StrCat("unknown filter '", filter, "'"));
        }
        ExprPtr f = NewExpr(Expr::Kind::kFilter, name.line);
        f->name = filter;
        f->items.push_back(std::move(e));
        if (IsOp("(")) TP_RETURN_IF_ERROR(ParseCallArgs(*f));
        e = std::move(f);
      } else if (IsName("is")) {
        int line = Next().line;
        ExprPtr t = NewExpr(Expr::Kind::kTest, line);
        if (IsName("not")) {
          Next();
          t->negated = true;
        }
        // `is none`, `is true`, ... are names here even though they are literals elsewhere.
        if (Peek().kind != Token::Kind::kName) {
          return Error(Peek().line, absl::StrCat("expected a test name, found ", Describe(Peek())));
        }
        std::string test = Next().text;
        if (test == "None") test = "none";
        if (test == "True") test = "true";
        if (test == "False") test = "false";
        if (!IsKnownTest(test)) return Error(line, absl::StrCat("unknown test '", test, "'"));
        t->name = test;
        t->items.push_back(std::move(e));
        if (IsOp("(")) {
          TP_RETURN_IF_ERROR(ParseCallArgs(*t));
        } else if (StartsTestArgument()) {
          TP_ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
          TP_ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
          t->args.push_back(std::move(arg));
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }

  // Jinja accepts one argument without parentheses: `x is divisibleby 3`, `x is sameas none`.
  bool StartsTestArgument() const {
    const Token& t = Peek();
    if (t.kind == Token::Kind::kString || t.kind == Token::Kind::kInt ||
        t.kind == Token::Kind::kFloat) {
      return true;
    }
    if (t.kind == Token::Kind::kOp) return t.text == "[" || t.text == "{";
    if (t.kind != Token::Kind::kName) return false;
    static const std::set<std::string> kStop = {"else", "or", "and", "if", "in", "not", "is"};
    return !kStop.count(t.text);
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  std::set<std::string> macros_;
  std::vector<std::pair<std::string, int>> called_functions_;
};

}  // namespace

absl::StatusOr<Program> ParseTemplate(const std::string& source) {
  TP_ASSIGN_OR_RETURN(std::vector<Token> tokens, Tokenize(source));
  return Parser(std::move(tokens)).Run();
}

}  // namespace tpserve::jinja
