// Filters, tests, str/dict methods and global functions of the chat-template interpreter, with
// the semantics of Jinja 3 under Python (what transformers renders with). Case mapping (upper,
// lower, title, capitalize) is ASCII-only: other characters pass through unchanged.
#include "coordinator/chat_template/builtins.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace tpserve::jinja {
namespace {

constexpr size_t kMaxSequence = 1 << 20;  // range() and repetition: a bound on memory

absl::Status Bad(const std::string& msg) { return absl::InvalidArgumentError(msg); }

// The argument at `pos` or named `name`, or nullptr.
const Value* Arg(const CallArgs& args, size_t pos, const char* name) {
  for (const auto& [k, v] : args.keyword) {
    if (k == name) return &v;
  }
  return pos < args.positional.size() ? &args.positional[pos] : nullptr;
}

absl::Status CheckArgs(const CallArgs& args, size_t max_positional,
                       std::initializer_list<const char*> names, const std::string& what) {
  if (args.positional.size() > max_positional) {
    return Bad(absl::StrCat(what, " takes at most ", max_positional, " positional arguments"));
  }
  for (const auto& [k, v] : args.keyword) {
    bool ok = false;
    for (const char* n : names) ok |= k == n;
    if (!ok) return Bad(absl::StrCat(what, " got an unexpected keyword argument '", k, "'"));
  }
  return absl::OkStatus();
}

bool ArgBool(const CallArgs& args, size_t pos, const char* name, bool def) {
  const Value* v = Arg(args, pos, name);
  return v == nullptr ? def : v->Truthy();
}

absl::StatusOr<std::string> ArgString(const CallArgs& args, size_t pos, const char* name,
                                      const std::string& what) {
  const Value* v = Arg(args, pos, name);
  if (v == nullptr || !v->is_string()) {
    return Bad(absl::StrCat(what, ": argument '", name, "' must be a string"));
  }
  return v->str();
}

char AsciiUpper(char c) { return c >= 'a' && c <= 'z' ? static_cast<char>(c - 32) : c; }
char AsciiLower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; }
bool AsciiAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

std::string Upper(std::string s) {
  for (char& c : s) c = AsciiUpper(c);
  return s;
}
std::string Lower(std::string s) {
  for (char& c : s) c = AsciiLower(c);
  return s;
}
std::string Capitalize(const std::string& s) {
  std::string out = Lower(s);
  if (!out.empty()) out[0] = AsciiUpper(out[0]);
  return out;
}
// Python's str.title(): a letter after a non-letter is upper case, other letters lower case.
std::string PyTitle(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    if (AsciiAlpha(c)) {
      c = prev_cased ? AsciiLower(c) : AsciiUpper(c);
      prev_cased = true;
    } else {
      prev_cased = (static_cast<unsigned char>(c) & 0x80) != 0 && prev_cased;
    }
  }
  return out;
}
// Jinja's title filter: words start after whitespace or one of -([{<.
std::string JinjaTitle(const std::string& s) {
  std::string out = s;
  bool start = true;
  for (char& c : out) {
    const bool boundary = c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' ||
                          c == '\f' || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (boundary) {
      start = true;
      continue;
    }
    c = start ? AsciiUpper(c) : AsciiLower(c);
    start = false;
  }
  return out;
}

// Python's str.isspace() set, in UTF-8.
const std::vector<std::string>& PyWhitespace() {
  static const std::vector<std::string> kSpaces = {" ",
                                                   "\t",
                                                   "\n",
                                                   "\v",
                                                   "\f",
                                                   "\r",
                                                   "\x1c",
                                                   "\x1d",
                                                   "\x1e",
                                                   "\x1f",
                                                   "\xc2\x85",
                                                   "\xc2\xa0",
                                                   "\xe1\x9a\x80",
                                                   "\xe2\x80\x80",
                                                   "\xe2\x80\x81",
                                                   "\xe2\x80\x82",
                                                   "\xe2\x80\x83",
                                                   "\xe2\x80\x84",
                                                   "\xe2\x80\x85",
                                                   "\xe2\x80\x86",
                                                   "\xe2\x80\x87",
                                                   "\xe2\x80\x88",
                                                   "\xe2\x80\x89",
                                                   "\xe2\x80\x8a",
                                                   "\xe2\x80\xa8",
                                                   "\xe2\x80\xa9",
                                                   "\xe2\x80\xaf",
                                                   "\xe2\x81\x9f",
                                                   "\xe3\x80\x80"};
  return kSpaces;
}

bool IsPySpace(const std::string& ch) {
  for (const auto& s : PyWhitespace()) {
    if (s == ch) return true;
  }
  return false;
}

absl::StatusOr<Value> Length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kString:
      return Value::Int(static_cast<int64_t>(Utf8Length(v.str())));
    case Value::Kind::kArray:
      return Value::Int(static_cast<int64_t>(v.array().size()));
    case Value::Kind::kObject:
      return Value::Int(static_cast<int64_t>(v.object().size()));
    case Value::Kind::kUndefined:
      return Value::Int(0);
    default:
      return Bad(absl::StrCat("object of type '", v.TypeName(), "' has no len()"));
  }
}

// The items a filter iterates: list items, dict keys, string characters.
absl::StatusOr<Value::Array> Iterate(const Value& v, const std::string& what) {
  switch (v.kind()) {
    case Value::Kind::kArray:
      return v.array();
    case Value::Kind::kObject: {
      Value::Array keys;
      for (const auto& kv : v.object().items()) keys.push_back(Value::String(kv.first));
      return keys;
    }
    case Value::Kind::kString: {
      Value::Array chars;
      for (auto& c : Utf8Chars(v.str())) chars.push_back(Value::String(std::move(c)));
      return chars;
    }
    case Value::Kind::kUndefined:
      return Value::Array{};
    default:
      return Bad(absl::StrCat(what, ": '", v.TypeName(), "' object is not iterable"));
  }
}

// `attribute` of Jinja's filters: dotted path of keys (or list indices).
Value GetAttributePath(const Value& item, const std::string& path) {
  Value v = item;
  size_t start = 0;
  while (start <= path.size()) {
    size_t dot = path.find('.', start);
    std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (v.is_object()) {
      const Value* f = v.object().Find(part);
      v = f ? *f : Value();
    } else if (v.is_array() && !part.empty() &&
               std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      size_t idx = 0;
      if (!absl::SimpleAtoi(part, &idx) || idx >= v.array().size()) return Value();
      v = v.array()[idx];
    } else {
      return Value();
    }
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return v;
}

// Ordering for sort/min/max: numbers by value, strings by code point (case-folded unless
// case_sensitive); anything else cannot be ordered.
absl::StatusOr<bool> Less(const Value& a, const Value& b, bool case_sensitive) {
  if ((a.is_number() || a.is_bool()) && (b.is_number() || b.is_bool())) {
    double x = a.is_bool() ? a.bool_value() : a.number();
    double y = b.is_bool() ? b.bool_value() : b.number();
    return x < y;
  }
  if (a.is_string() && b.is_string()) {
    return case_sensitive ? a.str() < b.str() : Lower(a.str()) < Lower(b.str());
  }
  return Bad(
      absl::StrCat("'<' not supported between '", a.TypeName(), "' and '", b.TypeName(), "'"));
}

absl::StatusOr<Value> SortFilter(const Value& input, CallArgs& args) {
  TP_RETURN_IF_ERROR(CheckArgs(args, 3, {"reverse", "case_sensitive", "attribute"}, "sort"));
  TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(input, "sort"));
  const bool reverse = ArgBool(args, 0, "reverse", false);
  const bool cs = ArgBool(args, 1, "case_sensitive", false);
  const Value* attr = Arg(args, 2, "attribute");
  std::string path = attr && attr->is_string() ? attr->str() : "";
  absl::Status error;
  auto key = [&](const Value& v) { return path.empty() ? v : GetAttributePath(v, path); };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    absl::StatusOr<bool> r = reverse ? Less(key(b), key(a), cs) : Less(key(a), key(b), cs);
    if (!r.ok()) {
      error = r.status();
      return false;
    }
    return *r;
  });
  if (!error.ok()) return error;
  return Value::NewArray(std::move(items));
}

absl::StatusOr<Value> MinMax(const Value& input, CallArgs& args, bool want_max) {
  const char* what = want_max ? "max" : "min";
  TP_RETURN_IF_ERROR(CheckArgs(args, 2, {"case_sensitive", "attribute"}, what));
  TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(input, what));
  if (items.empty()) return Value();
  const bool cs = ArgBool(args, 0, "case_sensitive", false);
  const Value* attr = Arg(args, 1, "attribute");
  std::string path = attr && attr->is_string() ? attr->str() : "";
  auto key = [&](const Value& v) { return path.empty() ? v : GetAttributePath(v, path); };
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    TP_ASSIGN_OR_RETURN(bool less, want_max ? Less(key(items[best]), key(items[i]), cs)
                                            : Less(key(items[i]), key(items[best]), cs));
    if (less) best = i;
  }
  return items[best];
}

absl::StatusOr<Value> Add(const Value& a, const Value& b) {
  if (a.is_int() && b.is_int()) return Value::Int(a.int_value() + b.int_value());
  if ((a.is_number() || a.is_bool()) && (b.is_number() || b.is_bool())) {
    return Value::Float((a.is_bool() ? a.bool_value() : a.number()) +
                        (b.is_bool() ? b.bool_value() : b.number()));
  }
  return Bad(absl::StrCat("unsupported operand types for +: '", a.TypeName(), "' and '",
                          b.TypeName(), "'"));
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

absl::StatusOr<Value> ToInt(const Value& v, const Value& def) {
  switch (v.kind()) {
    case Value::Kind::kInt:
      return v;
    case Value::Kind::kBool:
      return Value::Int(v.bool_value() ? 1 : 0);
    case Value::Kind::kFloat:
      if (!std::isfinite(v.float_value()) || std::fabs(v.float_value()) > 9.2e18) return def;
      return Value::Int(static_cast<int64_t>(v.float_value()));
    case Value::Kind::kString: {
      std::string s = StripChars(v.str(), nullptr, true, true);
      if (s.empty()) return def;
      int64_t i = 0;
      if (absl::SimpleAtoi(s, &i)) return Value::Int(i);
      double d = 0;
      if (absl::SimpleAtod(s, &d) && std::isfinite(d) && std::fabs(d) < 9.2e18) {
        return Value::Int(static_cast<int64_t>(d));
      }
      return def;
    }
    default:
      return def;
  }
}

absl::StatusOr<Value> ToFloat(const Value& v, const Value& def) {
  if (v.is_number()) return Value::Float(v.number());
  if (v.is_bool()) return Value::Float(v.bool_value() ? 1 : 0);
  if (v.is_string()) {
    double d = 0;
    if (absl::SimpleAtod(StripChars(v.str(), nullptr, true, true), &d)) return Value::Float(d);
  }
  return def;
}

absl::StatusOr<Value> Indent(const Value& input, CallArgs& args) {
  TP_RETURN_IF_ERROR(CheckArgs(args, 3, {"width", "first", "blank"}, "indent"));
  std::string pad = "    ";
  if (const Value* w = Arg(args, 0, "width")) {
    if (w->is_string()) {
      pad = w->str();
    } else if (w->is_int() && w->int_value() >= 0 && w->int_value() <= 1000) {
      pad = std::string(w->int_value(), ' ');
    } else {
      return Bad("indent: width must be a string or a small non-negative integer");
    }
  }
  const bool first = ArgBool(args, 1, "first", false);
  const bool blank = ArgBool(args, 2, "blank", false);
  std::string s = input.ToString();
  std::string out;
  size_t start = 0;
  bool is_first = true;
  while (true) {
    size_t nl = s.find('\n', start);
    std::string line = s.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    bool pad_it = is_first ? first : (blank || !StripChars(line, nullptr, true, true).empty());
    if (pad_it) out += pad;
    out += line;
    if (nl == std::string::npos) break;
    out.push_back('\n');
    start = nl + 1;
    is_first = false;
  }
  return Value::String(out);
}

absl::StatusOr<Value> ToJsonFilter(const Value& input, CallArgs& args) {
  // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
  TP_RETURN_IF_ERROR(
      CheckArgs(args, 4, {"ensure_ascii", "indent", "separators", "sort_keys"}, "tojson"));
  JsonOptions opt;
  opt.ensure_ascii = ArgBool(args, 0, "ensure_ascii", false);
  if (const Value* ind = Arg(args, 1, "indent"); ind != nullptr && !ind->is_none()) {
    if (!ind->is_int() || ind->int_value() < 0 || ind->int_value() > 64) {
      return Bad("tojson: indent must be an integer from 0 to 64");
    }
    opt.indent = static_cast<int>(ind->int_value());
  }
  if (const Value* sep = Arg(args, 2, "separators"); sep != nullptr && !sep->is_none()) {
    if (!sep->is_array() || sep->array().size() != 2 || !sep->array()[0].is_string() ||
        !sep->array()[1].is_string()) {
      return Bad("tojson: separators must be a pair of strings");
    }
    opt.item_separator = sep->array()[0].str();
    opt.key_separator = sep->array()[1].str();
    if (opt.item_separator.empty() || opt.key_separator.empty()) {
      return Bad("tojson: empty separators are not supported");
    }
  }
  opt.sort_keys = ArgBool(args, 3, "sort_keys", false);
  TP_ASSIGN_OR_RETURN(std::string s, ToJson(input, opt));
  return Value::String(std::move(s));
}

// select / reject / selectattr / rejectattr. args: [attribute,] test name, test arguments.
absl::StatusOr<Value> SelectFilter(const Value& input, CallArgs& args, bool by_attr, bool keep) {
  const char* what = by_attr ? (keep ? "selectattr" : "rejectattr") : (keep ? "select" : "reject");
  TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(input, what));
  if (!args.keyword.empty()) return Bad(absl::StrCat(what, " takes no keyword arguments"));
  size_t next = 0;
  std::string path;
  if (by_attr) {
    if (args.positional.empty() || !args.positional[0].is_string()) {
      return Bad(absl::StrCat(what, ": the attribute name must be a string"));
    }
    path = args.positional[0].str();
    next = 1;
  }
  std::string test;
  if (next < args.positional.size()) {
    if (!args.positional[next].is_string()) {
      return Bad(absl::StrCat(what, ": the test name must be a string"));
    }
    test = args.positional[next].str();
    if (!IsKnownTest(test)) return Bad(absl::StrCat(what, ": unknown test '", test, "'"));
    ++next;
  }
  CallArgs test_args;
  for (size_t i = next; i < args.positional.size(); ++i) {
    test_args.positional.push_back(args.positional[i]);
  }
  Value::Array out;
  for (const Value& item : items) {
    Value v = by_attr ? GetAttributePath(item, path) : item;
    bool pass;
    if (test.empty()) {
      pass = v.Truthy();
    } else {
      CallArgs a = test_args;
      TP_ASSIGN_OR_RETURN(pass, ApplyTest(test, v, a));
    }
    if (pass == keep) out.push_back(item);
  }
  return Value::NewArray(std::move(out));
}

absl::StatusOr<Value> MapFilter(const Value& input, CallArgs& args) {
  TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(input, "map"));
  Value::Array out;
  if (const Value* attr = Arg(args, 99, "attribute")) {
    if (!attr->is_string()) return Bad("map: attribute must be a string");
    const Value* def = Arg(args, 99, "default");
    for (const Value& item : items) {
      Value v = GetAttributePath(item, attr->str());
      out.push_back(v.is_undefined() && def ? *def : v);
    }
    return Value::NewArray(std::move(out));
  }
  if (args.positional.empty() || !args.positional[0].is_string()) {
    return Bad("map: needs a filter name or attribute=");
  }
  const std::string filter = args.positional[0].str();
  if (!IsKnownFilter(filter)) return Bad(absl::StrCat("map: unknown filter '", filter, "'"));
  CallArgs rest;
  rest.positional.assign(args.positional.begin() + 1, args.positional.end());
  rest.keyword = args.keyword;
  for (const Value& item : items) {
    CallArgs a = rest;
    TP_ASSIGN_OR_RETURN(Value v, ApplyFilter(filter, item, a));
    out.push_back(std::move(v));
  }
  return Value::NewArray(std::move(out));
}

const std::set<std::string>& Filters() {
  static const std::set<std::string> kFilters = {
      "abs",    "capitalize", "count",  "d",          "default", "e",          "escape",  "first",
      "float",  "indent",     "int",    "items",      "join",    "last",       "length",  "list",
      "lower",  "map",        "max",    "min",        "reject",  "rejectattr", "replace", "reverse",
      "round",  "safe",       "select", "selectattr", "sort",    "string",     "sum",     "title",
      "tojson", "trim",       "unique", "upper"};
  return kFilters;
}

const std::set<std::string>& Tests() {
  static const std::set<std::string> kTests = {
      "boolean", "callable", "defined",  "divisibleby", "eq",   "equalto",   "even",
      "false",   "float",    "ge",       "gt",          "in",   "integer",   "iterable",
      "le",      "lower",    "lt",       "mapping",     "ne",   "none",      "number",
      "odd",     "sameas",   "sequence", "string",      "true", "undefined", "upper",
      "==",      "!=",       "<",        "<=",          ">",    ">="};
  return kTests;
}

const std::set<std::string>& Methods() {
  static const std::set<std::string> kMethods = {
      "capitalize", "count",      "endswith", "find",   "get",     "items",
      "join",       "keys",       "lower",    "lstrip", "replace", "rstrip",
      "split",      "startswith", "strip",    "title",  "upper",   "values"};
  return kMethods;
}

absl::StatusOr<Value> Replace(const std::string& s, const std::string& old_s,
                              const std::string& new_s, int64_t count) {
  std::string out;
  if (old_s.empty()) {
    // Python inserts `new` between characters (and at both ends).
    auto chars = Utf8Chars(s);
    int64_t done = 0;
    for (size_t i = 0; i <= chars.size(); ++i) {
      if (count < 0 || done < count) {
        out += new_s;
        ++done;
      }
      if (i < chars.size()) out += chars[i];
      if (out.size() > (64u << 20)) return Bad("replace: result too large");
    }
    return Value::String(out);
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t f = s.find(old_s, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += new_s;
    pos = f + old_s.size();
    ++done;
    if (out.size() > (64u << 20)) return Bad("replace: result too large");
  }
  out.append(s, pos, std::string::npos);
  return Value::String(out);
}

absl::StatusOr<Value> Split(const std::string& s, const Value* sep, int64_t maxsplit) {
  Value::Array out;
  if (sep == nullptr || sep->is_none()) {
    // Runs of whitespace separate; leading and trailing whitespace is ignored.
    auto chars = Utf8Chars(s);
    size_t i = 0;
    int64_t splits = 0;
    while (i < chars.size()) {
      while (i < chars.size() && IsPySpace(chars[i])) ++i;
      if (i == chars.size()) break;
      std::string word;
      if (maxsplit >= 0 && splits >= maxsplit) {
        for (; i < chars.size(); ++i) word += chars[i];
        // Python keeps the remainder as is, minus trailing whitespace.
        word = StripChars(word, nullptr, false, true);
        out.push_back(Value::String(word));
        break;
      }
      while (i < chars.size() && !IsPySpace(chars[i])) word += chars[i++];
      out.push_back(Value::String(word));
      ++splits;
    }
    return Value::NewArray(std::move(out));
  }
  if (!sep->is_string()) return Bad("split: separator must be a string");
  const std::string& d = sep->str();
  if (d.empty()) return Bad("split: empty separator");
  size_t pos = 0;
  int64_t splits = 0;
  while (maxsplit < 0 || splits < maxsplit) {
    size_t f = s.find(d, pos);
    if (f == std::string::npos) break;
    out.push_back(Value::String(s.substr(pos, f - pos)));
    pos = f + d.size();
    ++splits;
  }
  out.push_back(Value::String(s.substr(pos)));
  return Value::NewArray(std::move(out));
}

absl::StatusOr<bool> AffixMatch(const std::string& s, const Value& affix, bool prefix) {
  auto one = [&](const Value& a) -> absl::StatusOr<bool> {
    if (!a.is_string()) return Bad("startswith/endswith: argument must be a string or a tuple");
    const std::string& x = a.str();
    if (x.size() > s.size()) return false;
    return prefix ? s.compare(0, x.size(), x) == 0
                  : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (affix.is_array()) {
    for (const Value& a : affix.array()) {
      TP_ASSIGN_OR_RETURN(bool m, one(a));
      if (m) return true;
    }
    return false;
  }
  return one(affix);
}

}  // namespace

std::string StripChars(const std::string& s, const std::string* chars, bool left, bool right) {
  auto chs = Utf8Chars(s);
  std::vector<std::string> set_chars;
  if (chars != nullptr) set_chars = Utf8Chars(*chars);
  auto strip_it = [&](const std::string& c) {
    if (chars == nullptr) return IsPySpace(c);
    return std::find(set_chars.begin(), set_chars.end(), c) != set_chars.end();
  };
  size_t b = 0, e = chs.size();
  if (left) {
    while (b < e && strip_it(chs[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(chs[e - 1])) --e;
  }
  std::string out;
  for (size_t i = b; i < e; ++i) out += chs[i];
  return out;
}

bool IsKnownFilter(const std::string& name) { return Filters().count(name) > 0; }
bool IsKnownTest(const std::string& name) { return Tests().count(name) > 0; }
bool IsKnownMethod(const std::string& name) { return Methods().count(name) > 0; }
bool IsKnownGlobalFunction(const std::string& name) {
  return name == "raise_exception" || name == "range" || name == "namespace" || name == "dict" ||
         name == "strftime_now";
}

absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& input, CallArgs& args) {
  if (name == "trim") {
    TP_RETURN_IF_ERROR(CheckArgs(args, 1, {"chars"}, "trim"));
    const Value* chars = Arg(args, 0, "chars");
    std::string cs = chars && chars->is_string() ? chars->str() : "";
    return Value::String(
        StripChars(input.ToString(), chars && chars->is_string() ? &cs : nullptr, true, true));
  }
  if (name == "tojson") return ToJsonFilter(input, args);
  if (name == "length" || name == "count") return Length(input);
  if (name == "upper") return Value::String(Upper(input.ToString()));
  if (name == "lower") return Value::String(Lower(input.ToString()));
  if (name == "title") return Value::String(JinjaTitle(input.ToString()));
  if (name == "capitalize") return Value::String(Capitalize(input.ToString()));
  if (name == "string") return Value::String(input.ToString());
  if (name == "safe") return input;
  if (name == "e" || name == "escape") return Value::String(HtmlEscape(input.ToString()));
  if (name == "default" || name == "d") {
    TP_RETURN_IF_ERROR(CheckArgs(args, 2, {"default_value", "boolean"}, name));
    const Value* def = Arg(args, 0, "default_value");
    const bool boolean = ArgBool(args, 1, "boolean", false);
    if (input.is_undefined() || (boolean && !input.Truthy())) {
      return def ? *def : Value::String("");
    }
    return input;
  }
  if (name == "first" || name == "last") {
    if (input.is_array()) {
      const auto& a = input.array();
      if (a.empty()) return Value();
      return name == "first" ? a.front() : a.back();
    }
    TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(input, name));
    if (items.empty()) return Value();
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    TP_RETURN_IF_ERROR(CheckArgs(args, 2, {"d", "attribute"}, "join"));
    TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(input, "join"));
    const Value* d = Arg(args, 0, "d");
    const Value* attr = Arg(args, 1, "attribute");
    std::string sep = d ? d->ToString() : "";
    std::string out;
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += sep;
      out += (attr && attr->is_string() ? GetAttributePath(items[i], attr->str()) : items[i])
                 .ToString();
      if (out.size() > (64u << 20)) return Bad("join: result too large");
    }
    return Value::String(out);
  }
  if (name == "replace") {
    TP_RETURN_IF_ERROR(CheckArgs(args, 3, {"old", "new", "count"}, "replace"));
    TP_ASSIGN_OR_RETURN(std::string old_s, ArgString(args, 0, "old", "replace"));
    TP_ASSIGN_OR_RETURN(std::string new_s, ArgString(args, 1, "new", "replace"));
    const Value* count = Arg(args, 2, "count");
    return Replace(input.ToString(), old_s, new_s,
                   count && count->is_int() ? count->int_value() : -1);
  }
  if (name == "list") {
    TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(input, "list"));
    return Value::NewArray(std::move(items));
  }
  if (name == "items") {
    if (input.is_undefined()) return Value::NewArray();
    if (!input.is_object()) {
      return Bad(absl::StrCat("items: expected a mapping, got '", input.TypeName(), "'"));
    }
    Value::Array out;
    for (const auto& [k, v] : input.object().items()) {
      out.push_back(Value::NewTuple({Value::String(k), v}));
    }
    return Value::NewArray(std::move(out));
  }
  if (name == "int") {
    TP_RETURN_IF_ERROR(CheckArgs(args, 1, {"default"}, "int"));
    const Value* def = Arg(args, 0, "default");
    return ToInt(input, def ? *def : Value::Int(0));
  }
  if (name == "float") {
    TP_RETURN_IF_ERROR(CheckArgs(args, 1, {"default"}, "float"));
    const Value* def = Arg(args, 0, "default");
    return ToFloat(input, def ? *def : Value::Float(0));
  }
  if (name == "abs") {
    if (input.is_int())
      return Value::Int(input.int_value() < 0 ? -input.int_value() : input.int_value());
    if (input.is_float()) return Value::Float(std::fabs(input.float_value()));
    return Bad(absl::StrCat("bad operand type for abs(): '", input.TypeName(), "'"));
  }
  if (name == "round") {
    TP_RETURN_IF_ERROR(CheckArgs(args, 2, {"precision", "method"}, "round"));
    if (!input.is_number()) return Bad("round: expected a number");
    const Value* p = Arg(args, 0, "precision");
    int64_t prec = p && p->is_int() ? std::clamp<int64_t>(p->int_value(), 0, 15) : 0;
    double scale = std::pow(10.0, static_cast<double>(prec));
    return Value::Float(std::round(input.number() * scale) / scale);
  }
  if (name == "reverse") {
    if (input.is_string()) {
      auto chars = Utf8Chars(input.str());
      std::string out;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
      return Value::String(out);
    }
    TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(input, "reverse"));
    std::reverse(items.begin(), items.end());
    return Value::NewArray(std::move(items));
  }
  if (name == "sort") return SortFilter(input, args);
  if (name == "min" || name == "max") return MinMax(input, args, name == "max");
  if (name == "unique") {
    TP_RETURN_IF_ERROR(CheckArgs(args, 2, {"case_sensitive", "attribute"}, "unique"));
    TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(input, "unique"));
    const bool cs = ArgBool(args, 0, "case_sensitive", false);
    const Value* attr = Arg(args, 1, "attribute");
    Value::Array out, seen;
    for (const Value& item : items) {
      Value k = attr && attr->is_string() ? GetAttributePath(item, attr->str()) : item;
      if (!cs && k.is_string()) k = Value::String(Lower(k.str()));
      bool dup = false;
      for (const Value& s : seen) dup |= s.Equals(k);
      if (dup) continue;
      seen.push_back(k);
      out.push_back(item);
    }
    return Value::NewArray(std::move(out));
  }
  if (name == "sum") {
    TP_RETURN_IF_ERROR(CheckArgs(args, 2, {"attribute", "start"}, "sum"));
    TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(input, "sum"));
    const Value* attr = Arg(args, 0, "attribute");
    const Value* start = Arg(args, 1, "start");
    Value total = start ? *start : Value::Int(0);
    for (const Value& item : items) {
      TP_ASSIGN_OR_RETURN(
          total,
          Add(total, attr && attr->is_string() ? GetAttributePath(item, attr->str()) : item));
    }
    return total;
  }
  if (name == "indent") return Indent(input, args);
  if (name == "select") return SelectFilter(input, args, false, true);
  if (name == "reject") return SelectFilter(input, args, false, false);
  if (name == "selectattr") return SelectFilter(input, args, true, true);
  if (name == "rejectattr") return SelectFilter(input, args, true, false);
  if (name == "map") return MapFilter(input, args);
  return Bad(absl::StrCat("unknown filter '", name, "'"));
}

absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& v, CallArgs& args) {
  const Value* arg = args.positional.empty() ? nullptr : &args.positional[0];
  auto need_arg = [&]() -> absl::Status {
    if (arg == nullptr) return Bad(absl::StrCat("test '", name, "' needs an argument"));
    return absl::OkStatus();
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && v.bool_value();
  if (name == "false") return v.is_bool() && !v.bool_value();
  if (name == "integer") return v.is_int();
  if (name == "float") return v.is_float();
  if (name == "number") return v.is_number() || v.is_bool();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_object() && !v.is_namespace();
  if (name == "iterable")
    return v.is_string() || v.is_array() || (v.is_object() && !v.is_namespace());
  if (name == "sequence")
    return v.is_string() || v.is_array() || (v.is_object() && !v.is_namespace());
  if (name == "callable") return v.is_function();
  if (name == "lower" || name == "upper") {
    if (!v.is_string()) return false;
    const std::string& s = v.str();
    return name == "lower" ? Lower(s) == s : Upper(s) == s;
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (!v.is_int()) return Bad(absl::StrCat("test '", name, "' needs an integer"));
    if (name == "divisibleby") {
      TP_RETURN_IF_ERROR(need_arg());
      if (!arg->is_int() || arg->int_value() == 0) {
        return Bad("divisibleby: needs a non-zero integer");
      }
      return v.int_value() % arg->int_value() == 0;
    }
    const bool odd = (v.int_value() % 2) != 0;
    return name == "odd" ? odd : !odd;
  }
  if (name == "eq" || name == "equalto" || name == "==") {
    TP_RETURN_IF_ERROR(need_arg());
    return v.Equals(*arg);
  }
  if (name == "ne" || name == "!=") {
    TP_RETURN_IF_ERROR(need_arg());
    return !v.Equals(*arg);
  }
  if (name == "lt" || name == "<" || name == "gt" || name == ">" || name == "le" || name == "<=" ||
      name == "ge" || name == ">=") {
    TP_RETURN_IF_ERROR(need_arg());
    const bool lt = name == "lt" || name == "<", gt = name == "gt" || name == ">";
    const bool le = name == "le" || name == "<=";
    if (lt) return Less(v, *arg, true);
    if (gt) return Less(*arg, v, true);
    TP_ASSIGN_OR_RETURN(bool greater, le ? Less(*arg, v, true) : Less(v, *arg, true));
    return !greater;
  }
  if (name == "in") {
    TP_RETURN_IF_ERROR(need_arg());
    if (arg->is_string()) return v.is_string() && arg->str().find(v.str()) != std::string::npos;
    if (arg->is_array()) {
      for (const Value& x : arg->array()) {
        if (x.Equals(v)) return true;
      }
      return false;
    }
    if (arg->is_object()) return v.is_string() && arg->object().Find(v.str()) != nullptr;
    return Bad(absl::StrCat("argument of type '", arg->TypeName(), "' is not iterable"));
  }
  if (name == "sameas") {
    TP_RETURN_IF_ERROR(need_arg());
    if (v.kind() != arg->kind()) return false;
    if (v.is_none() || v.is_undefined()) return true;
    if (v.is_bool()) return v.bool_value() == arg->bool_value();
    return v.Equals(*arg);
  }
  return Bad(absl::StrCat("unknown test '", name, "'"));
}

absl::StatusOr<Value> CallMethod(const Value& obj, const std::string& name, CallArgs& args) {
  if (obj.is_string()) {
    const std::string& s = obj.str();
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      TP_RETURN_IF_ERROR(CheckArgs(args, 1, {}, name));
      const Value* chars = Arg(args, 0, "chars");
      std::string cs = chars && chars->is_string() ? chars->str() : "";
      const std::string* cp = chars && chars->is_string() ? &cs : nullptr;
      return Value::String(StripChars(s, cp, name != "rstrip", name != "lstrip"));
    }
    if (name == "split") {
      TP_RETURN_IF_ERROR(CheckArgs(args, 2, {"sep", "maxsplit"}, "split"));
      const Value* max = Arg(args, 1, "maxsplit");
      return Split(s, Arg(args, 0, "sep"), max && max->is_int() ? max->int_value() : -1);
    }
    if (name == "startswith" || name == "endswith") {
      if (args.positional.size() != 1 || !args.keyword.empty()) {
        return Bad(absl::StrCat(name, " takes exactly one argument"));
      }
      TP_ASSIGN_OR_RETURN(bool m, AffixMatch(s, args.positional[0], name == "startswith"));
      return Value::Bool(m);
    }
    if (name == "upper") return Value::String(Upper(s));
    if (name == "lower") return Value::String(Lower(s));
    if (name == "title") return Value::String(PyTitle(s));
    if (name == "capitalize") return Value::String(Capitalize(s));
    if (name == "replace") {
      TP_RETURN_IF_ERROR(CheckArgs(args, 3, {}, "replace"));
      TP_ASSIGN_OR_RETURN(std::string old_s, ArgString(args, 0, "old", "replace"));
      TP_ASSIGN_OR_RETURN(std::string new_s, ArgString(args, 1, "new", "replace"));
      const Value* count = Arg(args, 2, "count");
      return Replace(s, old_s, new_s, count && count->is_int() ? count->int_value() : -1);
    }
    if (name == "find" || name == "count") {
      TP_RETURN_IF_ERROR(CheckArgs(args, 1, {}, name));
      TP_ASSIGN_OR_RETURN(std::string sub, ArgString(args, 0, "sub", name));
      if (name == "find") {
        size_t f = s.find(sub);
        if (f == std::string::npos) return Value::Int(-1);
        return Value::Int(static_cast<int64_t>(Utf8Length(s.substr(0, f))));
      }
      if (sub.empty()) return Value::Int(static_cast<int64_t>(Utf8Length(s) + 1));
      int64_t n = 0;
      for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
      return Value::Int(n);
    }
    if (name == "join") {
      if (args.positional.size() != 1) return Bad("join takes exactly one argument");
      TP_ASSIGN_OR_RETURN(Value::Array items, Iterate(args.positional[0], "join"));
      std::string out;
      for (size_t i = 0; i < items.size(); ++i) {
        if (!items[i].is_string()) return Bad("join: sequence item is not a string");
        if (i) out += s;
        out += items[i].str();
        if (out.size() > (64u << 20)) return Bad("join: result too large");
      }
      return Value::String(out);
    }
  } else if (obj.is_object() && !obj.is_namespace()) {
    const ObjectData& o = obj.object();
    if (name == "get") {
      if (args.positional.empty() || args.positional.size() > 2 || !args.keyword.empty()) {
        return Bad("get takes one or two arguments");
      }
      const Value& key = args.positional[0];
      const Value* found = key.is_string() ? o.Find(key.str()) : nullptr;
      if (found) return *found;
      return args.positional.size() == 2 ? args.positional[1] : Value::None();
    }
    if (name == "items" || name == "keys" || name == "values") {
      if (!args.positional.empty() || !args.keyword.empty()) {
        return Bad(absl::StrCat(name, "() takes no arguments"));
      }
      Value::Array out;
      for (const auto& [k, v] : o.items()) {
        if (name == "items") {
          out.push_back(Value::NewTuple({Value::String(k), v}));
        } else {
          out.push_back(name == "keys" ? Value::String(k) : v);
        }
      }
      return Value::NewArray(std::move(out));
    }
  }
  return Bad(absl::StrCat("'", obj.TypeName(), "' object has no method '", name, "'"));
}

Value MakeGlobalFunction(const std::string& name) {
  if (name == "range") {
    return Value::Function([](CallArgs& args) -> absl::StatusOr<Value> {
      if (!args.keyword.empty() || args.positional.empty() || args.positional.size() > 3) {
        return Bad("range takes 1 to 3 integer arguments");
      }
      for (const Value& a : args.positional) {
        if (!a.is_int()) return Bad("range: arguments must be integers");
      }
      int64_t start = 0, stop, step = 1;
      if (args.positional.size() == 1) {
        stop = args.positional[0].int_value();
      } else {
        start = args.positional[0].int_value();
        stop = args.positional[1].int_value();
        if (args.positional.size() == 3) step = args.positional[2].int_value();
      }
      if (step == 0) return Bad("range: step must not be zero");
      Value::Array out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (out.size() >= kMaxSequence) return Bad("range: too many items");
        out.push_back(Value::Int(i));
      }
      return Value::NewArray(std::move(out));
    });
  }
  if (name == "namespace" || name == "dict") {
    const bool ns = name == "namespace";
    return Value::Function([ns](CallArgs& args) -> absl::StatusOr<Value> {
      Value out = ns ? Value::NewNamespace() : Value::NewObject();
      if (args.positional.size() > 1) return Bad("namespace/dict take at most one mapping");
      if (!args.positional.empty()) {
        if (!args.positional[0].is_object()) return Bad("namespace/dict: expected a mapping");
        for (const auto& [k, v] : args.positional[0].object().items()) out.object().Set(k, v);
      }
      for (const auto& [k, v] : args.keyword) out.object().Set(k, v);
      return out;
    });
  }
  if (name == "strftime_now") {
    return Value::Function([](CallArgs& args) -> absl::StatusOr<Value> {
      if (args.positional.size() != 1 || !args.positional[0].is_string()) {
        return Bad("strftime_now takes one format string");
      }
      std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[512];
      size_t n = std::strftime(buf, sizeof(buf), args.positional[0].str().c_str(), &tm);
      return Value::String(std::string(buf, n));
    });
  }
  return Value();  // raise_exception is made by the interpreter (it marks the error as raised)
}

}  // namespace tpserve::jinja
