// Prefix caching end to end: a coordinator with 2 CPU workers (tp = 2, then pp = 2) and the same
// layout with --no-enable-prefix-caching answer the same script (multi-turn conversations, greedy
// and seeded, a shared system prompt (also one nobody sent before, in requests that arrive
// together: computed once), exact prefixes of cached prompts and one token longer, a
// repetition penalty over a cached prefix, logprobs) with the same tokens; the cache is used,
// salts isolate, DropPrefixCache forgets, and the KV pool returns to idle.
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/service_info.h"
#include "tests/testing/service_test_util.h"
#include "tpserve/v1/inference.grpc.pb.h"

namespace tpserve {
namespace {

using service_test::Info;
using service_test::ServerProcess;
using service_test::WaitIdle;
using Clock = std::chrono::steady_clock;

void SetDeadline(grpc::ClientContext& ctx, double seconds) {
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
}

std::vector<int32_t> PromptIds(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(3 + (i * 37 + salt * 101 + (i * i) % 11) % 250);
  return p;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Req {
  std::vector<int32_t> prompt;
  int max_new = 10;
  float temperature = 0;
  uint64_t seed = 0;
  float repetition_penalty = 1;
  int logprobs = -1;
  std::string salt;
};

struct Out {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
};

Out Generate(v1::Inference::Stub& stub, const Req& r) {
  v1::GenerateRequest req;
  req.mutable_token_ids()->mutable_ids()->Assign(r.prompt.begin(), r.prompt.end());
  req.mutable_stopping()->set_max_new_tokens(r.max_new);
  req.mutable_stopping()->set_ignore_eos(true);
  if (r.temperature > 0) {
    req.mutable_sampling()->set_temperature(r.temperature);
    req.mutable_sampling()->set_seed(r.seed);
    req.mutable_sampling()->set_top_k(20);
  }
  if (r.repetition_penalty != 1)
    req.mutable_sampling()->set_repetition_penalty(r.repetition_penalty);
  if (r.logprobs >= 0) req.mutable_sampling()->set_logprobs(r.logprobs);
  req.set_cache_salt(r.salt);
  grpc::ClientContext ctx;
  SetDeadline(ctx, 120);
  v1::GenerateResponse resp;
  const grpc::Status s = stub.Generate(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  Out o;
  o.ids.assign(resp.token_ids().begin(), resp.token_ids().end());
  EXPECT_EQ(static_cast<int>(o.ids.size()), r.max_new);
  for (const v1::TokenLogprobs& t : resp.logprobs()) {
    o.logprobs.push_back(t.logprob());
    for (const v1::TokenLogprob& a : t.top_logprobs()) {
      o.logprobs.push_back(static_cast<float>(a.token_id()));
      o.logprobs.push_back(a.logprob());
    }
  }
  return o;
}

// Five prompts behind one prefix nobody sent before, sent together (greedy and seeded); adds
// their outputs to `outs` and returns the prompt tokens the server computed for them.
int64_t RunTogether(ServerProcess& server, const std::vector<int32_t>& prefix,
                    std::vector<Out>& outs) {
  auto stub = v1::Inference::NewStub(server.Channel());
  const int64_t before = Info(*stub).prefix_cache().computed_prompt_tokens();
  std::vector<Out> together(5);
  std::vector<std::thread> threads;
  for (int i = 0; i < 5; ++i) {
    threads.emplace_back([&, i] {
      auto s = v1::Inference::NewStub(server.Channel());
      Req r{Concat(prefix, PromptIds(3 + i, 40 + i)), 8};
      if (i % 2 == 1) {
        r.temperature = 0.7f;
        r.seed = 200 + i;
      }
      together[i] = Generate(*s, r);
    });
  }
  for (auto& t : threads) t.join();
  outs.insert(outs.end(), together.begin(), together.end());
  return Info(*stub).prefix_cache().computed_prompt_tokens() - before;
}

// The script: every output in order. Later requests' prompts are built from earlier outputs
// (the conversations), so both servers must agree turn by turn for the prompts to agree.
// `together_computed`: the prompt tokens computed for five requests that share a fresh 64-token
// prefix and arrive together.
std::vector<Out> RunScript(ServerProcess& server, int64_t* together_computed) {
  auto stub = v1::Inference::NewStub(server.Channel());
  std::vector<Out> outs;
  // Two conversations of 3 turns, greedy and seeded: each turn resends history + answer.
  for (int conv = 0; conv < 2; ++conv) {
    Req r;
    r.prompt = PromptIds(40, 1 + conv);
    r.max_new = 12;
    if (conv == 1) {
      r.temperature = 0.8f;
      r.seed = 7;
    }
    for (int t = 0; t < 3; ++t) {
      outs.push_back(Generate(*stub, r));
      r.prompt = Concat(Concat(r.prompt, outs.back().ids), PromptIds(9, 10 + t));
      r.seed += 1;
    }
  }
  // A fresh 64-token prefix (4 blocks of 16) in front of five prompts sent together.
  *together_computed = RunTogether(server, PromptIds(64, 6), outs);
  // A shared 48-token system prompt (3 blocks of 16): one request, then five at once.
  const std::vector<int32_t> sys = PromptIds(48, 5);
  outs.push_back(Generate(*stub, {Concat(sys, PromptIds(5, 20)), 8}));
  {
    std::vector<Out> together(5);
    std::vector<std::thread> threads;
    for (int i = 0; i < 5; ++i) {
      threads.emplace_back([&, i] {
        auto s = v1::Inference::NewStub(server.Channel());
        Req r{Concat(sys, PromptIds(6 + i, 21 + i)), 8};
        if (i % 2 == 1) {
          r.temperature = 0.7f;
          r.seed = 100 + i;
        }
        together[i] = Generate(*s, r);
      });
    }
    for (auto& t : threads) t.join();
    outs.insert(outs.end(), together.begin(), together.end());
  }
  // Exact prefixes of the cached prompt: block-aligned (its last block is recomputed), one
  // token longer, the whole system prompt, and one token longer than that.
  for (int n : {32, 33, 48}) {
    outs.push_back(Generate(*stub, {std::vector<int32_t>(sys.begin(), sys.begin() + n), 6}));
  }
  outs.push_back(Generate(*stub, {Concat(sys, {77}), 6}));
  // A repetition penalty over a cached prefix (the sampling worker's history must hold it), and
  // logprobs.
  Req pen{Concat(sys, PromptIds(4, 30)), 10};
  pen.repetition_penalty = 1.5f;
  outs.push_back(Generate(*stub, pen));
  Req lp{Concat(sys, PromptIds(7, 31)), 6};
  lp.logprobs = 3;
  outs.push_back(Generate(*stub, lp));
  EXPECT_TRUE(WaitIdle(*stub, 5)) << "the KV pool did not return to idle";
  return outs;
}

void ExpectSame(const std::vector<Out>& on, const std::vector<Out>& off, const std::string& what) {
  ASSERT_EQ(on.size(), off.size());
  for (size_t i = 0; i < on.size(); ++i) {
    EXPECT_EQ(on[i].ids, off[i].ids) << what << " request " << i;
    ASSERT_EQ(on[i].logprobs.size(), off[i].logprobs.size()) << what << " request " << i;
    for (size_t k = 0; k < on[i].logprobs.size(); ++k) {
      // fp32 CPU workers; the cached K/V were computed in other batches.
      EXPECT_NEAR(on[i].logprobs[k], off[i].logprobs[k], 1e-4) << what << " request " << i;
    }
  }
}

int64_t Hits(v1::Inference::Stub& stub) { return Info(stub).prefix_cache().hits(); }

TEST(PrefixCacheServiceTest, CachedEqualsUncachedAtTp2AndPp2) {
  const std::string model = service_test::ServiceModelDir();
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{"--workers", "2"},
        std::vector<std::string>{"--tp", "1", "--pp", "2"}}) {
    const std::string name = layout[0] == "--workers" ? "tp=2" : "pp=2";
    std::vector<std::string> base = layout;
    for (const char* f : {"--max-num-seqs", "8", "--max-num-batched-tokens", "64"}) {
      base.push_back(f);
    }
    std::vector<Out> off_outs;
    {
      std::vector<std::string> args = base;
      args.push_back("--no-enable-prefix-caching");
      auto off = ServerProcess::Start(model, args);
      ASSERT_NE(off, nullptr);
      int64_t together = 0;
      off_outs = RunScript(*off, &together);
      EXPECT_EQ(together, 5 * 64 + (3 + 4 + 5 + 6 + 7)) << name;
      auto stub = v1::Inference::NewStub(off->Channel());
      const v1::ModelInfo info = Info(*stub);
      EXPECT_FALSE(info.prefix_cache().enabled());
      EXPECT_EQ(info.prefix_cache().hits(), 0);
      EXPECT_EQ(info.prefix_cache().cached_blocks(), 0);
      const int status = off->Stop();
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << off->Log();
    }
    auto on = ServerProcess::Start(model, base);
    ASSERT_NE(on, nullptr);
    int64_t together = 0;
    const std::vector<Out> on_outs = RunScript(*on, &together);
    // The shared prefix is computed once: the first request computes it, the others wait for
    // its blocks (or find them cached).
    EXPECT_EQ(together, 64 + (3 + 4 + 5 + 6 + 7)) << name;
    ExpectSame(on_outs, off_outs, name);
    auto stub = v1::Inference::NewStub(on->Channel());
    const v1::ModelInfo info = Info(*stub);
    const v1::PrefixCacheStats& pc = info.prefix_cache();
    EXPECT_TRUE(pc.enabled());
    EXPECT_GT(pc.queries(), 0);
    // Conversation turns 2-3 and 9 of the 11 system-prompt requests find 32-48 tokens each.
    EXPECT_GT(pc.hits(), 400) << name;
    EXPECT_NEAR(pc.hit_rate(), static_cast<double>(pc.hits()) / pc.queries(), 1e-9);
    EXPECT_GT(pc.cached_blocks(), 0);
    EXPECT_EQ(pc.evictable_blocks(), pc.cached_blocks()) << "idle: every cached block is evictable";
    EXPECT_EQ(info.kv().free_blocks(), info.kv().total_blocks());

    // Salts: tenant-b never sees tenant-a's blocks; DropPrefixCache forgets tenant-a's.
    Req a{PromptIds(40, 9), 4};
    a.salt = "tenant-a";
    const Out first = Generate(*stub, a);
    int64_t h = Hits(*stub);
    EXPECT_EQ(Generate(*stub, a).ids, first.ids);
    EXPECT_EQ(Hits(*stub) - h, 32) << name << ": two full blocks of tenant-a's prompt";
    Req b = a;
    b.salt = "tenant-b";
    h = Hits(*stub);
    EXPECT_EQ(Generate(*stub, b).ids, first.ids);
    EXPECT_EQ(Hits(*stub) - h, 0) << name << ": another salt shares nothing";
    {
      grpc::ClientContext ctx;
      SetDeadline(ctx, 10);
      v1::DropPrefixCacheRequest req;
      req.set_cache_salt("tenant-a");
      v1::DropPrefixCacheResponse resp;
      const grpc::Status s = stub->DropPrefixCache(&ctx, req, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.dropped_blocks(), 2) << name;
    }
    h = Hits(*stub);
    EXPECT_EQ(Generate(*stub, a).ids, first.ids);
    EXPECT_EQ(Hits(*stub) - h, 0) << name << ": dropped";
    {
      grpc::ClientContext ctx;
      SetDeadline(ctx, 10);
      v1::DropPrefixCacheRequest req;
      req.set_all(true);
      req.set_cache_salt("x");
      v1::DropPrefixCacheResponse resp;
      EXPECT_EQ(stub->DropPrefixCache(&ctx, req, &resp).error_code(),
                grpc::StatusCode::INVALID_ARGUMENT);
    }
    {
      grpc::ClientContext ctx;
      SetDeadline(ctx, 10);
      v1::DropPrefixCacheRequest req;
      req.set_all(true);
      v1::DropPrefixCacheResponse resp;
      ASSERT_TRUE(stub->DropPrefixCache(&ctx, req, &resp).ok());
      EXPECT_GT(resp.dropped_blocks(), 0);
    }
    EXPECT_EQ(Info(*stub).prefix_cache().cached_blocks(), 0);
    EXPECT_TRUE(WaitIdle(*stub, 5));
    const int status = on->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << on->Log();
  }
}

}  // namespace
}  // namespace tpserve
