// config.json / generation_config.json parsing: every supported form and every error case.
#include "common/model_config.h"

#include <string>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/test_files.h"

namespace tpserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// DeepSeek-Coder-6.7B-instruct's config.json (older form: rope_theta + rope_scaling linear).
constexpr char kDeepSeek67B[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 32013,
  "eos_token_id": 32021,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 16384,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"factor": 4.0, "type": "linear"},
  "rope_theta": 100000,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "use_cache": true,
  "vocab_size": 32256
})";

// Llama 3.1 8B: GQA and llama3 rope scaling (with "rope_type").
constexpr char kLlama31[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "mlp_bias": false
})";

// The same DeepSeek shape as transformers 5 writes it: rope_parameters, "dtype".
constexpr char kDeepSeekV5[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32256,
  "max_position_embeddings": 16384, "rms_norm_eps": 1e-06, "head_dim": 128,
  "rope_parameters": {"factor": 4.0, "rope_theta": 100000.0, "rope_type": "linear"},
  "bos_token_id": 32013, "eos_token_id": 32021, "dtype": "bfloat16"
})";

constexpr char kMistral7B[] = R"({
  "architectures": ["MistralForCausalLM"], "model_type": "mistral",
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
  "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "sliding_window": 4096, "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2,
  "torch_dtype": "bfloat16"
})";

constexpr char kQwen2[] = R"({
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
  "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
  "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
  "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 32768, "use_sliding_window": false, "max_window_layers": 21,
  "tie_word_embeddings": true, "bos_token_id": 151643, "eos_token_id": 151643,
  "torch_dtype": "bfloat16"
})";

// A small valid Llama config to derive error cases from by replacing one field.
std::string Tiny(const std::string& extra = "") {
  std::string s = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 100)";
  if (!extra.empty()) s += ", " + extra;
  return s + "}";
}

// Parses `json` expecting an error whose message contains each of `parts`.
void ExpectError(const std::string& json, std::initializer_list<std::string> parts) {
  auto c = ParseModelConfig(json, "dir/config.json");
  ASSERT_FALSE(c.ok()) << json;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("dir/config.json")) << json;
  for (const auto& p : parts) {
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(p)) << json;
  }
}

TEST(ModelConfigTest, DeepSeekCoderOldForm) {
  auto c = ParseModelConfig(kDeepSeek67B);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 11008);
  EXPECT_EQ(c->num_layers, 32);
  EXPECT_EQ(c->num_heads, 32);
  EXPECT_EQ(c->num_kv_heads, 32);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->vocab_size, 32256);
  EXPECT_EQ(c->max_position_embeddings, 16384);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope.theta, 100000.0);
  EXPECT_EQ(c->rope.scaling, RopeScalingType::kLinear);
  EXPECT_DOUBLE_EQ(c->rope.factor, 4.0);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->o_proj_bias);
  EXPECT_FALSE(c->mlp_bias);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_THAT(c->bos_token_ids, ElementsAre(32013));
  EXPECT_THAT(c->eos_token_ids, ElementsAre(32021));
  // q, k, v, o: 4 * 4096^2; gate, up, down: 3 * 4096 * 11008; two norms.
  EXPECT_EQ(c->LayerWeightElems(), 4LL * 4096 * 4096 + 3LL * 4096 * 11008 + 2 * 4096);
  EXPECT_EQ(c->EmbeddingElems(), 32256LL * 4096);
  EXPECT_EQ(c->KvElemsPerTokenPerLayer(), 2 * 4096);
}

TEST(ModelConfigTest, TheSharedDeepSeekFileWhenPresent) {
  const std::string path = "/work/shared/models/deepseek-coder-6.7b-instruct/config.json";
  auto c = LoadModelConfig(path);
  if (!c.ok() && c.status().code() == absl::StatusCode::kNotFound) {
    GTEST_SKIP() << path << " not on this machine";
  }
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->rope.scaling, RopeScalingType::kLinear);
}

TEST(ModelConfigTest, Llama3RopeScaling) {
  auto c = ParseModelConfig(kLlama31);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->rope.scaling, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(c->rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c->rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(c->rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 8192);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009));
  EXPECT_EQ(c->KvElemsPerTokenPerLayer(), 2 * 8 * 128);
}

TEST(ModelConfigTest, RopeParametersFormMatchesOldForm) {
  auto v5 = ParseModelConfig(kDeepSeekV5);
  auto old = ParseModelConfig(kDeepSeek67B);
  ASSERT_TRUE(v5.ok()) << v5.status();
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(v5->rope.scaling, RopeScalingType::kLinear);
  EXPECT_DOUBLE_EQ(v5->rope.theta, old->rope.theta);
  EXPECT_DOUBLE_EQ(v5->rope.factor, old->rope.factor);
  EXPECT_EQ(v5->head_dim, old->head_dim);
  EXPECT_EQ(v5->torch_dtype, "bfloat16");
  EXPECT_EQ(v5->LayerWeightElems(), old->LayerWeightElems());
}

TEST(ModelConfigTest, RopeParametersDefaultAndLlama3) {
  auto d =
      ParseModelConfig(Tiny(R"("rope_parameters": {"rope_type": "default", "rope_theta": 5e5})"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->rope.scaling, RopeScalingType::kNone);
  EXPECT_DOUBLE_EQ(d->rope.theta, 500000.0);

  auto l3 = ParseModelConfig(Tiny(
      R"("rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192})"));
  ASSERT_TRUE(l3.ok()) << l3.status();
  EXPECT_EQ(l3->rope.scaling, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(l3->rope.factor, 32.0);

  // rope_type absent = default; theta falls back to the top-level value.
  auto nt = ParseModelConfig(Tiny(R"("rope_theta": 1234.0, "rope_parameters": {})"));
  ASSERT_TRUE(nt.ok()) << nt.status();
  EXPECT_DOUBLE_EQ(nt->rope.theta, 1234.0);
  EXPECT_EQ(nt->rope.scaling, RopeScalingType::kNone);
}

TEST(ModelConfigTest, RopeScalingDefaultOrNullIsNone) {
  for (const char* extra : {R"("rope_scaling": null)", R"("rope_scaling": {"type": "default"})",
                            R"("rope_scaling": {"rope_type": "default", "factor": 2.0})"}) {
    auto c = ParseModelConfig(Tiny(extra));
    ASSERT_TRUE(c.ok()) << extra << ": " << c.status();
    EXPECT_EQ(c->rope.scaling, RopeScalingType::kNone) << extra;
    EXPECT_DOUBLE_EQ(c->rope.theta, 10000.0);
  }
}

TEST(ModelConfigTest, Mistral) {
  auto c = ParseModelConfig(kMistral7B);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "MistralForCausalLM");
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->sliding_window, 4096);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->rope.scaling, RopeScalingType::kNone);
}

TEST(ModelConfigTest, Qwen2AlwaysHasQkvBiasAndMayTie) {
  auto c = ParseModelConfig(kQwen2);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "Qwen2ForCausalLM");
  EXPECT_TRUE(c->attention_bias);
  EXPECT_FALSE(c->o_proj_bias);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->sliding_window, 0);  // use_sliding_window false
  const int64_t h = 896, q = 14 * 64, kv = 2 * 64, inter = 4864;
  EXPECT_EQ(c->LayerWeightElems(), h * q + 2 * h * kv + q * h + q + 2 * kv + 3 * h * inter + 2 * h);
}

TEST(ModelConfigTest, LlamaAttentionAndMlpBias) {
  auto c = ParseModelConfig(Tiny(R"("attention_bias": true, "mlp_bias": true)"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->attention_bias);
  EXPECT_TRUE(c->o_proj_bias);
  EXPECT_TRUE(c->mlp_bias);
}

TEST(ModelConfigTest, DefaultsAndExplicitHeadDim) {
  auto c = ParseModelConfig(R"({"model_type": "llama", "hidden_size": 5120,
      "intermediate_size": 14336, "num_hidden_layers": 40, "num_attention_heads": 32,
      "head_dim": 128, "vocab_size": 131072})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");  // from model_type
  EXPECT_EQ(c->num_kv_heads, 32);                  // defaults to heads
  EXPECT_EQ(c->head_dim, 128);                     // heads * head_dim != hidden is allowed
  EXPECT_EQ(c->max_position_embeddings, 2048);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope.theta, 10000.0);
  EXPECT_TRUE(c->bos_token_ids.empty());
  EXPECT_FALSE(c->tie_word_embeddings);
}

TEST(ModelConfigTest, TieWordEmbeddings) {
  auto c = ParseModelConfig(Tiny(R"("tie_word_embeddings": true)"));
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->tie_word_embeddings);
}

TEST(ModelConfigTest, ToJsonRoundTrips) {
  for (const char* text : {kDeepSeek67B, kLlama31, kDeepSeekV5, kMistral7B, kQwen2}) {
    auto a = ParseModelConfig(text);
    ASSERT_TRUE(a.ok()) << a.status();
    const std::string json = ModelConfigToJson(*a);
    EXPECT_EQ(json.find("rope_parameters"), std::string::npos);
    auto b = ParseModelConfig(json, "written");
    ASSERT_TRUE(b.ok()) << b.status() << "\n" << json;
    EXPECT_EQ(b->architecture, a->architecture);
    EXPECT_EQ(b->model_type, a->model_type);
    EXPECT_EQ(b->hidden_size, a->hidden_size);
    EXPECT_EQ(b->intermediate_size, a->intermediate_size);
    EXPECT_EQ(b->num_layers, a->num_layers);
    EXPECT_EQ(b->num_heads, a->num_heads);
    EXPECT_EQ(b->num_kv_heads, a->num_kv_heads);
    EXPECT_EQ(b->head_dim, a->head_dim);
    EXPECT_EQ(b->vocab_size, a->vocab_size);
    EXPECT_EQ(b->max_position_embeddings, a->max_position_embeddings);
    EXPECT_DOUBLE_EQ(b->rms_norm_eps, a->rms_norm_eps);
    EXPECT_DOUBLE_EQ(b->rope.theta, a->rope.theta);
    EXPECT_EQ(b->rope.scaling, a->rope.scaling);
    EXPECT_DOUBLE_EQ(b->rope.factor, a->rope.factor);
    EXPECT_DOUBLE_EQ(b->rope.low_freq_factor, a->rope.low_freq_factor);
    EXPECT_DOUBLE_EQ(b->rope.high_freq_factor, a->rope.high_freq_factor);
    EXPECT_EQ(b->rope.original_max_position_embeddings, a->rope.original_max_position_embeddings);
    EXPECT_EQ(b->tie_word_embeddings, a->tie_word_embeddings);
    EXPECT_EQ(b->attention_bias, a->attention_bias);
    EXPECT_EQ(b->o_proj_bias, a->o_proj_bias);
    EXPECT_EQ(b->mlp_bias, a->mlp_bias);
    EXPECT_EQ(b->sliding_window, a->sliding_window);
    EXPECT_EQ(b->torch_dtype, a->torch_dtype);
    EXPECT_EQ(b->bos_token_ids, a->bos_token_ids);
    EXPECT_EQ(b->eos_token_ids, a->eos_token_ids);
  }
}

TEST(ModelConfigErrorTest, UnsupportedArchitectureNamesItAndListsSupported) {
  ExpectError(R"({"architectures": ["GPT2LMHeadModel"], "hidden_size": 64})",
              {"GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"});
  ExpectError(R"({"model_type": "gpt2", "hidden_size": 64})", {"architectures"});
  ExpectError(R"({"architectures": [], "hidden_size": 64})", {"architectures"});
}

TEST(ModelConfigErrorTest, BadJson) {
  ExpectError("{\"hidden_size\": 64,", {"invalid JSON"});
  ExpectError("[1, 2]", {"JSON object"});
  ExpectError("", {"invalid JSON"});
}

TEST(ModelConfigErrorTest, MissingRequiredFields) {
  for (const char* field : {"hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "vocab_size"}) {
    nlohmann::json j = nlohmann::json::parse(Tiny());
    ASSERT_EQ(j.erase(field), 1u);
    ExpectError(j.dump(), {field, "missing"});
    j[field] = nullptr;  // null counts as missing
    ExpectError(j.dump(), {field, "missing"});
  }
}

TEST(ModelConfigErrorTest, NonPositiveOrNonIntegerSizes) {
  ExpectError(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 0, "intermediate_size": 1,
      "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 1})",
              {"'hidden_size'", "positive"});
  ExpectError(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
      "intermediate_size": -5, "num_hidden_layers": 1, "num_attention_heads": 1,
      "vocab_size": 1})",
              {"'intermediate_size'", "positive"});
  ExpectError(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": "64",
      "intermediate_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
      "vocab_size": 1})",
              {"'hidden_size'", "integer"});
  ExpectError(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64.5,
      "intermediate_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
      "vocab_size": 1})",
              {"'hidden_size'", "integer"});
  ExpectError(Tiny(R"("head_dim": 0)"), {"'head_dim'", "positive"});
  ExpectError(Tiny(R"("rms_norm_eps": -1)"), {"'rms_norm_eps'"});
  ExpectError(Tiny(R"("rope_theta": 0)"), {"'rope_theta'"});
  ExpectError(Tiny(R"("max_position_embeddings": 0)"), {"'max_position_embeddings'"});
}

TEST(ModelConfigErrorTest, HeadConsistency) {
  // hidden 64 is not divisible by 5 heads and head_dim is not given.
  ExpectError(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 5,
      "num_key_value_heads": 5, "vocab_size": 100})",
              {"num_attention_heads", "hidden_size"});
  // kv heads must divide heads.
  ExpectError(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 3, "vocab_size": 100})",
              {"'num_key_value_heads'", "divide"});
  ExpectError(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 8, "vocab_size": 100})",
              {"'num_key_value_heads'"});
  ExpectError(Tiny(R"("head_dim": 15)"), {"'head_dim'", "even"});
}

TEST(ModelConfigErrorTest, UnknownOrIncompleteRope) {
  ExpectError(Tiny(R"("rope_scaling": {"type": "yarn", "factor": 4.0})"),
              {"rope_scaling.type", "yarn", "linear", "llama3"});
  ExpectError(Tiny(R"("rope_scaling": {"rope_type": "dynamic", "factor": 2.0})"),
              {"rope_scaling.rope_type", "dynamic"});
  ExpectError(Tiny(R"("rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4})"),
              {"rope_parameters.rope_type", "longrope"});
  ExpectError(Tiny(R"("rope_scaling": {"type": "linear"})"), {"rope_scaling.factor"});
  ExpectError(Tiny(R"("rope_scaling": {"type": "linear", "factor": -2})"), {"rope_scaling.factor"});
  ExpectError(Tiny(R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0})"),
              {"rope_scaling.low_freq_factor"});
  ExpectError(Tiny(R"("rope_scaling": "linear")"), {"rope_scaling"});
  ExpectError(Tiny(R"("rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5})"),
              {"partial_rotary_factor"});
  ExpectError(Tiny(R"("rope_parameters": {"full_attention": {"rope_theta": 1e4}})"),
              {"rope_parameters"});
}

TEST(ModelConfigErrorTest, OtherFieldTypes) {
  ExpectError(Tiny(R"("hidden_act": "gelu")"), {"hidden_act", "gelu"});
  ExpectError(Tiny(R"("tie_word_embeddings": "yes")"), {"tie_word_embeddings"});
  ExpectError(Tiny(R"("eos_token_id": "x")"), {"eos_token_id"});
  ExpectError(Tiny(R"("bos_token_id": [1, -2])"), {"bos_token_id"});
  ExpectError(Tiny(R"("torch_dtype": 16)"), {"torch_dtype"});
}

TEST(ModelConfigErrorTest, LoadNamesTheFile) {
  auto missing = LoadModelConfig("/nonexistent/dir/config.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent/dir/config.json"));

  const std::string dir = testing_util::FreshTempDir();
  testing_util::WriteFile(dir + "/config.json", Tiny(R"("hidden_size": -1)"));
  auto bad = LoadModelConfig(dir + "/config.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(dir + "/config.json"));
}

TEST(GenerationConfigTest, MissingFileGivesDefaults) {
  auto g = LoadGenerationConfig("/nonexistent/generation_config.json");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->eos_token_ids.empty());
  EXPECT_EQ(g->bos_token_id, -1);
  EXPECT_DOUBLE_EQ(g->temperature, 0.0);
  EXPECT_DOUBLE_EQ(g->top_p, 1.0);
  EXPECT_EQ(g->top_k, 0);
  EXPECT_FALSE(g->do_sample);
}

TEST(GenerationConfigTest, ParsesFields) {
  const std::string dir = testing_util::FreshTempDir();
  testing_util::WriteFile(dir + "/generation_config.json", R"({
    "_from_model_config": true, "bos_token_id": 32013, "eos_token_id": [32021, 32014],
    "do_sample": true, "temperature": 0.7, "top_p": 0.95, "top_k": 40,
    "transformers_version": "4.33.1"})");
  auto g = LoadGenerationConfig(dir + "/generation_config.json");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->bos_token_id, 32013);
  EXPECT_THAT(g->eos_token_ids, ElementsAre(32021, 32014));
  EXPECT_TRUE(g->do_sample);
  EXPECT_DOUBLE_EQ(g->temperature, 0.7);
  EXPECT_DOUBLE_EQ(g->top_p, 0.95);
  EXPECT_EQ(g->top_k, 40);

  // Greedy unless do_sample, as in transformers; sampling defaults to temperature 1.
  auto greedy = ParseGenerationConfig(R"({"temperature": 0.7})");
  ASSERT_TRUE(greedy.ok());
  EXPECT_DOUBLE_EQ(greedy->temperature, 0.0);
  auto sample = ParseGenerationConfig(R"({"do_sample": true})");
  ASSERT_TRUE(sample.ok());
  EXPECT_DOUBLE_EQ(sample->temperature, 1.0);
}

TEST(GenerationConfigTest, ErrorsNameFileAndField) {
  const std::string dir = testing_util::FreshTempDir();
  testing_util::WriteFile(dir + "/generation_config.json", R"({"top_p": 2.0})");
  auto g = LoadGenerationConfig(dir + "/generation_config.json");
  ASSERT_FALSE(g.ok());
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("generation_config.json"));
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("top_p"));
  testing_util::WriteFile(dir + "/generation_config.json", "{oops");
  g = LoadGenerationConfig(dir + "/generation_config.json");
  ASSERT_FALSE(g.ok());
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("invalid JSON"));
}

}  // namespace
}  // namespace tpserve
