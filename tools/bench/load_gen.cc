// Sends the planned requests over gRPC (sync API, one thread per in-flight request) and measures
// them on the client side (see load_gen.h).
#include "tools/bench/load_gen.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "tpserve/v1/inference.grpc.pb.h"

namespace tpserve::bench {
namespace {

using Clock = std::chrono::steady_clock;

std::string CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return absl::StrCat("CODE_", static_cast<int>(code));
  }
}

std::chrono::system_clock::time_point Deadline(double seconds) {
  return std::chrono::system_clock::now() +
         std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// What one request sends (the prompt already includes a chat's history).
struct Outgoing {
  std::vector<int32_t> ids;
  std::string text;
  bool use_text = false;
  int64_t max_new_tokens = 0;
  std::string request_id;
  int64_t seed_offset = 0;
  // Sent as it is when set (LoadOptions::request_sampling); else the options' sampling.
  const v1::SamplingOptions* sampling = nullptr;
  std::string cache_salt;
};

struct Answer {
  RequestRecord record;
  std::vector<int32_t> output_ids;
  std::vector<OutputLogprobs> output_logprobs;
  std::string output_text;
};

void AppendLogprobs(const v1::GenerateResponse& msg, std::vector<OutputLogprobs>* out) {
  for (const v1::TokenLogprobs& t : msg.logprobs()) {
    OutputLogprobs& o = out->emplace_back();
    o.logprob = t.logprob();
    for (const v1::TokenLogprob& alt : t.top_logprobs()) {
      o.top_ids.push_back(alt.token_id());
      o.top_logprobs.push_back(alt.logprob());
    }
  }
}

Answer Send(v1::Inference::Stub& stub, const LoadOptions& o, const Outgoing& out,
            Clock::time_point run_start) {
  v1::GenerateRequest req;
  req.set_request_id(out.request_id);
  if (out.use_text) {
    req.set_text(out.text);
  } else {
    req.mutable_token_ids()->mutable_ids()->Assign(out.ids.begin(), out.ids.end());
  }
  if (out.sampling != nullptr) {
    *req.mutable_sampling() = *out.sampling;
  } else {
    *req.mutable_sampling() = o.sampling;
    if (o.sampling.has_seed()) {
      req.mutable_sampling()->set_seed(o.sampling.seed() + static_cast<uint64_t>(out.seed_offset));
    }
  }
  req.set_cache_salt(out.cache_salt);
  req.mutable_stopping()->set_max_new_tokens(static_cast<int32_t>(out.max_new_tokens));
  req.mutable_stopping()->set_ignore_eos(o.ignore_eos);

  Answer a;
  RequestRecord& r = a.record;
  r.max_new_tokens = out.max_new_tokens;
  grpc::ClientContext ctx;
  o.server.Authorize(&ctx);
  ctx.set_deadline(Deadline(o.timeout_s));
  v1::GenerateResponse final;
  bool have_final = false;
  const Clock::time_point start = Clock::now();
  r.start_s = Seconds(run_start, start);
  grpc::Status status;
  if (o.stream) {
    auto reader = stub.GenerateStream(&ctx, req);
    v1::GenerateResponse msg;
    Clock::time_point last;
    bool first = true;
    while (reader->Read(&msg)) {
      const Clock::time_point now = Clock::now();
      if (msg.token_ids_size() > 0) {
        if (first) {
          r.ttft_s = Seconds(start, now);
          first = false;
        } else {
          r.itl_s.push_back(Seconds(last, now));
        }
        last = now;
        a.output_ids.insert(a.output_ids.end(), msg.token_ids().begin(), msg.token_ids().end());
      }
      AppendLogprobs(msg, &a.output_logprobs);
      a.output_text += msg.text();
      if (msg.finished()) {
        final = msg;
        have_final = true;
      }
    }
    status = reader->Finish();
  } else {
    status = stub.Generate(&ctx, req, &final);
    have_final = status.ok();
    a.output_ids.assign(final.token_ids().begin(), final.token_ids().end());
    AppendLogprobs(final, &a.output_logprobs);
    a.output_text = final.text();
  }
  r.e2e_s = Seconds(start, Clock::now());
  if (!status.ok()) {
    r.ok = false;
    r.error_code = CodeName(status.error_code());
    r.error_message = status.error_message();
  } else if (!have_final) {
    r.ok = false;
    r.error_code = "NO_FINAL_MESSAGE";
    r.error_message = "the stream ended without a message with `finished` set";
  } else {
    r.ok = true;
  }
  if (have_final) {
    r.prompt_tokens = final.prompt_tokens();
    r.output_tokens = final.output_tokens();
    r.server_ttft_s = final.timings().time_to_first_token_seconds();
    r.server_queued_s = final.timings().queued_seconds();
  } else {
    r.output_tokens = static_cast<int64_t>(a.output_ids.size());
  }
  if (o.keep_outputs) {
    r.output_ids = a.output_ids;
    r.output_logprobs = a.output_logprobs;
  }
  return a;
}

// A unit of work: one request, or the turns of one conversation (sent in order).
struct Unit {
  std::vector<size_t> plan_indices;
  double arrival_s = 0;
};

class Runner {
 public:
  Runner(const LoadOptions& o, const std::vector<PlannedRequest>& plan,
         std::vector<std::string> texts, Progress* progress)
      : o_(o),
        plan_(plan),
        texts_(std::move(texts)),
        progress_(progress),
        stub_(v1::Inference::NewStub(o.server.Channel())),
        records_(plan.size()) {}

  std::vector<Unit> Units() const {
    std::vector<Unit> units;
    for (size_t i = 0; i < plan_.size(); ++i) {
      if (plan_[i].conversation >= 0 && plan_[i].turn > 0 && !units.empty()) {
        units.back().plan_indices.push_back(i);
      } else {
        units.push_back({{i}, plan_[i].arrival_s});
      }
    }
    return units;
  }

  void Warmup() {
    for (int64_t i = 0; i < o_.warmup && !plan_.empty(); ++i) {
      const size_t k = static_cast<size_t>(i) % plan_.size();
      Outgoing out;
      out.ids = plan_[k].prompt;
      out.use_text = o_.text_prompts;
      if (o_.text_prompts) out.text = texts_[k];
      out.max_new_tokens = plan_[k].max_new_tokens;
      out.request_id = absl::StrCat("bench-warmup-", i);
      out.sampling = SamplingOf(k);
      out.cache_salt = o_.cache_salt.empty() ? "" : o_.cache_salt + "-warmup";
      Send(*stub_, o_, out, Clock::now());
    }
  }

  void RunUnit(const Unit& unit, Clock::time_point run_start) {
    std::vector<int32_t> history_ids;
    std::string history_text;
    bool broken = false;
    for (size_t k : unit.plan_indices) {
      const PlannedRequest& p = plan_[k];
      RequestRecord& rec = records_[k];
      if (broken) {
        rec.index = p.index;
        rec.conversation = p.conversation;
        rec.turn = p.turn;
        rec.max_new_tokens = p.max_new_tokens;
        rec.ok = false;
        rec.error_code = "SKIPPED";
        rec.error_message = "an earlier turn of this conversation failed";
        Count(rec);
        continue;
      }
      Outgoing out;
      out.ids = history_ids;
      out.ids.insert(out.ids.end(), p.prompt.begin(), p.prompt.end());
      out.use_text = o_.text_prompts;
      if (o_.text_prompts) out.text = history_text + texts_[k];
      out.max_new_tokens = p.max_new_tokens;
      out.request_id = absl::StrCat("bench-", p.index);
      out.seed_offset = p.index;
      out.sampling = SamplingOf(k);
      out.cache_salt = o_.cache_salt;
      Answer a = Send(*stub_, o_, out, run_start);
      a.record.index = p.index;
      a.record.conversation = p.conversation;
      a.record.turn = p.turn;
      rec = std::move(a.record);
      Count(rec);
      if (!rec.ok) {
        broken = true;
        continue;
      }
      history_ids = std::move(out.ids);
      history_ids.insert(history_ids.end(), a.output_ids.begin(), a.output_ids.end());
      if (o_.text_prompts) history_text = out.text + a.output_text;
    }
  }

  LoadResult Run() {
    Warmup();
    if (o_.before_run) o_.before_run();
    const std::vector<Unit> units = Units();
    const Clock::time_point start = Clock::now();
    if (!o_.open_loop) {
      std::atomic<size_t> next{0};
      const int64_t clients = std::max<int64_t>(1, o_.concurrency);
      std::vector<std::thread> threads;
      for (int64_t c = 0; c < clients; ++c) {
        threads.emplace_back([&] {
          for (size_t u; (u = next.fetch_add(1)) < units.size();) RunUnit(units[u], start);
        });
      }
      for (auto& t : threads) t.join();
    } else {
      std::mutex mu;
      std::condition_variable cv;
      int64_t in_flight = 0;
      std::vector<std::thread> threads;
      for (const Unit& unit : units) {
        std::this_thread::sleep_until(
            start + std::chrono::microseconds(static_cast<int64_t>(unit.arrival_s * 1e6)));
        if (o_.concurrency > 0) {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return in_flight < o_.concurrency; });
          ++in_flight;
        }
        threads.emplace_back([&, unit_ptr = &unit] {
          RunUnit(*unit_ptr, start);
          if (o_.concurrency > 0) {
            std::lock_guard<std::mutex> lock(mu);
            --in_flight;
            cv.notify_all();
          }
        });
      }
      for (auto& t : threads) t.join();
    }
    LoadResult result;
    result.duration_s = Seconds(start, Clock::now());
    result.records = std::move(records_);
    return result;
  }

 private:
  const v1::SamplingOptions* SamplingOf(size_t plan_index) const {
    return plan_index < o_.request_sampling.size() ? &o_.request_sampling[plan_index] : nullptr;
  }

  void Count(const RequestRecord& r) {
    if (progress_ == nullptr) return;
    progress_->output_tokens += r.ok ? r.output_tokens : 0;
    if (!r.ok) ++progress_->failed;
    ++progress_->done;
  }

  const LoadOptions& o_;
  const std::vector<PlannedRequest>& plan_;
  std::vector<std::string> texts_;
  Progress* progress_;
  std::unique_ptr<v1::Inference::Stub> stub_;
  std::vector<RequestRecord> records_;
};

}  // namespace

absl::StatusOr<v1::ModelInfo> FetchModelInfo(const ServerEndpoint& server, double timeout_s) {
  auto stub = v1::Inference::NewStub(server.Channel());
  grpc::ClientContext ctx;
  server.Authorize(&ctx);
  ctx.set_deadline(Deadline(timeout_s));
  ctx.set_wait_for_ready(true);  // the server may still be starting
  v1::ModelInfo info;
  grpc::Status s = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("GetModelInfo on ", server.address, ": ", s.error_message()));
  }
  return info;
}

absl::StatusOr<LoadResult> RunLoad(const LoadOptions& options,
                                   const std::vector<PlannedRequest>& plan, Progress* progress) {
  std::vector<std::string> texts;
  if (options.text_prompts) {
    // The prompts as text: the server's detokenization of the random ids, fetched before the
    // measured run.
    auto stub = v1::Inference::NewStub(options.server.Channel());
    for (const PlannedRequest& p : plan) {
      grpc::ClientContext ctx;
      options.server.Authorize(&ctx);
      ctx.set_deadline(Deadline(30));
      v1::DetokenizeRequest req;
      req.mutable_token_ids()->Assign(p.prompt.begin(), p.prompt.end());
      req.set_skip_special_tokens(true);
      v1::DetokenizeResponse resp;
      grpc::Status s = stub->Detokenize(&ctx, req, &resp);
      if (!s.ok()) {
        return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                            absl::StrCat("--prompt-kind text: Detokenize on ",
                                         options.server.address, ": ", s.error_message()));
      }
      texts.push_back(resp.text());
    }
  }
  Runner runner(options, plan, std::move(texts), progress);
  return runner.Run();
}

Report ComputeReport(const std::vector<RequestRecord>& records, double duration_s) {
  Report rep;
  rep.num_requests = static_cast<int64_t>(records.size());
  rep.duration_s = duration_s;
  std::vector<double> ttft, tpot, itl, e2e, server_ttft;
  for (const RequestRecord& r : records) {
    if (!r.ok) {
      ++rep.failed;
      ++rep.errors[r.error_code.empty() ? "UNKNOWN" : r.error_code];
      continue;
    }
    ++rep.completed;
    rep.input_tokens += r.prompt_tokens;
    rep.output_tokens += r.output_tokens;
    if (r.output_tokens != r.max_new_tokens) ++rep.output_length_mismatches;
    e2e.push_back(r.e2e_s * 1e3);
    if (r.ttft_s >= 0) {
      ttft.push_back(r.ttft_s * 1e3);
      if (r.output_tokens > 1) {
        tpot.push_back((r.e2e_s - r.ttft_s) * 1e3 / static_cast<double>(r.output_tokens - 1));
      }
    }
    for (double g : r.itl_s) itl.push_back(g * 1e3);
    if (r.server_ttft_s >= 0) server_ttft.push_back(r.server_ttft_s * 1e3);
  }
  if (duration_s > 0) {
    rep.request_throughput = static_cast<double>(rep.completed) / duration_s;
    rep.output_throughput = static_cast<double>(rep.output_tokens) / duration_s;
    rep.total_token_throughput =
        static_cast<double>(rep.input_tokens + rep.output_tokens) / duration_s;
  }
  rep.ttft_ms = Summarize(std::move(ttft));
  rep.tpot_ms = Summarize(std::move(tpot));
  rep.itl_ms = Summarize(std::move(itl));
  rep.e2e_ms = Summarize(std::move(e2e));
  rep.server_ttft_ms = Summarize(std::move(server_ttft));
  return rep;
}

}  // namespace tpserve::bench
