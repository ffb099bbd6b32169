// Random model directories: weights come from a counter-based hash of (seed, tensor, index), so
// they are generated in parallel chunks and streamed to disk tensor by tensor.
#include "tools/random_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/bf16.h"
#include "common/flags.h"
#include "common/model_files.h"
#include "common/safetensors.h"
#include "common/status.h"

namespace tpserve {
namespace {

namespace fs = std::filesystem;
using OrderedJson = nlohmann::ordered_json;

constexpr int64_t kChunkElems = int64_t{1} << 24;  // 16M elements per generation chunk

inline uint64_t Mix64(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t TensorKey(uint64_t seed, std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return Mix64(h ^ Mix64(seed + 0x9e3779b97f4a7c15ull));
}

// Approximately standard normal: Irwin-Hall sum of four 16-bit uniforms, rescaled to unit
// variance (bounded at ±3.46σ). One hash per element keeps 6.7B-parameter models fast.
inline float NormalAt(uint64_t key, uint64_t index) {
  uint64_t r = Mix64(key + index * 0x9e3779b97f4a7c15ull);
  uint32_t s = static_cast<uint32_t>(r & 0xffff) + static_cast<uint32_t>((r >> 16) & 0xffff) +
               static_cast<uint32_t>((r >> 32) & 0xffff) + static_cast<uint32_t>(r >> 48);
  constexpr float kScale = 1.7320508f / 65536.0f;  // sqrt(3) / 2^16
  return (static_cast<float>(s) + 2.0f - 131072.0f) * kScale;
}

bool IsNorm(std::string_view name) { return name.find("norm") != std::string_view::npos; }

struct TensorParams {
  uint64_t key;
  float mean;
  float std;
};

TensorParams ParamsFor(const ModelConfig& config, uint64_t seed, std::string_view name) {
  if (IsNorm(name)) return {TensorKey(seed, name), 1.0f, 0.05f};
  return {TensorKey(seed, name), 0.0f, static_cast<float>(config.initializer_range)};
}

void Fill(const TensorParams& p, uint64_t first, int64_t n, DType dtype, void* dst) {
  switch (dtype) {
    case DType::kF32: {
      float* d = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = p.mean + p.std * NormalAt(p.key, first + i);
      break;
    }
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = F32ToBf16(p.mean + p.std * NormalAt(p.key, first + i));
      break;
    }
    default: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = F32ToF16(p.mean + p.std * NormalAt(p.key, first + i));
      break;
    }
  }
}

void ParallelFill(const TensorParams& p, uint64_t first, int64_t n, DType dtype, void* dst,
                  int threads) {
  const int64_t kMinPerThread = 1 << 16;
  int parts = static_cast<int>(std::min<int64_t>(threads, (n + kMinPerThread - 1) / kMinPerThread));
  if (parts <= 1) {
    Fill(p, first, n, dtype, dst);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (n + parts - 1) / parts;
  for (int t = 0; t < parts; ++t) {
    const int64_t b = t * per;
    const int64_t e = std::min(n, b + per);
    if (b >= e) break;
    pool.emplace_back([&, b, e] {
      Fill(p, first + b, e - b, dtype, static_cast<char*>(dst) + b * DTypeSize(dtype));
    });
  }
  for (auto& th : pool) th.join();
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

const char* TorchDtypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    default:
      return "bfloat16";
  }
}

}  // namespace

float RandomWeightValue(const ModelConfig& config, uint64_t seed, std::string_view name,
                        uint64_t index) {
  TensorParams p = ParamsFor(config, seed, name);
  return p.mean + p.std * NormalAt(p.key, index);
}

absl::Status WriteRandomModel(const RandomModelOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (options.dtype != DType::kBF16 && options.dtype != DType::kF32 &&
      options.dtype != DType::kF16) {
    return absl::InvalidArgumentError("random-model: --dtype must be bf16, fp32 or fp16");
  }
  if (options.out_dir.empty()) return absl::InvalidArgumentError("random-model: --out is empty");

  // The config: validated by the real parser, then copied with torch_dtype set.
  std::ifstream in(options.config_path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(options.config_path, ": cannot open file"));
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  TP_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(text, options.config_path));
  OrderedJson cfg_json = OrderedJson::parse(text);  // valid: ParseModelConfig accepted it
  cfg_json["torch_dtype"] = TorchDtypeName(options.dtype);
  if (cfg_json.contains("dtype")) cfg_json["dtype"] = TorchDtypeName(options.dtype);

  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec || !fs::is_directory(options.out_dir)) {
    return absl::PermissionDeniedError(
        absl::StrCat(options.out_dir, ": cannot create directory: ", ec.message()));
  }
  // Old weights would shadow or mix with the new ones.
  for (const auto& entry : fs::directory_iterator(options.out_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == "model.safetensors" || name == "model.safetensors.index.json" ||
        (name.rfind("model-", 0) == 0 && name.size() > 12 &&
         name.substr(name.size() - 12) == ".safetensors")) {
      fs::remove(entry.path(), ec);
    }
  }
  const std::string dir = options.out_dir;
  TP_RETURN_IF_ERROR(WriteText(dir + "/config.json", cfg_json.dump(2) + "\n"));
  OrderedJson gen = {{"_from_model_config", true}};
  auto ids = [](const std::vector<int32_t>& v) -> OrderedJson {
    if (v.size() == 1) return v[0];
    return v;
  };
  if (!config.bos_token_ids.empty()) gen["bos_token_id"] = ids(config.bos_token_ids);
  if (!config.eos_token_ids.empty()) gen["eos_token_id"] = ids(config.eos_token_ids);
  TP_RETURN_IF_ERROR(WriteText(dir + "/generation_config.json", gen.dump(2) + "\n"));

  // Plan the shards: tensors in load order, a new shard when the next tensor would overflow.
  const std::vector<WeightSpec> specs = LlamaWeightSpecs(config);
  const size_t elem = DTypeSize(options.dtype);
  std::vector<std::vector<size_t>> shards(1);
  uint64_t shard_bytes = 0;
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    uint64_t bytes = elem;
    for (int64_t d : specs[i].shape) bytes *= static_cast<uint64_t>(d);
    if (options.shard_size_bytes > 0 && !shards.back().empty() &&
        shard_bytes + bytes > static_cast<uint64_t>(options.shard_size_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += bytes;
    total_bytes += bytes;
  }
  const bool sharded = options.shard_size_bytes > 0;
  const int threads =
      options.threads > 0 ? options.threads : std::max(1u, std::thread::hardware_concurrency());

  std::vector<char> buffer;
  OrderedJson weight_map = OrderedJson::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file_name =
        sharded ? absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size())
                : std::string("model.safetensors");
    std::vector<SafetensorsWriter::Entry> entries;
    for (size_t i : shards[s]) {
      entries.push_back({specs[i].name, options.dtype, specs[i].shape});
      weight_map[specs[i].name] = file_name;
    }
    TP_ASSIGN_OR_RETURN(
        auto writer,
        SafetensorsWriter::Create(dir + "/" + file_name, std::move(entries), {{"format", "pt"}}));
    for (size_t i : shards[s]) {
      const WeightSpec& spec = specs[i];
      const TensorParams params = ParamsFor(config, options.seed, spec.name);
      int64_t numel = 1;
      for (int64_t d : spec.shape) numel *= d;
      for (int64_t first = 0; first < numel; first += kChunkElems) {
        const int64_t n = std::min(kChunkElems, numel - first);
        buffer.resize(static_cast<size_t>(n) * elem);
        ParallelFill(params, static_cast<uint64_t>(first), n, options.dtype, buffer.data(),
                     threads);
        TP_RETURN_IF_ERROR(writer->Append(buffer.data(), buffer.size()));
      }
    }
    TP_RETURN_IF_ERROR(writer->Finish());
  }
  if (sharded) {
    OrderedJson index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    TP_RETURN_IF_ERROR(WriteText(dir + "/model.safetensors.index.json", index.dump(2) + "\n"));
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << absl::StrFormat(
                   "random-model: wrote %s: %s, %d tensors, %.3f GB of %s in %d file(s), "
                   "seed %d, %.1f s\n",
                   dir, config.architecture, specs.size(), total_bytes / 1e9,
                   DTypeName(options.dtype), shards.size(), options.seed, secs)
            << std::flush;
  return absl::OkStatus();
}

const CommandSpec& RandomModelFlagSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve random-model",
      "Writes a model directory with random weights for a config.json.",
      {StringFlag("config", "FILE", "the model's config.json [required]"),
       StringFlag("out", "DIR", "directory to write [required]"),
       IntFlag("seed", INT64_MIN, INT64_MAX, "seed of the weights (default 0)"),
       StringFlag("dtype", "bf16|fp32", "weight dtype (default bf16)"),
       IntFlag("shard-size-mb", 0, int64_t{1} << 30,
               "split the safetensors into files of about this size; 0: one file", "N"),
       IntFlag("threads", 0, 1024, "writer threads; 0: all cores")},
      ""};
  return *spec;
}

absl::Status RunRandomModelCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags cli, Flags::Parse(RandomModelFlagSpec(), args));
  if (cli.help()) return PrintUsage(RandomModelFlagSpec());
  RandomModelOptions o;
  TP_ASSIGN_OR_RETURN(o.config_path, cli.Required("config"));
  TP_ASSIGN_OR_RETURN(o.out_dir, cli.Required("out"));
  o.seed = static_cast<uint64_t>(cli.GetInt("seed", 0));
  TP_ASSIGN_OR_RETURN(o.dtype, ParseDType(cli.GetOr("dtype", "bf16")));
  o.shard_size_bytes = cli.GetInt("shard-size-mb", 0) * (int64_t{1} << 20);
  o.threads = static_cast<int>(cli.GetInt("threads", 0));
  return WriteRandomModel(o);
}

}  // namespace tpserve
