// A Hugging Face model directory: config.json, generation_config.json and the weights, in one
// model.safetensors or sharded through model.safetensors.index.json; plus the Llama weight list.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/model_config.h"
#include "common/safetensors.h"

namespace tpserve {

// A tensor the model expects: its checkpoint name and shape.
struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// Every tensor of a LlamaForCausalLM-style checkpoint (Llama, Mistral, Qwen2) for `config`, in
// load order: embedding, then per layer input_layernorm, q/k/v/o (with biases as configured),
// post_attention_layernorm, gate/up/down, then model.norm and lm_head (absent when tied).
std::vector<WeightSpec> LlamaWeightSpecs(const ModelConfig& config);

struct WeightInfo {
  std::string dtype_name;  // as stored: "BF16", "F16", "F32", ...
  bool has_dtype = false;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::string file;  // path of the .safetensors file that holds it
};

class ModelFiles {
 public:
  // Reads dir/config.json (required), dir/generation_config.json (optional) and maps the
  // weights. bos/eos ids of generation_config.json override config.json's (and the other way
  // round when generation_config.json has none). Weights are not validated here: call
  // ValidateWeights().
  static absl::StatusOr<ModelFiles> Open(const std::string& dir);

  ModelFiles(ModelFiles&&) = default;
  ModelFiles& operator=(ModelFiles&&) = default;
  ~ModelFiles();

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  const GenerationConfig& generation_config() const { return generation_config_; }
  const std::vector<std::string>& weight_files() const { return file_paths_; }
  std::vector<std::string> TensorNames() const;  // sorted

  bool Has(std::string_view name) const;
  absl::StatusOr<WeightInfo> Info(std::string_view name) const;

  // As SafetensorsFile's Read/ReadRows/ReadCols, finding the file that holds `name`.
  absl::Status Read(std::string_view name, absl::Span<const int64_t> expected_shape,
                    DType out_dtype, void* dst) const;
  absl::Status ReadRows(std::string_view name, absl::Span<const int64_t> expected_shape,
                        int64_t row_begin, int64_t row_count, DType out_dtype, void* dst) const;
  absl::Status ReadCols(std::string_view name, absl::Span<const int64_t> expected_shape,
                        int64_t col_begin, int64_t col_count, DType out_dtype, void* dst) const;

  // The stored bytes of tensor `name` (inside the read-only mapping, valid while this lives).
  absl::StatusOr<std::string_view> RawBytes(std::string_view name) const;

  // Checks that every tensor of LlamaWeightSpecs(config()) is present with its shape and a
  // loadable dtype (F32, BF16, F16). Extra tensors are allowed.
  absl::Status ValidateWeights() const;

 private:
  ModelFiles() = default;
  absl::StatusOr<const SafetensorsFile*> FileFor(std::string_view name) const;

  std::string dir_;
  ModelConfig config_;
  GenerationConfig generation_config_;
  std::vector<std::string> file_paths_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t, std::less<>> tensor_file_;  // name -> index into files_
};

}  // namespace tpserve
