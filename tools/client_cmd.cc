// The gRPC client subcommands (see client_cmd.h).
#include "tools/client_cmd.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/env.h"
#include "common/flags.h"
#include "common/status.h"
#include "coordinator/coordinator_flags.h"
#include "coordinator/server.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tools/server_endpoint.h"
#include "tpserve/v1/inference.grpc.pb.h"

namespace tpserve {
namespace {

const CommandSpec& GenerateSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve generate",
      "Generates through a running server (gRPC); give exactly one of --prompt and --prompt-ids.",
      WithServerEndpointFlags(
          {StringFlag("prompt", "TEXT", "the prompt text"),
           StringFlag("prompt-ids", "1,2,3", "the prompt as token ids"),
           BoolFlag("stream", "stream the text as it is generated"),
           BoolFlag("json", "print the response as JSON"),
           IntFlag("max-new-tokens", 1, int64_t{1} << 30, "tokens to generate (server default)"),
           FloatFlag("temperature", 0, 1e6, "sampling temperature; 0: greedy", "T"),
           FloatFlag("top-p", 0, 1, "nucleus sampling mass", "P"),
           IntFlag("top-k", 0, int64_t{1} << 30, "sample among the K most likely tokens", "K"),
           IntFlag("seed", INT64_MIN, INT64_MAX, "sampling seed", "S"),
           FloatFlag("repetition-penalty", 0, 1e6, "penalty of tokens already present", "R"),
           Repeated(StringFlag("stop", "STR", "stop when the text contains STR")),
           StringFlag("stop-token-ids", "1,2", "stop at any of these token ids"),
           BoolFlag("ignore-eos", "keep generating past the end-of-sequence token"),
           StringFlag("request-id", "ID", "request id (shown in the server's log)"),
           FloatFlag("timeout", 0, 1e9, "deadline of the call in seconds (default 600)", "S",
                     true)}),
      ""};
  return *spec;
}

const CommandSpec& InfoSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve info", "Prints a server's model info as JSON.",
      WithServerEndpointFlags({FloatFlag(
          "timeout", 0, 1e9, "deadline of the call in seconds (default 10)", "S", true)}),
      ""};
  return *spec;
}

const CommandSpec& HealthSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve health", "Checks a server's health (grpc.health.v1); exits non-zero unless SERVING.",
      WithServerEndpointFlags(
          {StringFlag("service", "NAME", "service to check (default: the server)"),
           FloatFlag("timeout", 0, 1e9, "deadline of the call in seconds (default 5)", "S", true)}),
      ""};
  return *spec;
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& server) {
  if (s.ok()) return absl::OkStatus();
  std::string message = s.error_message();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    message = absl::StrCat(server, ": ", message);
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), message);
}

const char* FinishName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_STOP:
      return "stop";
    default:
      return "unspecified";
  }
}

}  // namespace

absl::Status RunGenerateCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags a, Flags::Parse(GenerateSpec(), args));
  if (a.help()) return PrintUsage(GenerateSpec());
  if (a.Has("prompt") == a.Has("prompt-ids")) {
    return absl::InvalidArgumentError(
        "give exactly one of --prompt and --prompt-ids (see tpserve generate --help)");
  }
  v1::GenerateRequest req;
  req.set_request_id(a.GetOr("request-id", ""));
  if (a.Has("prompt")) {
    req.set_text(*a.Get("prompt"));
  } else {
    TP_ASSIGN_OR_RETURN(auto ids, ParseTokenIds("prompt-ids", *a.Get("prompt-ids")));
    req.mutable_token_ids()->mutable_ids()->Assign(ids.begin(), ids.end());
  }
  // Only flags given are sent: the server validates and applies its defaults.
  v1::SamplingOptions* s = req.mutable_sampling();
  if (a.Has("temperature")) {
    const double v = a.GetDouble("temperature", 0);
    s->set_temperature(static_cast<float>(v));
  }
  if (a.Has("top-p")) {
    const double v = a.GetDouble("top-p", 1);
    s->set_top_p(static_cast<float>(v));
  }
  if (a.Has("top-k")) {
    const int64_t v = a.GetInt("top-k", 0);
    s->set_top_k(static_cast<int32_t>(v));
  }
  if (a.Has("seed")) {
    const int64_t v = a.GetInt("seed", 0);
    s->set_seed(static_cast<uint64_t>(v));
  }
  if (a.Has("repetition-penalty")) {
    const double v = a.GetDouble("repetition-penalty", 1);
    s->set_repetition_penalty(static_cast<float>(v));
  }
  v1::StoppingOptions* st = req.mutable_stopping();
  if (a.Has("max-new-tokens")) {
    const int64_t v = a.GetInt("max-new-tokens", 0);
    st->set_max_new_tokens(static_cast<int32_t>(v));
  }
  for (const std::string& stop : a.GetAll("stop")) st->add_stop(stop);
  if (a.Has("stop-token-ids")) {
    TP_ASSIGN_OR_RETURN(auto ids, ParseTokenIds("stop-token-ids", *a.Get("stop-token-ids")));
    st->mutable_stop_token_ids()->Assign(ids.begin(), ids.end());
  }
  st->set_ignore_eos(a.Flag("ignore-eos"));
  const double timeout = a.GetDouble("timeout", 600);

  TP_ASSIGN_OR_RETURN(const ServerEndpoint endpoint, ServerEndpointFromFlags(a));
  const std::string& server = endpoint.address;
  auto stub = v1::Inference::NewStub(endpoint.Channel());
  grpc::ClientContext ctx;
  endpoint.Authorize(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
  v1::GenerateResponse final;
  std::string text;
  std::vector<int32_t> ids;
  const bool json = a.Flag("json");
  if (a.Flag("stream")) {
    auto reader = stub->GenerateStream(&ctx, req);
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
      text += msg.text();
      ids.insert(ids.end(), msg.token_ids().begin(), msg.token_ids().end());
      if (!json) {
        std::cout << msg.text() << std::flush;
      }
      if (msg.finished()) final = msg;
    }
    TP_RETURN_IF_ERROR(FromGrpc(reader->Finish(), server));
    if (!json) std::cout << std::endl;
  } else {
    TP_RETURN_IF_ERROR(FromGrpc(stub->Generate(&ctx, req, &final), server));
    text = final.text();
    ids.assign(final.token_ids().begin(), final.token_ids().end());
    if (!json) std::cout << text << std::endl;
  }
  final.set_text(text);
  final.mutable_token_ids()->Assign(ids.begin(), ids.end());
  if (json) {
    std::string out;
    google::protobuf::util::JsonPrintOptions o;
    o.preserve_proto_field_names = true;
    o.always_print_primitive_fields = true;
    google::protobuf::util::MessageToJsonString(final, &out, o);
    std::cout << out << std::endl;
  } else {
    std::fprintf(stderr,
                 "[%d prompt + %d output tokens, finish: %s; queued %.3f s, first token %.3f s, "
                 "total %.3f s]\n",
                 final.prompt_tokens(), final.output_tokens(), FinishName(final.finish_reason()),
                 final.timings().queued_seconds(), final.timings().time_to_first_token_seconds(),
                 final.timings().total_seconds());
  }
  return absl::OkStatus();
}

absl::Status RunInfoCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags a, Flags::Parse(InfoSpec(), args));
  if (a.help()) return PrintUsage(InfoSpec());
  TP_ASSIGN_OR_RETURN(const ServerEndpoint endpoint, ServerEndpointFromFlags(a));
  const std::string& server = endpoint.address;
  const double timeout = a.GetDouble("timeout", 10);
  auto stub = v1::Inference::NewStub(endpoint.Channel());
  grpc::ClientContext ctx;
  endpoint.Authorize(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
  v1::ModelInfo info;
  TP_RETURN_IF_ERROR(FromGrpc(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info), server));
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  o.add_whitespace = true;
  google::protobuf::util::MessageToJsonString(info, &out, o);
  std::cout << out;
  return absl::OkStatus();
}

absl::Status RunHealthCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(Flags a, Flags::Parse(HealthSpec(), args));
  if (a.help()) return PrintUsage(HealthSpec());
  TP_ASSIGN_OR_RETURN(const ServerEndpoint endpoint, ServerEndpointFromFlags(a));
  const std::string& server = endpoint.address;
  const double timeout = a.GetDouble("timeout", 5);
  auto stub = grpc::health::v1::Health::NewStub(endpoint.Channel());
  grpc::ClientContext ctx;
  endpoint.Authorize(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(a.GetOr("service", ""));
  grpc::health::v1::HealthCheckResponse resp;
  TP_RETURN_IF_ERROR(FromGrpc(stub->Check(&ctx, req, &resp), server));
  const std::string name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  std::cout << name << std::endl;
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat(server, " is ", name));
  }
  return absl::OkStatus();
}

absl::Status RunServeCommand(const std::vector<std::string>& args) {
  TP_ASSIGN_OR_RETURN(CoordinatorOptions options,
                      ParseCoordinatorFlags(args, /*serve_command=*/true));
  if (options.help) return PrintUsage(CoordinatorFlagSpec(/*serve_command=*/true));
  return RunCoordinator(options);
}

}  // namespace tpserve
