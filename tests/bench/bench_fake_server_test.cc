// `tpserve bench` against an in-process fake tpserve.v1.Inference server whose timings are
// known (first token 50 ms after the request, then one token every 20 ms): the measured
// percentiles must land on the known values; counts, error codes, open-loop pacing, chat history
// and seeding are checked exactly; --check-deterministic passes on answers that never change and
// names the request, position and kind of each answer that depends on the batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "tools/bench/bench_cmd.h"
#include "tools/bench/workload.h"
#include "tpserve/v1/inference.grpc.pb.h"

namespace tpserve {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kTtftMs = 50;
constexpr int kTokenMs = 20;
constexpr int kVocab = 1000;

class FakeInference final : public v1::Inference::Service {
 public:
  struct Seen {
    std::vector<int32_t> ids;
    std::string text;
    int max_new_tokens = 0;
    bool ignore_eos = false;
    Clock::time_point arrival;
    v1::SamplingOptions sampling;
    std::string cache_salt;
  };

  grpc::Status GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                            v1::ModelInfo* info) override {
    info->set_model("fake");
    info->set_vocab_size(kVocab);
    info->set_context_length(4096);
    info->set_tp(1);
    info->set_pp(1);
    info->add_rank_devices("cpu");
    info->set_has_tokenizer(true);
    // Made-up prefix cache counters: every prompt token is a query, every other one a hit.
    std::lock_guard<std::mutex> lock(mu_);
    info->mutable_prefix_cache()->set_enabled(true);
    info->mutable_prefix_cache()->set_queries(cache_queries_);
    info->mutable_prefix_cache()->set_hits(cache_queries_ / 2);
    info->mutable_prefix_cache()->set_evictions(cache_queries_ / 10);
    return grpc::Status::OK;
  }

  grpc::Status Detokenize(grpc::ServerContext*, const v1::DetokenizeRequest* req,
                          v1::DetokenizeResponse* resp) override {
    std::string text;
    for (int32_t id : req->token_ids()) absl::StrAppend(&text, "w", id, " ");
    resp->set_text(text);
    return grpc::Status::OK;
  }

  grpc::Status Generate(grpc::ServerContext*, const v1::GenerateRequest* req,
                        v1::GenerateResponse* resp) override {
    const Clock::time_point start = Clock::now();
    grpc::Status st = Record(*req, start);
    if (!st.ok()) return st;
    InFlight in_flight(this);
    const int n = req->stopping().max_new_tokens();
    std::this_thread::sleep_until(start + std::chrono::milliseconds(kTtftMs + kTokenMs * (n - 1)));
    for (int i = 0; i < n; ++i) AddToken(*req, i, resp);
    Finish(*req, n, resp);
    return grpc::Status::OK;
  }

  grpc::Status GenerateStream(grpc::ServerContext*, const v1::GenerateRequest* req,
                              grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    const Clock::time_point start = Clock::now();
    grpc::Status st = Record(*req, start);
    if (!st.ok()) return st;
    InFlight in_flight(this);
    const int n = req->stopping().max_new_tokens();
    for (int i = 0; i < n; ++i) {
      // Absolute schedule: one late write does not delay the following tokens.
      std::this_thread::sleep_until(start + std::chrono::milliseconds(kTtftMs + kTokenMs * i));
      v1::GenerateResponse msg;
      AddToken(*req, i, &msg);
      msg.set_text(absl::StrCat("w", Token(i), " "));
      if (i == n - 1) Finish(*req, n, &msg);  // the last token rides on the final message
      writer->Write(msg);
    }
    return grpc::Status::OK;
  }

  void FailWith(const std::string& request_id, grpc::StatusCode code) {
    std::lock_guard<std::mutex> lock(mu_);
    failures_[request_id] = code;
  }
  std::map<std::string, Seen> seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }
  // Every request in arrival order (seen() keeps the last of each request id).
  std::vector<std::pair<std::string, Seen>> arrivals() {
    std::lock_guard<std::mutex> lock(mu_);
    return arrivals_;
  }
  // The answer of `request_id` changes at `position` when another request is in flight then: its
  // token (+1), or with `logprob_only` the last bit of its logprob.
  void PerturbWhenBatched(const std::string& request_id, int position, bool logprob_only) {
    std::lock_guard<std::mutex> lock(mu_);
    perturb_[request_id] = {position, logprob_only};
  }
  static int32_t Token(int i) { return 500 + i; }

 private:
  struct InFlight {
    explicit InFlight(FakeInference* f) : f(f) { ++f->in_flight_; }
    ~InFlight() { --f->in_flight_; }
    FakeInference* f;
  };

  // Token i of `req`, with its logprobs when asked: the token's -0.25 (i + 1), then alternatives
  // Token(i) + k at 1 less each.
  void AddToken(const v1::GenerateRequest& req, int i, v1::GenerateResponse* msg) {
    int32_t token = Token(i);
    float logprob = -0.25f * static_cast<float>(i + 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = perturb_.find(req.request_id());
      if (it != perturb_.end() && it->second.first == i && in_flight_ > 1) {
        if (it->second.second) {
          logprob = std::nextafter(logprob, 0.0f);
        } else {
          token += 1;
        }
      }
    }
    msg->add_token_ids(token);
    if (!req.sampling().has_logprobs()) return;
    v1::TokenLogprobs* lp = msg->add_logprobs();
    lp->set_token_id(token);
    lp->set_logprob(logprob);
    for (int k = 0; k < req.sampling().logprobs(); ++k) {
      v1::TokenLogprob* alt = lp->add_top_logprobs();
      alt->set_token_id(token + k);
      alt->set_logprob(logprob - static_cast<float>(k));
    }
  }

  grpc::Status Record(const v1::GenerateRequest& req, Clock::time_point arrival) {
    std::lock_guard<std::mutex> lock(mu_);
    Seen s;
    s.ids.assign(req.token_ids().ids().begin(), req.token_ids().ids().end());
    s.text = req.text();
    s.max_new_tokens = req.stopping().max_new_tokens();
    s.ignore_eos = req.stopping().ignore_eos();
    s.arrival = arrival;
    s.sampling = req.sampling();
    s.cache_salt = req.cache_salt();
    cache_queries_ += static_cast<int64_t>(s.ids.size());
    seen_[req.request_id()] = s;
    arrivals_.emplace_back(req.request_id(), s);
    auto it = failures_.find(req.request_id());
    if (it != failures_.end()) return grpc::Status(it->second, "injected failure");
    if (s.max_new_tokens < 1) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "max_new");
    return grpc::Status::OK;
  }
  static void Finish(const v1::GenerateRequest& req, int n, v1::GenerateResponse* msg) {
    msg->set_request_id(req.request_id());
    msg->set_finished(true);
    msg->set_finish_reason(v1::FINISH_REASON_LENGTH);
    msg->set_prompt_tokens(req.has_token_ids() ? req.token_ids().ids_size()
                                               : static_cast<int>(req.text().size()));
    msg->set_output_tokens(n);
    msg->mutable_timings()->set_time_to_first_token_seconds(kTtftMs / 1e3);
  }

  std::mutex mu_;
  std::map<std::string, grpc::StatusCode> failures_;
  std::map<std::string, Seen> seen_;
  std::vector<std::pair<std::string, Seen>> arrivals_;
  std::map<std::string, std::pair<int, bool>> perturb_;
  std::atomic<int> in_flight_{0};
  int64_t cache_queries_ = 0;
};

class BenchFakeServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now()); }

  // Runs `tpserve bench` with `args` (+ --server, --json, --no-progress); returns the JSON.
  nlohmann::json Bench(std::vector<std::string> args, absl::Status* status = nullptr) {
    const std::string json =
        (std::filesystem::path(::testing::TempDir()) /
         absl::StrCat("bench_", ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                      "_", runs_++, ".json"))
            .string();
    args.insert(args.end(), {"--server", address_, "--json", json, "--no-progress"});
    absl::Status s = RunBenchCommand(args);
    if (status != nullptr) {
      *status = s;
    } else {
      EXPECT_TRUE(s.ok()) << s;
    }
    std::ifstream in(json);
    if (!in) return nlohmann::json();
    return nlohmann::json::parse(in);
  }

  FakeInference service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int runs_ = 0;
};

// Tolerances: the fake server sleeps to an absolute schedule, so no measured time can be early
// (lower bounds are the known values, less 1 ms of clock granularity); late wake-ups on a
// loaded 2-core CI machine are a few ms typically, so medians get +12 ms and p90 +30 ms.
TEST_F(BenchFakeServerTest, ClosedLoopCountsAndKnownLatencies) {
  constexpr int kRequests = 12, kOut = 10, kPrompt = 32;
  const nlohmann::json j =
      Bench({"--concurrency", "4", "--num-requests", std::to_string(kRequests), "--prompt-len",
             std::to_string(kPrompt), "--output-len", std::to_string(kOut), "--warmup", "0"});
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(j["num_requests"], kRequests);
  EXPECT_EQ(j["completed"], kRequests);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_TRUE(j["errors"].empty());
  EXPECT_EQ(j["total_output_tokens"], kRequests * kOut);
  EXPECT_EQ(j["total_input_tokens"], kRequests * kPrompt);
  EXPECT_EQ(j["output_length_mismatches"], 0);
  EXPECT_EQ(j["model"], "fake");
  EXPECT_EQ(j["config"]["mode"], "closed");
  EXPECT_EQ(j["config"]["concurrency"], 4);

  const auto& ttft = j["ttft_ms"];
  EXPECT_EQ(ttft["count"], kRequests);
  EXPECT_GE(ttft["min"].get<double>(), kTtftMs - 1);
  EXPECT_LE(ttft["median"].get<double>(), kTtftMs + 12);
  EXPECT_LE(ttft["p90"].get<double>(), kTtftMs + 30);
  const auto& itl = j["itl_ms"];
  EXPECT_EQ(itl["count"], kRequests * (kOut - 1));  // one token per message
  EXPECT_NEAR(itl["median"].get<double>(), kTokenMs, 5);
  EXPECT_LE(itl["p90"].get<double>(), kTokenMs + 30);
  const auto& tpot = j["tpot_ms"];
  EXPECT_EQ(tpot["count"], kRequests);
  // Absolute schedule: e2e - ttft = 9 * 20 ms less the first token's lateness.
  EXPECT_NEAR(tpot["mean"].get<double>(), kTokenMs, 3);
  const auto& e2e = j["e2e_ms"];
  EXPECT_GE(e2e["min"].get<double>(), kTtftMs + kTokenMs * (kOut - 1) - 1);
  EXPECT_LE(e2e["median"].get<double>(), kTtftMs + kTokenMs * (kOut - 1) + 12);
  // 12 requests of ~230 ms on 4 clients: 3 waves, >= 690 ms.
  EXPECT_GE(j["duration_s"].get<double>(), 3 * (kTtftMs + kTokenMs * (kOut - 1)) / 1e3 - 0.003);
  EXPECT_NEAR(j["request_throughput"].get<double>(), kRequests / j["duration_s"].get<double>(),
              1e-9);
  EXPECT_NEAR(j["server_ttft_ms"]["median"].get<double>(), kTtftMs, 1e-9);

  // What the server saw: ignore_eos, max_new_tokens, valid ids of the right length.
  const auto seen = service_.seen();
  ASSERT_EQ(seen.size(), static_cast<size_t>(kRequests));
  for (const auto& [id, s] : seen) {
    EXPECT_TRUE(s.ignore_eos) << id;
    EXPECT_EQ(s.max_new_tokens, kOut);
    ASSERT_EQ(s.ids.size(), static_cast<size_t>(kPrompt));
    for (int32_t t : s.ids) {
      EXPECT_GE(t, 0);
      EXPECT_LT(t, kVocab);
    }
  }
}

TEST_F(BenchFakeServerTest, ErrorsAreCountedByCode) {
  service_.FailWith("bench-3", grpc::StatusCode::RESOURCE_EXHAUSTED);
  service_.FailWith("bench-7", grpc::StatusCode::RESOURCE_EXHAUSTED);
  service_.FailWith("bench-5", grpc::StatusCode::UNAVAILABLE);
  const std::vector<std::string> args = {"--concurrency", "3", "--num-requests", "10",
                                         "--prompt-len",  "8", "--output-len",   "3",
                                         "--warmup",      "0"};
  absl::Status status;
  nlohmann::json j = Bench(args, &status);
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_NE(status.message().find("3 of 10 requests failed"), std::string::npos) << status;
  EXPECT_EQ(j["completed"], 7);
  EXPECT_EQ(j["failed"], 3);
  EXPECT_EQ(j["errors"]["RESOURCE_EXHAUSTED"], 2);
  EXPECT_EQ(j["errors"]["UNAVAILABLE"], 1);
  EXPECT_EQ(j["total_output_tokens"], 21);
  EXPECT_EQ(j["ttft_ms"]["count"], 7);

  std::vector<std::string> allow = args;
  allow.push_back("--allow-errors");
  j = Bench(allow, &status);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(j["failed"], 3);
}

TEST_F(BenchFakeServerTest, OpenLoopFollowsThePoissonSchedule) {
  constexpr int kRequests = 30;
  constexpr double kRate = 25;
  const nlohmann::json j =
      Bench({"--request-rate", "25", "--num-requests", std::to_string(kRequests), "--prompt-len",
             "4", "--output-len", "2", "--warmup", "0", "--seed", "9"});
  EXPECT_EQ(j["completed"], kRequests);
  EXPECT_EQ(j["config"]["mode"], "open");
  EXPECT_EQ(j["config"]["request_rate"], kRate);
  const std::vector<double> planned = bench::PoissonArrivals(kRequests, kRate, 9);
  const auto seen = service_.seen();
  ASSERT_EQ(seen.size(), static_cast<size_t>(kRequests));
  const Clock::time_point t0 = seen.at("bench-0").arrival;
  std::vector<double> offset;  // arrival - planned time, from the first arrival
  for (int i = 0; i < kRequests; ++i) {
    const double at =
        std::chrono::duration<double>(seen.at(absl::StrCat("bench-", i)).arrival - t0).count();
    offset.push_back(at - planned[i]);
  }
  // The schedule as a whole may start late or early against bench-0's arrival (the first
  // request also opens the channel): deviations are taken from the median offset, so one slow
  // first request does not count against every other one.
  std::vector<double> sorted = offset;
  std::sort(sorted.begin(), sorted.end());
  const double shift = sorted[kRequests / 2];
  std::vector<double> lateness;
  for (double o : offset) lateness.push_back(std::abs(o - shift));
  std::sort(lateness.begin(), lateness.end());
  // Requests are sent at their planned times (no cap on requests in flight): the median
  // deviation is a few ms of scheduling, the worst under 100 ms on a loaded machine.
  EXPECT_LT(lateness[kRequests / 2], 0.010);
  EXPECT_LT(lateness.back(), 0.100);
  // The run lasts at least until the last planned arrival + one request.
  EXPECT_GE(j["duration_s"].get<double>(), planned.back() + (kTtftMs + kTokenMs) / 1e3 - 0.003);
}

TEST_F(BenchFakeServerTest, ChatResendsTheGrowingHistory) {
  const nlohmann::json j =
      Bench({"--turns", "3", "--num-conversations", "3", "--concurrency", "2", "--prompt-len", "20",
             "--user-turn-len", "5", "--output-len", "4", "--warmup", "0"});
  EXPECT_EQ(j["num_requests"], 9);
  EXPECT_EQ(j["completed"], 9);
  // Per conversation: 20 + (20 + 4 + 5) + (29 + 4 + 5) = 87 prompt tokens.
  EXPECT_EQ(j["total_input_tokens"], 3 * 87);
  EXPECT_EQ(j["total_output_tokens"], 9 * 4);
  const auto seen = service_.seen();
  ASSERT_EQ(seen.size(), 9u);
  for (int c = 0; c < 3; ++c) {
    const auto& t0 = seen.at(absl::StrCat("bench-", 3 * c)).ids;
    const auto& t1 = seen.at(absl::StrCat("bench-", 3 * c + 1)).ids;
    const auto& t2 = seen.at(absl::StrCat("bench-", 3 * c + 2)).ids;
    ASSERT_EQ(t0.size(), 20u);
    ASSERT_EQ(t1.size(), 29u);
    ASSERT_EQ(t2.size(), 38u);
    // Turn 1 = turn 0's prompt + turn 0's output + a new user turn; same for turn 2.
    EXPECT_TRUE(std::equal(t0.begin(), t0.end(), t1.begin()));
    for (int k = 0; k < 4; ++k) EXPECT_EQ(t1[20 + k], FakeInference::Token(k));
    EXPECT_TRUE(std::equal(t1.begin(), t1.end(), t2.begin()));
    for (int k = 0; k < 4; ++k) EXPECT_EQ(t2[29 + k], FakeInference::Token(k));
  }
}

TEST_F(BenchFakeServerTest, SameSeedSamePromptsAndLengths) {
  const std::vector<std::string> args = {"--concurrency",
                                         "2",
                                         "--num-requests",
                                         "6",
                                         "--prompt-len-dist",
                                         "uniform:4:30",
                                         "--output-len-dist",
                                         "uniform:1:5",
                                         "--warmup",
                                         "0",
                                         "--seed",
                                         "3"};
  const nlohmann::json a = Bench(args);
  const auto first = service_.seen();
  const nlohmann::json b = Bench(args);
  const auto second = service_.seen();
  ASSERT_EQ(first.size(), 6u);
  std::set<size_t> lengths;
  for (const auto& [id, s] : first) {
    EXPECT_EQ(s.ids, second.at(id).ids) << id;
    EXPECT_EQ(s.max_new_tokens, second.at(id).max_new_tokens) << id;
    lengths.insert(s.ids.size());
  }
  EXPECT_GT(lengths.size(), 1u);  // drawn, not fixed
  EXPECT_EQ(a["total_output_tokens"], b["total_output_tokens"]);
  EXPECT_EQ(a["total_input_tokens"], b["total_input_tokens"]);
  std::vector<std::string> other = args;
  other.back() = "4";
  Bench(other);
  EXPECT_NE(service_.seen().at("bench-0").ids, first.at("bench-0").ids);
}

TEST_F(BenchFakeServerTest, UnaryAndTextPrompts) {
  const nlohmann::json j = Bench({"--no-stream", "--prompt-kind", "text", "--num-requests", "2",
                                  "--prompt-len", "3", "--output-len", "4", "--warmup", "1"});
  EXPECT_EQ(j["completed"], 2);
  EXPECT_EQ(j["ttft_ms"]["count"], 0);  // no TTFT without streaming
  EXPECT_GE(j["e2e_ms"]["min"].get<double>(), kTtftMs + 3 * kTokenMs - 1);
  const auto seen = service_.seen();
  EXPECT_EQ(seen.size(), 3u);  // with the warm-up request
  const std::string& text = seen.at("bench-0").text;
  EXPECT_EQ(std::count(text.begin(), text.end(), 'w'), 3) << text;
}

TEST_F(BenchFakeServerTest, PresetsAndBadFlags) {
  // The latency preset's shape, shortened: 512-token prompts, one client.
  const nlohmann::json j =
      Bench({"--preset", "latency", "--num-requests", "2", "--output-len", "2", "--warmup", "0"});
  EXPECT_EQ(j["preset"], "latency");
  EXPECT_EQ(j["config"]["prompt_len"], "512");
  EXPECT_EQ(j["config"]["concurrency"], 1);
  EXPECT_EQ(j["total_input_tokens"], 2 * 512);

  // The chat preset, shortened: its conversations x turns, its concurrency unless overridden.
  const nlohmann::json chat =
      Bench({"--preset", "chat", "--num-conversations", "2", "--turns", "2", "--prompt-len", "8",
             "--user-turn-len", "4", "--output-len", "3", "--warmup", "0"});
  EXPECT_EQ(chat["preset"], "chat");
  EXPECT_EQ(chat["num_requests"], 4);
  EXPECT_EQ(chat["completed"], 4);
  EXPECT_EQ(chat["config"]["concurrency"], 8);
  EXPECT_EQ(chat["total_input_tokens"], 2 * (8 + 8 + 3 + 4));
  // The hit rate over the measured run: the difference of the server's counters.
  EXPECT_EQ(chat["prefix_cache"]["enabled"], true);
  EXPECT_EQ(chat["prefix_cache"]["queries"], 2 * (8 + 8 + 3 + 4));
  EXPECT_EQ(chat["prefix_cache"]["hits"], 2 * (8 + 8 + 3 + 4) / 2);
  EXPECT_DOUBLE_EQ(chat["prefix_cache"]["hit_rate"].get<double>(), 0.5);

  // The shared-prefix preset, shortened: one 40-token prefix in front of every prompt. With a
  // warm-up request, whose prompt tokens are not in the run's counters.
  const nlohmann::json shared =
      Bench({"--preset", "shared-prefix", "--num-requests", "3", "--concurrency", "2",
             "--shared-prefix-len", "40", "--prompt-len", "6", "--output-len", "2"});
  EXPECT_EQ(shared["preset"], "shared-prefix");
  EXPECT_EQ(shared["config"]["shared_prefix_len"], 40);
  EXPECT_EQ(shared["total_input_tokens"], 3 * 46);
  EXPECT_EQ(shared["prefix_cache"]["queries"], 3 * 46);
  const auto seen = service_.seen();
  ASSERT_EQ(seen.at("bench-0").ids.size(), 46u);
  EXPECT_EQ(
      std::vector<int32_t>(seen.at("bench-0").ids.begin(), seen.at("bench-0").ids.begin() + 40),
      std::vector<int32_t>(seen.at("bench-2").ids.begin(), seen.at("bench-2").ids.begin() + 40));

  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--prompt-len-dist", "zipf:1:2"},
        std::vector<std::string>{"--preset", "nope"},
        std::vector<std::string>{"--request-rate", "-1"},
        std::vector<std::string>{"--concurrency", "0"},
        std::vector<std::string>{"--prompt-kind", "bytes"},
        std::vector<std::string>{"--prompt-len", "4000", "--output-len", "200"},
        std::vector<std::string>{"--preset", "chat", "--num-requests", "5"},
        std::vector<std::string>{"--user-turn-len", "5"},
        std::vector<std::string>{"--shared-prefix-len", "-1"},
        std::vector<std::string>{"--shared-prefix-len", "4000"},
        std::vector<std::string>{"--bogus"}}) {
    absl::Status status;
    Bench(bad, &status);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad[0] << ": " << status;
  }
}

TEST_F(BenchFakeServerTest, CheckDeterministicPassesOnUnchangingAnswers) {
  constexpr int kRequests = 6, kOut = 6;
  const nlohmann::json j =
      Bench({"--check-deterministic", "--num-requests", std::to_string(kRequests), "--prompt-len",
             "8", "--output-len", std::to_string(kOut), "--logprobs", "2", "--temperature", "0.5",
             "--sampling-seed", "10"});
  ASSERT_FALSE(j.is_null());
  const nlohmann::json& c = j["deterministic_check"];
  EXPECT_EQ(c["passed"], true);
  EXPECT_EQ(c["requests"], kRequests);
  EXPECT_EQ(c["identical"], kRequests);
  EXPECT_EQ(c["differing"], 0);
  EXPECT_EQ(c["failed"], 0);
  EXPECT_EQ(c["logprob_tokens"], kRequests * kOut);
  EXPECT_EQ(c["sampled"]["requests"], 3);
  EXPECT_EQ(c["greedy"]["identical"], 3);
  EXPECT_TRUE(c["differences"].empty());
  EXPECT_EQ(c["first_difference"]["count"], 0);
  EXPECT_EQ(c["concurrent"]["completed"], kRequests);
  EXPECT_EQ(c["sequential"]["completed"], kRequests);
  EXPECT_EQ(j["config"]["concurrency"], kRequests);
  EXPECT_EQ(j["config"]["sampling"]["logprobs"], 2);

  // The warm-up, then every request at once, then one at a time, each run with its own salt.
  const auto arrivals = service_.arrivals();
  ASSERT_EQ(arrivals.size(), 1u + 2 * kRequests);
  EXPECT_EQ(arrivals[0].first, "bench-warmup-0");
  const std::string salt = arrivals[1].second.cache_salt;  // "tpserve-bench-check-<random>-"
  ASSERT_TRUE(salt.starts_with("tpserve-bench-check-") && salt.ends_with("-concurrent")) << salt;
  const std::string base = salt.substr(0, salt.size() - std::string("concurrent").size());
  EXPECT_EQ(arrivals[0].second.cache_salt, salt + "-warmup");
  Clock::time_point first = arrivals[1].second.arrival, last = first;
  for (int i = 1; i <= kRequests; ++i) {
    EXPECT_EQ(arrivals[i].second.cache_salt, salt);
    first = std::min(first, arrivals[i].second.arrival);
    last = std::max(last, arrivals[i].second.arrival);
  }
  // All in flight together: the last arrived before the first could have ended.
  EXPECT_LT(last - first, std::chrono::milliseconds(kTtftMs + kTokenMs * (kOut - 1)));
  for (int i = kRequests + 1; i < 1 + 2 * kRequests; ++i) {
    EXPECT_EQ(arrivals[i].second.cache_salt, base + "sequential");
    if (i > kRequests + 1) {  // one at a time: each after the previous one's last token
      EXPECT_GE(arrivals[i].second.arrival - arrivals[i - 1].second.arrival,
                std::chrono::milliseconds(kTtftMs + kTokenMs * (kOut - 1)));
    }
  }
  // Even requests sample at the given temperature, odd ones are greedy; seeds 10 + index.
  const auto seen = service_.seen();
  for (int i = 0; i < kRequests; ++i) {
    const v1::SamplingOptions& s = seen.at(absl::StrCat("bench-", i)).sampling;
    EXPECT_FLOAT_EQ(s.temperature(), i % 2 == 0 ? 0.5f : 0.0f) << i;
    EXPECT_EQ(s.seed(), 10u + static_cast<uint64_t>(i)) << i;
    EXPECT_EQ(s.logprobs(), 2) << i;
  }
  // Another check draws other salts: nothing the first one cached is found.
  Bench({"--check-deterministic", "--num-requests", "2", "--prompt-len", "8", "--output-len", "2",
         "--warmup", "0"});
  EXPECT_NE(service_.arrivals().back().second.cache_salt.substr(0, base.size()), base);
}

TEST_F(BenchFakeServerTest, CheckDeterministicNamesAnswersThatDependOnTheBatch) {
  // bench-3's token 2 and bench-1's logprob 4 change while other requests are in flight.
  service_.PerturbWhenBatched("bench-3", 2, /*logprob_only=*/false);
  service_.PerturbWhenBatched("bench-1", 4, /*logprob_only=*/true);
  absl::Status status;
  const nlohmann::json j = Bench({"--check-deterministic", "--num-requests", "6", "--prompt-len",
                                  "8", "--output-len", "6", "--logprobs", "1", "--warmup", "0"},
                                 &status);
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_NE(status.message().find("2 of 6 answers differ"), std::string::npos) << status;
  ASSERT_FALSE(j.is_null());
  const nlohmann::json& c = j["deterministic_check"];
  EXPECT_EQ(c["passed"], false);
  EXPECT_EQ(c["identical"], 4);
  EXPECT_EQ(c["differing"], 2);
  ASSERT_EQ(c["differences"].size(), 2u);
  const nlohmann::json& lp = c["differences"][0];
  EXPECT_EQ(lp["index"], 1);
  EXPECT_EQ(lp["sampling"], "greedy");
  EXPECT_EQ(lp["divergence"], "logprobs");
  EXPECT_EQ(lp["first_difference"], 4);
  EXPECT_EQ(lp["first_token_difference"], -1);
  const nlohmann::json& tok = c["differences"][1];
  EXPECT_EQ(tok["index"], 3);
  EXPECT_EQ(tok["divergence"], "tokens");
  EXPECT_EQ(tok["first_difference"], 2);
  EXPECT_EQ(tok["first_token_difference"], 2);
  // The ids around the difference: positions 0..5 at once (one changed), alone.
  EXPECT_EQ(
      tok["concurrent_ids_around"],
      nlohmann::json({FakeInference::Token(0), FakeInference::Token(1), FakeInference::Token(2) + 1,
                      FakeInference::Token(3), FakeInference::Token(4), FakeInference::Token(5)}));
  EXPECT_EQ(tok["sequential_ids_around"][2], FakeInference::Token(2));
  EXPECT_EQ(c["first_difference"]["min"], 2);
  EXPECT_EQ(c["first_difference"]["max"], 4);
  EXPECT_EQ(c["ids_differing"], 1);
  EXPECT_EQ(c["first_token_difference"]["median"], 2);
}

TEST_F(BenchFakeServerTest, CheckDeterministicFlags) {
  // A preset's concurrency is the number of requests sent at once.
  const nlohmann::json j = Bench({"--check-deterministic", "--preset", "batch32", "--prompt-len",
                                  "4", "--output-len", "1", "--warmup", "0"});
  EXPECT_EQ(j["deterministic_check"]["requests"], 32);
  EXPECT_EQ(j["deterministic_check"]["passed"], true);
  EXPECT_EQ(j["config"]["prompt_len"], "4");
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--check-deterministic", "--concurrency", "2"},
        std::vector<std::string>{"--check-deterministic", "--request-rate", "3"},
        std::vector<std::string>{"--check-deterministic", "--temperature", "0"},
        std::vector<std::string>{"--check-deterministic", "--preset", "chat"},
        std::vector<std::string>{"--logprobs", "21"}}) {
    absl::Status status;
    Bench(bad, &status);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad[1] << ": " << status;
  }
}

TEST(BenchCommandTest, UnreachableServerFailsWithinTheDeadline) {
  // Nothing listens on port 1: GetModelInfo waits for the channel up to its 60 s deadline is too
  // long for a test, so a closed port must fail fast enough (wait_for_ready retries) -- bounded.
  const auto start = Clock::now();
  absl::Status s =
      RunBenchCommand({"--server", "127.0.0.1:1", "--no-progress", "--info-timeout", "2"});
  EXPECT_FALSE(s.ok());
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10);
  EXPECT_NE(s.message().find("127.0.0.1:1"), std::string::npos) << s;
}

}  // namespace
}  // namespace tpserve
