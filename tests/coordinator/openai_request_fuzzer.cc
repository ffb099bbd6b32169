// libFuzzer target of the OpenAI-compatible request parser (coordinator/http/openai_api.cc): any
// body for /v1/completions or /v1/chat/completions either parses or is refused with an error
// naming a field or the JSON, without a crash or sanitizer report; errors map to 4xx.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "coordinator/http/openai_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto endpoint =
      data[0] % 2 == 0 ? tpserve::openai::Endpoint::kCompletions : tpserve::openai::Endpoint::kChat;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  const auto parsed = tpserve::openai::ParseRequest(endpoint, body);
  if (!parsed.ok()) {
    const int http = tpserve::openai::HttpStatus(parsed.status());
    if (http < 400 || http >= 500 || parsed.status().message().empty()) {
      std::fprintf(stderr, "a bad body got HTTP %d / '%s'\n", http,
                   std::string(parsed.status().message()).c_str());
      std::abort();
    }
  }
  return 0;
}
