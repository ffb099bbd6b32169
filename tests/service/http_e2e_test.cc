// End to end over HTTP: a real coordinator with a CPU worker serving the bundled model, driven by
// curl, the official `openai` npm SDK and Debian's Prometheus server (scraping /metrics); a
// client that hangs up mid-stream cancels its request.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "coordinator/chat_template/chat_template.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "tests/testing/http_test_util.h"
#include "tests/testing/service_test_util.h"

namespace tpserve {
namespace {

using nlohmann::json;
using service_test::CommandResult;
using service_test::FreePort;
using service_test::MetricValue;
using service_test::RunCommand;
using service_test::ServerProcess;
namespace fs = std::filesystem;

std::string SourceDir() {
  const char* s = std::getenv("TPSERVE_SOURCE_DIR");
  return s ? s : ".";
}

struct HttpAnswer {
  int status = 0;
  std::string body;
  json Json() const { return json::parse(body, nullptr, false); }
};

class HttpServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    http_port_ = FreePort();
    ASSERT_GT(http_port_, 0);
    server_ = ServerProcess::Start(service_test::ServiceModelDir(),
                                   {"--workers", "1", "--http-port", std::to_string(http_port_)})
                  .release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr) << "the server did not start"; }

  static std::string Url(const std::string& path) {
    return "http://127.0.0.1:" + std::to_string(http_port_) + path;
  }
  static std::string Model() { return fs::path(service_test::ServiceModelDir()).filename(); }

  // curl; `body` empty: GET.
  static HttpAnswer Curl(const std::string& path, const std::string& body = "",
                         const std::string& extra = "") {
    std::string cmd = "curl -sS --max-time 60 -w '\\n%{http_code}' " + extra + " ";
    if (!body.empty()) cmd += "-H 'Content-Type: application/json' -d '" + body + "' ";
    cmd += Url(path);
    const CommandResult r = RunCommand(cmd, 90);
    HttpAnswer a;
    const size_t nl = r.output.rfind('\n');
    if (r.exit_code != 0 || nl == std::string::npos) {
      ADD_FAILURE() << cmd << " failed: " << r.output;
      return a;
    }
    a.status = std::atoi(r.output.c_str() + nl + 1);
    a.body = r.output.substr(0, nl);
    return a;
  }

  static std::string Metrics() { return Curl("/metrics").body; }

  static ServerProcess* server_;
  static int http_port_;
};

ServerProcess* HttpServiceTest::server_ = nullptr;
int HttpServiceTest::http_port_ = 0;

TEST_F(HttpServiceTest, CurlCompletionsStreamModelsHealthAndErrors) {
  HttpAnswer health = Curl("/health");
  EXPECT_EQ(health.status, 200) << health.body;

  HttpAnswer models = Curl("/v1/models");
  ASSERT_EQ(models.status, 200) << models.body;
  EXPECT_EQ(models.Json()["data"][0]["id"], Model());

  const json req = {{"model", Model()},
                    {"prompt", "def add(a, b):"},
                    {"max_tokens", 6},
                    {"ignore_eos", true},
                    {"temperature", 0}};
  HttpAnswer whole = Curl("/v1/completions", req.dump());
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json w = whole.Json();
  EXPECT_EQ(w["object"], "text_completion");
  EXPECT_EQ(w["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(w["usage"]["completion_tokens"], 6);
  const std::string text = w["choices"][0]["text"];

  // Streamed: Server-Sent Events, the same text in pieces, the usage chunk, then [DONE].
  json sreq = req;
  sreq["stream"] = true;
  sreq["stream_options"] = {{"include_usage", true}};
  HttpAnswer stream = Curl("/v1/completions", sreq.dump(), "-N");
  ASSERT_EQ(stream.status, 200) << stream.body;
  std::istringstream in(stream.body);
  std::string line, streamed, last_data;
  json usage;
  int events = 0;
  while (std::getline(in, line)) {
    if (line.rfind("data: ", 0) != 0) continue;
    last_data = line.substr(6);
    if (last_data == "[DONE]") break;
    ++events;
    const json e = json::parse(last_data);
    if (!e["usage"].is_null()) usage = e["usage"];
    for (const json& c : e["choices"]) streamed += c["text"].get<std::string>();
  }
  EXPECT_EQ(last_data, "[DONE]") << stream.body;
  EXPECT_GE(events, 3);
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(usage, w["usage"]);

  // Errors: OpenAI's shape, the right status, the field named.
  HttpAnswer n2 =
      Curl("/v1/completions", R"({"model": ")" + Model() + R"(", "prompt": "x", "n": 2})");
  EXPECT_EQ(n2.status, 400);
  EXPECT_EQ(n2.Json()["error"]["param"], "n") << n2.body;
  EXPECT_EQ(n2.Json()["error"]["type"], "invalid_request_error");
  HttpAnswer unknown =
      Curl("/v1/completions", R"({"model": ")" + Model() + R"(", "prompt": "x", "best_of": 3})");
  EXPECT_EQ(unknown.status, 400);
  EXPECT_EQ(unknown.Json()["error"]["param"], "best_of") << unknown.body;
  HttpAnswer model = Curl("/v1/completions", R"({"model": "gpt-4", "prompt": "x"})");
  EXPECT_EQ(model.status, 404);
  EXPECT_EQ(model.Json()["error"]["code"], "model_not_found") << model.body;
  HttpAnswer big = Curl("/v1/completions",
                        R"({"model": ")" + Model() + R"(", "prompt": "x", "max_tokens": 100000})");
  EXPECT_EQ(big.status, 400);
  EXPECT_EQ(big.Json()["error"]["param"], "max_tokens") << big.body;
  HttpAnswer route = Curl("/v1/embeddings", R"({"model": "m"})");
  EXPECT_EQ(route.status, 404);
  EXPECT_TRUE(route.Json()["error"].is_object()) << route.body;
  HttpAnswer bad_json = Curl("/v1/completions", "{not json");
  EXPECT_EQ(bad_json.status, 400);
}

// Chat completions render the model's own chat template (tiny-coder's, from its
// tokenizer_config.json) and tokenize it without adding a BOS: the answer equals a completion of
// exactly those token ids, and the prompt token count is theirs.
TEST_F(HttpServiceTest, ChatUsesTheModelsChatTemplate) {
  auto chat = ChatTemplate::Load(service_test::ServiceModelDir());
  ASSERT_TRUE(chat.ok()) << chat.status();
  auto tokenizer = Tokenizer::Load(service_test::ServiceModelDir());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const std::vector<ChatMessage> messages = {{"system", "You write Python."},
                                             {"user", "Sort a list. Ünïcödé 字"}};
  auto rendered = (*chat)->Render(messages, /*add_generation_prompt=*/true);
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  const std::vector<int32_t> ids = (*tokenizer)->Encode(*rendered, /*add_special_tokens=*/false);
  json msgs = json::array();
  for (const ChatMessage& m : messages) msgs.push_back({{"role", m.role}, {"content", m.content}});
  HttpAnswer answer = Curl("/v1/chat/completions", json{{"model", Model()},
                                                        {"messages", msgs},
                                                        {"max_tokens", 8},
                                                        {"ignore_eos", true},
                                                        {"temperature", 0}}
                                                       .dump());
  ASSERT_EQ(answer.status, 200) << answer.body;
  const json a = answer.Json();
  EXPECT_EQ(a["usage"]["prompt_tokens"], static_cast<int>(ids.size()));
  HttpAnswer same = Curl("/v1/completions", json{{"model", Model()},
                                                 {"prompt", ids},
                                                 {"max_tokens", 8},
                                                 {"ignore_eos", true},
                                                 {"temperature", 0}}
                                                .dump());
  ASSERT_EQ(same.status, 200) << same.body;
  EXPECT_EQ(a["choices"][0]["message"]["content"], same.Json()["choices"][0]["text"]);
  EXPECT_EQ(a["choices"][0]["message"]["role"], "assistant");
}

TEST_F(HttpServiceTest, OpenAiNpmSdkCompletionsModelsAndErrors) {
  const std::string cache = SourceDir() + "/.cache/npm-openai";
  ASSERT_TRUE(fs::exists(cache + "/node_modules/openai/package.json"))
      << "the openai npm SDK is not installed: run bash tests/service/openai_sdk/setup.sh";
  const CommandResult r = RunCommand(
      "node " + SourceDir() + "/tests/service/openai_sdk/openai_sdk_test.mjs --cache " + cache +
          " --base-url " + Url("/v1") + " --model " + Model() + " --mode completions",
      120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("openai sdk: ok completions"), std::string::npos) << r.output;
}

TEST_F(HttpServiceTest, ClientHangingUpMidStreamCancelsItsRequest) {
  const double aborted_before =
      MetricValue(Metrics(), "tpserve:request_success_total{finished_reason=\"abort\"}")
          .value_or(-1);
  ASSERT_GE(aborted_before, 0);
  // ~2000 tokens take seconds on the CPU; curl leaves after 1 s of streaming.
  const json req = {{"model", Model()},
                    {"prompt", "x"},
                    {"max_tokens", 2000},
                    {"ignore_eos", true},
                    {"stream", true}};
  const CommandResult r =
      RunCommand("curl -sS -N --max-time 1 -H 'Content-Type: application/json' -d '" + req.dump() +
                     "' " + Url("/v1/completions"),
                 30);
  EXPECT_EQ(r.exit_code, 28) << "curl should time out mid-stream: " << r.output.substr(0, 500);
  EXPECT_NE(r.output.find("data: {"), std::string::npos) << r.output.substr(0, 500);
  EXPECT_EQ(r.output.find("[DONE]"), std::string::npos) << "the request finished within 1 s";
  // The server notices at its next write: the request ends as aborted, its blocks are freed.
  std::string m;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < end) {
    m = Metrics();
    if (MetricValue(m, "tpserve:request_success_total{finished_reason=\"abort\"}").value_or(0) >
            aborted_before &&
        MetricValue(m, "tpserve:num_requests_running") == 0.0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(MetricValue(m, "tpserve:request_success_total{finished_reason=\"abort\"}"),
            aborted_before + 1)
      << m;
  EXPECT_EQ(MetricValue(m, "tpserve:num_requests_running"), 0.0) << m;
  EXPECT_EQ(MetricValue(m, "tpserve:kv_cache_usage_perc"), 0.0) << m;
}

// Debian's Prometheus scrapes /metrics every second; the series come back through its query API.
TEST_F(HttpServiceTest, PrometheusScrapesTheMetrics) {
  if (access("/usr/bin/prometheus", X_OK) != 0) {
    FAIL() << "Debian's prometheus is not installed (deploy/install-deps.sh installs it)";
  }
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("tpserve_prometheus_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  const int prom_port = FreePort();
  std::ofstream(dir / "prometheus.yml")
      << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
      << "scrape_configs:\n  - job_name: tpserve\n    static_configs:\n"
      << "      - targets: ['127.0.0.1:" << http_port_ << "']\n";
  const pid_t prom = fork();
  if (prom == 0) {
    setpgid(0, 0);
    const std::string log = (dir / "log").string();
    FILE* f = std::fopen(log.c_str(), "w");
    dup2(fileno(f), 1);
    dup2(fileno(f), 2);
    const std::string config = "--config.file=" + (dir / "prometheus.yml").string();
    const std::string storage = "--storage.tsdb.path=" + (dir / "data").string();
    const std::string listen = "--web.listen-address=127.0.0.1:" + std::to_string(prom_port);
    execl("/usr/bin/prometheus", "prometheus", config.c_str(), storage.c_str(), listen.c_str(),
          "--log.level=warn", static_cast<char*>(nullptr));
    _exit(127);
  }
  ASSERT_GT(prom, 0);
  struct Reaper {
    pid_t pid;
    ~Reaper() {
      kill(pid, SIGTERM);
      for (int i = 0; i < 100; ++i) {
        if (waitpid(pid, nullptr, WNOHANG) == pid) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  } reaper{prom};

  for (int i = 0; i < 3; ++i) {
    HttpAnswer a =
        Curl("/v1/completions", R"({"model": ")" + Model() +
                                    R"(", "prompt": "x", "max_tokens": 4, "ignore_eos": true})");
    ASSERT_EQ(a.status, 200) << a.body;
  }
  // Each query: the value of the one series it selects, or nothing yet.
  auto query = [&](const std::string& q) -> std::optional<double> {
    const CommandResult r =
        RunCommand("curl -sS --max-time 5 'http://127.0.0.1:" + std::to_string(prom_port) +
                       "/api/v1/query' --data-urlencode 'query=" + q + "'",
                   15);
    const json j = json::parse(r.output, nullptr, false);
    if (j.is_discarded() || j.value("status", "") != "success") return std::nullopt;
    const json& res = j["data"]["result"];
    if (!res.is_array() || res.empty()) return std::nullopt;
    return std::stod(res[0]["value"][1].get<std::string>());
  };
  const std::vector<std::string> queries = {
      "sum(tpserve:request_success_total{job=\"tpserve\"})",
      "tpserve:time_to_first_token_seconds_count{job=\"tpserve\"}",
      "tpserve:generation_tokens_total{job=\"tpserve\"}",
      "tpserve:worker_device_memory_total_bytes{rank=\"0\"}",
      "tpserve:worker_device_memory_used_bytes{rank=\"0\"}",
      "tpserve:num_requests_running{job=\"tpserve\"}",
      "histogram_quantile(0.5, tpserve:e2e_request_latency_seconds_bucket{job=\"tpserve\"})",
      "up{job=\"tpserve\"}"};
  std::map<std::string, double> got;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(45);
  while (std::chrono::steady_clock::now() < end && got.size() < queries.size()) {
    for (const std::string& q : queries) {
      if (got.count(q)) continue;
      if (auto v = query(q)) got[q] = *v;
    }
    if (got.size() < queries.size()) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  std::ifstream log(dir / "log");
  std::stringstream prom_log;
  prom_log << log.rdbuf();
  ASSERT_EQ(got.size(), queries.size()) << "Prometheus did not return every series in 45 s; log:\n"
                                        << prom_log.str();
  EXPECT_EQ(got[queries[7]], 1.0);  // the scrape works
  EXPECT_GE(got[queries[0]], 4.0);  // 3 requests + the warm-up, at least
  EXPECT_GE(got[queries[1]], 4.0);
  EXPECT_GE(got[queries[2]], 12.0);  // 3 x 4 tokens
  EXPECT_GT(got[queries[3]], 0.0);   // a CPU worker reports host memory
  EXPECT_GT(got[queries[4]], 0.0);
  EXPECT_LE(got[queries[4]], got[queries[3]]);
  EXPECT_EQ(got[queries[5]], 0.0);
  EXPECT_GT(got[queries[6]], 0.0);  // a median latency from the buckets
  EXPECT_LT(got[queries[6]], 60.0);
}

// A full queue answers 429 in OpenAI's error shape; once SIGTERM starts the drain, /health and new
// requests answer 503 while the running request completes.
TEST(HttpOverloadTest, QueueFullIs429AndDrainingIs503) {
  const int http_port = FreePort();
  auto server = ServerProcess::Start(
      service_test::ServiceModelDir(),
      {"--workers", "1", "--http-port", std::to_string(http_port), "--max-num-seqs", "1",
       "--max-queued-requests", "1", "--drain-timeout", "120"});
  ASSERT_NE(server, nullptr);
  const std::string url = "http://127.0.0.1:" + std::to_string(http_port);
  const std::string model = fs::path(service_test::ServiceModelDir()).filename();
  const std::string body =
      R"({"model": ")" + model + R"(", "prompt": "x", "max_tokens": 400, "ignore_eos": true})";
  // Six at once: one runs, one waits, the rest find the queue full.
  std::string cmd;
  for (int i = 0; i < 6; ++i) {
    cmd +=
        "curl -sS --max-time 60 -o /dev/null -w '%{http_code}\\n' -H 'Content-Type: "
        "application/json' -d '" +
        body + "' " + url + "/v1/completions & ";
  }
  cmd += "wait";
  const CommandResult codes = RunCommand(cmd, 90);
  int ok = 0, full = 0;
  std::istringstream in(codes.output);
  for (std::string line; std::getline(in, line);) {
    ok += line == "200";
    full += line == "429";
  }
  EXPECT_GE(ok, 2) << codes.output;
  EXPECT_GE(full, 1) << codes.output;
  EXPECT_EQ(ok + full, 6) << codes.output;

  // The error body of a 429: flood until one comes back with its body.
  bool saw_body = false;
  for (int attempt = 0; attempt < 5 && !saw_body; ++attempt) {
    std::string flood;
    for (int i = 0; i < 4; ++i) {
      flood += "curl -sS --max-time 60 -H 'Content-Type: application/json' -d '" + body + "' " +
               url + "/v1/completions; echo; ";
    }
    const std::string both = "(" + flood + ") & (" + flood + ") & (" + flood + ") & wait";
    const CommandResult r = RunCommand(both, 120);
    std::istringstream lines(r.output);
    for (std::string line; std::getline(lines, line);) {
      const json j = json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.contains("error") && j["error"]["code"] == "queue_full") {
        EXPECT_EQ(j["error"]["type"], "rate_limit_error") << line;
        saw_body = true;
      }
    }
  }
  EXPECT_TRUE(saw_body) << "no 429 body with code queue_full";

  // Draining: a long request runs, SIGTERM, then /health and new requests are 503. The drain
  // timeout (120 s) is far above the request's time (1,500 tokens: ~2 s here, but 10-20 s with
  // the 2 cores shared by 4 busy loops, where a 10 s timeout ended it UNAVAILABLE).
  const std::string long_body =
      R"({"model": ")" + model + R"(", "prompt": "x", "max_tokens": 1500, "ignore_eos": true})";
  CommandResult running;
  std::thread long_request([&] {
    running = RunCommand(
        "curl -sS --max-time 150 -o /dev/null -w '%{http_code}' -H "
        "'Content-Type: application/json' -d '" +
            long_body + "' " + url + "/v1/completions",
        160);
  });
  // SIGTERM once it runs (a fixed sleep may come before a loaded machine admits it).
  const auto admit_end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  bool admitted = false;
  while (!admitted && std::chrono::steady_clock::now() < admit_end) {
    const CommandResult m = RunCommand("curl -sS --max-time 5 " + url + "/metrics", 10);
    admitted = MetricValue(m.output, "tpserve:num_requests_running") == 1.0;
    if (!admitted) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(admitted) << "the long request was not running within 30 s";
  kill(server->pid(), SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const CommandResult health =
      RunCommand("curl -sS --max-time 5 -o /dev/null -w '%{http_code}' " + url + "/health", 10);
  EXPECT_EQ(health.output, "503");
  const CommandResult late =
      RunCommand("curl -sS --max-time 5 -H 'Content-Type: application/json' -d '" + body + "' " +
                     url + "/v1/completions",
                 10);
  const json lj = json::parse(late.output, nullptr, false);
  EXPECT_FALSE(lj.is_discarded()) << late.output;
  if (!lj.is_discarded())
    EXPECT_EQ(lj["error"]["type"], "service_unavailable_error") << late.output;
  const int status = server->Stop(std::chrono::seconds(150));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  long_request.join();
  EXPECT_EQ(running.output, "200") << "the running request did not complete during the drain";
}

// `cmake --install` into a temporary prefix; `tpserve serve` from there (no --model: the
// installed bundled model; its worker binary found beside it) answers one request over HTTP and
// exits cleanly on SIGTERM.
TEST(HttpInstallTest, InstalledServeAnswersOverHttp) {
  const char* build = std::getenv("TPSERVE_BINARY_DIR");
  ASSERT_NE(build, nullptr);
  const fs::path prefix =
      fs::path(::testing::TempDir()) / ("tpserve_install_" + std::to_string(getpid()));
  fs::remove_all(prefix);
  const CommandResult install =
      RunCommand(std::string("cmake --install ") + build + " --prefix " + prefix.string(), 120);
  ASSERT_EQ(install.exit_code, 0) << install.output;
  for (const char* f : {"bin/tpserve", "bin/tpserve-coordinator", "bin/tpserve-worker",
                        "share/tpserve/models/tiny-coder/config.json",
                        "share/tpserve/models/tiny-coder/model.safetensors"}) {
    EXPECT_TRUE(fs::exists(prefix / f)) << f;
  }
  const int http_port = FreePort();
  const std::string ready = (prefix / "ready").string();
  const std::string log = (prefix / "log").string();
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    FILE* f = std::fopen(log.c_str(), "w");
    dup2(fileno(f), 1);
    dup2(fileno(f), 2);
    unsetenv("TPSERVE_WORKER");
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    const std::string bin = (prefix / "bin/tpserve").string();
    const std::string hp = std::to_string(http_port);
    execl(bin.c_str(), "tpserve", "serve", "--device", "cpu", "--workers", "1", "--host",
          "127.0.0.1", "--port", "0", "--http-port", hp.c_str(), "--ready-file", ready.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  auto read_log = [&] {
    std::ifstream in(log);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  bool exited = false;
  int status = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  while (!fs::exists(ready) && std::chrono::steady_clock::now() < end) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (fs::exists(ready)) {
    const CommandResult r = RunCommand(
        "curl -sS --max-time 30 -H 'Content-Type: application/json' -d '{\"model\": "
        "\"tiny-coder\", \"prompt\": \"def main():\", \"max_tokens\": 3, \"ignore_eos\": true}' "
        "http://127.0.0.1:" +
            std::to_string(http_port) + "/v1/completions",
        60);
    const json j = json::parse(r.output, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << r.output;
    if (!j.is_discarded()) EXPECT_EQ(j["usage"]["completion_tokens"], 3) << r.output;
  } else {
    ADD_FAILURE() << "the installed server did not start:\n" << read_log();
  }
  if (!exited) {
    kill(pid, SIGTERM);
    const auto stop_end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < stop_end) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        exited = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!exited) {
      ADD_FAILURE() << "the installed server ignored SIGTERM:\n" << read_log();
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
    } else {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_log();
    }
  }
  kill(-pid, SIGKILL);  // the worker, if anything was left
  EXPECT_NE(read_log().find(prefix.string() + "/share/tpserve/models/tiny-coder"),
            std::string::npos)
      << "the bundled model was not served from the prefix:\n"
      << read_log();
  EXPECT_NE(read_log().find(prefix.string() + "/bin/tpserve-worker"), std::string::npos)
      << "the worker binary beside tpserve was not used:\n"
      << read_log();
  fs::remove_all(prefix);
}

}  // namespace
}  // namespace tpserve
