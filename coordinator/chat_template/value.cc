// Value semantics of the chat-template interpreter (Python's truthiness, str, repr, ==) and the
// Hugging Face flavour of json.dumps used by `tojson`.
#include "coordinator/chat_template/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tpserve::jinja {

const Value* ObjectData::Find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

void ObjectData::Set(const std::string& key, Value value) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    depth_ = std::max(depth_, value.depth() + 1);
    contains_namespace_ = contains_namespace_ || value.ContainsNamespace();
    items_[it->second].second = std::move(value);
    return;
  }
  depth_ = std::max(depth_, value.depth() + 1);
  contains_namespace_ = contains_namespace_ || value.ContainsNamespace();
  index_.emplace(key, items_.size());
  items_.emplace_back(key, std::move(value));
}

Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value Value::Bool(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.b_ = b;
  return v;
}
Value Value::Int(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.i_ = i;
  return v;
}
Value Value::Float(double d) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.d_ = d;
  return v;
}
Value Value::String(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.s_ = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::NewArray(Array items) {
  Value v;
  v.kind_ = Kind::kArray;
  int depth = 0;
  for (const Value& item : items) {
    depth = std::max(depth, item.depth());
    v.array_has_namespace_ = v.array_has_namespace_ || item.ContainsNamespace();
  }
  v.array_depth_ = depth + 1;
  v.a_ = std::make_shared<Array>(std::move(items));
  return v;
}
Value Value::NewTuple(Array items) {
  Value v = NewArray(std::move(items));
  v.tuple_ = true;
  return v;
}
Value Value::NewObject() {
  Value v;
  v.kind_ = Kind::kObject;
  v.o_ = std::make_shared<ObjectData>();
  return v;
}
Value Value::NewNamespace() {
  Value v = NewObject();
  v.namespace_ = true;
  return v;
}
Value Value::Function(NativeFunction fn) {
  Value v;
  v.kind_ = Kind::kFunction;
  v.f_ = std::make_shared<const NativeFunction>(std::move(fn));
  return v;
}

Value Value::FromJson(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return None();
    case nlohmann::ordered_json::value_t::boolean:
      return Bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Float(static_cast<double>(u));
      return Int(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Float(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return String(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Array items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(FromJson(e));
      return NewArray(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value o = NewObject();
      for (auto it = j.begin(); it != j.end(); ++it) o.object().Set(it.key(), FromJson(it.value()));
      return o;
    }
    default:
      return Value();
  }
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
      return i_ != 0;
    case Kind::kFloat:
      return d_ != 0;
    case Kind::kString:
      return !s_->empty();
    case Kind::kArray:
      return !a_->empty();
    case Kind::kObject:
      return namespace_ || o_->size() > 0;
    case Kind::kFunction:
      return true;
  }
  return false;
}

namespace {

// Python's float repr: the shortest round-trip digits, positional for 1e-4 <= |x| < 1e16.
std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  int exp = std::stoi(sci.substr(e + 1));
  bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant) {
    if (c != '.') digits.push_back(c);
  }
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out = "0." + std::string(-exp - 1, '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exp + 1) {
      out = digits + std::string(exp + 1 - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

std::string StringRepr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == q || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", c);
      out += b;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  out.push_back(q);
  return out;
}

}  // namespace

std::string Value::ToString() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return b_ ? "True" : "False";
    case Kind::kInt:
      return std::to_string(i_);
    case Kind::kFloat:
      return FloatRepr(d_);
    case Kind::kString:
      return *s_;
    default:
      return Repr();
  }
}

std::string Value::Repr() const {
  switch (kind_) {
    case Kind::kString:
      return StringRepr(*s_);
    case Kind::kArray: {
      std::string out = tuple_ ? "(" : "[";
      for (size_t i = 0; i < a_->size(); ++i) {
        if (i) out += ", ";
        out += (*a_)[i].Repr();
      }
      if (tuple_ && a_->size() == 1) out += ",";
      return out + (tuple_ ? ")" : "]");
    }
    case Kind::kObject: {
      if (namespace_) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : o_->items()) {
        if (!first) out += ", ";
        first = false;
        out += StringRepr(k) + ": " + v.Repr();
      }
      return out + "}";
    }
    case Kind::kFunction:
      return "<function>";
    case Kind::kUndefined:
      return "Undefined";
    default:
      return ToString();
  }
}

bool Value::Equals(const Value& o) const {
  if (is_number() || is_bool()) {
    if (!(o.is_number() || o.is_bool())) return false;
    if (is_float() || o.is_float()) {
      double a = is_bool() ? (b_ ? 1 : 0) : number();
      double b = o.is_bool() ? (o.b_ ? 1 : 0) : o.number();
      return a == b;
    }
    int64_t a = is_bool() ? (b_ ? 1 : 0) : i_;
    int64_t b = o.is_bool() ? (o.b_ ? 1 : 0) : o.i_;
    return a == b;
  }
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return *s_ == *o.s_;
    case Kind::kArray: {
      if (a_ == o.a_) return true;
      if (tuple_ != o.tuple_) return false;  // Python: (1,) != [1]
      if (a_->size() != o.a_->size()) return false;
      for (size_t i = 0; i < a_->size(); ++i) {
        if (!(*a_)[i].Equals((*o.a_)[i])) return false;
      }
      return true;
    }
    case Kind::kObject: {
      if (o_ == o.o_) return true;
      if (namespace_ || o.namespace_) return false;
      if (o_->size() != o.o_->size()) return false;
      for (const auto& [k, v] : o_->items()) {
        const Value* w = o.o_->Find(k);
        if (w == nullptr || !v.Equals(*w)) return false;
      }
      return true;
    }
    case Kind::kFunction:
      return f_ == o.f_;
    default:
      return false;
  }
}

int Value::depth() const {
  if (kind_ == Kind::kArray) return array_depth_;
  if (kind_ == Kind::kObject) return o_->depth();
  return 0;
}

bool Value::ContainsNamespace() const {
  if (kind_ == Kind::kArray) return array_has_namespace_;
  if (kind_ == Kind::kObject) return namespace_ || o_->contains_namespace();
  return false;
}

const char* Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "undefined";
    case Kind::kNone:
      return "none";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kArray:
      return "list";
    case Kind::kObject:
      return namespace_ ? "namespace" : "dict";
    case Kind::kFunction:
      return "function";
  }
  return "?";
}

size_t Utf8Length(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

std::vector<std::string> Utf8Chars(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    size_t j = i + 1;
    while (j < s.size() && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) ++j;
    out.push_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

namespace {

// Decodes one UTF-8 sequence at s[i] (advancing i); invalid bytes decode as themselves.
uint32_t DecodeUtf8(const std::string& s, size_t& i) {
  unsigned char c = s[i];
  int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (len == 1 || i + len > s.size()) {
    ++i;
    return c;
  }
  uint32_t cp = c & (0x7F >> len);
  for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

void AppendJsonString(const std::string& s, bool ensure_ascii, std::string& out) {
  out.push_back('"');
  for (size_t i = 0; i < s.size();) {
    unsigned char c = s[i];
    if (c >= 0x80 && ensure_ascii) {
      uint32_t cp = DecodeUtf8(s, i);
      char b[16];
      if (cp >= 0x10000) {
        cp -= 0x10000;
        std::snprintf(b, sizeof(b), "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
      } else {
        std::snprintf(b, sizeof(b), "\\u%04x", cp);
      }
      out += b;
      continue;
    }
    ++i;
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (c == 0x7f && ensure_ascii)) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", c);
          out += b;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
}

absl::Status AppendJson(const Value& v, const JsonOptions& opt, int depth, std::string& out) {
  if (depth > 512) return absl::InvalidArgumentError("tojson: value nested too deeply");
  const std::string item_sep =
      !opt.item_separator.empty() ? opt.item_separator : (opt.indent >= 0 ? "," : ", ");
  const std::string key_sep = !opt.key_separator.empty() ? opt.key_separator : ": ";
  auto newline = [&](int d) {
    if (opt.indent < 0) return;
    out.push_back('\n');
    out.append(static_cast<size_t>(opt.indent) * d, ' ');
  };
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      out += "null";
      return absl::OkStatus();
    case Value::Kind::kBool:
      out += v.bool_value() ? "true" : "false";
      return absl::OkStatus();
    case Value::Kind::kInt:
    case Value::Kind::kFloat:
      if (v.is_float() && std::isnan(v.float_value())) {
        out += "NaN";
      } else if (v.is_float() && std::isinf(v.float_value())) {
        out += v.float_value() < 0 ? "-Infinity" : "Infinity";
      } else {
        out += v.ToString();
      }
      return absl::OkStatus();
    case Value::Kind::kString:
      AppendJsonString(v.str(), opt.ensure_ascii, out);
      return absl::OkStatus();
    case Value::Kind::kArray: {
      const auto& a = v.array();
      out.push_back('[');
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        absl::Status s = AppendJson(a[i], opt, depth + 1, out);
        if (!s.ok()) return s;
      }
      if (!a.empty()) newline(depth);
      out.push_back(']');
      return absl::OkStatus();
    }
    case Value::Kind::kObject: {
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.object().items()) items.push_back(&kv);
      if (opt.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      }
      out.push_back('{');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        AppendJsonString(items[i]->first, opt.ensure_ascii, out);
        out += key_sep;
        absl::Status s = AppendJson(items[i]->second, opt, depth + 1, out);
        if (!s.ok()) return s;
      }
      if (!items.empty()) newline(depth);
      out.push_back('}');
      return absl::OkStatus();
    }
    case Value::Kind::kFunction:
      return absl::InvalidArgumentError("tojson: a function is not JSON serializable");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ToJson(const Value& v, const JsonOptions& options) {
  std::string out;
  absl::Status s = AppendJson(v, options, 0, out);
  if (!s.ok()) return s;
  return out;
}

}  // namespace tpserve::jinja
