// Parsing and validation of config.json / generation_config.json, and writing config.json back.
// Both the older form (rope_theta + rope_scaling) and transformers 5's rope_parameters are read.
#include "common/model_config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace tpserve {
namespace {

using Json = nlohmann::json;

constexpr const char* kSupportedArchitectures[] = {"LlamaForCausalLM", "MistralForCausalLM",
                                                   "Qwen2ForCausalLM"};

// Short, bounded rendering of a JSON value for error messages.
std::string Describe(const Json& v) {
  if (v.is_structured()) return std::string(v.type_name());
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 40) + "...";
  return s;
}

// Field readers bound to one JSON object; every error names the source file and the field.
class Fields {
 public:
  Fields(const Json& obj, absl::string_view source, std::string prefix = "")
      : obj_(obj), source_(source), prefix_(std::move(prefix)) {}

  bool Present(const char* key) const {
    auto it = obj_.find(key);
    return it != obj_.end() && !it->is_null();
  }

  absl::Status Error(const char* key, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": field '", prefix_, key, "' ", what));
  }

  absl::StatusOr<int64_t> Int(const char* key) const {
    if (!Present(key)) return Error(key, "is required but missing");
    const Json& v = obj_.at(key);
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) {
        return static_cast<int64_t>(d);
      }
    }
    return Error(key, absl::StrCat("must be an integer, got ", Describe(v)));
  }
  absl::StatusOr<int64_t> PositiveInt(const char* key) const {
    TP_ASSIGN_OR_RETURN(int64_t v, Int(key));
    if (v <= 0) return Error(key, absl::StrCat("must be positive, got ", v));
    return v;
  }
  absl::StatusOr<int64_t> PositiveIntOr(const char* key, int64_t fallback) const {
    if (!Present(key)) return fallback;
    return PositiveInt(key);
  }
  absl::StatusOr<double> Double(const char* key) const {
    if (!Present(key)) return Error(key, "is required but missing");
    const Json& v = obj_.at(key);
    if (!v.is_number()) return Error(key, absl::StrCat("must be a number, got ", Describe(v)));
    return v.get<double>();
  }
  absl::StatusOr<double> PositiveDoubleOr(const char* key, double fallback) const {
    if (!Present(key)) return fallback;
    TP_ASSIGN_OR_RETURN(double v, Double(key));
    if (!(v > 0) || !std::isfinite(v)) {
      return Error(key, absl::StrCat("must be a positive number, got ", v));
    }
    return v;
  }
  absl::StatusOr<bool> BoolOr(const char* key, bool fallback) const {
    if (!Present(key)) return fallback;
    const Json& v = obj_.at(key);
    if (!v.is_boolean())
      return Error(key, absl::StrCat("must be true or false, got ", Describe(v)));
    return v.get<bool>();
  }
  absl::StatusOr<std::string> StringOr(const char* key, std::string fallback) const {
    if (!Present(key)) return fallback;
    const Json& v = obj_.at(key);
    if (!v.is_string()) return Error(key, absl::StrCat("must be a string, got ", Describe(v)));
    return v.get<std::string>();
  }
  // An int, a list of ints, or absent/null (empty list).
  absl::StatusOr<std::vector<int32_t>> TokenIds(const char* key) const {
    std::vector<int32_t> out;
    if (!Present(key)) return out;
    const Json& v = obj_.at(key);
    auto one = [&](const Json& e) -> absl::Status {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX) {
        return Error(key,
                     absl::StrCat("must be a token id or a list of token ids, got ", Describe(e)));
      }
      out.push_back(static_cast<int32_t>(e.get<int64_t>()));
      return absl::OkStatus();
    };
    if (v.is_array()) {
      for (const Json& e : v) TP_RETURN_IF_ERROR(one(e));
    } else {
      TP_RETURN_IF_ERROR(one(v));
    }
    return out;
  }

 private:
  const Json& obj_;
  std::string source_;
  std::string prefix_;
};

absl::StatusOr<Json> ParseJsonObject(std::string_view text, absl::string_view source) {
  Json j;
  try {
    j = Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": invalid JSON: ", e.what()));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected a JSON object at the top level, got ", j.type_name()));
  }
  return j;
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open file"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return ss.str();
}

// Reads a rope scaling description: `obj` is either rope_scaling (old form) or
// rope_parameters (transformers 5). `field` is the name used in messages.
absl::Status ParseRope(const Json& obj, absl::string_view source, const std::string& field,
                       RopeConfig* rope) {
  if (!obj.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": field '", field, "' must be an object or null, got ", Describe(obj)));
  }
  Fields f(obj, source, field + ".");
  std::string type = "default";
  if (f.Present("rope_type")) {
    TP_ASSIGN_OR_RETURN(type, f.StringOr("rope_type", "default"));
  } else if (f.Present("type")) {
    TP_ASSIGN_OR_RETURN(type, f.StringOr("type", "default"));
  }
  if (f.Present("rope_theta")) {
    TP_ASSIGN_OR_RETURN(rope->theta, f.PositiveDoubleOr("rope_theta", rope->theta));
  }
  if (f.Present("partial_rotary_factor")) {
    TP_ASSIGN_OR_RETURN(double p, f.Double("partial_rotary_factor"));
    if (p != 1.0) return f.Error("partial_rotary_factor", "other than 1.0 is not supported");
  }
  if (type == "default") {
    rope->scaling = RopeScalingType::kNone;
    rope->factor = 1.0;
    return absl::OkStatus();
  }
  if (type == "linear") {
    rope->scaling = RopeScalingType::kLinear;
    if (!f.Present("factor")) return f.Error("factor", "is required for rope type 'linear'");
    TP_ASSIGN_OR_RETURN(rope->factor, f.PositiveDoubleOr("factor", 1.0));
    return absl::OkStatus();
  }
  if (type == "llama3") {
    rope->scaling = RopeScalingType::kLlama3;
    for (const char* key :
         {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
      if (!f.Present(key)) return f.Error(key, "is required for rope type 'llama3'");
    }
    TP_ASSIGN_OR_RETURN(rope->factor, f.PositiveDoubleOr("factor", 1.0));
    TP_ASSIGN_OR_RETURN(rope->low_freq_factor, f.PositiveDoubleOr("low_freq_factor", 1.0));
    TP_ASSIGN_OR_RETURN(rope->high_freq_factor, f.PositiveDoubleOr("high_freq_factor", 4.0));
    TP_ASSIGN_OR_RETURN(rope->original_max_position_embeddings,
                        f.PositiveInt("original_max_position_embeddings"));
    if (rope->high_freq_factor <= rope->low_freq_factor) {
      return f.Error("high_freq_factor", "must be larger than low_freq_factor");
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      source, ": field '", field, ".", obj.contains("rope_type") ? "rope_type" : "type",
      "' has unsupported rope type '", type, "' (supported: default, linear, llama3)"));
}

}  // namespace

int64_t ModelConfig::LayerWeightElems() const {
  const int64_t q = num_heads * head_dim;
  const int64_t kv = num_kv_heads * head_dim;
  int64_t n = hidden_size * q + 2 * hidden_size * kv + q * hidden_size;  // q, k, v, o
  if (attention_bias) n += q + 2 * kv;
  if (o_proj_bias) n += hidden_size;
  n += 3 * hidden_size * intermediate_size;  // gate, up, down
  if (mlp_bias) n += 2 * intermediate_size + hidden_size;
  n += 2 * hidden_size;  // input and post-attention RMSNorm
  return n;
}

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text,
                                             std::string_view source_name) {
  const absl::string_view source(source_name.data(), source_name.size());
  TP_ASSIGN_OR_RETURN(Json j, ParseJsonObject(json_text, source));
  Fields f(j, source);
  ModelConfig c;

  // Architecture: architectures[0], else derived from model_type.
  TP_ASSIGN_OR_RETURN(c.model_type, f.StringOr("model_type", ""));
  if (f.Present("architectures")) {
    const Json& a = j["architectures"];
    if (!a.is_array() || a.empty() || !a[0].is_string()) {
      return f.Error("architectures", "must be a non-empty list of strings");
    }
    c.architecture = a[0].get<std::string>();
  } else if (c.model_type == "llama") {
    c.architecture = "LlamaForCausalLM";
  } else if (c.model_type == "mistral") {
    c.architecture = "MistralForCausalLM";
  } else if (c.model_type == "qwen2") {
    c.architecture = "Qwen2ForCausalLM";
  } else {
    return f.Error("architectures",
                   "is required but missing (and model_type does not name a "
                   "supported model)");
  }
  bool supported = false;
  for (const char* a : kSupportedArchitectures) supported |= c.architecture == a;
  if (!supported) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": unsupported architecture '", c.architecture,
                     "' (supported: ", absl::StrJoin(kSupportedArchitectures, ", "), ")"));
  }
  const bool is_llama = c.architecture == "LlamaForCausalLM";
  const bool is_qwen2 = c.architecture == "Qwen2ForCausalLM";
  if (c.model_type.empty()) c.model_type = is_llama ? "llama" : is_qwen2 ? "qwen2" : "mistral";

  TP_ASSIGN_OR_RETURN(std::string act, f.StringOr("hidden_act", "silu"));
  if (act != "silu") {
    return f.Error("hidden_act", absl::StrCat("'", act, "' is not supported (only silu)"));
  }

  TP_ASSIGN_OR_RETURN(c.hidden_size, f.PositiveInt("hidden_size"));
  TP_ASSIGN_OR_RETURN(c.intermediate_size, f.PositiveInt("intermediate_size"));
  TP_ASSIGN_OR_RETURN(c.num_layers, f.PositiveInt("num_hidden_layers"));
  TP_ASSIGN_OR_RETURN(c.num_heads, f.PositiveInt("num_attention_heads"));
  TP_ASSIGN_OR_RETURN(c.num_kv_heads, f.PositiveIntOr("num_key_value_heads", c.num_heads));
  TP_ASSIGN_OR_RETURN(c.vocab_size, f.PositiveInt("vocab_size"));
  if (f.Present("head_dim")) {
    TP_ASSIGN_OR_RETURN(c.head_dim, f.PositiveInt("head_dim"));
  } else {
    if (c.hidden_size % c.num_heads != 0) {
      return f.Error("num_attention_heads",
                     absl::StrCat("(", c.num_heads, ") must divide hidden_size (", c.hidden_size,
                                  ") when head_dim is not given"));
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.head_dim % 2 != 0) {
    return f.Error("head_dim",
                   absl::StrCat("must be even for rotary embeddings, got ", c.head_dim));
  }
  if (c.num_kv_heads > c.num_heads || c.num_heads % c.num_kv_heads != 0) {
    return f.Error(
        "num_key_value_heads",
        absl::StrCat("(", c.num_kv_heads, ") must divide num_attention_heads (", c.num_heads, ")"));
  }
  TP_ASSIGN_OR_RETURN(c.max_position_embeddings,
                      f.PositiveIntOr("max_position_embeddings", c.max_position_embeddings));
  TP_ASSIGN_OR_RETURN(c.rms_norm_eps, f.PositiveDoubleOr("rms_norm_eps", c.rms_norm_eps));
  TP_ASSIGN_OR_RETURN(c.initializer_range,
                      f.PositiveDoubleOr("initializer_range", c.initializer_range));

  // RoPE: top-level rope_theta, then rope_scaling (old) or rope_parameters (transformers 5).
  TP_ASSIGN_OR_RETURN(c.rope.theta, f.PositiveDoubleOr("rope_theta", c.rope.theta));
  if (f.Present("rope_parameters")) {
    const Json& rp = j["rope_parameters"];
    if (rp.is_object() && (rp.contains("full_attention") || rp.contains("sliding_attention"))) {
      return f.Error("rope_parameters", "per-layer-type RoPE parameters are not supported");
    }
    TP_RETURN_IF_ERROR(ParseRope(rp, source, "rope_parameters", &c.rope));
  } else if (f.Present("rope_scaling")) {
    TP_RETURN_IF_ERROR(ParseRope(j["rope_scaling"], source, "rope_scaling", &c.rope));
  }

  TP_ASSIGN_OR_RETURN(c.tie_word_embeddings, f.BoolOr("tie_word_embeddings", false));
  TP_ASSIGN_OR_RETURN(bool attention_bias, f.BoolOr("attention_bias", false));
  TP_ASSIGN_OR_RETURN(bool mlp_bias, f.BoolOr("mlp_bias", false));
  if (is_qwen2) {  // Qwen2Attention: q/k/v always biased, o_proj never.
    c.attention_bias = true;
    c.o_proj_bias = false;
  } else if (is_llama) {  // LlamaAttention: attention_bias applies to q, k, v and o.
    c.attention_bias = attention_bias;
    c.o_proj_bias = attention_bias;
  }
  c.mlp_bias = is_llama && mlp_bias;

  // Sliding window: Mistral's `sliding_window`; Qwen2's only when use_sliding_window is true.
  if (!is_llama && f.Present("sliding_window")) {
    TP_ASSIGN_OR_RETURN(bool use_window, f.BoolOr("use_sliding_window", !is_qwen2));
    if (use_window) {
      TP_ASSIGN_OR_RETURN(c.sliding_window, f.PositiveInt("sliding_window"));
      if (c.sliding_window >= c.max_position_embeddings) c.sliding_window = 0;  // no effect
    }
  }

  if (f.Present("torch_dtype")) {
    TP_ASSIGN_OR_RETURN(c.torch_dtype, f.StringOr("torch_dtype", c.torch_dtype));
  } else if (f.Present("dtype")) {
    TP_ASSIGN_OR_RETURN(c.torch_dtype, f.StringOr("dtype", c.torch_dtype));
  }
  TP_ASSIGN_OR_RETURN(c.bos_token_ids, f.TokenIds("bos_token_id"));
  TP_ASSIGN_OR_RETURN(c.eos_token_ids, f.TokenIds("eos_token_id"));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  TP_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  return ParseModelConfig(text, path);
}

absl::StatusOr<GenerationConfig> ParseGenerationConfig(std::string_view json_text,
                                                       std::string_view source_name) {
  const absl::string_view source(source_name.data(), source_name.size());
  TP_ASSIGN_OR_RETURN(Json j, ParseJsonObject(json_text, source));
  Fields f(j, source);
  GenerationConfig g;
  TP_ASSIGN_OR_RETURN(g.eos_token_ids, f.TokenIds("eos_token_id"));
  TP_ASSIGN_OR_RETURN(std::vector<int32_t> bos, f.TokenIds("bos_token_id"));
  if (!bos.empty()) g.bos_token_id = bos[0];
  TP_ASSIGN_OR_RETURN(g.do_sample, f.BoolOr("do_sample", false));
  if (g.do_sample) {  // as in transformers: temperature 1.0 unless given
    g.temperature = 1.0;
    if (f.Present("temperature")) {
      TP_ASSIGN_OR_RETURN(g.temperature, f.Double("temperature"));
    }
    if (g.temperature < 0) return f.Error("temperature", "must not be negative");
  }
  if (f.Present("top_p")) {
    TP_ASSIGN_OR_RETURN(g.top_p, f.Double("top_p"));
    if (!(g.top_p > 0 && g.top_p <= 1)) return f.Error("top_p", "must be in (0, 1]");
  }
  if (f.Present("top_k")) {
    TP_ASSIGN_OR_RETURN(g.top_k, f.Int("top_k"));
    if (g.top_k < 0) return f.Error("top_k", "must not be negative");
  }
  return g;
}

absl::StatusOr<GenerationConfig> LoadGenerationConfig(const std::string& path) {
  std::ifstream probe(path);
  if (!probe) return GenerationConfig{};  // optional file
  probe.close();
  TP_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  return ParseGenerationConfig(text, path);
}

std::string ModelConfigToJson(const ModelConfig& c) {
  nlohmann::ordered_json j;
  j["architectures"] = {c.architecture};
  j["model_type"] = c.model_type;
  j["hidden_act"] = "silu";
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["initializer_range"] = c.initializer_range;
  j["rope_theta"] = c.rope.theta;
  switch (c.rope.scaling) {
    case RopeScalingType::kNone:
      j["rope_scaling"] = nullptr;
      break;
    case RopeScalingType::kLinear:
      j["rope_scaling"] = {{"type", "linear"}, {"factor", c.rope.factor}};
      break;
    case RopeScalingType::kLlama3:
      j["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", c.rope.factor},
          {"low_freq_factor", c.rope.low_freq_factor},
          {"high_freq_factor", c.rope.high_freq_factor},
          {"original_max_position_embeddings", c.rope.original_max_position_embeddings}};
      break;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["attention_bias"] = c.attention_bias;
  if (c.architecture == "LlamaForCausalLM") j["mlp_bias"] = c.mlp_bias;
  if (c.architecture != "LlamaForCausalLM") {
    if (c.sliding_window > 0) {
      j["sliding_window"] = c.sliding_window;
      if (c.architecture == "Qwen2ForCausalLM") j["use_sliding_window"] = true;
    } else {
      j["sliding_window"] = nullptr;
    }
  }
  auto ids = [](const std::vector<int32_t>& v) -> nlohmann::ordered_json {
    if (v.size() == 1) return v[0];
    return v;
  };
  if (!c.bos_token_ids.empty()) j["bos_token_id"] = ids(c.bos_token_ids);
  if (!c.eos_token_ids.empty()) j["eos_token_id"] = ids(c.eos_token_ids);
  j["torch_dtype"] = c.torch_dtype;
  return j.dump(2) + "\n";
}

}  // namespace tpserve
