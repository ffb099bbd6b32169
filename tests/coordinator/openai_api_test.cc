// The OpenAI API's JSON translation: fields into the gRPC request, refusals naming the field,
// error shape and status codes, response and chunk shapes.
#include "coordinator/http/openai_api.h"

#include <gtest/gtest.h>

namespace tpserve::openai {
namespace {

using nlohmann::json;

ParsedRequest Parse(Endpoint e, const json& body) {
  absl::StatusOr<ParsedRequest> r = ParseRequest(e, body.dump());
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : ParsedRequest();
}

absl::Status Error(Endpoint e, const json& body) {
  absl::StatusOr<ParsedRequest> r = ParseRequest(e, body.dump());
  EXPECT_FALSE(r.ok()) << body.dump();
  return r.ok() ? absl::OkStatus() : r.status();
}

TEST(OpenAiApiTest, CompletionFieldsReachTheGenerateRequest) {
  const ParsedRequest r =
      Parse(Endpoint::kCompletions, {{"model", "m"},
                                     {"prompt", "def f():"},
                                     {"max_tokens", 7},
                                     {"temperature", 0.5},
                                     {"top_p", 0.9},
                                     {"seed", 42},
                                     {"top_k", 5},
                                     {"repetition_penalty", 1.1},
                                     {"stop", "\n\n"},
                                     {"n", 1},
                                     {"logprobs", 2},
                                     {"stream", true},
                                     {"stream_options", {{"include_usage", true}}},
                                     {"user", "me"},
                                     {"presence_penalty", 0}});
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.generate.text(), "def f():");
  EXPECT_EQ(r.generate.stopping().max_new_tokens(), 7);
  EXPECT_FLOAT_EQ(r.generate.sampling().temperature(), 0.5f);
  EXPECT_FLOAT_EQ(r.generate.sampling().top_p(), 0.9f);
  EXPECT_EQ(r.generate.sampling().seed(), 42u);
  EXPECT_EQ(r.generate.sampling().top_k(), 5);
  EXPECT_FLOAT_EQ(r.generate.sampling().repetition_penalty(), 1.1f);
  ASSERT_EQ(r.generate.stopping().stop_size(), 1);
  EXPECT_EQ(r.generate.stopping().stop(0), "\n\n");
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.generate.sampling().logprobs(), 2);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

TEST(OpenAiApiTest, AbsentFieldsTakeOpenAisDefaults) {
  const ParsedRequest r = Parse(Endpoint::kCompletions, {{"model", "m"}, {"prompt", "x"}});
  EXPECT_FLOAT_EQ(r.generate.sampling().temperature(), 1.0f);  // OpenAI's default: sampling
  EXPECT_FALSE(r.generate.sampling().has_seed());
  EXPECT_FALSE(r.generate.sampling().has_logprobs());
  EXPECT_FALSE(r.generate.stopping().has_max_new_tokens());
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.logprobs);
}

TEST(OpenAiApiTest, PromptAsTokenIdsAndStopAsList) {
  const ParsedRequest r =
      Parse(Endpoint::kCompletions, {{"model", "m"}, {"prompt", {1, 2, 3}}, {"stop", {"a", "bc"}}});
  ASSERT_EQ(r.generate.token_ids().ids_size(), 3);
  EXPECT_EQ(r.generate.token_ids().ids(2), 3);
  ASSERT_EQ(r.generate.stopping().stop_size(), 2);
  EXPECT_EQ(r.generate.stopping().stop(1), "bc");
  EXPECT_EQ(Parse(Endpoint::kCompletions, {{"model", "m"}, {"prompt", {"one"}}}).generate.text(),
            "one");
}

TEST(OpenAiApiTest, ChatMessagesWithStringAndTextParts) {
  const ParsedRequest r =
      Parse(Endpoint::kChat,
            {{"model", "m"},
             {"messages",
              {{{"role", "system"}, {"content", "be brief"}},
               {{"role", "user"},
                {"content",
                 {{{"type", "text"}, {"text", "hello "}}, {{"type", "text"}, {"text", "you"}}}}},
               {{"role", "assistant"}, {"content", "hi"}}}},
             {"max_completion_tokens", 9},
             {"logprobs", true},
             {"top_logprobs", 3}});
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].content, "hello you");
  EXPECT_EQ(r.messages[2].role, "assistant");
  EXPECT_EQ(r.generate.stopping().max_new_tokens(), 9);
  EXPECT_EQ(r.generate.sampling().logprobs(), 3);
  EXPECT_EQ(r.generate.prompt_case(), v1::GenerateRequest::PROMPT_NOT_SET);
}

TEST(OpenAiApiTest, UnknownAndUnsupportedFieldsAreRefusedByName) {
  absl::Status s =
      Error(Endpoint::kCompletions, {{"model", "m"}, {"prompt", "x"}, {"tempreature", 1}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParamOf(s), "tempreature");
  EXPECT_NE(s.message().find("tempreature"), std::string::npos) << s;

  s = Error(Endpoint::kCompletions, {{"model", "m"}, {"prompt", "x"}, {"frequency_penalty", 0.5}});
  EXPECT_EQ(ParamOf(s), "frequency_penalty");
  EXPECT_NE(s.message().find("not supported"), std::string::npos) << s;

  s = Error(Endpoint::kChat, {{"model", "m"},
                              {"messages", {{{"role", "user"}, {"content", "x"}}}},
                              {"tools", {{{"type", "function"}}}}});
  EXPECT_EQ(ParamOf(s), "tools");
  // A chat-only field on the completions endpoint is unknown there.
  s = Error(Endpoint::kCompletions, {{"model", "m"}, {"prompt", "x"}, {"messages", json::array()}});
  EXPECT_EQ(ParamOf(s), "messages");
  s = Error(Endpoint::kChat,
            {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "x"}, {"name", "a"}}}}});
  EXPECT_EQ(ParamOf(s), "messages[0].name");
}

TEST(OpenAiApiTest, NOtherThanOneIsRefusedSayingSo) {
  const absl::Status s = Error(Endpoint::kCompletions, {{"model", "m"}, {"prompt", "x"}, {"n", 2}});
  EXPECT_EQ(ParamOf(s), "n");
  EXPECT_NE(s.message().find("must be 1"), std::string::npos) << s;
}

TEST(OpenAiApiTest, WrongTypesAndMissingFieldsNameTheField) {
  EXPECT_EQ(ParamOf(Error(Endpoint::kCompletions,
                          {{"model", "m"}, {"prompt", "x"}, {"max_tokens", "5"}})),
            "max_tokens");
  EXPECT_EQ(
      ParamOf(Error(Endpoint::kCompletions, {{"model", "m"}, {"prompt", "x"}, {"stop", {1}}})),
      "stop");
  EXPECT_EQ(ParamOf(Error(Endpoint::kCompletions, {{"prompt", "x"}})), "model");
  EXPECT_EQ(ParamOf(Error(Endpoint::kCompletions, {{"model", "m"}})), "prompt");
  EXPECT_EQ(ParamOf(Error(Endpoint::kCompletions, {{"model", "m"}, {"prompt", {"a", "b"}}})),
            "prompt");
  EXPECT_EQ(ParamOf(Error(Endpoint::kChat, {{"model", "m"}, {"messages", json::array()}})),
            "messages");
  EXPECT_EQ(ParamOf(Error(Endpoint::kChat,
                          {{"model", "m"}, {"messages", {{{"role", "tool"}, {"content", "x"}}}}})),
            "messages[0].role");
  EXPECT_EQ(ParamOf(Error(Endpoint::kChat, {{"model", "m"},
                                            {"messages", {{{"role", "user"}, {"content", "x"}}}},
                                            {"top_logprobs", 2}})),
            "top_logprobs");
  EXPECT_EQ(ParamOf(Error(
                Endpoint::kCompletions,
                {{"model", "m"}, {"prompt", "x"}, {"stream_options", {{"include_usage", true}}}})),
            "stream_options");
  const absl::StatusOr<ParsedRequest> bad = ParseRequest(Endpoint::kCompletions, "{not json");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(OpenAiApiTest, ValidationErrorsUseTheApiNames) {
  const absl::Status s = ToApiNames(
      absl::InvalidArgumentError("stopping.max_new_tokens must be >= 1 (got 0)"), Endpoint::kChat);
  EXPECT_EQ(s.message(), "max_tokens must be >= 1 (got 0)");
  EXPECT_EQ(ParamOf(s), "max_tokens");
  EXPECT_EQ(ParamOf(ToApiNames(absl::InvalidArgumentError("sampling.temperature must be a number"),
                               Endpoint::kCompletions)),
            "temperature");
  EXPECT_EQ(ParamOf(ToApiNames(absl::InvalidArgumentError("prompt.text is empty"),
                               Endpoint::kCompletions)),
            "prompt");
  // Other codes pass through untouched.
  EXPECT_EQ(ToApiNames(absl::ResourceExhaustedError("queue full"), Endpoint::kChat).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(OpenAiApiTest, ErrorsHaveOpenAisShapeAndStatus) {
  const json e = ErrorJson(InvalidParam("n", "`n` must be 1"));
  ASSERT_TRUE(e.contains("error"));
  EXPECT_EQ(e["error"]["message"], "`n` must be 1");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "n");
  EXPECT_TRUE(e["error"].contains("code"));
  EXPECT_EQ(HttpStatus(absl::InvalidArgumentError("x")), 400);
  EXPECT_EQ(HttpStatus(absl::UnauthenticatedError("x")), 401);
  EXPECT_EQ(HttpStatus(absl::NotFoundError("x")), 404);
  EXPECT_EQ(HttpStatus(absl::ResourceExhaustedError("x")), 429);
  EXPECT_EQ(HttpStatus(absl::UnavailableError("x")), 503);
  const json nf = ErrorJson(WithParam(absl::NotFoundError("no such model"), "model"));
  EXPECT_EQ(nf["error"]["code"], "model_not_found");
  EXPECT_TRUE(ErrorJson(absl::UnavailableError("draining"))["error"]["param"].is_null());
}

TEST(OpenAiApiTest, ResponsesAndChunksHaveOpenAisShape) {
  const TokenText text = [](int32_t id) { return std::string(1, static_cast<char>('a' + id)); };
  ParsedRequest chat = Parse(Endpoint::kChat, {{"model", "m"},
                                               {"messages", {{{"role", "user"}, {"content", "x"}}}},
                                               {"logprobs", true},
                                               {"top_logprobs", 1}});
  Answer a;
  a.id = "chatcmpl-1";
  a.model = "m";
  a.text = "bc";
  a.ids = {1, 2};
  a.logprobs = {{-0.5f, {{1, -0.5f}}}, {-0.25f, {{2, -0.25f}}}};
  a.info.reason = Finish::kLength;
  a.info.prompt_tokens = 4;
  a.info.output_tokens = 2;
  json r = ResponseJson(chat, a, text);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["message"]["content"], "bc");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r["usage"]["total_tokens"], 6);
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][1]["token"], "c");
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][1]["top_logprobs"][0]["logprob"], -0.25);

  ParsedRequest cmpl =
      Parse(Endpoint::kCompletions, {{"model", "m"},
                                     {"prompt", "x"},
                                     {"logprobs", 1},
                                     {"stream", true},
                                     {"stream_options", {{"include_usage", true}}}});
  a.info.reason = Finish::kStop;
  r = ResponseJson(cmpl, a, text);
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["choices"][0]["text"], "bc");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["choices"][0]["logprobs"]["text_offset"], json({0, 1}));
  EXPECT_EQ(r["choices"][0]["logprobs"]["top_logprobs"][0]["b"], -0.5);

  Chunk c;
  c.text = "c";
  c.ids = {2};
  c.logprobs = {a.logprobs[1]};
  c.text_offset = 1;
  json chunk = ChunkJson(cmpl, "cmpl-1", 5, "m", c, text);
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(chunk.contains("usage") && chunk["usage"].is_null());
  EXPECT_EQ(chunk["choices"][0]["logprobs"]["text_offset"], json({1}));
  const json usage = UsageChunkJson(cmpl, "cmpl-1", 5, "m", a.info);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 2);

  Chunk first;
  first.first = true;
  chat.logprobs = false;
  json cf = ChunkJson(chat, "chatcmpl-1", 5, "m", first, text);
  EXPECT_EQ(cf["object"], "chat.completion.chunk");
  EXPECT_EQ(cf["choices"][0]["delta"]["role"], "assistant");
  Chunk last;
  last.last = true;
  last.reason = Finish::kStop;
  json cl = ChunkJson(chat, "chatcmpl-1", 5, "m", last, text);
  EXPECT_EQ(cl["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(cl["choices"][0]["delta"].empty());
}

}  // namespace
}  // namespace tpserve::openai
