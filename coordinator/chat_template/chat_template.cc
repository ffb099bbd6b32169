// Loading a model's chat template from tokenizer_config.json and rendering conversations.
#include "coordinator/chat_template/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "coordinator/chat_template/jinja.h"

namespace tpserve {
namespace {

namespace fs = std::filesystem;
using OrderedJson = nlohmann::ordered_json;

absl::StatusOr<std::string> ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// bos_token / eos_token: a string, an AddedToken object {"content": ...}, null or absent.
std::string TokenText(const OrderedJson& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  return "";
}

// Nesting depth of a JSON value, without recursion (request bodies can be arbitrarily deep).
int JsonDepth(const OrderedJson& root) {
  int max_depth = 0;
  std::vector<std::pair<const OrderedJson*, int>> stack = {{&root, 0}};
  while (!stack.empty()) {
    auto [j, d] = stack.back();
    stack.pop_back();
    max_depth = std::max(max_depth, d);
    if (j->is_structured()) {
      for (const auto& child : *j) stack.emplace_back(&child, d + 1);
    }
  }
  return max_depth;
}

constexpr int kMaxJsonDepth = 64;

}  // namespace

ChatTemplate::~ChatTemplate() = default;

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::FromString(
    const std::string& source, const std::string& bos_token, const std::string& eos_token) {
  absl::StatusOr<std::unique_ptr<jinja::Template>> t = jinja::Template::Parse(source);
  if (!t.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("chat template ", t.status().message()));
  }
  std::unique_ptr<ChatTemplate> ct(new ChatTemplate());
  ct->template_ = std::move(*t);
  ct->source_ = source;
  ct->bos_token_ = bos_token;
  ct->eos_token_ = eos_token;
  return ct;
}

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::Load(const std::string& model_dir) {
  const fs::path config_path = fs::path(model_dir) / "tokenizer_config.json";
  OrderedJson config = OrderedJson::object();
  if (fs::exists(config_path)) {
    TP_ASSIGN_OR_RETURN(std::string text, ReadFile(config_path));
    config = OrderedJson::parse(text, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(config_path.string(), " is not a valid JSON object"));
    }
  }
  std::string source;
  auto it = config.find("chat_template");
  if (it != config.end() && it->is_string()) {
    source = it->get<std::string>();
  } else if (it != config.end() && it->is_array()) {
    std::vector<std::string> names;
    for (const auto& entry : *it) {
      if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
          !entry.contains("template") || !entry["template"].is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(config_path.string(),
                         ": chat_template list entries need string 'name' and 'template'"));
      }
      names.push_back(entry["name"].get<std::string>());
      if (names.back() == "default") source = entry["template"].get<std::string>();
    }
    if (source.empty()) {
      return absl::NotFoundError(
          absl::StrCat(config_path.string(),
                       ": no 'default' chat template among: ", absl::StrJoin(names, ", ")));
    }
  } else if (it != config.end() && !it->is_null()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path.string(), ": chat_template must be a string or a list"));
  } else if (fs::exists(fs::path(model_dir) / "chat_template.jinja")) {
    // Newer transformers save the template in its own file.
    TP_ASSIGN_OR_RETURN(source, ReadFile(fs::path(model_dir) / "chat_template.jinja"));
  } else {
    return absl::NotFoundError(absl::StrCat("model ", model_dir, " has no chat template (",
                                            config_path.string(), " has no chat_template)"));
  }
  absl::StatusOr<std::unique_ptr<ChatTemplate>> t =
      FromString(source, TokenText(config, "bos_token"), TokenText(config, "eos_token"));
  if (!t.ok()) return Annotate(t.status(), model_dir);
  return t;
}

absl::StatusOr<std::string> ChatTemplate::Render(const std::vector<ChatMessage>& messages,
                                                 bool add_generation_prompt) const {
  OrderedJson list = OrderedJson::array();
  for (const ChatMessage& m : messages) {
    OrderedJson o = OrderedJson::object();
    o["role"] = m.role;
    o["content"] = m.content;
    list.push_back(std::move(o));
  }
  return RenderJson(list, add_generation_prompt);
}

absl::StatusOr<std::string> ChatTemplate::RenderJson(const OrderedJson& messages,
                                                     bool add_generation_prompt,
                                                     const OrderedJson& tools) const {
  if (!messages.is_array()) return absl::InvalidArgumentError("messages must be a JSON array");
  if (JsonDepth(messages) > kMaxJsonDepth || JsonDepth(tools) > kMaxJsonDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat("messages or tools nested deeper than ", kMaxJsonDepth, " levels"));
  }
  jinja::Value vars = jinja::Value::NewObject();
  vars.object().Set("messages", jinja::Value::FromJson(messages));
  vars.object().Set("bos_token", jinja::Value::String(bos_token_));
  vars.object().Set("eos_token", jinja::Value::String(eos_token_));
  vars.object().Set("add_generation_prompt", jinja::Value::Bool(add_generation_prompt));
  // transformers always passes tools (None without tools).
  vars.object().Set("tools", jinja::Value::FromJson(tools));
  absl::StatusOr<std::string> out = template_->Render(vars);
  if (!out.ok() && !jinja::IsRaisedError(out.status())) {
    return absl::InvalidArgumentError(absl::StrCat("chat template ", out.status().message()));
  }
  return out;
}

}  // namespace tpserve
