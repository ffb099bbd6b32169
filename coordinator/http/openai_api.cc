// The OpenAI-compatible API's JSON (see openai_api.h).
#include "coordinator/http/openai_api.h"

#include <cmath>
#include <limits>
#include <optional>
#include <set>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace tpserve::openai {

using nlohmann::json;

namespace {

constexpr char kParamPayload[] = "tpserve.dev/param";

const char* TypeName(const json& v) {
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

absl::Status WrongType(const std::string& key, const char* want, const json& got) {
  return InvalidParam(key,
                      absl::StrCat("`", key, "` must be ", want, " (got ", TypeName(got), ")"));
}

// Typed readers: nullopt when the field is absent or null.
absl::StatusOr<std::optional<double>> Number(const json& j, const std::string& key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<double>();
  if (!it->is_number()) return WrongType(key, "a number", *it);
  return std::optional<double>(it->get<double>());
}

absl::StatusOr<std::optional<int64_t>> Integer(const json& j, const std::string& key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<int64_t>();
  if (it->is_number_unsigned()) {
    const uint64_t u = it->get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return InvalidParam(key, absl::StrCat("`", key, "` is too large"));
    }
    return std::optional<int64_t>(static_cast<int64_t>(u));
  }
  if (!it->is_number_integer()) return WrongType(key, "an integer", *it);
  return std::optional<int64_t>(it->get<int64_t>());
}

absl::StatusOr<std::optional<bool>> Bool(const json& j, const std::string& key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<bool>();
  if (!it->is_boolean()) return WrongType(key, "a boolean", *it);
  return std::optional<bool>(it->get<bool>());
}

// An int32 field with a range the API states (the rest is checked by ValidateGenerateRequest).
absl::StatusOr<std::optional<int32_t>> Int32(const json& j, const std::string& key) {
  auto v = Integer(j, key);
  if (!v.ok()) return v.status();
  if (!v->has_value()) return std::optional<int32_t>();
  if (**v < std::numeric_limits<int32_t>::min() || **v > std::numeric_limits<int32_t>::max()) {
    return InvalidParam(key, absl::StrCat("`", key, "` = ", **v, " is out of range"));
  }
  return std::optional<int32_t>(static_cast<int32_t>(**v));
}

#define TP_API_ASSIGN(lhs, expr)                \
  auto lhs##_or = (expr);                       \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  auto lhs = *std::move(lhs##_or)

// Fields OpenAI defines that tpserve does not implement: accepted only at their no-op value (so
// clients that always send defaults work), refused otherwise.
bool IsNoOp(const std::string& key, const json& v) {
  if (v.is_null()) return true;
  if (key == "presence_penalty" || key == "frequency_penalty") return v.is_number() && v == 0;
  if (key == "best_of") return v.is_number_integer() && v == 1;
  if (key == "echo" || key == "parallel_tool_calls") return v.is_boolean() && !v.get<bool>();
  if (key == "logit_bias" || key == "metadata") return v.is_object() && v.empty();
  if (key == "tools" || key == "functions") return v.is_array() && v.empty();
  if (key == "tool_choice" || key == "function_call") return v == "none";
  if (key == "response_format")
    return v.is_object() && v.value("type", "") == "text" && v.size() == 1;
  if (key == "suffix") return v.is_string() && v.get<std::string>().empty();
  return false;
}

absl::Status CheckFields(Endpoint endpoint, const json& j) {
  static const std::set<std::string> common = {
      "model", "max_tokens", "temperature",        "top_p",     "seed",
      "stop",  "n",          "logprobs",           "stream",    "stream_options",
      "user",  "top_k",      "repetition_penalty", "ignore_eos"};
  static const std::set<std::string> completions = {"prompt"};
  static const std::set<std::string> chat = {"messages", "max_completion_tokens", "top_logprobs"};
  static const std::set<std::string> unsupported = {"presence_penalty",
                                                    "frequency_penalty",
                                                    "logit_bias",
                                                    "best_of",
                                                    "echo",
                                                    "suffix",
                                                    "tools",
                                                    "tool_choice",
                                                    "functions",
                                                    "function_call",
                                                    "parallel_tool_calls",
                                                    "response_format",
                                                    "metadata"};
  std::vector<std::string> unknown, refused;
  for (const auto& [key, value] : j.items()) {
    if (common.count(key) || (endpoint == Endpoint::kCompletions ? completions : chat).count(key)) {
      continue;
    }
    if (unsupported.count(key)) {
      if (!IsNoOp(key, value)) refused.push_back(key);
      continue;
    }
    unknown.push_back(key);
  }
  if (!unknown.empty()) {
    return InvalidParam(
        unknown[0], absl::StrCat("unknown field", unknown.size() > 1 ? "s" : "", " `",
                                 absl::StrJoin(unknown, "`, `"), "`: tpserve does not recognise ",
                                 unknown.size() > 1 ? "them" : "it"));
  }
  if (!refused.empty()) {
    return InvalidParam(refused[0],
                        absl::StrCat("`", absl::StrJoin(refused, "`, `"),
                                     "` is not supported by tpserve (only its default value is "
                                     "accepted)"));
  }
  return absl::OkStatus();
}

absl::Status ParseStop(const json& j, v1::StoppingOptions* s) {
  auto it = j.find("stop");
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (it->is_string()) {
    s->add_stop(it->get<std::string>());
    return absl::OkStatus();
  }
  if (!it->is_array()) return WrongType("stop", "a string or an array of strings", *it);
  for (size_t i = 0; i < it->size(); ++i) {
    if (!(*it)[i].is_string()) {
      return InvalidParam(
          "stop", absl::StrCat("`stop[", i, "]` must be a string (got ", TypeName((*it)[i]), ")"));
    }
    s->add_stop((*it)[i].get<std::string>());
  }
  return absl::OkStatus();
}

absl::Status ParsePrompt(const json& j, v1::GenerateRequest* g) {
  auto it = j.find("prompt");
  if (it == j.end() || it->is_null()) return InvalidParam("prompt", "`prompt` is required");
  if (it->is_string()) {
    g->set_text(it->get<std::string>());
    return absl::OkStatus();
  }
  if (!it->is_array()) return WrongType("prompt", "a string or an array of token ids", *it);
  if (it->empty()) return InvalidParam("prompt", "`prompt` is an empty array");
  if (it->size() == 1 && (*it)[0].is_string()) {
    g->set_text((*it)[0].get<std::string>());
    return absl::OkStatus();
  }
  if ((*it)[0].is_string() || (*it)[0].is_array()) {
    return InvalidParam("prompt",
                        "`prompt` holds several prompts: tpserve answers one prompt per request "
                        "(send them as separate requests)");
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const json& v = (*it)[i];
    if (!v.is_number_integer() || v.get<int64_t>() < std::numeric_limits<int32_t>::min() ||
        v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return InvalidParam(
          "prompt", absl::StrCat("`prompt[", i, "]` must be a token id (got ", v.dump(), ")"));
    }
    g->mutable_token_ids()->add_ids(v.get<int32_t>());
  }
  return absl::OkStatus();
}

absl::Status ParseMessages(const json& j, std::vector<HttpChatMessage>* out) {
  auto it = j.find("messages");
  if (it == j.end() || it->is_null()) return InvalidParam("messages", "`messages` is required");
  if (!it->is_array()) return WrongType("messages", "an array", *it);
  if (it->empty()) return InvalidParam("messages", "`messages` is empty");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& m = (*it)[i];
    const std::string where = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return WrongType(where, "an object", m);
    for (const auto& [key, value] : m.items()) {
      if (key != "role" && key != "content") {
        return InvalidParam(where + "." + key,
                            absl::StrCat("`", where, ".", key,
                                         "` is not supported (a message has a role and content)"));
      }
    }
    HttpChatMessage msg;
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return InvalidParam(where + ".role", absl::StrCat("`", where, ".role` must be a string"));
    }
    msg.role = role->get<std::string>();
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant") {
      return InvalidParam(where + ".role",
                          absl::StrCat("`", where, ".role` is '", msg.role,
                                       "'; tpserve accepts system, user and assistant"));
    }
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      return InvalidParam(where + ".content", absl::StrCat("`", where, ".content` is required"));
    }
    if (content->is_string()) {
      msg.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t p = 0; p < content->size(); ++p) {
        const json& part = (*content)[p];
        const std::string pw = absl::StrCat(where, ".content[", p, "]");
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string()) {
          return InvalidParam(pw, absl::StrCat("`", pw,
                                               "` must be a text part {\"type\": \"text\", "
                                               "\"text\": ...}; tpserve serves text only"));
        }
        msg.content += part["text"].get<std::string>();
      }
    } else {
      return WrongType(where + ".content", "a string or an array of text parts", *content);
    }
    out->push_back(std::move(msg));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WithParam(absl::Status status, const std::string& param) {
  if (!param.empty()) status.SetPayload(kParamPayload, absl::Cord(param));
  return status;
}

absl::Status InvalidParam(const std::string& param, const std::string& message) {
  return WithParam(absl::InvalidArgumentError(message), param);
}

std::string ParamOf(const absl::Status& status) {
  auto p = status.GetPayload(kParamPayload);
  return p ? std::string(*p) : std::string();
}

absl::StatusOr<ParsedRequest> ParseRequest(Endpoint endpoint, std::string_view body) {
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidParam("", "the request body is not valid JSON");
  if (!j.is_object()) return InvalidParam("", "the request body must be a JSON object");
  if (absl::Status s = CheckFields(endpoint, j); !s.ok()) return s;

  ParsedRequest r;
  r.endpoint = endpoint;
  auto model = j.find("model");
  if (model == j.end() || model->is_null()) {
    return InvalidParam("model", "`model` is required (GET /v1/models lists it)");
  }
  if (!model->is_string()) return WrongType("model", "a string", *model);
  r.model = model->get<std::string>();

  TP_API_ASSIGN(n, Integer(j, "n"));
  if (n.has_value() && *n != 1) {
    return InvalidParam("n", absl::StrCat("`n` must be 1: tpserve returns one choice per request "
                                          "(got ",
                                          *n, ")"));
  }
  if (auto u = j.find("user"); u != j.end() && !u->is_null() && !u->is_string()) {
    return WrongType("user", "a string", *u);
  }

  v1::SamplingOptions* s = r.generate.mutable_sampling();
  TP_API_ASSIGN(temperature, Number(j, "temperature"));
  // OpenAI's default temperature is 1 (sampling); the gRPC API's is 0 (greedy).
  s->set_temperature(temperature ? static_cast<float>(*temperature) : 1.0f);
  TP_API_ASSIGN(top_p, Number(j, "top_p"));
  if (top_p) s->set_top_p(static_cast<float>(*top_p));
  TP_API_ASSIGN(top_k, Int32(j, "top_k"));
  if (top_k) s->set_top_k(*top_k);  // vLLM's -1 (off) is 0 here; negatives fail validation
  TP_API_ASSIGN(repetition_penalty, Number(j, "repetition_penalty"));
  if (repetition_penalty) s->set_repetition_penalty(static_cast<float>(*repetition_penalty));
  TP_API_ASSIGN(seed, Integer(j, "seed"));
  if (seed) s->set_seed(static_cast<uint64_t>(*seed));

  if (endpoint == Endpoint::kCompletions) {
    TP_API_ASSIGN(logprobs, Int32(j, "logprobs"));
    if (logprobs) {
      r.logprobs = true;
      r.top_logprobs = *logprobs;
      s->set_logprobs(*logprobs);
    }
  } else {
    TP_API_ASSIGN(logprobs, Bool(j, "logprobs"));
    TP_API_ASSIGN(top_logprobs, Int32(j, "top_logprobs"));
    if (top_logprobs.has_value() && !logprobs.value_or(false)) {
      return InvalidParam("top_logprobs", "`top_logprobs` needs `logprobs` set to true");
    }
    if (logprobs.value_or(false)) {
      r.logprobs = true;
      r.top_logprobs = top_logprobs.value_or(0);
      s->set_logprobs(r.top_logprobs);
    }
  }

  v1::StoppingOptions* st = r.generate.mutable_stopping();
  TP_API_ASSIGN(max_tokens, Int32(j, "max_tokens"));
  std::optional<int32_t> max_completion_tokens;
  if (endpoint == Endpoint::kChat) {
    TP_API_ASSIGN(mct, Int32(j, "max_completion_tokens"));
    max_completion_tokens = mct;
  }
  if (max_tokens && max_completion_tokens && *max_tokens != *max_completion_tokens) {
    return InvalidParam("max_completion_tokens",
                        "`max_tokens` and `max_completion_tokens` differ; set one of them");
  }
  if (auto m = max_completion_tokens ? max_completion_tokens : max_tokens) {
    st->set_max_new_tokens(*m);
  }
  if (absl::Status stop = ParseStop(j, st); !stop.ok()) return stop;
  TP_API_ASSIGN(ignore_eos, Bool(j, "ignore_eos"));  // vLLM's extension
  if (ignore_eos) st->set_ignore_eos(*ignore_eos);

  TP_API_ASSIGN(stream, Bool(j, "stream"));
  r.stream = stream.value_or(false);
  if (auto so = j.find("stream_options"); so != j.end() && !so->is_null()) {
    if (!r.stream) {
      return InvalidParam("stream_options", "`stream_options` is only allowed with `stream: true`");
    }
    if (!so->is_object()) return WrongType("stream_options", "an object", *so);
    for (const auto& [key, value] : so->items()) {
      if (key != "include_usage") {
        return InvalidParam("stream_options." + key,
                            absl::StrCat("unknown field `stream_options.", key, "`"));
      }
    }
    TP_API_ASSIGN(include_usage, Bool(*so, "include_usage"));
    r.include_usage = include_usage.value_or(false);
  }

  if (endpoint == Endpoint::kCompletions) {
    if (absl::Status p = ParsePrompt(j, &r.generate); !p.ok()) return p;
  } else {
    if (absl::Status m = ParseMessages(j, &r.messages); !m.ok()) return m;
  }
  return r;
}

absl::Status ToApiNames(const absl::Status& status, Endpoint endpoint) {
  if (status.code() != absl::StatusCode::kInvalidArgument || !ParamOf(status).empty()) {
    return status;
  }
  const std::string prompt = endpoint == Endpoint::kChat ? "messages" : "prompt";
  const std::string logprobs = endpoint == Endpoint::kChat ? "top_logprobs" : "logprobs";
  // Longest names first: "stopping.max_new_tokens" before "max_new_tokens".
  const std::vector<std::pair<std::string, std::string>> names = {
      {"prompt.token_ids", prompt},
      {"prompt.text", prompt},
      {"sampling.temperature", "temperature"},
      {"sampling.top_p", "top_p"},
      {"sampling.top_k", "top_k"},
      {"sampling.repetition_penalty", "repetition_penalty"},
      {"sampling.logprobs", logprobs},
      {"stopping.max_new_tokens", "max_tokens"},
      {"stopping.stop_token_ids", "stop_token_ids"},
      {"stopping.stop", "stop"},
      {"max_new_tokens", "max_tokens"},
  };
  std::string message(status.message());
  std::string param;
  size_t first = std::string::npos;
  for (const auto& [from, to] : names) {
    const size_t at = message.find(from);
    if (at == std::string::npos) continue;
    if (at < first) {
      first = at;
      param = to;
    }
    message = absl::StrReplaceAll(message, {{from, to}});
  }
  if (param.empty() && message.find("the prompt has") != std::string::npos) param = prompt;
  return InvalidParam(param, message);
}

int HttpStatus(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kDeadlineExceeded:
      return 408;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

json ErrorJson(const absl::Status& status) {
  const int http = HttpStatus(status);
  const char* type = http == 400   ? "invalid_request_error"
                     : http == 401 ? "authentication_error"
                     : http == 403 ? "permission_error"
                     : http == 404 ? "not_found_error"
                     : http == 408 ? "timeout_error"
                     : http == 429 ? "rate_limit_error"
                     : http == 501 ? "not_implemented_error"
                     : http == 503 ? "service_unavailable_error"
                                   : "internal_error";
  const std::string param = ParamOf(status);
  json code = nullptr;
  if (status.code() == absl::StatusCode::kNotFound && param == "model") code = "model_not_found";
  if (status.code() == absl::StatusCode::kResourceExhausted) code = "queue_full";
  if (status.code() == absl::StatusCode::kUnauthenticated) code = "invalid_api_key";
  return {{"error",
           {{"message", std::string(status.message())},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code}}}};
}

json FinishReasonJson(Finish reason) {
  switch (reason) {
    case Finish::kStop:
      return "stop";
    case Finish::kLength:
      return "length";
    default:
      return nullptr;
  }
}

json UsageJson(const FinalInfo& info) {
  return {{"prompt_tokens", info.prompt_tokens},
          {"completion_tokens", info.output_tokens},
          {"total_tokens", info.prompt_tokens + info.output_tokens}};
}

namespace {
json Bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}
}  // namespace

json LogprobsJson(Endpoint endpoint, const std::vector<int32_t>& ids,
                  const std::vector<TokenLogprobs>& logprobs, const TokenText& text,
                  int64_t text_offset) {
  const size_t n = std::min(ids.size(), logprobs.size());
  if (endpoint == Endpoint::kChat) {
    json content = json::array();
    for (size_t i = 0; i < n; ++i) {
      const std::string t = text(ids[i]);
      json top = json::array();
      for (const TokenLogprob& alt : logprobs[i].top) {
        const std::string at = text(alt.id);
        top.push_back({{"token", at}, {"logprob", alt.logprob}, {"bytes", Bytes(at)}});
      }
      content.push_back({{"token", t},
                         {"logprob", logprobs[i].logprob},
                         {"bytes", Bytes(t)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  for (size_t i = 0; i < n; ++i) {
    const std::string t = text(ids[i]);
    tokens.push_back(t);
    token_logprobs.push_back(logprobs[i].logprob);
    json alts = json::object();
    for (const TokenLogprob& alt : logprobs[i].top) alts[text(alt.id)] = alt.logprob;
    top.push_back(alts);
    offsets.push_back(text_offset);
    text_offset += static_cast<int64_t>(t.size());
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top},
          {"text_offset", offsets}};
}

json ResponseJson(const ParsedRequest& request, const Answer& a, const TokenText& text) {
  const bool chat = request.endpoint == Endpoint::kChat;
  json choice = {{"index", 0}, {"finish_reason", FinishReasonJson(a.info.reason)}};
  choice["logprobs"] =
      request.logprobs ? LogprobsJson(request.endpoint, a.ids, a.logprobs, text) : json(nullptr);
  if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", a.text}};
  } else {
    choice["text"] = a.text;
  }
  return {{"id", a.id},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", a.created},
          {"model", a.model},
          {"choices", json::array({choice})},
          {"usage", UsageJson(a.info)}};
}

json ChunkJson(const ParsedRequest& request, const std::string& id, int64_t created,
               const std::string& model, const Chunk& c, const TokenText& text) {
  const bool chat = request.endpoint == Endpoint::kChat;
  json choice = {{"index", 0},
                 {"finish_reason", c.last ? FinishReasonJson(c.reason) : json(nullptr)}};
  choice["logprobs"] = request.logprobs
                           ? LogprobsJson(request.endpoint, c.ids, c.logprobs, text, c.text_offset)
                           : json(nullptr);
  if (chat) {
    json delta = json::object();
    if (c.first) delta["role"] = "assistant";
    if (!c.text.empty() || c.first) delta["content"] = c.text;
    choice["delta"] = delta;
  } else {
    choice["text"] = c.text;
  }
  json out = {{"id", id},
              {"object", chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", json::array({choice})}};
  if (request.include_usage) out["usage"] = nullptr;
  return out;
}

json UsageChunkJson(const ParsedRequest& request, const std::string& id, int64_t created,
                    const std::string& model, const FinalInfo& info) {
  const bool chat = request.endpoint == Endpoint::kChat;
  return {{"id", id},
          {"object", chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array()},
          {"usage", UsageJson(info)}};
}

json ModelJson(const std::string& model, int64_t created, int64_t context_length) {
  return {{"id", model},
          {"object", "model"},
          {"created", created},
          {"owned_by", "tpserve"},
          {"max_model_len", context_length}};
}

json ModelsJson(const std::string& model, int64_t created, int64_t context_length) {
  return {{"object", "list"}, {"data", json::array({ModelJson(model, created, context_length)})}};
}

}  // namespace tpserve::openai
