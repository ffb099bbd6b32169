// --kv-cache-dtype end to end on CPU workers (tp = 2, chunked prefill): a server storing its KV
// cache in fp8, int8 or int4 reports the dtype and the larger capacity, and serves the greedy
// tokens the in-process engine with the same KV dtype generates; a dtype the workers cannot
// store stops the server at start with the reason.
#include <sys/wait.h>

#include <chrono>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/model_files.h"
#include "kernels/kv_quant.h"
#include "tests/testing/http_test_util.h"
#include "tests/testing/run_command.h"
#include "tests/testing/service_info.h"
#include "tests/testing/service_test_util.h"
#include "tpserve/v1/inference.grpc.pb.h"
#include "worker/engine.h"
#include "worker/kv_cache.h"

namespace tpserve {
namespace {

using service_test::Info;
using service_test::ServerProcess;
using ::testing::HasSubstr;

std::vector<int32_t> Greedy(v1::Inference::Stub& stub, const std::vector<int32_t>& prompt,
                            int max_new) {
  v1::GenerateRequest req;
  req.mutable_token_ids()->mutable_ids()->Assign(prompt.begin(), prompt.end());
  req.mutable_stopping()->set_max_new_tokens(max_new);
  req.mutable_stopping()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::GenerateResponse resp;
  const grpc::Status s = stub.Generate(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return {resp.token_ids().begin(), resp.token_ids().end()};
}

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(3 + (i * 37 + salt * 101) % 250);
  return p;
}

class KvCacheDTypeServiceTest : public ::testing::TestWithParam<const char*> {};

TEST_P(KvCacheDTypeServiceTest, ReportsTheDTypeAndCapacityAndServesTheEnginesTokens) {
  const std::string name = GetParam();
  const DType dtype = **ParseKvCacheDType(name);
  const std::string model = service_test::ServiceModelDir();
  const std::vector<std::string> common = {
      "--workers", "2", "--kv-cache-mb", "2", "--max-num-batched-tokens", "32"};
  int64_t f32_capacity = 0;
  {
    auto plain = ServerProcess::Start(model, common);
    ASSERT_NE(plain, nullptr);
    auto stub = v1::Inference::NewStub(plain->Channel());
    const v1::ModelInfo info = Info(*stub);
    EXPECT_EQ(info.kv_cache_dtype(), "fp32");
    f32_capacity = info.kv_capacity_tokens();
  }
  const int http_port = service_test::FreePort();
  ASSERT_GT(http_port, 0);
  std::vector<std::string> args = common;
  args.insert(args.end(), {"--kv-cache-dtype", name, "--http-port", std::to_string(http_port)});
  auto server = ServerProcess::Start(model, args);
  ASSERT_NE(server, nullptr);
  auto stub = v1::Inference::NewStub(server->Channel());
  const v1::ModelInfo info = Info(*stub);
  EXPECT_EQ(info.kv_cache_dtype(), name);
  EXPECT_THAT(server->Log(), HasSubstr("tokens in " + name));
  // Prometheus sees the same capacity, labelled with the dtype.
  const std::string metrics =
      service_test::RunCommand("curl -s http://127.0.0.1:" + std::to_string(http_port) + "/metrics",
                               10)
          .output;
  EXPECT_EQ(service_test::MetricValue(metrics,
                                      "tpserve:kv_cache_capacity_tokens{dtype=\"" + name + "\"}"),
            static_cast<double>(info.kv_capacity_tokens()))
      << metrics;
  // The same 2 MiB per worker holds as many more tokens as a token's bytes shrink (each worker
  // holds half the KV heads; whole blocks only).
  auto files = ModelFiles::Open(model);
  ASSERT_TRUE(files.ok()) << files.status();
  const ModelConfig& c = files->config();
  const int layers = static_cast<int>(c.num_layers), heads = static_cast<int>(c.num_kv_heads / 2);
  const int d = static_cast<int>(c.head_dim);
  const int64_t per_block = KvCache::BlockBytes(layers, 16, heads, d, dtype);
  EXPECT_EQ(info.kv_capacity_tokens(), (int64_t{2} << 20) / per_block * 16);
  EXPECT_EQ(f32_capacity,
            (int64_t{2} << 20) / KvCache::BlockBytes(layers, 16, heads, d, DType::kF32) * 16);
  EXPECT_GT(info.kv_capacity_tokens(), f32_capacity * (dtype == DType::kI4 ? 5 : 3))
      << "fp32 -> 8 bits should give ~3.6x the tokens, -> 4 bits ~5-7x";

  // Served greedy tokens equal the engine's with the same KV dtype: prompts of one and of
  // several prefill chunks (later chunks attend to the quantized prefix).
  EngineOptions options;
  options.device = "cpu";
  options.kv_cache_dtype = dtype;
  auto engine = Engine::Create(model, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EngineOptions plain_options;
  plain_options.device = "cpu";
  auto plain_engine = Engine::Create(model, plain_options);
  ASSERT_TRUE(plain_engine.ok()) << plain_engine.status();
  int differ_from_f32 = 0;
  for (int i = 0; i < 3; ++i) {
    GenerateRequest req;
    req.prompt = Prompt(i == 0 ? 9 : 70 + 20 * i, i + 1);
    req.max_new_tokens = 24;
    req.ignore_eos = true;
    auto expected = (*engine)->Generate({req});
    ASSERT_TRUE(expected.ok()) << expected.status();
    EXPECT_EQ(Greedy(*stub, req.prompt, 24), expected->at(0).output_ids) << name << " prompt " << i;
    auto f32 = (*plain_engine)->Generate({req});
    ASSERT_TRUE(f32.ok()) << f32.status();
    differ_from_f32 += f32->at(0).output_ids != expected->at(0).output_ids;
  }
  std::printf("%s: %d of 3 greedy outputs differ from the fp32 cache's\n", name.c_str(),
              differ_from_f32);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KvCacheDTypeServiceTest, ::testing::Values("fp8", "int8", "int4"));

TEST(KvCacheDTypeServiceRefusalTest, ADTypeTheWorkersCannotStoreStopsTheServerWithTheReason) {
  // The CPU workers keep fp32; bf16 is the CUDA compute dtype.
  const std::string cmd = std::string("timeout 60 ") + TPSERVE_COORDINATOR_BIN + " --model " +
                          service_test::ServiceModelDir() +
                          " --host 127.0.0.1 --port 0 --http-port 0 --spawn-workers --device cpu "
                          "--worker-binary " +
                          TPSERVE_WORKER_BIN + " --kv-cache-dtype bf16 2>&1";
  const testing_util::RunResult r = testing_util::RunCommand(cmd);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "the server did not stop: " << r.output;
  EXPECT_THAT(r.output, HasSubstr("--kv-cache-dtype bf16 is not supported on the CPU"));
  EXPECT_THAT(r.output, HasSubstr("fp32, fp8, int8, int4"));
}

}  // namespace
}  // namespace tpserve
