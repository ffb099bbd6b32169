// End-to-end tests of the service: a coordinator and 2 CPU workers (TP=2, spawned under mpirun)
// answering over gRPC, checked against the in-process engine and against itself (batching,
// streaming, stop strings, cancellation, overflow, worker death, health, a Python client).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/chat_template/chat_template.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/testing/service_info.h"
#include "tests/testing/service_test_util.h"
#include "tpserve/v1/inference.grpc.pb.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

using service_test::Info;
using service_test::ServerProcess;
using service_test::WaitIdle;
using Clock = std::chrono::steady_clock;

struct Result {
  grpc::Status status;
  v1::GenerateResponse response;  // unary answer, or the stream folded into one
  int messages = 0;
  int misaligned = 0;  // stream messages whose logprobs do not match their token_ids one-to-one
};

void SetDeadline(grpc::ClientContext& ctx, double seconds) {
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
}

Result Unary(v1::Inference::Stub& stub, const v1::GenerateRequest& req, double timeout = 120) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout);
  Result r;
  r.status = stub.Generate(&ctx, req, &r.response);
  r.messages = 1;
  return r;
}

Result Stream(v1::Inference::Stub& stub, const v1::GenerateRequest& req, double timeout = 120) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout);
  Result r;
  auto reader = stub.GenerateStream(&ctx, req);
  v1::GenerateResponse msg;
  std::string text;
  std::vector<int32_t> ids;
  google::protobuf::RepeatedPtrField<v1::TokenLogprobs> logprobs;
  const bool asked = req.sampling().has_logprobs();
  while (reader->Read(&msg)) {
    ++r.messages;
    text += msg.text();
    ids.insert(ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    bool aligned = msg.logprobs_size() == (asked ? msg.token_ids_size() : 0);
    for (int i = 0; aligned && i < msg.logprobs_size(); ++i) {
      aligned = msg.logprobs(i).token_id() == msg.token_ids(i);
    }
    r.misaligned += !aligned;
    logprobs.MergeFrom(msg.logprobs());
    if (msg.finished()) r.response = msg;
  }
  r.status = reader->Finish();
  r.response.set_text(text);
  r.response.mutable_token_ids()->Assign(ids.begin(), ids.end());
  *r.response.mutable_logprobs() = logprobs;
  return r;
}

std::vector<int32_t> Ids(const v1::GenerateResponse& r) {
  return std::vector<int32_t>(r.token_ids().begin(), r.token_ids().end());
}

v1::GenerateRequest IdsRequest(const std::vector<int32_t>& prompt, int max_new) {
  v1::GenerateRequest req;
  req.mutable_token_ids()->mutable_ids()->Assign(prompt.begin(), prompt.end());
  req.mutable_stopping()->set_max_new_tokens(max_new);
  req.mutable_stopping()->set_ignore_eos(true);
  return req;
}

v1::GenerateRequest TextRequest(const std::string& text, int max_new) {
  v1::GenerateRequest req;
  req.set_text(text);
  req.mutable_stopping()->set_max_new_tokens(max_new);
  req.mutable_stopping()->set_ignore_eos(true);
  return req;
}

std::vector<int32_t> PromptIds(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(3 + (i * 37 + salt * 101) % 250);
  return p;
}

grpc::health::v1::HealthCheckResponse::ServingStatus Health(const ServerProcess& server,
                                                            const std::string& service,
                                                            grpc::StatusCode* code = nullptr) {
  auto stub = grpc::health::v1::Health::NewStub(server.Channel());
  grpc::ClientContext ctx;
  SetDeadline(ctx, 5);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (code) *code = s.error_code();
  return resp.status();
}

class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_dir_ = new std::string(service_test::ServiceModelDir());
    server_ = ServerProcess::Start(
                  *model_dir_, {"--workers", "2", "--max-num-seqs", "8", "--max-num-batched-tokens",
                                "64", "--max-queued-requests", "32",
                                // Forwarded to the workers; CPU workers have no device budget.
                                "--gpu-memory-utilization", "0.5"})
                  .release();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) {
      const int status = server_->Stop();
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
          << "the coordinator did not drain and exit cleanly (status " << status << "):\n"
          << server_->Log();
    }
    delete server_;
    delete model_dir_;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Inference::NewStub(server_->Channel());
  }

  static std::string* model_dir_;
  static ServerProcess* server_;
  std::unique_ptr<v1::Inference::Stub> stub_;
};
std::string* ServiceTest::model_dir_ = nullptr;
ServerProcess* ServiceTest::server_ = nullptr;

TEST_F(ServiceTest, HealthAnswersLikeGrpcHealthV1) {
  EXPECT_EQ(Health(*server_, ""), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(*server_, "tpserve.v1.Inference"),
            grpc::health::v1::HealthCheckResponse::SERVING);
  grpc::StatusCode code;
  Health(*server_, "no.such.Service", &code);
  EXPECT_EQ(code, grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, ModelInfoDescribesTheGroup) {
  v1::ModelInfo info = Info(*stub_);
  EXPECT_EQ(info.tp(), 2);
  EXPECT_EQ(info.pp(), 1);
  EXPECT_EQ(info.rank_devices_size(), 2);
  EXPECT_GT(info.kv().total_blocks(), 0);
  EXPECT_EQ(info.kv_capacity_tokens(), int64_t{info.kv().total_blocks()} * info.kv().block_size());
  EXPECT_TRUE(info.has_tokenizer());
  EXPECT_EQ(info.architecture(), "LlamaForCausalLM");
}

TEST_F(ServiceTest, GreedyMatchesInProcessEngine) {
  EngineOptions options;
  options.device = "cpu";
  auto engine = Engine::Create(*model_dir_, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto tokenizer = Tokenizer::Load(*model_dir_);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::vector<std::vector<int32_t>> prompts = {PromptIds(5, 1), PromptIds(40, 2), PromptIds(97, 3)};
  const std::string text = "def fibonacci(n):\n    ";
  prompts.push_back((*tokenizer)->Encode(text, true));
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest req;
    req.prompt = prompts[i];
    req.max_new_tokens = 16;
    req.ignore_eos = true;
    auto expected = (*engine)->Generate({req});
    ASSERT_TRUE(expected.ok()) << expected.status();
    Result got = i + 1 < prompts.size() ? Unary(*stub_, IdsRequest(prompts[i], 16))
                                        : Unary(*stub_, TextRequest(text, 16));
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(Ids(got.response), expected->at(0).output_ids) << "prompt " << i;
    EXPECT_EQ(got.response.prompt_tokens(), static_cast<int>(prompts[i].size()));
    EXPECT_EQ(got.response.output_tokens(), 16);
    EXPECT_EQ(got.response.finish_reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(got.response.text(), (*tokenizer)->Decode(expected->at(0).output_ids, true));
    EXPECT_GT(got.response.timings().total_seconds(), 0);
    EXPECT_GE(got.response.timings().total_seconds(),
              got.response.timings().time_to_first_token_seconds());
  }
}

// The engine and the workers run the same shard runner, repetition penalty included: served
// tokens with a penalty equal the in-process engine's (greedy and seeded).
TEST_F(ServiceTest, RepetitionPenaltyMatchesInProcessEngine) {
  EngineOptions options;
  options.device = "cpu";
  auto engine = Engine::Create(*model_dir_, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  for (float temperature : {0.0f, 0.9f}) {
    GenerateRequest req;
    req.prompt = PromptIds(30, 4);
    req.max_new_tokens = 24;
    req.ignore_eos = true;
    req.sampling.temperature = temperature;
    req.sampling.seed = 11;
    req.sampling.repetition_penalty = 1.8f;
    auto expected = (*engine)->Generate({req});
    ASSERT_TRUE(expected.ok()) << expected.status();
    GenerateRequest plain = req;
    plain.sampling.repetition_penalty = 1.0f;
    auto unpenalized = (*engine)->Generate({plain});
    ASSERT_TRUE(unpenalized.ok()) << unpenalized.status();
    EXPECT_NE(expected->at(0).output_ids, unpenalized->at(0).output_ids)
        << "the penalty should change this output (T " << temperature << ")";
    v1::GenerateRequest served = IdsRequest(req.prompt, req.max_new_tokens);
    served.mutable_sampling()->set_repetition_penalty(1.8f);
    served.mutable_sampling()->set_temperature(temperature);
    served.mutable_sampling()->set_seed(11);
    Result got = Unary(*stub_, served);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(Ids(got.response), expected->at(0).output_ids) << "T " << temperature;
  }
}

// A messages prompt renders the model's chat template (tiny-coder has one) and is tokenized
// without an added BOS: it answers what the rendered ids answer; an empty conversation and a
// role the template refuses are INVALID_ARGUMENT.
TEST_F(ServiceTest, MessagesPromptsUseTheChatTemplate) {
  auto chat = ChatTemplate::Load(*model_dir_);
  ASSERT_TRUE(chat.ok()) << chat.status();
  auto tokenizer = Tokenizer::Load(*model_dir_);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const std::vector<ChatMessage> conversation = {{"system", "You write C++."},
                                                 {"user", "Reverse a string."},
                                                 {"assistant", "std::reverse"},
                                                 {"user", "And a vector? 向量"}};
  auto text = (*chat)->Render(conversation, /*add_generation_prompt=*/true);
  ASSERT_TRUE(text.ok()) << text.status();
  const std::vector<int32_t> ids = (*tokenizer)->Encode(*text, /*add_special_tokens=*/false);
  v1::GenerateRequest req = IdsRequest({1}, 12);
  for (const ChatMessage& m : conversation) {
    v1::ChatMessage* out = req.mutable_messages()->add_messages();
    out->set_role(m.role);
    out->set_content(m.content);
  }
  const Result got = Unary(*stub_, req);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  const Result want = Unary(*stub_, IdsRequest(ids, 12));
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  EXPECT_EQ(got.response.prompt_tokens(), static_cast<int>(ids.size()));
  EXPECT_EQ(Ids(got.response), Ids(want.response));

  v1::GenerateRequest empty = IdsRequest({1}, 2);
  empty.mutable_messages();
  Result bad = Unary(*stub_, empty);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.status.error_message().find("prompt.messages is empty"), std::string::npos);
  v1::GenerateRequest tool = IdsRequest({1}, 2);
  v1::ChatMessage* m = tool.mutable_messages()->add_messages();
  m->set_role("tool");
  m->set_content("x");
  bad = Unary(*stub_, tool);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.status.error_message().find("chat template failed"), std::string::npos)
      << bad.status.error_message();
}

TEST_F(ServiceTest, SixteenConcurrentClientsGetWhatTheyGetAlone) {
  constexpr int kClients = 16;
  std::vector<v1::GenerateRequest> reqs;
  for (int i = 0; i < kClients; ++i) {
    reqs.push_back(IdsRequest(PromptIds(3 + i * 7, 10 + i), 8 + i % 5));
    if (i % 3 == 0) {  // some seeded sampling too: the RNG is keyed by (seed, position)
      reqs.back().mutable_sampling()->set_temperature(0.8f);
      reqs.back().mutable_sampling()->set_seed(1000 + i);
      reqs.back().mutable_sampling()->set_top_k(20);
    }
  }
  std::vector<Result> alone(kClients), together(kClients);
  for (int i = 0; i < kClients; ++i) alone[i] = Unary(*stub_, reqs[i]);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      auto stub = v1::Inference::NewStub(server_->Channel());
      together[i] = i % 2 ? Stream(*stub, reqs[i]) : Unary(*stub, reqs[i]);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    ASSERT_TRUE(alone[i].status.ok()) << alone[i].status.error_message();
    ASSERT_TRUE(together[i].status.ok()) << together[i].status.error_message();
    EXPECT_EQ(Ids(together[i].response), Ids(alone[i].response)) << "client " << i;
    EXPECT_EQ(together[i].response.text(), alone[i].response.text()) << "client " << i;
  }
  EXPECT_TRUE(WaitIdle(*stub_, 5));
}

TEST_F(ServiceTest, StreamConcatenationEqualsUnary) {
  v1::GenerateRequest req = TextRequest("import os\nimport sys\n", 24);
  Result unary = Unary(*stub_, req);
  Result stream = Stream(*stub_, req);
  ASSERT_TRUE(unary.status.ok()) << unary.status.error_message();
  ASSERT_TRUE(stream.status.ok()) << stream.status.error_message();
  EXPECT_EQ(stream.response.text(), unary.response.text());
  EXPECT_EQ(Ids(stream.response), Ids(unary.response));
  EXPECT_EQ(stream.response.output_tokens(), 24);
  EXPECT_TRUE(stream.response.finished());
  EXPECT_GT(stream.messages, 1);
}

// Checks `r`'s logprobs against the engine's for the same request (ids exactly, logprobs within
// `tol`: the service's TP workers sum partial products in another order) and their shape: one
// entry per token, `n` alternatives each, ordered, the greedy token first.
void ExpectLogprobs(const v1::GenerateResponse& r, const GenerateResult& engine, int n, double tol,
                    bool greedy, const Tokenizer* tokenizer, const std::string& what) {
  ASSERT_EQ(r.logprobs_size(), r.token_ids_size()) << what;
  ASSERT_EQ(engine.logprobs.size(), engine.output_ids.size()) << what;
  ASSERT_EQ(Ids(r), engine.output_ids) << what;
  for (int i = 0; i < r.logprobs_size(); ++i) {
    const v1::TokenLogprobs& t = r.logprobs(i);
    const TokenLogprobs& e = engine.logprobs[i];
    EXPECT_EQ(t.token_id(), r.token_ids(i)) << what << " token " << i;
    EXPECT_LE(t.logprob(), 0.0f);
    EXPECT_NEAR(t.logprob(), e.logprob, tol) << what << " token " << i;
    if (tokenizer != nullptr) {
      EXPECT_EQ(t.text(), tokenizer->Decode({t.token_id()}, false));
    }
    ASSERT_EQ(t.top_logprobs_size(), n) << what << " token " << i;
    for (int k = 0; k < n; ++k) {
      const v1::TokenLogprob& a = t.top_logprobs(k);
      EXPECT_EQ(a.token_id(), e.top[k].id) << what << " token " << i << " rank " << k;
      EXPECT_NEAR(a.logprob(), e.top[k].logprob, tol) << what << " token " << i << " rank " << k;
      if (k > 0) {
        EXPECT_GE(t.top_logprobs(k - 1).logprob(), a.logprob());
      }
      if (tokenizer != nullptr) {
        EXPECT_EQ(a.text(), tokenizer->Decode({a.token_id()}, false));
      }
    }
    if (greedy && n > 0) {
      EXPECT_EQ(t.top_logprobs(0).token_id(), t.token_id()) << what << " token " << i;
      EXPECT_EQ(t.top_logprobs(0).logprob(), t.logprob()) << what << " token " << i;
    }
  }
}

// logprobs = 3 through the 2 TP workers: every token, unary and streaming, carries exactly 3
// alternatives, aligned with token_ids, equal to the in-process engine's.
TEST_F(ServiceTest, LogprobsAlignWithTokensAndMatchTheEngine) {
  EngineOptions options;
  options.device = "cpu";
  auto engine = Engine::Create(*model_dir_, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto tokenizer = Tokenizer::Load(*model_dir_);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  constexpr double kTol = 1e-4;  // fp32 logits of two TP shards vs one rank
  struct Case {
    std::vector<int32_t> prompt;
    float temperature;
    int top_k;
    int logprobs;
  };
  const std::vector<Case> cases = {{PromptIds(21, 5), 0.0f, 0, 3},
                                   {PromptIds(8, 6), 0.9f, 15, 3},
                                   {PromptIds(13, 7), 0.0f, 0, 0},
                                   {PromptIds(30, 8), 0.7f, 0, kMaxLogprobs}};
  for (size_t c = 0; c < cases.size(); ++c) {
    GenerateRequest ereq;
    ereq.prompt = cases[c].prompt;
    ereq.max_new_tokens = 12;
    ereq.ignore_eos = true;
    ereq.sampling.temperature = cases[c].temperature;
    ereq.sampling.top_k = cases[c].top_k;
    ereq.sampling.seed = 40 + c;
    ereq.sampling.logprobs = cases[c].logprobs;
    auto expected = (*engine)->Generate({ereq});
    ASSERT_TRUE(expected.ok()) << expected.status();
    v1::GenerateRequest req = IdsRequest(cases[c].prompt, 12);
    req.mutable_sampling()->set_temperature(cases[c].temperature);
    req.mutable_sampling()->set_top_k(cases[c].top_k);
    req.mutable_sampling()->set_seed(40 + c);
    req.mutable_sampling()->set_logprobs(cases[c].logprobs);
    const Result unary = Unary(*stub_, req);
    const Result stream = Stream(*stub_, req);
    ASSERT_TRUE(unary.status.ok()) << unary.status.error_message();
    ASSERT_TRUE(stream.status.ok()) << stream.status.error_message();
    EXPECT_GT(stream.messages, 1);
    EXPECT_EQ(stream.misaligned, 0) << "case " << c;
    const bool greedy = cases[c].temperature == 0.0f;
    ExpectLogprobs(unary.response, expected->at(0), cases[c].logprobs, kTol, greedy,
                   tokenizer->get(), "unary case " + std::to_string(c));
    ExpectLogprobs(stream.response, expected->at(0), cases[c].logprobs, kTol, greedy,
                   tokenizer->get(), "stream case " + std::to_string(c));
  }
  // A repetition penalty changes the sampled tokens, not the reported distribution: the first
  // token's context is the same with and without it, so its 20 alternatives are too, and the
  // chosen token's logprob is its raw one (the step runner takes them before the penalty).
  v1::GenerateRequest raw = IdsRequest(cases[0].prompt, 4);
  raw.mutable_sampling()->set_logprobs(kMaxLogprobs);
  v1::GenerateRequest penalized = raw;
  penalized.mutable_sampling()->set_repetition_penalty(3.0f);
  const Result raw_r = Unary(*stub_, raw);
  const Result pen_r = Unary(*stub_, penalized);
  ASSERT_TRUE(raw_r.status.ok() && pen_r.status.ok()) << pen_r.status.error_message();
  ASSERT_EQ(pen_r.response.logprobs_size(), 4);
  const v1::TokenLogprobs& first_raw = raw_r.response.logprobs(0);
  const v1::TokenLogprobs& first_pen = pen_r.response.logprobs(0);
  ASSERT_EQ(first_pen.top_logprobs_size(), kMaxLogprobs);
  int penalized_alternatives = 0;  // the penalty does move these (the prompt's tokens)
  for (int k = 0; k < kMaxLogprobs; ++k) {
    const int32_t id = first_raw.top_logprobs(k).token_id();
    penalized_alternatives += std::count(cases[0].prompt.begin(), cases[0].prompt.end(), id) > 0;
    EXPECT_EQ(first_pen.top_logprobs(k).token_id(), first_raw.top_logprobs(k).token_id()) << k;
    EXPECT_NEAR(first_pen.top_logprobs(k).logprob(), first_raw.top_logprobs(k).logprob(), kTol);
    if (first_raw.top_logprobs(k).token_id() == first_pen.token_id()) {
      EXPECT_NEAR(first_pen.logprob(), first_raw.top_logprobs(k).logprob(), kTol);
    }
  }
  EXPECT_GT(penalized_alternatives, 0) << "the check needs a prompt token among the top 20";
  // Without the field: no logprobs, the same tokens.
  const Result plain = Unary(*stub_, IdsRequest(cases[0].prompt, 12));
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  EXPECT_EQ(plain.response.logprobs_size(), 0);
  const Result plain_stream = Stream(*stub_, IdsRequest(cases[0].prompt, 12));
  EXPECT_EQ(plain_stream.response.logprobs_size(), 0);
  EXPECT_EQ(plain_stream.misaligned, 0);
  EXPECT_TRUE(WaitIdle(*stub_, 5));
}

TEST_F(ServiceTest, StopStringsAndStopIdsCutWhereTheyShould) {
  v1::GenerateRequest req = TextRequest("class Node:\n", 40);
  Result full = Unary(*stub_, req);
  ASSERT_TRUE(full.status.ok()) << full.status.error_message();
  const std::string text = full.response.text();
  // A stop string: the 2 characters (UTF-8) starting at the 6th character boundary.
  size_t start = 0;
  for (int chars = 0; chars < 6 && start < text.size(); ++chars) {
    ++start;
    while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
  }
  size_t end = start;
  for (int chars = 0; chars < 2 && end < text.size(); ++chars) {
    ++end;
    while (end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
  }
  ASSERT_LT(start, end) << "the completion is too short: '" << text << "'";
  const std::string stop = text.substr(start, end - start);
  const std::string expected = text.substr(0, text.find(stop));
  for (bool streaming : {false, true}) {
    v1::GenerateRequest s = req;
    s.mutable_stopping()->add_stop(stop);
    s.mutable_stopping()->add_stop("this string never appears \x01\x02");
    Result r = streaming ? Stream(*stub_, s) : Unary(*stub_, s);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.response.text(), expected) << "stop '" << stop << "' streaming " << streaming;
    EXPECT_EQ(r.response.finish_reason(), v1::FINISH_REASON_STOP);
    EXPECT_LT(r.response.output_tokens(), 40);
  }
  // A stop token id: generation ends right after its first occurrence.
  const std::vector<int32_t> ids = Ids(full.response);
  const int32_t stop_id = ids.at(5);
  const size_t first = std::find(ids.begin(), ids.end(), stop_id) - ids.begin();
  v1::GenerateRequest s = req;
  s.mutable_stopping()->add_stop_token_ids(stop_id);
  Result r = Unary(*stub_, s);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(Ids(r.response), std::vector<int32_t>(ids.begin(), ids.begin() + first + 1));
  EXPECT_EQ(r.response.finish_reason(), v1::FINISH_REASON_STOP);
}

TEST_F(ServiceTest, EveryBadFieldIsInvalidArgumentNamingIt) {
  struct Case {
    v1::GenerateRequest req;
    std::vector<std::string> mentions;
  };
  const v1::ModelInfo info = Info(*stub_);
  const int ctx = static_cast<int>(info.context_length());
  const int vocab = static_cast<int>(info.vocab_size());
  const std::string ctx_s = std::to_string(ctx);
  std::vector<Case> cases;
  cases.push_back({v1::GenerateRequest(), {"prompt"}});
  {
    v1::GenerateRequest r = IdsRequest({5, vocab + 41, 7}, 4);
    cases.push_back(
        {r, {"prompt.token_ids[1]", std::to_string(vocab + 41), std::to_string(vocab)}});
  }
  {
    v1::GenerateRequest r = IdsRequest(PromptIds(ctx + 88, 1), 4);
    cases.push_back({r, {std::to_string(ctx + 88), ctx_s}});
  }
  {
    v1::GenerateRequest r = IdsRequest(PromptIds(ctx - 12, 1), 20);
    cases.push_back({r, {std::to_string(ctx - 12), "max_new_tokens", "20", ctx_s}});
  }
  {
    v1::GenerateRequest r = IdsRequest({5}, 0);
    cases.push_back({r, {"stopping.max_new_tokens"}});
  }
  {
    v1::GenerateRequest r = IdsRequest({5}, 4);
    r.mutable_sampling()->set_top_p(1.5f);
    cases.push_back({r, {"sampling.top_p"}});
  }
  {
    v1::GenerateRequest r = IdsRequest({5}, 4);
    r.mutable_sampling()->set_temperature(-1);
    cases.push_back({r, {"sampling.temperature"}});
  }
  {
    v1::GenerateRequest r = IdsRequest({5}, 4);
    r.mutable_sampling()->set_top_k(-3);
    cases.push_back({r, {"sampling.top_k"}});
  }
  {
    v1::GenerateRequest r = IdsRequest({5}, 4);
    r.mutable_sampling()->set_repetition_penalty(0);
    cases.push_back({r, {"sampling.repetition_penalty"}});
  }
  {
    v1::GenerateRequest r = IdsRequest({5}, 4);
    r.mutable_stopping()->add_stop("");
    cases.push_back({r, {"stopping.stop[0]"}});
  }
  {
    v1::GenerateRequest r = IdsRequest({5}, 4);
    r.mutable_stopping()->add_stop_token_ids(-1);
    cases.push_back({r, {"stopping.stop_token_ids[0]"}});
  }
  {
    v1::GenerateRequest r = TextRequest("", 4);
    cases.push_back({r, {"prompt.text"}});
  }
  for (int n : {21, -1}) {
    v1::GenerateRequest r = IdsRequest({5}, 4);
    r.mutable_sampling()->set_logprobs(n);
    cases.push_back({r, {"sampling.logprobs", "20", std::to_string(n)}});
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    for (bool streaming : {false, true}) {
      Result r = streaming ? Stream(*stub_, cases[i].req) : Unary(*stub_, cases[i].req);
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "case " << i;
      for (const std::string& m : cases[i].mentions) {
        EXPECT_NE(r.status.error_message().find(m), std::string::npos)
            << "case " << i << ": '" << r.status.error_message() << "' should mention '" << m
            << "'";
      }
    }
  }
}

TEST_F(ServiceTest, CancelAndDeadlineReturnEveryKvBlock) {
  ASSERT_TRUE(WaitIdle(*stub_, 5));
  {
    grpc::ClientContext ctx;
    SetDeadline(ctx, 60);
    auto reader = stub_->GenerateStream(&ctx, IdsRequest(PromptIds(60, 4), 400));
    v1::GenerateResponse msg;
    int got = 0;
    while (got < 3 && reader->Read(&msg)) got += msg.token_ids_size();
    EXPECT_GE(got, 3);
    EXPECT_LT(Info(*stub_).kv().free_blocks(), Info(*stub_).kv().total_blocks());
    ctx.TryCancel();
    while (reader->Read(&msg)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_TRUE(WaitIdle(*stub_, 2)) << "cancelling must free the blocks at once";
  // An expired deadline too.
  const auto t0 = Clock::now();
  Result r = Unary(*stub_, IdsRequest(PromptIds(30, 5), 450), 0.08);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
  EXPECT_TRUE(WaitIdle(*stub_, 2)) << "an expired deadline must free the blocks";
  // The service still answers.
  Result ok = Unary(*stub_, IdsRequest({7, 8, 9}, 3));
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
}

TEST_F(ServiceTest, TokenizeDetokenizeAndRepetitionPenalty) {
  grpc::ClientContext c1;
  SetDeadline(c1, 10);
  v1::TokenizeRequest treq;
  treq.set_text("héllo wörld");
  treq.set_add_special_tokens(true);
  v1::TokenizeResponse tresp;
  ASSERT_TRUE(stub_->Tokenize(&c1, treq, &tresp).ok());
  ASSERT_GT(tresp.token_ids_size(), 1);
  grpc::ClientContext c2;
  SetDeadline(c2, 10);
  v1::DetokenizeRequest dreq;
  dreq.mutable_token_ids()->CopyFrom(tresp.token_ids());
  dreq.set_skip_special_tokens(true);
  v1::DetokenizeResponse dresp;
  ASSERT_TRUE(stub_->Detokenize(&c2, dreq, &dresp).ok());
  EXPECT_EQ(dresp.text(), "héllo wörld");

  v1::GenerateRequest req = IdsRequest(PromptIds(10, 6), 24);
  Result plain = Unary(*stub_, req);
  req.mutable_sampling()->set_repetition_penalty(1.0f);
  Result one = Unary(*stub_, req);
  req.mutable_sampling()->set_repetition_penalty(50.0f);
  Result strong = Unary(*stub_, req);
  Result strong_again = Unary(*stub_, req);
  ASSERT_TRUE(plain.status.ok() && one.status.ok() && strong.status.ok() &&
              strong_again.status.ok());
  EXPECT_EQ(Ids(one.response), Ids(plain.response));
  EXPECT_EQ(Ids(strong.response), Ids(strong_again.response));
  EXPECT_NE(Ids(strong.response), Ids(plain.response));
}

TEST_F(ServiceTest, PythonClientWithDebianGrpcio) {
  if (access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/python3";
  const char* src = std::getenv("TPSERVE_SOURCE_DIR");
  const std::string root = src ? src : ".";
  const std::string cmd = "timeout -k 5 120 /usr/bin/python3 " + root +
                          "/tests/service/python_client_test.py --server " + server_->address() +
                          " --proto-dir " + root + "/proto 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int status = pclose(p);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("reflection lists"), std::string::npos) << out;
}

// A small queue: overflow answers RESOURCE_EXHAUSTED and the service keeps serving; SIGTERM then
// drains a running request to completion.
TEST(ServiceOverflowTest, FullQueueIsResourceExhaustedAndServiceKeepsServing) {
  const std::string model = service_test::ServiceModelDir();
  auto server = ServerProcess::Start(
      model, {"--workers", "2", "--max-num-seqs", "2", "--max-queued-requests", "3",
              // The drain below must outlast its request's 480 tokens: ~1 s here, but over the
              // default 15 s with the 2 cores shared by 4 busy loops (it then ended UNAVAILABLE).
              "--drain-timeout", "120"});
  ASSERT_NE(server, nullptr);
  constexpr int kClients = 12;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<grpc::Status> statuses(kClients);
  std::vector<std::thread> threads;
  std::atomic<int> exhausted{0};
  for (int i = 0; i < kClients; ++i) contexts.push_back(std::make_unique<grpc::ClientContext>());
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      auto stub = v1::Inference::NewStub(server->Channel());
      SetDeadline(*contexts[i], 60);
      v1::GenerateResponse resp;
      statuses[i] = stub->Generate(contexts[i].get(), IdsRequest(PromptIds(20, i), 300), &resp);
      if (statuses[i].error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) exhausted++;
    });
  }
  // Rejections come at once; then cancel the rest.
  const auto end = Clock::now() + std::chrono::seconds(20);
  while (exhausted.load() < kClients - 2 - 3 && Clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // 2 running + 3 queued are accepted (up to 2 more when the first admissions free queue slots
  // before the burst is over); the rest are refused at once.
  EXPECT_GE(exhausted.load(), kClients - 2 - 3);
  EXPECT_LE(exhausted.load(), kClients - 3);
  for (auto& c : contexts) c->TryCancel();
  for (auto& t : threads) t.join();
  for (const grpc::Status& s : statuses) {
    // An accepted request may also have finished its 300 tokens before the cancel (a loaded
    // machine can take seconds to deliver the burst's refusals).
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ||
                s.error_code() == grpc::StatusCode::CANCELLED || s.ok())
        << s.error_code() << " " << s.error_message();
  }
  auto stub = v1::Inference::NewStub(server->Channel());
  EXPECT_TRUE(WaitIdle(*stub, 5));
  Result ok = Unary(*stub, IdsRequest({7, 8, 9}, 3));
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(Health(*server, ""), grpc::health::v1::HealthCheckResponse::SERVING);

  // SIGTERM drains: the running request finishes, new ones are refused, the process exits 0.
  Result drained;
  std::thread running([&] { drained = Unary(*stub, IdsRequest(PromptIds(10, 9), 480)); });
  // Stop while it runs: wait until it holds KV blocks.
  for (int i = 0; i < 500 && Info(*stub).kv().running_sequences() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  const int status = server->Stop(std::chrono::seconds(150));
  running.join();
  EXPECT_TRUE(drained.status.ok()) << drained.status.error_message() << "\n" << server->Log();
  EXPECT_EQ(drained.response.output_tokens(), 480);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << server->Log();
}

// Pipeline parallelism (2 stages, two steps in flight over disjoint sequences) and a single
// worker (no mpirun) give the engine's tokens too, and its logprobs.
TEST(ServiceLayoutTest, PipelineAndSingleWorkerMatchTheEngine) {
  const std::string model = service_test::ServiceModelDir();
  EngineOptions options;
  options.device = "cpu";
  auto engine = Engine::Create(model, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<GenerateResult> expected;
  const std::vector<std::vector<int32_t>> prompts = {PromptIds(9, 21),  PromptIds(70, 22),
                                                     PromptIds(33, 23), PromptIds(5, 24),
                                                     PromptIds(17, 25), PromptIds(50, 26)};
  // Even prompts ask for logprobs: they come from the last stage through the control plane.
  auto logprobs_of = [](size_t i) { return i % 2 == 0 ? static_cast<int>(2 + i) : -1; };
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest req;
    req.prompt = prompts[i];
    req.max_new_tokens = 12;
    req.ignore_eos = true;
    req.sampling.logprobs = logprobs_of(i);
    auto r = (*engine)->Generate({req});
    ASSERT_TRUE(r.ok()) << r.status();
    expected.push_back(r->at(0));
  }
  for (const std::vector<std::string>& layout : {std::vector<std::string>{"--tp", "1", "--pp", "2"},
                                                 std::vector<std::string>{"--workers", "1"}}) {
    auto server = ServerProcess::Start(model, layout);
    ASSERT_NE(server, nullptr);
    auto stub = v1::Inference::NewStub(server->Channel());
    v1::ModelInfo info = Info(*stub);
    EXPECT_EQ(info.tp() * info.pp(), layout[0] == "--tp" ? 2 : 1);
    std::vector<Result> results(prompts.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < prompts.size(); ++i) {
      threads.emplace_back([&, i] {
        auto s = v1::Inference::NewStub(server->Channel());
        v1::GenerateRequest req = IdsRequest(prompts[i], 12);
        if (logprobs_of(i) >= 0) req.mutable_sampling()->set_logprobs(logprobs_of(i));
        results[i] = Stream(*s, req);
      });
    }
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_TRUE(results[i].status.ok()) << results[i].status.error_message();
      EXPECT_EQ(Ids(results[i].response), expected[i].output_ids) << layout[0] << " prompt " << i;
      EXPECT_EQ(results[i].misaligned, 0) << layout[0] << " prompt " << i;
      if (logprobs_of(i) >= 0) {
        // fp32 on both sides; batches differ (the engine ran each prompt alone).
        ExpectLogprobs(results[i].response, expected[i], logprobs_of(i), 1e-4, true, nullptr,
                       layout[0] + " prompt " + std::to_string(i));
      } else {
        EXPECT_EQ(results[i].response.logprobs_size(), 0);
      }
    }
    const int status = server->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << server->Log();
  }
}

// Overlapped scheduling (the default) against the serial loop (--no-overlap-scheduling) and the
// in-process engine, at tp = 2 and pp = 2, and at tp = 1 with the worker launching each step
// before the previous one's ids reach its host (TPSERVE_LAUNCH_AHEAD=1: the CPU runs the same
// logic as a GPU, fed tokens included), with a KV pool small enough to preempt: greedy and
// seeded tokens, a repetition penalty (whose steps wait for the host), logprobs, stop ids (the
// token after a stop is never streamed), stop strings, length limits, cancels at random points
// and deadlines; every block back to idle after each part.
TEST(ServiceOverlapTest, OverlapEqualsTheSerialLoopAndTheEngine) {
  const std::string model = service_test::ServiceModelDir();
  EngineOptions options;
  options.device = "cpu";
  auto engine = Engine::Create(model, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  constexpr int kRequests = 8;
  std::vector<GenerateRequest> ereqs(kRequests);
  std::vector<v1::GenerateRequest> reqs(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    ereqs[i].prompt = PromptIds(50 + i * 7, 30 + i);
    ereqs[i].max_new_tokens = 100 + i * 5;
    ereqs[i].ignore_eos = true;
    if (i % 2 == 1) {
      ereqs[i].sampling.temperature = 0.8f;
      ereqs[i].sampling.seed = 500 + i;
    }
  }
  constexpr int kPenalized = 3, kLogprobs = 6;
  ereqs[kPenalized].sampling.repetition_penalty = 1.3f;
  ereqs[kLogprobs].sampling.logprobs = 3;
  // Stop ids: the id the request emits at output position 4 + i (found with a first run).
  for (int i : {2, 5}) {
    auto full = (*engine)->Generate({ereqs[i]});
    ASSERT_TRUE(full.ok()) << full.status();
    ereqs[i].stop_token_ids = {full->at(0).output_ids.at(4 + i)};
  }
  std::vector<std::vector<int32_t>> expected;
  GenerateResult expected_logprobs;
  for (int i = 0; i < kRequests; ++i) {
    auto r = (*engine)->Generate({ereqs[i]});
    ASSERT_TRUE(r.ok()) << r.status();
    expected.push_back(r->at(0).output_ids);
    if (i == kLogprobs) expected_logprobs = r->at(0);
    reqs[i] = IdsRequest(ereqs[i].prompt, ereqs[i].max_new_tokens);
    if (i % 2 == 1) {
      reqs[i].mutable_sampling()->set_temperature(0.8f);
      reqs[i].mutable_sampling()->set_seed(500 + i);
    }
    if (i == kPenalized) reqs[i].mutable_sampling()->set_repetition_penalty(1.3f);
    if (i == kLogprobs) reqs[i].mutable_sampling()->set_logprobs(3);
    for (int32_t id : ereqs[i].stop_token_ids) reqs[i].mutable_stopping()->add_stop_token_ids(id);
  }
  engine->reset();
  // Text requests with stop strings: compared between the two schedulers.
  std::vector<v1::GenerateRequest> text_reqs;
  for (const char* stop : {"\n", "(", "e"}) {
    v1::GenerateRequest t = TextRequest("def parse(line):\n    ", 30);
    t.mutable_stopping()->add_stop(stop);
    text_reqs.push_back(t);
  }
  std::vector<std::vector<Result>> text_results;
  struct Layout {
    std::string name;
    std::vector<std::string> args;
    bool overlap;
    bool launch_ahead = false;  // TPSERVE_LAUNCH_AHEAD=1 in the workers' environment
  };
  const std::vector<Layout> layouts = {
      {"tp=2 overlapped", {"--workers", "2"}, true},
      {"tp=2 serial", {"--workers", "2", "--no-overlap-scheduling"}, false},
      {"pp=2 (disjoint steps in flight)", {"--tp", "1", "--pp", "2"}, false},
      {"tp=1 overlapped, launched ahead", {"--workers", "1"}, true, true}};
  for (const Layout& layout : layouts) {
    std::vector<std::string> args = layout.args;
    for (const char* a :
         {"--kv-cache-mb", "1", "--max-num-seqs", "8", "--max-num-batched-tokens", "96"}) {
      args.push_back(a);
    }
    const std::string& name = layout.name;
    // The spawned workers inherit it.
    if (layout.launch_ahead) setenv("TPSERVE_LAUNCH_AHEAD", "1", 1);
    auto server = ServerProcess::Start(model, args);
    unsetenv("TPSERVE_LAUNCH_AHEAD");
    ASSERT_NE(server, nullptr);
    auto stub = v1::Inference::NewStub(server->Channel());
    const v1::ModelInfo info = Info(*stub);
    EXPECT_EQ(info.steps().overlap_scheduling(), layout.overlap) << name;
    std::vector<Result> results(kRequests);
    std::vector<std::thread> threads;
    for (int i = 0; i < kRequests; ++i) {
      threads.emplace_back([&, i] {
        auto s = v1::Inference::NewStub(server->Channel());
        results[i] = i % 2 ? Stream(*s, reqs[i]) : Unary(*s, reqs[i]);
      });
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < kRequests; ++i) {
      ASSERT_TRUE(results[i].status.ok()) << name << ": " << results[i].status.error_message();
      EXPECT_EQ(Ids(results[i].response), expected[i]) << name << " request " << i;
      EXPECT_EQ(results[i].response.output_tokens(), static_cast<int>(expected[i].size()));
      EXPECT_EQ(results[i].response.finish_reason(),
                ereqs[i].stop_token_ids.empty() ? v1::FINISH_REASON_LENGTH : v1::FINISH_REASON_STOP)
          << name << " request " << i;
    }
    // Request kLogprobs (even: greedy) carries 3 alternatives a token, the engine's (1e-4: fp32
    // logits of TP shards against one rank, as in LogprobsAlignWithTokensAndMatchTheEngine).
    ExpectLogprobs(results[kLogprobs].response, expected_logprobs, 3, 1e-4, /*greedy=*/true,
                   nullptr, name + " logprobs");
    EXPECT_GT(Info(*stub).kv().preemptions(), 0) << name << ": the small pool should preempt ("
                                                 << Info(*stub).kv().total_blocks() << " blocks)";
    EXPECT_TRUE(WaitIdle(*stub, 5)) << name;
    text_results.emplace_back();
    for (const v1::GenerateRequest& t : text_reqs) {
      text_results.back().push_back(Stream(*stub, t));
      ASSERT_TRUE(text_results.back().back().status.ok());
      EXPECT_EQ(text_results.back().back().response.finish_reason(), v1::FINISH_REASON_STOP)
          << name << ": stop '" << t.stopping().stop(0) << "' should appear in 30 tokens";
    }
    EXPECT_TRUE(WaitIdle(*stub, 5)) << name;
    // Cancels after a random number of streamed tokens, and short deadlines, all at once.
    std::mt19937 rng(name.size());
    threads.clear();
    std::vector<grpc::StatusCode> codes(kRequests);
    for (int i = 0; i < kRequests; ++i) {
      const int after = std::uniform_int_distribution<int>(1, 12)(rng);
      const double deadline = std::uniform_int_distribution<int>(20, 150)(rng) / 1000.0;
      threads.emplace_back([&, i, after, deadline] {
        auto s = v1::Inference::NewStub(server->Channel());
        v1::GenerateRequest req = IdsRequest(PromptIds(40, 60 + i), 400);
        if (i % 2 == 0) {
          codes[i] = Unary(*s, req, deadline).status.error_code();
          return;
        }
        grpc::ClientContext ctx;
        SetDeadline(ctx, 60);
        auto reader = s->GenerateStream(&ctx, req);
        v1::GenerateResponse msg;
        int got = 0;
        while (got < after && reader->Read(&msg)) got += msg.token_ids_size();
        ctx.TryCancel();
        while (reader->Read(&msg)) {
        }
        codes[i] = reader->Finish().error_code();
      });
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < kRequests; ++i) {
      EXPECT_EQ(codes[i], i % 2 ? grpc::StatusCode::CANCELLED : grpc::StatusCode::DEADLINE_EXCEEDED)
          << name << " request " << i;
    }
    EXPECT_TRUE(WaitIdle(*stub, 5)) << name << ": cancels and deadlines leak blocks";
    const v1::ModelInfo end = Info(*stub);
    EXPECT_GT(end.steps().scheduler_cpu_seconds(), 0) << name;
    const int status = server->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << name << "\n" << server->Log();
    // The worker's count of steps launched ahead: some with the switch, none without (the CPU's
    // sampling is synchronous, so auto does not go ahead).
    const std::string log = server->Log();
    const std::regex counts("steps: ([0-9]+) launched, ([0-9]+) of them ahead");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(log, m, counts)) << name << ": no step count in the log\n" << log;
    EXPECT_GT(std::stoll(m[1].str()), 0) << name;
    if (layout.launch_ahead) {
      EXPECT_GT(std::stoll(m[2].str()), 0) << name << ": no step went ahead";
    } else {
      EXPECT_EQ(std::stoll(m[2].str()), 0) << name;
    }
  }
  for (size_t l = 1; l < text_results.size(); ++l) {
    for (size_t i = 0; i < text_reqs.size(); ++i) {
      EXPECT_EQ(text_results[l][i].response.text(), text_results[0][i].response.text())
          << layouts[l].name << " stop string " << i;
      EXPECT_EQ(Ids(text_results[l][i].response), Ids(text_results[0][i].response))
          << layouts[l].name << " stop string " << i;
    }
  }
}

TEST(ServiceWorkerFailureTest, KilledWorkerFailsTheStreamWithUnavailableWithinFiveSeconds) {
  const std::string model = service_test::ServiceModelDir();
  auto server = ServerProcess::Start(model, {"--workers", "2"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::Inference::NewStub(server->Channel());
  grpc::ClientContext ctx;
  SetDeadline(ctx, 60);
  auto reader = stub->GenerateStream(&ctx, IdsRequest(PromptIds(30, 7), 480));
  v1::GenerateResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  const std::vector<pid_t> workers = server->WorkerPids();
  ASSERT_EQ(workers.size(), 2u) << server->Log();
  const auto t0 = Clock::now();
  kill(workers.back(), SIGKILL);
  while (reader->Read(&msg)) {
  }
  const grpc::Status s = reader->Finish();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("rank"), std::string::npos) << s.error_message();
  EXPECT_LT(seconds, 5.0);
  // Health turns NOT_SERVING and new requests are refused, promptly.
  auto end = Clock::now() + std::chrono::seconds(3);
  while (Health(*server, "") != grpc::health::v1::HealthCheckResponse::NOT_SERVING &&
         Clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(Health(*server, ""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  Result after = Unary(*stub, IdsRequest({7, 8, 9}, 3), 10);
  EXPECT_EQ(after.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(after.status.error_message().find("rank"), std::string::npos);
}

}  // namespace
}  // namespace tpserve

namespace tpserve {
namespace {

TEST(ServiceWorkerFailureTest, SilentWorkerFailsTheRequestWithUnavailable) {
  const std::string model = service_test::ServiceModelDir();
  auto server = ServerProcess::Start(model, {"--workers", "2", "--heartbeat-timeout", "2"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::Inference::NewStub(server->Channel());
  grpc::ClientContext ctx;
  SetDeadline(ctx, 60);
  auto reader = stub->GenerateStream(&ctx, IdsRequest(PromptIds(30, 8), 480));
  v1::GenerateResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  const std::vector<pid_t> workers = server->WorkerPids();
  ASSERT_EQ(workers.size(), 2u) << server->Log();
  const auto t0 = Clock::now();
  kill(workers.back(), SIGSTOP);  // alive, connected, silent
  while (reader->Read(&msg)) {
  }
  const grpc::Status s = reader->Finish();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  kill(workers.back(), SIGKILL);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("rank"), std::string::npos) << s.error_message();
  EXPECT_LT(seconds, 5.0) << "a 2 s heartbeat timeout";
  EXPECT_EQ(Health(*server, ""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
}

}  // namespace
}  // namespace tpserve
