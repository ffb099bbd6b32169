// Deterministic mode on the GPU (bf16, CUDA graphs on): one request's tokens, logprobs and
// logits are the same bits alone and among 1, 7, 64 or 200 other requests of random lengths,
// at random positions, with chunked prefill of several sizes, a prefix-cache hit and a
// preemption; for tiny-coder and for the DeepSeek-Coder-6.7B shape (TPSERVE_DS67_DIR when the
// job made the full random checkpoint, else two layers of that shape written here). Without a
// CUDA device the tests print "no CUDA device, test skipped" and are skipped.
#include <cstdlib>
#include <random>

#include <gtest/gtest.h>

#include "common/check.h"
#include "common/model_config.h"
#include "kernels/cuda/cuda_ops.h"
#include "tests/testing/determinism_harness.h"
#include "tests/testing/test_models.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

using testing_util::DetHarness;
using testing_util::DetScenario;

#define SKIP_WITHOUT_GPU()                         \
  if (CudaDeviceCount() == 0) {                    \
    std::printf("no CUDA device, test skipped\n"); \
    GTEST_SKIP() << "no CUDA device";              \
  }

std::string SourceDir() {
  const char* dir = std::getenv("TPSERVE_SOURCE_DIR");
  return dir ? dir : ".";
}

// `prompt_len` tokens; others' prompts up to `other_max_prompt`, chunks of `chunk` scaled.
void CheckModel(const std::string& dir, int prompt_len, int other_max_prompt, int chunk) {
  EngineOptions options;
  options.device = "cuda";
  options.deterministic = true;
  options.block_size = 16;
  options.num_kv_blocks = 8192;
  options.model.max_batch_tokens = 4096;
  options.model.max_batch_seqs = 256;
  auto engine = Engine::Create(dir, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const int vocab = static_cast<int>((*engine)->config().vocab_size);
  DetHarness h(&(*engine)->runner());
  h.set_vocab_hint(vocab);
  std::mt19937 rng(3);
  std::vector<int32_t> prompt;
  for (int i = 0; i < prompt_len; ++i) prompt.push_back(static_cast<int32_t>(rng() % vocab));
  constexpr int kNewTokens = 12;
  auto alone = h.Run(prompt, kNewTokens, DetScenario{.name = "alone, one pass"},
                     /*keep_prefix=*/true);
  ASSERT_TRUE(alone.ok()) << alone.status();
  const std::vector<DetScenario> scenarios = {
      {.name = "alone, chunks", .chunk = chunk, .other_max_prompt = other_max_prompt},
      {.name = "1 other",
       .others = 1,
       .chunk = chunk / 2 + 1,
       .other_max_prompt = other_max_prompt,
       .seed = 2},
      {.name = "7 others",
       .others = 7,
       .chunk = chunk,
       .other_max_prompt = other_max_prompt,
       .seed = 3},
      {.name = "64 others",
       .others = 64,
       .chunk = chunk / 3 + 1,
       .other_max_prompt = other_max_prompt,
       .seed = 4},
      // Every other request in every step: 200 x 16 tokens.
      {.name = "200 others, chunks of 16",
       .others = 200,
       .chunk = 16,
       .max_step_tokens = 4000,
       .other_max_prompt = other_max_prompt,
       .seed = 5},
      {.name = "prefix hit, 7 others",
       .others = 7,
       .chunk = chunk,
       .other_max_prompt = other_max_prompt,
       .prefix_hit = true,
       .seed = 6},
      {.name = "preempted after 4 tokens, 30 others",
       .others = 30,
       .chunk = chunk / 2 + 3,
       .other_max_prompt = other_max_prompt,
       .preempt_after = 4,
       .seed = 7},
  };
  for (const DetScenario& sc : scenarios) {
    auto got = h.Run(prompt, kNewTokens, sc);
    ASSERT_TRUE(got.ok()) << sc.name << ": " << got.status();
    testing_util::ExpectSameBits(*got, *alone, sc.name);
  }
}

TEST(DeterminismGpuTest, TinyCoder) {
  SKIP_WITHOUT_GPU();
  CheckModel(SourceDir() + "/models/tiny-coder", 300, 200, 64);
}

std::string DeepSeek67BShapeDir() {
  if (const char* full = std::getenv("TPSERVE_DS67_DIR")) return full;
  auto config =
      LoadModelConfig(SourceDir() + "/tests/data/deepseek-coder-6.7b-instruct.config.json");
  TP_CHECK(config.ok()) << config.status();
  config->num_layers = 2;  // the shapes of every op; two layers keep the job quick
  return testing_util::WriteTestModel(*config, "ds67_2layers", 1, DType::kBF16);
}

TEST(DeterminismGpuTest, DeepSeek67BShape) {
  SKIP_WITHOUT_GPU();
  CheckModel(DeepSeek67BShapeDir(), 600, 300, 128);
}

// TPSERVE_DETERMINISTIC_GEMM=cublaslt-only: every GEMM through cuBLASLt and the unfused ops (the
// default runs decode steps of 1-2 rows through the chain GEMMs and their fusions).
TEST(DeterminismGpuTest, CublasLtOnlyTinyCoderAnd67BShape) {
  SKIP_WITHOUT_GPU();
  ASSERT_EQ(setenv("TPSERVE_DETERMINISTIC_GEMM", "cublaslt-only", 1), 0);
  CheckModel(SourceDir() + "/models/tiny-coder", 300, 200, 64);
  CheckModel(DeepSeek67BShapeDir(), 600, 300, 128);
  unsetenv("TPSERVE_DETERMINISTIC_GEMM");
}

}  // namespace
}  // namespace tpserve
