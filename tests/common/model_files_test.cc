// Model directories: random-model output (single and sharded) read back through ModelFiles,
// the Llama weight list, and every bad-directory case.
#include "common/model_files.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_format.h"
#include "common/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/test_files.h"
#include "tools/random_model.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;
using testing_util::FreshTempDir;
using testing_util::ReadFile;
using testing_util::WriteFile;

constexpr char kTinyConfig[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
  "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 300,
  "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
  "rope_scaling": {"type": "linear", "factor": 4.0}, "tie_word_embeddings": false,
  "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", "initializer_range": 0.02
})";

std::string WriteConfig(const std::string& dir, const std::string& text) {
  const std::string path = dir + "/input_config.json";
  WriteFile(path, text);
  return path;
}

absl::Status MakeRandom(const std::string& config_path, const std::string& out, DType dtype,
                        int64_t shard_bytes = 0, uint64_t seed = 5, int threads = 3) {
  RandomModelOptions o;
  o.config_path = config_path;
  o.out_dir = out;
  o.seed = seed;
  o.dtype = dtype;
  o.shard_size_bytes = shard_bytes;
  o.threads = threads;
  return WriteRandomModel(o);
}

void ExpectErrorMentions(const absl::Status& s, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(s.ok());
  for (const auto& p : parts) EXPECT_THAT(std::string(s.message()), HasSubstr(p)) << s;
}

TEST(LlamaWeightSpecsTest, NamesAndShapes) {
  auto c = ParseModelConfig(kTinyConfig);
  ASSERT_TRUE(c.ok());
  auto specs = LlamaWeightSpecs(*c);
  ASSERT_EQ(specs.size(), 1 + 3 * 9 + 2u);
  EXPECT_EQ(specs[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(specs[0].shape, (std::vector<int64_t>{300, 64}));
  std::map<std::string, std::vector<int64_t>> by_name;
  int64_t layer_elems = 0;
  for (const auto& s : specs) {
    by_name[s.name] = s.shape;
    if (s.name.rfind("model.layers.1.", 0) == 0) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      layer_elems += n;
    }
  }
  EXPECT_EQ(by_name["model.layers.1.self_attn.q_proj.weight"], (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(by_name["model.layers.1.self_attn.k_proj.weight"], (std::vector<int64_t>{16, 64}));
  EXPECT_EQ(by_name["model.layers.1.self_attn.v_proj.weight"], (std::vector<int64_t>{16, 64}));
  EXPECT_EQ(by_name["model.layers.1.self_attn.o_proj.weight"], (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(by_name["model.layers.2.mlp.gate_proj.weight"], (std::vector<int64_t>{96, 64}));
  EXPECT_EQ(by_name["model.layers.2.mlp.up_proj.weight"], (std::vector<int64_t>{96, 64}));
  EXPECT_EQ(by_name["model.layers.2.mlp.down_proj.weight"], (std::vector<int64_t>{64, 96}));
  EXPECT_EQ(by_name["model.layers.0.input_layernorm.weight"], (std::vector<int64_t>{64}));
  EXPECT_EQ(by_name["model.layers.0.post_attention_layernorm.weight"], (std::vector<int64_t>{64}));
  EXPECT_EQ(by_name["model.norm.weight"], (std::vector<int64_t>{64}));
  EXPECT_EQ(by_name["lm_head.weight"], (std::vector<int64_t>{300, 64}));
  EXPECT_EQ(layer_elems, c->LayerWeightElems());

  c->tie_word_embeddings = true;
  specs = LlamaWeightSpecs(*c);
  for (const auto& s : specs) EXPECT_NE(s.name, "lm_head.weight");
}

TEST(LlamaWeightSpecsTest, Qwen2BiasesAndLlamaBiases) {
  nlohmann::json j = nlohmann::json::parse(kTinyConfig);
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["model_type"] = "qwen2";
  auto q = ParseModelConfig(j.dump());
  ASSERT_TRUE(q.ok()) << q.status();
  std::map<std::string, std::vector<int64_t>> by_name;
  int64_t layer_elems = 0;
  for (const auto& s : LlamaWeightSpecs(*q)) {
    by_name[s.name] = s.shape;
    if (s.name.rfind("model.layers.0.", 0) == 0) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      layer_elems += n;
    }
  }
  EXPECT_EQ(by_name["model.layers.0.self_attn.q_proj.bias"], (std::vector<int64_t>{64}));
  EXPECT_EQ(by_name["model.layers.0.self_attn.k_proj.bias"], (std::vector<int64_t>{16}));
  EXPECT_EQ(by_name["model.layers.0.self_attn.v_proj.bias"], (std::vector<int64_t>{16}));
  EXPECT_EQ(by_name.count("model.layers.0.self_attn.o_proj.bias"), 0u);
  EXPECT_EQ(layer_elems, q->LayerWeightElems());

  j = nlohmann::json::parse(kTinyConfig);
  j["attention_bias"] = true;
  j["mlp_bias"] = true;
  auto l = ParseModelConfig(j.dump());
  ASSERT_TRUE(l.ok());
  by_name.clear();
  for (const auto& s : LlamaWeightSpecs(*l)) by_name[s.name] = s.shape;
  EXPECT_EQ(by_name["model.layers.2.self_attn.o_proj.bias"], (std::vector<int64_t>{64}));
  EXPECT_EQ(by_name["model.layers.2.mlp.gate_proj.bias"], (std::vector<int64_t>{96}));
  EXPECT_EQ(by_name["model.layers.2.mlp.down_proj.bias"], (std::vector<int64_t>{64}));
}

TEST(RandomModelTest, SingleFileRoundTripInEveryDtype) {
  const std::string dir = FreshTempDir();
  const std::string cfg = WriteConfig(dir, kTinyConfig);
  auto config = ParseModelConfig(kTinyConfig);
  ASSERT_TRUE(config.ok());
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const std::string out = dir + "/model_" + std::string(DTypeName(dtype));
    ASSERT_TRUE(MakeRandom(cfg, out, dtype).ok());
    auto m = ModelFiles::Open(out);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE(m->ValidateWeights().ok()) << m->ValidateWeights();
    EXPECT_EQ(m->weight_files().size(), 1u);
    EXPECT_EQ(m->config().torch_dtype, dtype == DType::kF32    ? "float32"
                                       : dtype == DType::kBF16 ? "bfloat16"
                                                               : "float16");
    EXPECT_EQ(m->config().hidden_size, 64);
    EXPECT_EQ(m->generation_config().bos_token_id, 1);
    EXPECT_EQ(m->generation_config().eos_token_ids, (std::vector<int32_t>{2}));
    auto info = m->Info("model.layers.1.mlp.down_proj.weight");
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->shape, (std::vector<int64_t>{64, 96}));
    EXPECT_TRUE(info->has_dtype);
    EXPECT_EQ(info->dtype, dtype);
    EXPECT_EQ(info->file, out + "/model.safetensors");

    // Values are the documented pure function of (seed, name, index), rounded to the dtype.
    for (const WeightSpec& spec : LlamaWeightSpecs(*config)) {
      int64_t n = 1;
      for (int64_t d : spec.shape) n *= d;
      std::vector<float> got(n);
      ASSERT_TRUE(m->Read(spec.name, spec.shape, DType::kF32, got.data()).ok()) << spec.name;
      double sum = 0, sum2 = 0;
      for (int64_t i = 0; i < n; ++i) {
        float want = RandomWeightValue(*config, 5, spec.name, i);
        want = dtype == DType::kF32    ? want
               : dtype == DType::kBF16 ? Bf16ToF32(F32ToBf16(want))
                                       : F16ToF32(F32ToF16(want));
        ASSERT_EQ(got[i], want) << spec.name << "[" << i << "]";
        sum += got[i];
        sum2 += static_cast<double>(got[i]) * got[i];
      }
      const double mean = sum / n;
      const double std = std::sqrt(sum2 / n - mean * mean);
      if (spec.name.find("norm") != std::string::npos) {
        EXPECT_NEAR(mean, 1.0, 0.03) << spec.name;
        EXPECT_NEAR(std, 0.05, 0.02) << spec.name;
      } else if (n > 1000) {
        EXPECT_NEAR(mean, 0.0, 0.003) << spec.name;
        EXPECT_NEAR(std, 0.02, 0.003) << spec.name;
      }
    }
  }
}

TEST(RandomModelTest, ShardedEqualsSingleAndSlicesMatch) {
  const std::string dir = FreshTempDir();
  const std::string cfg = WriteConfig(dir, kTinyConfig);
  ASSERT_TRUE(MakeRandom(cfg, dir + "/single", DType::kBF16).ok());
  // ~40 KB per file: several shards; threads 1 vs 4 must not change a bit.
  ASSERT_TRUE(MakeRandom(cfg, dir + "/sharded", DType::kBF16, 40 << 10, 5, 1).ok());
  auto single = ModelFiles::Open(dir + "/single");
  auto sharded = ModelFiles::Open(dir + "/sharded");
  ASSERT_TRUE(single.ok()) << single.status();
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  ASSERT_TRUE(sharded->ValidateWeights().ok()) << sharded->ValidateWeights();
  EXPECT_GT(sharded->weight_files().size(), 3u);
  EXPECT_EQ(single->TensorNames(), sharded->TensorNames());

  const std::string index = ReadFile(dir + "/sharded/model.safetensors.index.json");
  auto j = nlohmann::json::parse(index);
  ASSERT_TRUE(j["weight_map"].is_object());
  EXPECT_EQ(j["weight_map"].size(), single->TensorNames().size());
  EXPECT_EQ(j["weight_map"]["model.embed_tokens.weight"],
            absl::StrFormat("model-00001-of-%05d.safetensors", sharded->weight_files().size()));
  uint64_t total = 0;
  for (const auto& f : sharded->weight_files()) {
    EXPECT_LE(std::filesystem::file_size(f), (40u << 10) + 4096) << f;
  }
  for (const auto& name : single->TensorNames()) {
    auto info = single->Info(name);
    int64_t n = 1;
    for (int64_t d : info->shape) n *= d;
    total += n * 2;
    std::vector<uint16_t> a(n), b(n);
    ASSERT_TRUE(single->Read(name, info->shape, DType::kBF16, a.data()).ok());
    ASSERT_TRUE(sharded->Read(name, info->shape, DType::kBF16, b.data()).ok());
    ASSERT_EQ(a, b) << name;
  }
  EXPECT_EQ(j["metadata"]["total_size"].get<uint64_t>(), total);

  // Tensor-parallel slices of the sharded model equal slices of the whole tensor.
  const std::string q = "model.layers.2.self_attn.q_proj.weight";  // [64, 64]
  const std::string o = "model.layers.2.self_attn.o_proj.weight";  // [64, 64]
  std::vector<float> whole(64 * 64), rows(16 * 64), cols(64 * 16);
  ASSERT_TRUE(single->Read(q, {64, 64}, DType::kF32, whole.data()).ok());
  ASSERT_TRUE(sharded->ReadRows(q, {64, 64}, 32, 16, DType::kF32, rows.data()).ok());
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 64; ++c) ASSERT_EQ(rows[r * 64 + c], whole[(32 + r) * 64 + c]);
  }
  ASSERT_TRUE(single->Read(o, {64, 64}, DType::kF32, whole.data()).ok());
  ASSERT_TRUE(sharded->ReadCols(o, {64, 64}, 48, 16, DType::kF32, cols.data()).ok());
  for (int r = 0; r < 64; ++r) {
    for (int c = 0; c < 16; ++c) ASSERT_EQ(cols[r * 16 + c], whole[r * 64 + 48 + c]);
  }

  // Rewriting a directory as one file removes the old shards and index.
  ASSERT_TRUE(MakeRandom(cfg, dir + "/sharded", DType::kBF16).ok());
  EXPECT_FALSE(std::filesystem::exists(dir + "/sharded/model.safetensors.index.json"));
  auto again = ModelFiles::Open(dir + "/sharded");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->weight_files().size(), 1u);
}

TEST(RandomModelTest, SeedChangesValuesAndConfigIsCopied) {
  const std::string dir = FreshTempDir();
  const std::string cfg = WriteConfig(dir, kTinyConfig);
  ASSERT_TRUE(MakeRandom(cfg, dir + "/a", DType::kF32, 0, 1).ok());
  ASSERT_TRUE(MakeRandom(cfg, dir + "/b", DType::kF32, 0, 2).ok());
  ASSERT_TRUE(MakeRandom(cfg, dir + "/c", DType::kF32, 0, 1, 7).ok());
  EXPECT_NE(ReadFile(dir + "/a/model.safetensors"), ReadFile(dir + "/b/model.safetensors"));
  EXPECT_EQ(ReadFile(dir + "/a/model.safetensors"), ReadFile(dir + "/c/model.safetensors"));
  auto written = nlohmann::json::parse(ReadFile(dir + "/a/config.json"));
  EXPECT_EQ(written["torch_dtype"], "float32");
  EXPECT_EQ(written["rope_scaling"]["factor"], 4.0);
  auto gen = nlohmann::json::parse(ReadFile(dir + "/a/generation_config.json"));
  EXPECT_EQ(gen["eos_token_id"], 2);
}

TEST(RandomModelTest, CommandLine) {
  const std::string dir = FreshTempDir();
  const std::string cfg = WriteConfig(dir, kTinyConfig);
  ASSERT_TRUE(RunRandomModelCommand({"--config", cfg, "--out", dir + "/m", "--seed", "3", "--dtype",
                                     "fp32", "--shard-size-mb", "1"})
                  .ok());
  auto m = ModelFiles::Open(dir + "/m");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->ValidateWeights().ok());
  EXPECT_TRUE(std::filesystem::exists(dir + "/m/model.safetensors.index.json"));
  EXPECT_EQ(m->Info("model.norm.weight")->dtype, DType::kF32);

  ExpectErrorMentions(RunRandomModelCommand({"--out", dir + "/x"}), {"--config"});
  ExpectErrorMentions(RunRandomModelCommand({"--config", cfg}), {"--out"});
  ExpectErrorMentions(
      RunRandomModelCommand({"--config", cfg, "--out", dir + "/x", "--dtype", "int4"}), {"int4"});
  ExpectErrorMentions(RunRandomModelCommand({"--config", cfg, "--out", dir + "/x", "--bogus", "1"}),
                      {"--bogus"});
  ExpectErrorMentions(
      RunRandomModelCommand({"--config", dir + "/missing.json", "--out", dir + "/x"}),
      {"missing.json"});
  WriteFile(dir + "/gpt2.json", R"({"architectures": ["GPT2LMHeadModel"]})");
  ExpectErrorMentions(RunRandomModelCommand({"--config", dir + "/gpt2.json", "--out", dir + "/x"}),
                      {"gpt2.json", "GPT2LMHeadModel"});
}

// ---- Bad model directories ----

class BadModelDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTempDir();
    auto c = ParseModelConfig(kTinyConfig);
    ASSERT_TRUE(c.ok());
    config_ = *c;
  }
  // Writes model.safetensors with every expected tensor (fp32 zeros), letting `edit` change
  // the list first.
  void WriteWeights(const std::function<void(std::vector<SafetensorsWriter::Entry>&)>& edit,
                    const std::string& file = "model.safetensors") {
    std::vector<SafetensorsWriter::Entry> entries;
    for (const auto& s : LlamaWeightSpecs(config_))
      entries.push_back({s.name, DType::kF32, s.shape});
    if (edit) edit(entries);
    auto w = SafetensorsWriter::Create(dir_ + "/" + file, entries);
    ASSERT_TRUE(w.ok());
    uint64_t bytes = 0;
    for (const auto& e : entries) {
      uint64_t n = DTypeSize(e.dtype);
      for (int64_t d : e.shape) n *= d;
      bytes += n;
    }
    std::vector<char> zeros(bytes);
    ASSERT_TRUE((*w)->Append(zeros.data(), zeros.size()).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  }
  std::string dir_;
  ModelConfig config_;
};

TEST_F(BadModelDirTest, GoodDirectoryValidates) {
  WriteFile(dir_ + "/config.json", kTinyConfig);
  WriteWeights(nullptr);
  auto m = ModelFiles::Open(dir_);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->ValidateWeights().ok()) << m->ValidateWeights();
  // No generation_config.json: ids come from config.json.
  EXPECT_EQ(m->generation_config().bos_token_id, 1);
}

TEST_F(BadModelDirTest, MissingDirectoryConfigOrWeights) {
  ExpectErrorMentions(ModelFiles::Open(dir_ + "/nope").status(), {dir_ + "/nope"});
  ExpectErrorMentions(ModelFiles::Open(dir_).status(), {dir_ + "/config.json"});
  WriteFile(dir_ + "/config.json", kTinyConfig);
  ExpectErrorMentions(ModelFiles::Open(dir_).status(), {dir_, "model.safetensors"});
}

TEST_F(BadModelDirTest, UnsupportedArchitecture) {
  nlohmann::json j = nlohmann::json::parse(kTinyConfig);
  j["architectures"] = {"FalconForCausalLM"};
  WriteFile(dir_ + "/config.json", j.dump());
  WriteWeights(nullptr);
  ExpectErrorMentions(ModelFiles::Open(dir_).status(),
                      {dir_ + "/config.json", "FalconForCausalLM", "LlamaForCausalLM"});
}

TEST_F(BadModelDirTest, MissingTensor) {
  WriteFile(dir_ + "/config.json", kTinyConfig);
  WriteWeights([](auto& e) {
    e.erase(
        std::remove_if(e.begin(), e.end(),
                       [](const auto& x) { return x.name == "model.layers.1.mlp.up_proj.weight"; }),
        e.end());
  });
  auto m = ModelFiles::Open(dir_);
  ASSERT_TRUE(m.ok());
  ExpectErrorMentions(m->ValidateWeights(),
                      {"model.layers.1.mlp.up_proj.weight", "model.safetensors", "missing"});
  std::vector<float> buf(96 * 64);
  ExpectErrorMentions(
      m->Read("model.layers.1.mlp.up_proj.weight", {96, 64}, DType::kF32, buf.data()),
      {"model.layers.1.mlp.up_proj.weight"});
  EXPECT_FALSE(m->Has("model.layers.1.mlp.up_proj.weight"));
  EXPECT_TRUE(m->Has("model.layers.1.mlp.gate_proj.weight"));
}

TEST_F(BadModelDirTest, WrongShape) {
  WriteFile(dir_ + "/config.json", kTinyConfig);
  WriteWeights([](auto& e) {
    for (auto& x : e) {
      if (x.name == "model.layers.2.self_attn.k_proj.weight") x.shape = {64, 64};
    }
  });
  auto m = ModelFiles::Open(dir_);
  ASSERT_TRUE(m.ok());
  ExpectErrorMentions(m->ValidateWeights(),
                      {dir_ + "/model.safetensors", "model.layers.2.self_attn.k_proj.weight",
                       "[64, 64]", "expected [16, 64]"});
}

TEST_F(BadModelDirTest, WrongDtype) {
  WriteFile(dir_ + "/config.json", kTinyConfig);
  WriteWeights([](auto& e) {
    for (auto& x : e) {
      if (x.name == "model.norm.weight") x.dtype = DType::kI32;
    }
  });
  auto m = ModelFiles::Open(dir_);
  ASSERT_TRUE(m.ok());
  ExpectErrorMentions(m->ValidateWeights(),
                      {dir_ + "/model.safetensors", "model.norm.weight", "I32"});
}

TEST_F(BadModelDirTest, ShardedIndexErrors) {
  WriteFile(dir_ + "/config.json", kTinyConfig);
  WriteWeights(nullptr, "model-00001-of-00002.safetensors");
  nlohmann::json index;
  index["metadata"] = {{"total_size", 1}};
  for (const auto& s : LlamaWeightSpecs(config_)) {
    index["weight_map"][s.name] = "model-00001-of-00002.safetensors";
  }
  // A tensor listed in a shard that does not exist.
  index["weight_map"]["extra.weight"] = "model-00002-of-00002.safetensors";
  WriteFile(dir_ + "/model.safetensors.index.json", index.dump());
  ExpectErrorMentions(
      ModelFiles::Open(dir_).status(),
      {"model.safetensors.index.json", "model-00002-of-00002.safetensors", "does not exist"});
  // A tensor listed in a shard that lacks it.
  index["weight_map"]["extra.weight"] = "model-00001-of-00002.safetensors";
  WriteFile(dir_ + "/model.safetensors.index.json", index.dump());
  ExpectErrorMentions(
      ModelFiles::Open(dir_).status(),
      {"model.safetensors.index.json", "extra.weight", "model-00001-of-00002.safetensors"});
  // Bad JSON and a missing weight_map.
  WriteFile(dir_ + "/model.safetensors.index.json", "{\"weight_map\": ");
  ExpectErrorMentions(ModelFiles::Open(dir_).status(),
                      {"model.safetensors.index.json", "invalid JSON"});
  WriteFile(dir_ + "/model.safetensors.index.json", "{}");
  ExpectErrorMentions(ModelFiles::Open(dir_).status(),
                      {"model.safetensors.index.json", "weight_map"});
  // Paths that escape the directory.
  WriteFile(dir_ + "/model.safetensors.index.json",
            R"({"weight_map": {"a": "../model-00001-of-00002.safetensors"}})");
  ExpectErrorMentions(ModelFiles::Open(dir_).status(), {"'a'", "bad file name"});
}

TEST_F(BadModelDirTest, CorruptWeightsFileNamesIt) {
  WriteFile(dir_ + "/config.json", kTinyConfig);
  WriteFile(dir_ + "/model.safetensors", std::string("\x10\0\0\0\0\0\0\0{", 9));
  ExpectErrorMentions(ModelFiles::Open(dir_).status(), {dir_ + "/model.safetensors"});
}

TEST_F(BadModelDirTest, GenerationConfigOverridesIds) {
  WriteFile(dir_ + "/config.json", kTinyConfig);
  WriteFile(dir_ + "/generation_config.json", R"({"bos_token_id": 7, "eos_token_id": [8, 9]})");
  WriteWeights(nullptr);
  auto m = ModelFiles::Open(dir_);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->config().bos_token_ids, (std::vector<int32_t>{7}));
  EXPECT_EQ(m->config().eos_token_ids, (std::vector<int32_t>{8, 9}));
  EXPECT_EQ(m->generation_config().eos_token_ids, (std::vector<int32_t>{8, 9}));
}

}  // namespace
}  // namespace tpserve
