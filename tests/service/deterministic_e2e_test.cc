// --deterministic end to end: a coordinator with 2 CPU workers (tp = 2, chunked prefill) gives a
// seeded request the same tokens and logprobs, bit for bit, alone, among 24 concurrent requests
// of random lengths (twice, in other mixes, without prefix-cache hits), and again from the
// prefix cache.
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/service_test_util.h"
#include "tpserve/v1/inference.grpc.pb.h"

namespace tpserve {
namespace {

using service_test::ServerProcess;

struct Out {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;  // each token's, then its alternatives' (id, logprob)
};

Out Generate(v1::Inference::Stub& stub, const std::vector<int32_t>& prompt, int max_new,
             uint64_t seed, int logprobs, const std::string& salt = "") {
  v1::GenerateRequest req;
  req.set_cache_salt(salt);  // another salt: no prefix-cache hit
  req.mutable_token_ids()->mutable_ids()->Assign(prompt.begin(), prompt.end());
  req.mutable_stopping()->set_max_new_tokens(max_new);
  req.mutable_stopping()->set_ignore_eos(true);
  req.mutable_sampling()->set_temperature(0.8f);
  req.mutable_sampling()->set_seed(seed);
  if (logprobs >= 0) req.mutable_sampling()->set_logprobs(logprobs);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::GenerateResponse resp;
  const grpc::Status s = stub.Generate(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  Out o;
  o.ids.assign(resp.token_ids().begin(), resp.token_ids().end());
  for (const v1::TokenLogprobs& t : resp.logprobs()) {
    o.logprobs.push_back(t.logprob());
    for (const v1::TokenLogprob& a : t.top_logprobs()) {
      o.logprobs.push_back(static_cast<float>(a.token_id()));
      o.logprobs.push_back(a.logprob());
    }
  }
  return o;
}

TEST(DeterministicServiceTest, SameBitsAloneAndAmongConcurrentRequests) {
  auto server = ServerProcess::Start(service_test::ServiceModelDir(),
                                     {"--workers", "2", "--deterministic", "--max-num-seqs", "32",
                                      "--max-num-batched-tokens", "48"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::Inference::NewStub(server->Channel());
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ModelInfo info;
    ASSERT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
    EXPECT_TRUE(info.deterministic());
  }
  std::vector<int32_t> prompt;
  for (int i = 0; i < 57; ++i) prompt.push_back(3 + (i * 53 + 7) % 240);
  const Out alone = Generate(*stub, prompt, 12, 7, 3, "alone");
  ASSERT_EQ(alone.ids.size(), 12u);
  ASSERT_FALSE(alone.logprobs.empty());
  for (uint32_t mix = 1; mix <= 2; ++mix) {
    std::mt19937 rng(mix);
    std::vector<std::thread> others;
    for (int i = 0; i < 24; ++i) {
      std::vector<int32_t> p(1 + rng() % 70);
      for (int32_t& t : p) t = 3 + static_cast<int32_t>(rng() % 240);
      const int n = 2 + static_cast<int>(rng() % 14);
      const uint64_t seed = rng();
      others.emplace_back([&server, p, n, seed] {
        auto s = v1::Inference::NewStub(server->Channel());
        Generate(*s, p, n, seed, seed % 2 == 0 ? 2 : -1);
      });
      // The target arrives while others are in prefill and decode.
      if (i == 8 + static_cast<int>(mix) * 4) {
        const Out together = Generate(*stub, prompt, 12, 7, 3, "mix" + std::to_string(mix));
        EXPECT_EQ(together.ids, alone.ids) << "mix " << mix;
        EXPECT_EQ(together.logprobs, alone.logprobs) << "mix " << mix;
      }
    }
    for (auto& t : others) t.join();
  }
  // The alone run's full prompt blocks are cached: a prefix hit gives the same bits.
  const Out cached = Generate(*stub, prompt, 12, 7, 3, "alone");
  EXPECT_EQ(cached.ids, alone.ids);
  EXPECT_EQ(cached.logprobs, alone.logprobs);
  const int status = server->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << server->Log();
}

}  // namespace
}  // namespace tpserve
