// Conformance of tpserve::ChatTemplate with @huggingface/jinja (npm, the renderer of
// transformers.js): every template of tests/data/chat_templates/templates.json (DeepSeek-Coder
// 6.7B Instruct, Llama 3.1 8B Instruct, Qwen2.5 Instruct, Mistral 7B Instruct v0.3, and the
// bundled tiny-coder's own) renders every conversation of
// tests/chat_template_conformance/conversations.json. The test runs node on reference_js.mjs
// itself, so the reference always comes from the templates as they are now; the package is
// installed by tests/chat_template_conformance/setup.sh (into $TPSERVE_NPM_JINJA_CACHE or
// <repo>/.cache/npm-jinja). Outputs must be byte-identical; where the JS renderer raises, tpserve
// must fail too, with the same message when the template called raise_exception.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "coordinator/chat_template/chat_template.h"

namespace tpserve {
namespace {

namespace fs = std::filesystem;
using OrderedJson = nlohmann::ordered_json;

std::string SourceDir() {
  const char* s = std::getenv("TPSERVE_SOURCE_DIR");
  return s != nullptr ? s : ".";
}

fs::path NpmCache() {
  const char* s = std::getenv("TPSERVE_NPM_JINJA_CACHE");
  if (s != nullptr && *s != 0) return s;
  return fs::path(SourceDir()) / ".cache" / "npm-jinja";
}

std::string ReadBytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs reference_js.mjs and returns its results keyed by "template/conversation".
std::map<std::string, OrderedJson> RunJsReference() {
  const fs::path cache = NpmCache();
  if (!fs::exists(cache / "node_modules" / "@huggingface" / "jinja" / "package.json")) {
    ADD_FAILURE() << "@huggingface/jinja is not installed in " << cache
                  << ": run tests/chat_template_conformance/setup.sh first";
    return {};
  }
  const char* bin = std::getenv("TPSERVE_BINARY_DIR");
  const fs::path out = fs::path(bin != nullptr ? bin : fs::temp_directory_path().string()) /
                       "chat_template_reference_js.json";
  fs::remove(out);
  const std::string cmd =
      "timeout 120 node '" +
      (fs::path(SourceDir()) / "tests" / "chat_template_conformance" / "reference_js.mjs")
          .string() +
      "' '" + cache.string() + "' '" + SourceDir() + "' '" + out.string() + "'";
  const int rc = std::system(cmd.c_str());
  if (rc != 0 || !fs::exists(out)) {
    ADD_FAILURE() << "the JS reference failed (exit " << rc << "): " << cmd;
    return {};
  }
  OrderedJson ref = OrderedJson::parse(ReadBytes(out));
  std::map<std::string, OrderedJson> by_key;
  for (const auto& r : ref["results"]) {
    by_key[r["template"].get<std::string>() + "/" + r["conversation"].get<std::string>()] = r;
  }
  return by_key;
}

absl::StatusOr<std::unique_ptr<ChatTemplate>> LoadTemplate(const OrderedJson& spec) {
  const fs::path src(SourceDir());
  if (spec.contains("model_dir")) {
    return ChatTemplate::Load((src / spec["model_dir"].get<std::string>()).string());
  }
  const std::string text =
      ReadBytes(src / "tests" / "data" / "chat_templates" / spec["file"].get<std::string>());
  return ChatTemplate::FromString(text, spec["bos_token"], spec["eos_token"]);
}

TEST(ChatTemplateConformance, ByteIdenticalToHuggingFaceJinja) {
  const fs::path src(SourceDir());
  const OrderedJson templates =
      OrderedJson::parse(ReadBytes(src / "tests" / "data" / "chat_templates" / "templates.json"));
  const OrderedJson convs = OrderedJson::parse(
      ReadBytes(src / "tests" / "chat_template_conformance" / "conversations.json"));
  ASSERT_EQ(templates["templates"].size(), 5u);
  ASSERT_GE(convs["conversations"].size(), 12u);
  std::map<std::string, OrderedJson> ref = RunJsReference();
  ASSERT_FALSE(ref.empty());

  int identical = 0, both_raise = 0, mismatches = 0;
  for (const auto& spec : templates["templates"]) {
    const std::string tname = spec["name"];
    auto tmpl = LoadTemplate(spec);
    ASSERT_TRUE(tmpl.ok()) << tname << ": " << tmpl.status();
    for (const auto& c : convs["conversations"]) {
      const std::string key = tname + "/" + c["name"].get<std::string>();
      auto it = ref.find(key);
      ASSERT_NE(it, ref.end()) << "JS reference lacks " << key;
      const OrderedJson& r = it->second;
      const OrderedJson tools = c.contains("tools") ? c["tools"] : OrderedJson(nullptr);
      absl::StatusOr<std::string> got =
          (*tmpl)->RenderJson(c["messages"], c["add_generation_prompt"].get<bool>(), tools);
      if (r.contains("output")) {
        const std::string want = r["output"];
        if (!got.ok()) {
          ++mismatches;
          ADD_FAILURE() << key << ": tpserve failed where JS rendered\n  tpserve: " << got.status()
                        << "\n  JS: " << OrderedJson(want).dump();
        } else if (*got != want) {
          ++mismatches;
          size_t at = 0;
          while (at < got->size() && at < want.size() && (*got)[at] == want[at]) ++at;
          ADD_FAILURE() << key << ": outputs differ at byte " << at << "\n  tpserve: "
                        << OrderedJson(got->substr(at > 40 ? at - 40 : 0, 160)).dump()
                        << "\n  JS:      "
                        << OrderedJson(want.substr(at > 40 ? at - 40 : 0, 160)).dump();
        } else {
          ++identical;
        }
        continue;
      }
      const std::string js_error = r["error"];
      if (got.ok()) {
        ++mismatches;
        ADD_FAILURE() << key << ": JS raised \"" << js_error << "\" but tpserve rendered "
                      << OrderedJson(*got).dump();
        continue;
      }
      const std::string msg(got.status().message());
      // A template's raise_exception(msg) must give the same text in both renderers.
      if (msg.rfind("chat template line", 0) != 0 && msg != js_error) {
        ++mismatches;
        ADD_FAILURE() << key << ": raise_exception messages differ\n  tpserve: " << msg
                      << "\n  JS: " << js_error;
        continue;
      }
      ++both_raise;
    }
  }
  std::printf(
      "chat template conformance: %zu templates x %zu conversations: %d byte-identical "
      "outputs, %d raised in both, %d mismatches\n",
      templates["templates"].size(), convs["conversations"].size(), identical, both_raise,
      mismatches);
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(identical, 60);  // most renderings are outputs, not errors
  EXPECT_GE(both_raise, 3);  // Mistral's role checks and tiny-coder's raise are exercised
}

}  // namespace
}  // namespace tpserve
