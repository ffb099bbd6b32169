// Chat completions over HTTP with the official `openai` npm SDK: the HTTP front end, the real
// scheduler and tokenizer, a deterministic stand-in for the workers and a test chat renderer
// (the model's real chat template is wired in by the coordinator). Checks that the rendered
// chat is tokenized without an added BOS, the error of a model without a chat template, the
// API key, a port in use, the cancel of a whole answer whose client left, and the default
// temperature.
#include <atomic>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "coordinator/http/http_server.h"
#include "coordinator/inference_service.h"
#include "coordinator/metrics.h"
#include "coordinator/scheduler.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "tests/testing/http_test_util.h"

namespace tpserve {
namespace {

using nlohmann::json;
using service_test::CommandResult;
using service_test::RunCommand;
namespace fs = std::filesystem;

std::string SourceDir() {
  const char* s = std::getenv("TPSERVE_SOURCE_DIR");
  return s ? s : ".";
}

// Samples a token from a hash of the sequence so far (deterministic, like greedy decoding), with
// made-up logprobs when asked.
class HashExecutor : public StepExecutor {
 public:
  absl::StatusOr<worker::StepResult> Execute(const worker::StepPlan& plan) override {
    if (const int ms = step_ms.load(); ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++steps;
    worker::StepResult out;
    for (uint64_t id : plan.finished_seq_ids()) history_.erase(id);
    for (const worker::SeqStep& s : plan.seqs()) {
      std::vector<int32_t>& h = history_[s.seq_id()];
      // A cached prefix (prefix caching): the plan names the tokens this worker never saw.
      if (s.prefix_token_ids_size() > 0) {
        h.assign(s.prefix_token_ids().begin(), s.prefix_token_ids().end());
      }
      h.resize(s.start_pos());
      h.insert(h.end(), s.token_ids().begin(), s.token_ids().end());
      if (!s.sample()) continue;
      last_temperature = s.sampling().temperature();
      uint64_t x = 1469598103934665603ull;
      for (int32_t t : h) x = (x ^ static_cast<uint64_t>(t)) * 1099511628211ull;
      const int32_t token = static_cast<int32_t>(300 + x % 500);  // plain text pieces
      out.add_token_ids(token);
      if (s.sampling().has_logprobs()) {
        worker::SampledLogprobs* lp = out.add_logprobs();
        lp->set_logprob(-0.5f);
        for (int k = 0; k < s.sampling().logprobs(); ++k) {
          worker::TokenLogprob* alt = lp->add_top();
          alt->set_token_id(token + k);
          alt->set_logprob(-0.5f - k);
        }
      }
    }
    return out;
  }

  std::atomic<int> step_ms{0};  // how long a step takes
  std::atomic<int> steps{0};    // steps executed
  std::atomic<float> last_temperature{-1.0f};

 private:
  std::mutex mu_;
  std::map<uint64_t, std::vector<int32_t>> history_;
};

class HttpChatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = Tokenizer::Load(SourceDir() + "/models/tiny-coder");
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = std::move(*t);
    SchedulerOptions so;
    so.num_blocks = 256;
    so.block_size = 16;
    so.context_length = 2048;
    scheduler_ = std::make_unique<Scheduler>(so, tokenizer_.get(), &executor_);
    scheduler_->Start();
    service_ = std::make_unique<InferenceService>(tokenizer_.get());
    ServiceLimits limits;
    limits.context_length = 2048;
    limits.vocab_size = 32000;
    limits.kv_capacity_tokens = 256 * 16;
    v1::ModelInfo info;
    info.set_model("tiny-chat");
    info.set_context_length(2048);
    service_->Activate(scheduler_.get(), limits, info);
  }
  void TearDown() override {
    if (http_) http_->Stop();
    scheduler_.reset();
  }

  // Starts the front end with `render` (may be empty); returns its base URL.
  std::string StartHttp(ChatRenderer render, HttpFrontendOptions options = {}) {
    http_ = std::make_unique<HttpFrontend>(service_.get(), &metrics_, std::move(render),
                                           std::move(options));
    absl::StatusOr<int> port = http_->Start("127.0.0.1", 0);
    EXPECT_TRUE(port.ok()) << port.status();
    http_->SetServing(true);
    return "http://127.0.0.1:" + std::to_string(port.ok() ? *port : 0);
  }

  json PostChat(const std::string& base, const json& body, int* status) {
    const CommandResult r = RunCommand(
        "curl -sS --max-time 30 -w '\\n%{http_code}' -H 'Content-Type: "
        "application/json' -d '" +
            body.dump() + "' " + base + "/v1/chat/completions",
        60);
    const size_t nl = r.output.rfind('\n');
    EXPECT_TRUE(r.exit_code == 0 && nl != std::string::npos) << r.output;
    if (nl == std::string::npos) return json();
    *status = std::atoi(r.output.c_str() + nl + 1);
    return json::parse(r.output.substr(0, nl), nullptr, false);
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  HashExecutor executor_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<InferenceService> service_;
  MetricsRegistry metrics_;
  std::unique_ptr<HttpFrontend> http_;
};

// A stand-in template: "<|role|>\ncontent\n" per message, then "<|assistant|>\n"; it writes the
// BOS itself, as real templates do.
ChatRenderer TestRenderer(std::string* last, std::mutex* mu) {
  return [last, mu](const std::vector<openai::HttpChatMessage>& messages,
                    bool add_generation_prompt) -> absl::StatusOr<std::string> {
    std::string out = "<｜begin▁of▁sentence｜>";
    for (const auto& m : messages) out += "<|" + m.role + "|>\n" + m.content + "\n";
    if (add_generation_prompt) out += "<|assistant|>\n";
    std::lock_guard<std::mutex> lock(*mu);
    *last = out;
    return out;
  };
}

TEST_F(HttpChatTest, RenderedChatIsTokenizedWithoutAnAddedBos) {
  std::string last;
  std::mutex mu;
  const std::string base = StartHttp(TestRenderer(&last, &mu));
  int status = 0;
  const json r = PostChat(
      base,
      {{"model", "tiny-chat"},
       {"messages",
        {{{"role", "system"}, {"content", "Be brief."}},
         {{"role", "user"},
          {"content",
           {{{"type", "text"}, {"text", "Hello "}}, {{"type", "text"}, {"text", "there"}}}}}}},
       {"max_tokens", 5}},
      &status);
  ASSERT_EQ(status, 200) << r.dump();
  std::string rendered;
  {
    std::lock_guard<std::mutex> lock(mu);
    rendered = last;
  }
  EXPECT_NE(rendered.find("<|system|>\nBe brief.\n<|user|>\nHello there\n<|assistant|>\n"),
            std::string::npos)
      << rendered;
  const std::vector<int32_t> ids = tokenizer_->Encode(rendered, /*add_special_tokens=*/false);
  ASSERT_TRUE(tokenizer_->bos_id().has_value());
  EXPECT_EQ(ids.front(), *tokenizer_->bos_id());
  EXPECT_NE(ids[1], *tokenizer_->bos_id());
  // The check below can fail: encoding with special tokens adds a (second) BOS on this model.
  ASSERT_EQ(tokenizer_->Encode(rendered, /*add_special_tokens=*/true).size(), ids.size() + 1);
  EXPECT_EQ(r["usage"]["prompt_tokens"], ids.size()) << "a second BOS was added";
  EXPECT_EQ(r["usage"]["completion_tokens"], 5);
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
}

TEST_F(HttpChatTest, OpenAiNpmSdkChatStreamingAndNot) {
  std::string last;
  std::mutex mu;
  const std::string base = StartHttp(TestRenderer(&last, &mu));
  const std::string cache = SourceDir() + "/.cache/npm-openai";
  ASSERT_TRUE(fs::exists(cache + "/node_modules/openai/package.json"))
      << "the openai npm SDK is not installed: run bash tests/service/openai_sdk/setup.sh";
  const CommandResult r =
      RunCommand("node " + SourceDir() + "/tests/service/openai_sdk/openai_sdk_test.mjs --cache " +
                     cache + " --base-url " + base + "/v1 --model tiny-chat --mode chat",
                 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("openai sdk: ok chat"), std::string::npos) << r.output;
}

TEST_F(HttpChatTest, ModelWithoutChatTemplateAnswers400SayingSo) {
  const std::string base = StartHttp(ChatRenderer());
  int status = 0;
  const json r = PostChat(
      base, {{"model", "tiny-chat"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}},
      &status);
  EXPECT_EQ(status, 400);
  EXPECT_NE(r["error"]["message"].get<std::string>().find("no chat template"), std::string::npos)
      << r.dump();
  EXPECT_EQ(r["error"]["param"], "messages");
}

TEST_F(HttpChatTest, ApiKeyIsRequiredWhenSet) {
  HttpFrontendOptions options;
  options.api_keys = ApiKeys({"sesame"});
  const std::string base = StartHttp(ChatRenderer(), options);
  auto status_of = [&](const std::string& extra) {
    const CommandResult r = RunCommand("curl -sS --max-time 10 -o /dev/null -w '%{http_code}' " +
                                           extra + " " + base + "/v1/models",
                                       20);
    return r.output;
  };
  EXPECT_EQ(status_of(""), "401");
  EXPECT_EQ(status_of("-H 'Authorization: Bearer wrong'"), "401");
  EXPECT_EQ(status_of("-H 'Authorization: Bearer sesame'"), "200");
  EXPECT_EQ(status_of("-H 'authorization: bearer sesame'"), "200");  // the scheme ignores case
  EXPECT_EQ(status_of("-H 'Authorization: BEARER sesame'"), "200");
  EXPECT_EQ(status_of("-H 'Authorization: Bearer SESAME'"), "401");  // the key does not
  const CommandResult body = RunCommand("curl -sS --max-time 10 " + base + "/v1/models", 20);
  const json j = json::parse(body.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << body.output;
  EXPECT_EQ(j["error"]["type"], "authentication_error");
  // /health and /metrics stay open (probes and scrapers carry no key).
  EXPECT_EQ(
      RunCommand("curl -sS --max-time 10 -o /dev/null -w '%{http_code}' " + base + "/health", 20)
          .output,
      "200");
}

// A port another server listens on is refused at start (httplib's default SO_REUSEPORT would let
// the second server bind it and take part of the clients).
TEST_F(HttpChatTest, APortInUseIsAnErrorAtStart) {
  const std::string base = StartHttp(ChatRenderer());
  const int port = std::atoi(base.substr(base.rfind(':') + 1).c_str());
  HttpFrontend second(service_.get(), &metrics_, ChatRenderer(), HttpFrontendOptions());
  absl::StatusOr<int> bound = second.Start("127.0.0.1", port);
  ASSERT_FALSE(bound.ok()) << "a second front end bound port " << port;
  EXPECT_NE(bound.status().message().find("could not listen"), std::string::npos) << bound.status();
}

// A client that leaves while it waits for a whole (unstreamed) answer cancels its request, as a
// streamed one does: the steps stop.
TEST_F(HttpChatTest, WholeAnswerIsCancelledWhenTheClientLeaves) {
  const std::string base = StartHttp(ChatRenderer());
  executor_.step_ms = 20;  // 1,000 tokens: ~20 s of steps
  const json body = {
      {"model", "tiny-chat"}, {"prompt", "def f(x):"}, {"max_tokens", 1000}, {"ignore_eos", true}};
  const CommandResult r = RunCommand(
      "curl -sS --max-time 1 -H 'Content-Type: application/json' "
      "-d '" +
          body.dump() + "' " + base + "/v1/completions",
      30);
  EXPECT_NE(r.exit_code, 0) << "the answer came within 1 s: " << r.output;
  // The front end looks every half second; give it 3 s, then the steps must have stopped.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  const int after = executor_.steps.load();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  EXPECT_EQ(executor_.steps.load(), after) << "the request still runs after its client left";
  EXPECT_LT(after, 500);
}

// A request without `temperature` samples at 1, OpenAI's default (the gRPC API's is 0).
TEST_F(HttpChatTest, AbsentTemperatureSamplesAtOne) {
  const std::string base = StartHttp(ChatRenderer());
  const CommandResult r =
      RunCommand("curl -sS --max-time 30 -H 'Content-Type: application/json' -d '" +
                     json{{"model", "tiny-chat"}, {"prompt", "x"}, {"max_tokens", 2}}.dump() +
                     "' " + base + "/v1/completions",
                 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FLOAT_EQ(executor_.last_temperature.load(), 1.0f) << r.output;
  RunCommand(
      "curl -sS --max-time 30 -H 'Content-Type: application/json' -d '" +
          json{{"model", "tiny-chat"}, {"prompt", "x"}, {"max_tokens", 2}, {"temperature", 0}}
              .dump() +
          "' " + base + "/v1/completions",
      60);
  EXPECT_FLOAT_EQ(executor_.last_temperature.load(), 0.0f);
}

// GET /v1/models lists the served model; GET /v1/models/{id} (the SDKs' models.retrieve) returns
// it, or 404 model_not_found for another id.
TEST_F(HttpChatTest, ModelsAreListedAndRetrieved) {
  const std::string base = StartHttp(ChatRenderer());
  auto get = [&](const std::string& path, std::string* code) {
    const CommandResult r =
        RunCommand("curl -sS --max-time 10 -w '\\n%{http_code}' " + base + path, 20);
    const size_t nl = r.output.rfind('\n');
    *code = nl == std::string::npos ? "" : r.output.substr(nl + 1);
    return json::parse(r.output.substr(0, nl), nullptr, false);
  };
  std::string code;
  const json list = get("/v1/models", &code);
  EXPECT_EQ(code, "200");
  EXPECT_EQ(list["data"][0]["id"], "tiny-chat") << list.dump();
  EXPECT_EQ(list["data"][0]["max_model_len"], 2048) << list.dump();
  const json one = get("/v1/models/tiny-chat", &code);
  EXPECT_EQ(code, "200");
  EXPECT_EQ(one["id"], "tiny-chat") << one.dump();
  EXPECT_EQ(one["object"], "model") << one.dump();
  const json other = get("/v1/models/gpt-4", &code);
  EXPECT_EQ(code, "404");
  EXPECT_EQ(other["error"]["code"], "model_not_found") << other.dump();
}

}  // namespace
}  // namespace tpserve
