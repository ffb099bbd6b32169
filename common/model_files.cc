// Opening a model directory (single or sharded safetensors), finding tensors across shards,
// and checking a checkpoint against the Llama weight list.
#include "common/model_files.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace tpserve {
namespace {

bool IsFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool IsDir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string ShapeOf(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

std::vector<WeightSpec> LlamaWeightSpecs(const ModelConfig& c) {
  const int64_t h = c.hidden_size;
  const int64_t q = c.num_heads * c.head_dim;
  const int64_t kv = c.num_kv_heads * c.head_dim;
  const int64_t inter = c.intermediate_size;
  std::vector<WeightSpec> specs;
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, h}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    specs.push_back({p + "input_layernorm.weight", {h}});
    specs.push_back({p + "self_attn.q_proj.weight", {q, h}});
    if (c.attention_bias) specs.push_back({p + "self_attn.q_proj.bias", {q}});
    specs.push_back({p + "self_attn.k_proj.weight", {kv, h}});
    if (c.attention_bias) specs.push_back({p + "self_attn.k_proj.bias", {kv}});
    specs.push_back({p + "self_attn.v_proj.weight", {kv, h}});
    if (c.attention_bias) specs.push_back({p + "self_attn.v_proj.bias", {kv}});
    specs.push_back({p + "self_attn.o_proj.weight", {h, q}});
    if (c.o_proj_bias) specs.push_back({p + "self_attn.o_proj.bias", {h}});
    specs.push_back({p + "post_attention_layernorm.weight", {h}});
    specs.push_back({p + "mlp.gate_proj.weight", {inter, h}});
    if (c.mlp_bias) specs.push_back({p + "mlp.gate_proj.bias", {inter}});
    specs.push_back({p + "mlp.up_proj.weight", {inter, h}});
    if (c.mlp_bias) specs.push_back({p + "mlp.up_proj.bias", {inter}});
    specs.push_back({p + "mlp.down_proj.weight", {h, inter}});
    if (c.mlp_bias) specs.push_back({p + "mlp.down_proj.bias", {h}});
  }
  specs.push_back({"model.norm.weight", {h}});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, h}});
  return specs;
}

ModelFiles::~ModelFiles() = default;

absl::StatusOr<ModelFiles> ModelFiles::Open(const std::string& dir) {
  if (!IsDir(dir)) {
    return absl::NotFoundError(absl::StrCat(dir, ": model directory does not exist"));
  }
  ModelFiles m;
  m.dir_ = dir;
  TP_ASSIGN_OR_RETURN(m.config_, LoadModelConfig(dir + "/config.json"));
  TP_ASSIGN_OR_RETURN(m.generation_config_, LoadGenerationConfig(dir + "/generation_config.json"));
  GenerationConfig& g = m.generation_config_;
  ModelConfig& c = m.config_;
  if (!g.eos_token_ids.empty()) {
    c.eos_token_ids = g.eos_token_ids;
  } else {
    g.eos_token_ids = c.eos_token_ids;
  }
  if (g.bos_token_id >= 0) {
    c.bos_token_ids = {g.bos_token_id};
  } else if (!c.bos_token_ids.empty()) {
    g.bos_token_id = c.bos_token_ids[0];
  }

  const std::string index_path = dir + "/model.safetensors.index.json";
  const std::string single_path = dir + "/model.safetensors";
  if (IsFile(index_path)) {
    std::ifstream in(index_path, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(ss.str());
    } catch (const nlohmann::json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": invalid JSON: ", e.what()));
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": missing 'weight_map' object"));
    }
    std::map<std::string, size_t> file_index;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": weight_map entry for tensor '", name, "' must be a file name"));
      }
      const std::string shard = file.get<std::string>();
      if (shard.empty() || shard[0] == '/' || shard.find("..") != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor '", name,
                                                       "' maps to a bad file name '", shard, "'"));
      }
      auto it = file_index.find(shard);
      if (it == file_index.end()) {
        const std::string path = dir + "/" + shard;
        if (!IsFile(path)) {
          return absl::NotFoundError(absl::StrCat(
              index_path, ": shard '", shard, "' (listed for tensor '", name, "') does not exist"));
        }
        TP_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path));
        it = file_index.emplace(shard, m.files_.size()).first;
        m.files_.push_back(std::move(f));
        m.file_paths_.push_back(path);
      }
      if (m.files_[it->second]->Find(name) == nullptr) {
        return absl::NotFoundError(absl::StrCat(index_path, " lists tensor '", name, "' in '",
                                                shard, "', but that file has no such tensor"));
      }
      m.tensor_file_[name] = it->second;
    }
  } else if (IsFile(single_path)) {
    TP_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(single_path));
    for (const auto& t : f->tensors()) m.tensor_file_[t.name] = 0;
    m.files_.push_back(std::move(f));
    m.file_paths_.push_back(single_path);
  } else {
    std::string hint;
    if (IsFile(dir + "/pytorch_model.bin") || IsFile(dir + "/pytorch_model.bin.index.json")) {
      hint = " (pytorch_model.bin is not supported; convert the checkpoint to safetensors)";
    }
    return absl::NotFoundError(
        absl::StrCat(dir, ": no model.safetensors or model.safetensors.index.json", hint));
  }
  return m;
}

std::vector<std::string> ModelFiles::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensor_file_.size());
  for (const auto& [name, idx] : tensor_file_) names.push_back(name);
  return names;
}

bool ModelFiles::Has(std::string_view name) const { return tensor_file_.count(name) > 0; }

absl::StatusOr<const SafetensorsFile*> ModelFiles::FileFor(std::string_view name) const {
  auto it = tensor_file_.find(name);
  if (it == tensor_file_.end()) {
    return absl::NotFoundError(absl::StrCat(dir_, ": missing tensor '", std::string(name), "' (in ",
                                            absl::StrJoin(file_paths_, ", "), ")"));
  }
  return files_[it->second].get();
}

absl::StatusOr<WeightInfo> ModelFiles::Info(std::string_view name) const {
  TP_ASSIGN_OR_RETURN(const SafetensorsFile* f, FileFor(name));
  const SafetensorsTensorInfo* t = f->Find(name);
  WeightInfo info;
  info.dtype_name = t->dtype_name;
  info.has_dtype = t->has_dtype;
  info.dtype = t->dtype;
  info.shape = t->shape;
  info.file = f->path();
  return info;
}

absl::Status ModelFiles::Read(std::string_view name, absl::Span<const int64_t> expected_shape,
                              DType out_dtype, void* dst) const {
  TP_ASSIGN_OR_RETURN(const SafetensorsFile* f, FileFor(name));
  return f->Read(name, expected_shape, out_dtype, dst);
}

absl::Status ModelFiles::ReadRows(std::string_view name, absl::Span<const int64_t> expected_shape,
                                  int64_t row_begin, int64_t row_count, DType out_dtype,
                                  void* dst) const {
  TP_ASSIGN_OR_RETURN(const SafetensorsFile* f, FileFor(name));
  return f->ReadRows(name, expected_shape, row_begin, row_count, out_dtype, dst);
}

absl::Status ModelFiles::ReadCols(std::string_view name, absl::Span<const int64_t> expected_shape,
                                  int64_t col_begin, int64_t col_count, DType out_dtype,
                                  void* dst) const {
  TP_ASSIGN_OR_RETURN(const SafetensorsFile* f, FileFor(name));
  return f->ReadCols(name, expected_shape, col_begin, col_count, out_dtype, dst);
}

absl::StatusOr<std::string_view> ModelFiles::RawBytes(std::string_view name) const {
  TP_ASSIGN_OR_RETURN(const SafetensorsFile* f, FileFor(name));
  return f->RawBytes(name);
}

absl::Status ModelFiles::ValidateWeights() const {
  for (const WeightSpec& spec : LlamaWeightSpecs(config_)) {
    TP_ASSIGN_OR_RETURN(const SafetensorsFile* f, FileFor(spec.name));
    const SafetensorsTensorInfo* t = f->Find(spec.name);
    if (t->shape != spec.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          f->path(), ": tensor '", spec.name, "' has shape ", t->ShapeString(), ", expected ",
          ShapeOf(spec.shape), " for ", config_.architecture, " (from ", dir_, "/config.json)"));
    }
    const bool loadable = t->has_dtype && (t->dtype == DType::kF32 || t->dtype == DType::kBF16 ||
                                           t->dtype == DType::kF16);
    if (!loadable) {
      return absl::InvalidArgumentError(absl::StrCat(f->path(), ": tensor '", spec.name,
                                                     "' has dtype ", t->dtype_name,
                                                     ", expected F32, BF16 or F16"));
    }
  }
  return absl::OkStatus();
}

}  // namespace tpserve
