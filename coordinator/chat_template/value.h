// The value type of the chat-template interpreter: Python-like none/bool/int/float/str, lists and
// insertion-ordered dicts shared by reference (as in Python), namespaces, and callables.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace tpserve::jinja {

class Value;

struct CallArgs;
class ObjectData;
using NativeFunction = std::function<absl::StatusOr<Value>(CallArgs&)>;

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kArray, kObject, kFunction };
  using Array = std::vector<Value>;

  Value() = default;  // undefined
  static Value None();
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double d);
  static Value String(std::string s);
  static Value NewArray(Array items = {});
  // A list that prints as a Python tuple: (a, b). Tuple literals and dict items are tuples.
  static Value NewTuple(Array items);
  static Value NewObject();
  static Value NewNamespace();
  static Value Function(NativeFunction fn);
  // Converts parsed JSON (objects keep their key order).
  static Value FromJson(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }
  bool is_namespace() const { return kind_ == Kind::kObject && namespace_; }
  bool is_function() const { return kind_ == Kind::kFunction; }

  bool bool_value() const { return b_; }
  int64_t int_value() const { return i_; }
  double float_value() const { return d_; }
  double number() const { return kind_ == Kind::kFloat ? d_ : static_cast<double>(i_); }
  const std::string& str() const { return *s_; }
  Array& array() const { return *a_; }
  ObjectData& object() const;
  const NativeFunction& function() const { return *f_; }

  // Python truthiness.
  bool Truthy() const;
  // Python str(): what {{ value }} prints (undefined prints nothing).
  std::string ToString() const;
  // Python repr() (used inside str() of lists and dicts).
  std::string Repr() const;
  // Python ==, deep for lists and dicts.
  bool Equals(const Value& other) const;
  // A short type name for error messages.
  const char* TypeName() const;
  // Nesting depth: 0 for scalars, 1 for a flat list or dict. Kept with the value (O(1)) so that
  // the interpreter can refuse values nested deeper than recursion over them can handle.
  int depth() const;
  // Whether this is, or holds at any depth, a namespace (the only mutable value: storing one
  // in a namespace could make a cycle).
  bool ContainsNamespace() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  bool namespace_ = false;
  int array_depth_ = 0;
  bool array_has_namespace_ = false;
  bool tuple_ = false;
  int64_t i_ = 0;
  double d_ = 0;
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<Array> a_;
  std::shared_ptr<ObjectData> o_;
  std::shared_ptr<const NativeFunction> f_;
};

// Arguments of a call: positional first, then keyword arguments in source order.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// Insertion-ordered string-keyed map (Python dicts keep insertion order; so does JSON output).
class ObjectData {
 public:
  const Value* Find(const std::string& key) const;
  void Set(const std::string& key, Value value);
  const std::vector<std::pair<std::string, Value>>& items() const { return items_; }
  size_t size() const { return items_.size(); }
  // Nesting depth of the values stored (an upper bound once a namespace attribute is replaced).
  int depth() const { return depth_; }
  bool contains_namespace() const { return contains_namespace_; }

 private:
  int depth_ = 1;
  bool contains_namespace_ = false;
  std::vector<std::pair<std::string, Value>> items_;
  absl::flat_hash_map<std::string, size_t> index_;
};

inline ObjectData& Value::object() const { return *o_; }

// JSON text the way Hugging Face's chat-template `tojson` writes it: json.dumps with
// ensure_ascii=False by default, separators (", ", ": ") without indent and (",", ": ") with it.
struct JsonOptions {
  int indent = -1;  // < 0: one line
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::string item_separator;  // empty: the default for the indent
  std::string key_separator;
};
absl::StatusOr<std::string> ToJson(const Value& v, const JsonOptions& options);

// UTF-8 helpers shared by the interpreter: code point count, and splitting into code points.
size_t Utf8Length(const std::string& s);
std::vector<std::string> Utf8Chars(const std::string& s);

}  // namespace tpserve::jinja
