// The model's shape and numerics, read from a Hugging Face config.json (LlamaForCausalLM,
// MistralForCausalLM, Qwen2ForCausalLM), and its generation_config.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tpserve {

enum class RopeScalingType { kNone, kLinear, kLlama3 };

struct RopeConfig {
  double theta = 10000.0;
  RopeScalingType scaling = RopeScalingType::kNone;
  double factor = 1.0;  // linear and llama3
  // llama3 only:
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string architecture;  // e.g. "LlamaForCausalLM"
  std::string model_type;    // e.g. "llama"
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;  // hidden_size / num_heads unless config.json sets it
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  bool tie_word_embeddings = false;
  bool attention_bias = false;      // q/k/v biases (Qwen2 always has them)
  bool o_proj_bias = false;         // Llama's attention_bias also biases o_proj; Qwen2's does not
  bool mlp_bias = false;            // gate/up/down biases (Llama's mlp_bias only)
  int64_t sliding_window = 0;       // 0 = full attention (Mistral/Qwen2 may set a window)
  double initializer_range = 0.02;  // std of random weights (tools/random_model)
  std::string torch_dtype = "bfloat16";
  std::vector<int32_t> bos_token_ids;  // from config.json, overridden by generation_config.json
  std::vector<int32_t> eos_token_ids;

  // Bytes of one layer's weights at `bytes_per_elem` (for planning), and of the embedding.
  int64_t LayerWeightElems() const;
  int64_t EmbeddingElems() const { return vocab_size * hidden_size; }
  // K and V bytes one token adds in one layer at `bytes_per_elem`.
  int64_t KvElemsPerTokenPerLayer() const { return 2 * num_kv_heads * head_dim; }
};

// Default generation settings from generation_config.json (all optional).
struct GenerationConfig {
  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;
  double temperature = 0.0;  // 0 = greedy unless do_sample
  double top_p = 1.0;
  int64_t top_k = 0;
  bool do_sample = false;
};

// Parses config.json text; errors name the field (and `source`, used in messages).
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text,
                                             std::string_view source = "config.json");
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);
// A missing generation_config.json gives the defaults; a bad one is an error naming the field.
absl::StatusOr<GenerationConfig> LoadGenerationConfig(const std::string& path);
absl::StatusOr<GenerationConfig> ParseGenerationConfig(
    std::string_view json_text, std::string_view source = "generation_config.json");
// Writes a config.json (the older rope_theta/rope_scaling form) describing `config`.
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace tpserve
