// A model's chat template (tokenizer_config.json's `chat_template`), rendered the way Hugging
// Face transformers' apply_chat_template renders it: Jinja with trim_blocks and lstrip_blocks,
// variables messages, bos_token, eos_token, add_generation_prompt and tools.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

namespace tpserve {

namespace jinja {
class Template;
}

struct ChatMessage {
  std::string role;
  std::string content;
};

class ChatTemplate {
 public:
  // Loads tokenizer_config.json's chat_template from a model directory (a string, or a list of
  // {name, template} of which "default" is used; or else a chat_template.jinja file beside it).
  // NotFound when the model has none; InvalidArgument naming the construct (and its line) when
  // it cannot be rendered.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> Load(const std::string& model_dir);
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> FromString(const std::string& source,
                                                                  const std::string& bos_token,
                                                                  const std::string& eos_token);
  ~ChatTemplate();

  // A template's raise_exception(msg) is InvalidArgument with exactly msg; other render errors
  // are InvalidArgument "chat template line N: ...". Both mean the messages do not fit the model.
  absl::StatusOr<std::string> Render(const std::vector<ChatMessage>& messages,
                                     bool add_generation_prompt) const;

  // Messages as JSON objects with any fields the template reads (role, content, tool_calls,
  // name, ...), and the OpenAI `tools` array (null: no tools). Parse requests with
  // nlohmann::ordered_json: tojson writes keys in their order.
  absl::StatusOr<std::string> RenderJson(const nlohmann::ordered_json& messages,
                                         bool add_generation_prompt,
                                         const nlohmann::ordered_json& tools = nullptr) const;

  const std::string& source() const { return source_; }
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }

 private:
  ChatTemplate() = default;
  std::unique_ptr<jinja::Template> template_;
  std::string source_;
  std::string bos_token_;
  std::string eos_token_;
};

}  // namespace tpserve
