// libFuzzer entry point for the chat-template interpreter (see CMakeLists.txt). An input is
// either a template, parsed and rendered against a fixed conversation with tools, or, after the
// line "//messages", a JSON value rendered as `messages` by the five conformance templates.
// Invariants: no crash, no sanitizer report, bounded work; every load error names its line.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/chat_template/chat_template.h"
#include "coordinator/chat_template/jinja.h"

namespace {

using OrderedJson = nlohmann::ordered_json;

std::vector<std::unique_ptr<tpserve::ChatTemplate>>* g_templates = nullptr;
tpserve::jinja::Value* g_context = nullptr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  g_templates = new std::vector<std::unique_ptr<tpserve::ChatTemplate>>();
  const char* src = std::getenv("TPSERVE_SOURCE_DIR");
  const std::string dir = std::string(src ? src : ".") + "/tests/data/chat_templates/";
  OrderedJson spec = OrderedJson::parse(ReadFile(dir + "templates.json"), nullptr, false);
  if (spec.is_discarded()) {
    std::fprintf(stderr, "chat_template_fuzzer: cannot read %stemplates.json\n", dir.c_str());
    std::abort();
  }
  for (const auto& t : spec["templates"]) {
    auto ct = t.contains("model_dir")
                  ? tpserve::ChatTemplate::Load(std::string(src ? src : ".") + "/" +
                                                t["model_dir"].get<std::string>())
                  : tpserve::ChatTemplate::FromString(ReadFile(dir + t["file"].get<std::string>()),
                                                      t["bos_token"], t["eos_token"]);
    if (!ct.ok()) {
      std::fprintf(stderr, "chat_template_fuzzer: %s\n",
                   std::string(ct.status().message()).c_str());
      std::abort();
    }
    g_templates->push_back(std::move(*ct));
  }
  g_context = new tpserve::jinja::Value(tpserve::jinja::Value::FromJson(OrderedJson::parse(R"({
    "messages": [
      {"role": "system", "content": "Be brief. 日本語 🙂"},
      {"role": "user", "content": "  Hi {{ there }}  "},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "abcdefghi", "type": "function",
        "function": {"name": "f", "arguments": {"x": [1, 2.5, null, true]}}}]},
      {"role": "tool", "tool_call_id": "abcdefghi", "content": "{\"ok\": 1}"},
      {"role": "user", "content": "e\u0301"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": true})")));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  static const std::string kMessages = "//messages\n";
  if (input.rfind(kMessages, 0) == 0) {
    OrderedJson messages = OrderedJson::parse(input.substr(kMessages.size()), nullptr, false);
    if (messages.is_discarded()) return 0;
    for (const auto& t : *g_templates) {
      (void)t->RenderJson(messages, true);
      (void)t->RenderJson(messages, false, OrderedJson::parse(R"([{"type": "function",
          "function": {"name": "g", "description": "d", "parameters": {}}}])"));
    }
    return 0;
  }
  auto tmpl = tpserve::jinja::Template::Parse(input);
  if (!tmpl.ok()) {
    if (std::string(tmpl.status().message()).rfind("line ", 0) != 0) {
      std::fprintf(stderr, "load error without a line: %s\n",
                   std::string(tmpl.status().message()).c_str());
      std::abort();
    }
    return 0;
  }
  tpserve::jinja::RenderLimits limits;
  limits.max_steps = 20000;
  limits.max_output_bytes = 1 << 20;
  (void)(*tmpl)->Render(*g_context, limits);
  return 0;
}
