// Small random models for worker tests, written once per test binary into the temp dir.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "common/model_config.h"
#include "tools/random_model.h"

namespace tpserve::testing_util {

// An awkward little LLaMA: GQA 8/2, odd vocab, 3 layers, linear RoPE scaling, fp32 weights.
inline ModelConfig AwkwardConfig() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.model_type = "llama";
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_layers = 3;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.vocab_size = 301;
  c.max_position_embeddings = 512;
  c.rms_norm_eps = 1e-6;
  c.rope.theta = 100000;
  c.rope.scaling = RopeScalingType::kLinear;
  c.rope.factor = 4.0;
  c.bos_token_ids = {1};
  c.eos_token_ids = {2};
  return c;
}

// Writes a random model for `config` under the temp dir and returns the directory: one per
// process, since ctest runs test binaries (and one binary under several environments) at once,
// and a writer removes the old weight files first.
inline std::string WriteTestModel(const ModelConfig& config, const std::string& name,
                                  uint64_t seed = 7, DType dtype = DType::kF32) {
  namespace fs = std::filesystem;
  fs::path dir =
      fs::path(::testing::TempDir()) / "tpserve_models" / (name + "." + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path config_path = dir / "source_config.json";
  std::ofstream(config_path) << ModelConfigToJson(config);
  RandomModelOptions options;
  options.config_path = config_path.string();
  options.out_dir = dir.string();
  options.seed = seed;
  options.dtype = dtype;
  options.threads = 1;
  absl::Status status = WriteRandomModel(options);
  EXPECT_TRUE(status.ok()) << status;
  return dir.string();
}

}  // namespace tpserve::testing_util
