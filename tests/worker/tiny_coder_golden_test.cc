// The bundled tiny-coder on the CPU reference engine against Hugging Face transformers (fp32,
// eager attention; tests/data/tiny_coder_golden.* made by tools/make_golden.py): logits of every
// stored prompt position and of 8 decode steps within a relative error of 1e-4, and the 32-token
// greedy continuations identical.
#include <cmath>
#include <filesystem>

#include <gtest/gtest.h>

#include "common/safetensors.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

constexpr double kMaxRelErr = 1e-4;  // fp32 vs fp32: summation order only

std::string SourceDir() {
  const char* dir = std::getenv("TPSERVE_SOURCE_DIR");
  return dir ? dir : ".";
}

template <typename T>
std::vector<T> ReadAll(const SafetensorsFile& f, const std::string& name, DType dtype) {
  const SafetensorsTensorInfo* info = f.Find(name);
  EXPECT_NE(info, nullptr) << name;
  if (info == nullptr) return {};
  std::vector<T> out(info->numel());
  if (dtype == DType::kF32) {
    auto s = f.Read(name, info->shape, DType::kF32, out.data());
    EXPECT_TRUE(s.ok()) << s;
  } else {
    auto raw = f.RawBytes(name);
    EXPECT_TRUE(raw.ok());
    std::memcpy(out.data(), raw->data(), raw->size());
  }
  return out;
}

// Relative L2 error of one row, and the max over elements of |got - want| / max|want|.
double RowRelErr(const std::vector<float>& got, const float* want, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += double(got[i] - want[i]) * (got[i] - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / den);
}

TEST(TinyCoderGoldenTest, LogitsAndGreedyTokensMatchTransformers) {
  const std::string model = SourceDir() + "/models/tiny-coder";
  const std::string golden = SourceDir() + "/tests/data/tiny_coder_golden.safetensors";
  ASSERT_TRUE(std::filesystem::exists(model + "/config.json")) << model << " missing";
  auto file = SafetensorsFile::Open(golden);
  ASSERT_TRUE(file.ok()) << file.status();

  EngineOptions options;
  options.device = "cpu";
  options.num_kv_blocks = 64;
  auto engine_or = Engine::Create(model, options);
  ASSERT_TRUE(engine_or.ok()) << engine_or.status();
  Engine& engine = **engine_or;
  const int64_t vocab = engine.config().vocab_size;

  int prompts = 0;
  for (int p = 0; (*file)->Find("p" + std::to_string(p) + ".prompt_ids") != nullptr; ++p) {
    ++prompts;
    const std::string key = "p" + std::to_string(p) + ".";
    auto ids = ReadAll<int32_t>(**file, key + "prompt_ids", DType::kI32);
    auto positions = ReadAll<int32_t>(**file, key + "prefill_positions", DType::kI32);
    auto prefill = ReadAll<float>(**file, key + "prefill_logits", DType::kF32);
    auto decode = ReadAll<float>(**file, key + "decode_logits", DType::kF32);
    auto greedy = ReadAll<int32_t>(**file, key + "greedy_ids", DType::kI32);
    ASSERT_EQ(prefill.size(), positions.size() * vocab);

    auto rows = engine.PromptLogits(ids);
    ASSERT_TRUE(rows.ok()) << rows.status();
    double worst = 0;
    for (size_t k = 0; k < positions.size(); ++k) {
      worst = std::max(worst, RowRelErr((*rows)[positions[k]], &prefill[k * vocab], vocab));
    }
    EXPECT_LT(worst, kMaxRelErr) << "prompt " << p << " prefill";
    const double worst_prefill = worst;

    GenerateRequest req;
    req.prompt = ids;
    req.max_new_tokens = static_cast<int>(greedy.size());
    req.ignore_eos = true;
    req.record_logits = true;
    auto result = engine.Generate({req});
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ((*result)[0].output_ids, greedy) << "prompt " << p << " greedy continuation";
    const size_t steps = decode.size() / vocab;
    ASSERT_GE((*result)[0].step_logits.size(), steps + 1);
    worst = 0;
    for (size_t s = 0; s < steps; ++s) {
      worst =
          std::max(worst, RowRelErr((*result)[0].step_logits[s + 1], &decode[s * vocab], vocab));
    }
    EXPECT_LT(worst, kMaxRelErr) << "prompt " << p << " decode";
    std::printf(
        "prompt %d: %zu prompt tokens, %zu rows, %zu decode steps; worst relative error "
        "prefill %.2e, decode %.2e\n",
        p, ids.size(), positions.size(), steps, worst_prefill, worst);
  }
  EXPECT_GE(prompts, 3);
}

}  // namespace
}  // namespace tpserve
