// The OpenAI-compatible API's JSON: request parsing into the gRPC request (one validation path
// for both front ends), responses, stream chunks and errors. Pure functions, no I/O.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/logprobs.h"
#include "coordinator/request.h"
#include "tpserve/v1/inference.pb.h"

namespace tpserve::openai {

// One chat message as the API gives it (text parts joined). The chat template renders these.
struct HttpChatMessage {
  std::string role;  // system, user, assistant
  std::string content;
};

enum class Endpoint { kCompletions, kChat };

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;
  // Sampling and stopping set; the prompt too for completions. For chat the front end renders
  // `messages` and sets the prompt's token ids.
  v1::GenerateRequest generate;
  std::vector<HttpChatMessage> messages;  // chat only
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool logprobs = false;       // answer with logprobs (top_logprobs alternatives each)
  int top_logprobs = 0;
};

// Parses a request body. Extensions beside OpenAI's fields: top_k, repetition_penalty and
// ignore_eos (as vLLM names them). Unknown fields, unsupported ones (unless at their no-op value),
// wrong types and n != 1 are INVALID_ARGUMENT naming the field (ParamOf gives it).
absl::StatusOr<ParsedRequest> ParseRequest(Endpoint endpoint, std::string_view body);

// The field an error is about ("" when none).
std::string ParamOf(const absl::Status& status);
absl::Status InvalidParam(const std::string& param, const std::string& message);
absl::Status WithParam(absl::Status status, const std::string& param);
// Renames the gRPC field names in a validation error (sampling.temperature, stopping.stop...)
// to the API's (temperature, stop...) and records the field.
absl::Status ToApiNames(const absl::Status& status, Endpoint endpoint);

// HTTP status for an error: INVALID_ARGUMENT 400, UNAUTHENTICATED 401, NOT_FOUND 404,
// RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, FAILED_PRECONDITION 400, others 500.
int HttpStatus(const absl::Status& status);
// {"error": {"message", "type", "param", "code"}}.
nlohmann::json ErrorJson(const absl::Status& status);

// "stop", "length", or null.
nlohmann::json FinishReasonJson(Finish reason);
nlohmann::json UsageJson(const FinalInfo& info);

using TokenText = std::function<std::string(int32_t)>;

// Logprobs of `ids` in the endpoint's shape: completions {tokens, token_logprobs, top_logprobs,
// text_offset} (offsets from `text_offset`), chat {content: [{token, logprob, bytes,
// top_logprobs}]}.
nlohmann::json LogprobsJson(Endpoint endpoint, const std::vector<int32_t>& ids,
                            const std::vector<TokenLogprobs>& logprobs, const TokenText& text,
                            int64_t text_offset = 0);

// Whole (non-streamed) answers.
struct Answer {
  std::string id;
  int64_t created = 0;
  std::string model;
  std::string text;
  std::vector<int32_t> ids;
  std::vector<TokenLogprobs> logprobs;
  FinalInfo info;
};
nlohmann::json ResponseJson(const ParsedRequest& request, const Answer& answer,
                            const TokenText& text);

// One stream chunk: `delta` text (chat: the first chunk also carries the assistant role), its
// logprobs, and the finish reason on the last. With include_usage every chunk has "usage": null.
struct Chunk {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<TokenLogprobs> logprobs;
  bool first = false;
  bool last = false;
  Finish reason = Finish::kNone;
  int64_t text_offset = 0;  // completions logprobs: where this chunk's text starts
};
nlohmann::json ChunkJson(const ParsedRequest& request, const std::string& id, int64_t created,
                         const std::string& model, const Chunk& chunk, const TokenText& text);
// The final usage chunk (choices empty) of stream_options.include_usage.
nlohmann::json UsageChunkJson(const ParsedRequest& request, const std::string& id, int64_t created,
                              const std::string& model, const FinalInfo& info);

// {"id", "object": "model", "created", "owned_by": "tpserve", "max_model_len"} (GET
// /v1/models/{id}), and the list of it (GET /v1/models: {"object": "list", "data": [...]}).
nlohmann::json ModelJson(const std::string& model, int64_t created, int64_t context_length);
nlohmann::json ModelsJson(const std::string& model, int64_t created, int64_t context_length);

}  // namespace tpserve::openai
