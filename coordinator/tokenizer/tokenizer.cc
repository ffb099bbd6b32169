// Tokenizer: loading tokenizer.json / tokenizer_config.json, added-token extraction, the encode
// pipeline (normalize, pre-tokenize, BPE, post-process), decoding and streaming decoding.
#include "coordinator/tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "coordinator/tokenizer/bpe.h"
#include "coordinator/tokenizer/pipeline.h"
#include "coordinator/tokenizer/text_util.h"
#include "nlohmann/json.hpp"

namespace tpserve {
namespace tok {

using json = nlohmann::json;

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool single_word = false;
};

// Leftmost-longest matcher over a set of added tokens (a byte trie).
class TokenTrie {
 public:
  void Add(std::string_view s, int32_t index) {
    if (s.empty()) return;
    if (nodes_.empty()) nodes_.emplace_back();
    int32_t node = 0;
    for (unsigned char c : s) {
      auto it = nodes_[node].children.find(c);
      if (it == nodes_[node].children.end()) {
        int32_t next = static_cast<int32_t>(nodes_.size());
        nodes_[node].children[c] = next;
        nodes_.emplace_back();
        node = next;
      } else {
        node = it->second;
      }
    }
    if (nodes_[node].value < 0) nodes_[node].value = index;
    first_byte_[static_cast<unsigned char>(s[0])] = true;
  }
  bool empty() const { return nodes_.empty(); }
  // Finds the leftmost-longest match starting at or after `from`; returns false if none.
  bool Find(std::string_view s, size_t from, size_t* start, size_t* end, int32_t* index) const {
    for (size_t i = from; i < s.size(); ++i) {
      if (!first_byte_[static_cast<unsigned char>(s[i])]) continue;
      int32_t node = 0, best = -1;
      size_t best_end = 0;
      for (size_t k = i; k < s.size(); ++k) {
        auto it = nodes_[node].children.find(static_cast<unsigned char>(s[k]));
        if (it == nodes_[node].children.end()) break;
        node = it->second;
        if (nodes_[node].value >= 0) {
          best = nodes_[node].value;
          best_end = k + 1;
        }
      }
      if (best >= 0) {
        *start = i;
        *end = best_end;
        *index = best;
        return true;
      }
    }
    return false;
  }

 private:
  struct Node {
    absl::flat_hash_map<unsigned char, int32_t> children;
    int32_t value = -1;
  };
  std::vector<Node> nodes_;
  bool first_byte_[256] = {};
};

// A segment of input: either an added token (id >= 0) or text to process further.
struct Segment {
  size_t start, end;
  int32_t id;
};

class TokenizerImpl {
 public:
  absl::Status Init(const json& tj, const json& cfg, const std::string& source);

  // Stops early once `ids` holds more than `limit` ids (the caller refuses such a text).
  void Encode(std::string_view text, bool add_special_tokens, size_t limit,
              std::vector<int32_t>* ids) const;
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const;

  std::optional<int32_t> TokenToId(std::string_view token) const {
    auto it = added_by_content_.find(AbslView(token));
    if (it != added_by_content_.end()) return added_[it->second].id;
    return model_->TokenToId(token);
  }
  std::optional<std::string> IdToToken(int32_t id) const {
    auto it = added_by_id_.find(id);
    if (it != added_by_id_.end()) return added_[it->second].content;
    const std::string* s = model_->IdToToken(id);
    if (s == nullptr) return std::nullopt;
    return *s;
  }
  bool IsSpecial(int32_t id) const {
    auto it = added_by_id_.find(id);
    return it != added_by_id_.end() && added_[it->second].special;
  }

  std::optional<int32_t> bos_id, eos_id;
  bool add_bos = false, add_eos = false;  // tokenizer_config.json flags (not applied)
  int32_t vocab_size = 0;

 private:
  void SplitAddedTokens(std::string_view s, const TokenTrie& trie,
                        const std::vector<int32_t>& trie_tokens, std::vector<Segment>* out) const;
  void EncodeText(std::string_view text, bool at_start, size_t limit,
                  std::vector<int32_t>* ids) const;
  void EncodeNormalized(std::string text, bool at_start, size_t limit,
                        std::vector<int32_t>* ids) const;

  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<Decoder> decoder_;
  std::optional<PostProcessor> post_processor_;
  bool byte_mode_ = false;

  std::vector<AddedToken> added_;
  absl::flat_hash_map<std::string, size_t> added_by_content_;
  absl::flat_hash_map<int32_t, size_t> added_by_id_;
  TokenTrie raw_trie_, normalized_trie_;
  std::vector<int32_t> raw_trie_tokens_, normalized_trie_tokens_;  // trie index -> added_ index
};

namespace {

std::optional<std::string> ConfigToken(const json& cfg, const char* key) {
  if (!cfg.is_object() || !cfg.contains(key)) return std::nullopt;
  const json& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) {
    return v["content"].get<std::string>();
  }
  return std::nullopt;
}

bool EndsWithWord(std::string_view s) {
  if (s.empty()) return false;
  size_t p = s.size() - 1;
  while (p > 0 && (s[p] & 0xC0) == 0x80) --p;
  int len;
  return IsWordChar(DecodeCodePoint(s, p, &len));
}

bool StartsWithWord(std::string_view s) {
  if (s.empty()) return false;
  int len;
  return IsWordChar(DecodeCodePoint(s, 0, &len));
}

}  // namespace

absl::Status TokenizerImpl::Init(const json& tj, const json& cfg, const std::string& source) {
  if (!tj.is_object()) return absl::InvalidArgumentError(source + ": not a JSON object");
  if (!tj.contains("model") || !tj["model"].is_object()) {
    return absl::InvalidArgumentError(source + ": missing field \"model\"");
  }
  const json& model = tj["model"];
  std::string model_type = model.value("type", "BPE");
  if (model_type != "BPE") {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": model.type \"", model_type, "\" is not supported (only BPE)"));
  }
  auto bpe = BpeModel::FromJson(model);
  if (!bpe.ok()) return Annotate(bpe.status(), source);
  model_ = std::move(*bpe);

  auto field = [&](const char* name) -> const json* {
    if (tj.contains(name) && !tj[name].is_null()) return &tj[name];
    return nullptr;
  };
  if (const json* n = field("normalizer")) {
    auto r = MakeNormalizer(*n, "normalizer");
    if (!r.ok()) return Annotate(r.status(), source);
    normalizer_ = std::move(*r);
  }
  if (const json* p = field("pre_tokenizer")) {
    auto r = MakePreTokenizer(*p, "pre_tokenizer");
    if (!r.ok()) return Annotate(r.status(), source);
    pre_tokenizer_ = std::move(*r);
    PreTokenizer* last = pre_tokenizer_->Last();
    if (last->IsByteLevel() && model_->EnableByteMode()) {
      SetByteLevelMapping(last, false);
      byte_mode_ = true;
    }
  }
  if (const json* d = field("decoder")) {
    auto r = MakeDecoder(*d, "decoder");
    if (!r.ok()) return Annotate(r.status(), source);
    decoder_ = std::move(*r);
  }

  // Added tokens.
  if (const json* at = field("added_tokens")) {
    if (!at->is_array()) return absl::InvalidArgumentError(source + ": added_tokens: not an array");
    for (size_t i = 0; i < at->size(); ++i) {
      const json& t = (*at)[i];
      if (!t.contains("content") || !t["content"].is_string() || !t.contains("id")) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": added_tokens[", i, "]: needs content and id"));
      }
      AddedToken a;
      a.content = t["content"].get<std::string>();
      a.id = t["id"].get<int32_t>();
      a.special = t.value("special", false);
      a.lstrip = t.value("lstrip", false);
      a.rstrip = t.value("rstrip", false);
      a.normalized = t.value("normalized", !a.special);
      a.single_word = t.value("single_word", false);
      added_by_content_[a.content] = added_.size();
      added_by_id_[a.id] = added_.size();
      added_.push_back(std::move(a));
    }
  }
  for (size_t i = 0; i < added_.size(); ++i) {
    const AddedToken& a = added_[i];
    if (a.normalized) {
      std::string content = a.content;
      if (normalizer_) normalizer_->Normalize(&content);
      normalized_trie_.Add(content, static_cast<int32_t>(normalized_trie_tokens_.size()));
      normalized_trie_tokens_.push_back(static_cast<int32_t>(i));
    } else {
      raw_trie_.Add(a.content, static_cast<int32_t>(raw_trie_tokens_.size()));
      raw_trie_tokens_.push_back(static_cast<int32_t>(i));
    }
  }

  auto resolve = [this](const std::string& t) { return TokenToId(t); };
  if (const json* pp = field("post_processor")) {
    auto r = MakePostProcessor(*pp, "post_processor", resolve);
    if (!r.ok()) return Annotate(r.status(), source);
    post_processor_ = std::move(*r);
  }

  // tokenizer_config.json
  if (auto b = ConfigToken(cfg, "bos_token")) bos_id = TokenToId(*b);
  if (auto e = ConfigToken(cfg, "eos_token")) eos_id = TokenToId(*e);
  if (cfg.is_object()) {
    auto flag = [&](const char* key) {
      return cfg.contains(key) && cfg[key].is_boolean() && cfg[key].get<bool>();
    };
    add_bos = flag("add_bos_token");
    add_eos = flag("add_eos_token");
  }

  vocab_size = model_->max_id() + 1;
  for (const auto& a : added_) vocab_size = std::max(vocab_size, a.id + 1);
  return absl::OkStatus();
}

void TokenizerImpl::SplitAddedTokens(std::string_view s, const TokenTrie& trie,
                                     const std::vector<int32_t>& trie_tokens,
                                     std::vector<Segment>* out) const {
  out->clear();
  size_t start_offset = 0, pos = 0;
  size_t ms, me;
  int32_t index;
  while (!trie.empty() && trie.Find(s, pos, &ms, &me, &index)) {
    pos = me;
    const AddedToken& a = added_[trie_tokens[index]];
    size_t start = ms, stop = me;
    if (a.single_word) {
      bool start_space = start == 0 || !EndsWithWord(s.substr(0, start));
      bool stop_space = stop == s.size() || !StartsWithWord(s.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (a.lstrip) {
      size_t new_start = start;
      while (new_start > 0) {
        size_t p = new_start - 1;
        while (p > 0 && (s[p] & 0xC0) == 0x80) --p;
        int len;
        if (!IsWhitespace(DecodeCodePoint(s, p, &len))) break;
        new_start = p;
      }
      start = std::max(new_start, start_offset);
    }
    if (a.rstrip) {
      while (stop < s.size()) {
        int len;
        if (!IsWhitespace(DecodeCodePoint(s, stop, &len))) break;
        stop += len;
      }
      pos = stop;
    }
    if (start_offset < start) out->push_back({start_offset, start, -1});
    out->push_back({start, stop, a.id});
    start_offset = stop;
  }
  if (start_offset < s.size()) out->push_back({start_offset, s.size(), -1});
}

void TokenizerImpl::Encode(std::string_view text, bool add_special_tokens, size_t limit,
                           std::vector<int32_t>* ids) const {
  std::string repaired;
  if (!IsValidUtf8(text)) {
    repaired = Utf8Lossy(text);
    text = repaired;
  }
  if (add_special_tokens && post_processor_) {
    ids->insert(ids->end(), post_processor_->prefix.begin(), post_processor_->prefix.end());
  }
  if (raw_trie_.empty()) {
    EncodeText(text, true, limit, ids);
  } else {
    std::vector<Segment> segs;
    SplitAddedTokens(text, raw_trie_, raw_trie_tokens_, &segs);
    for (const Segment& s : segs) {
      if (ids->size() > limit) return;
      if (s.id >= 0) {
        ids->push_back(s.id);
      } else {
        EncodeText(text.substr(s.start, s.end - s.start), s.start == 0, limit, ids);
      }
    }
  }
  if (ids->size() > limit) return;
  if (add_special_tokens && post_processor_) {
    ids->insert(ids->end(), post_processor_->suffix.begin(), post_processor_->suffix.end());
  }
}

void TokenizerImpl::EncodeText(std::string_view text, bool at_start, size_t limit,
                               std::vector<int32_t>* ids) const {
  std::string normalized(text);
  if (normalizer_) normalizer_->Normalize(&normalized);
  if (normalized_trie_.empty()) {
    EncodeNormalized(std::move(normalized), at_start, limit, ids);
    return;
  }
  std::vector<Segment> segs;
  SplitAddedTokens(normalized, normalized_trie_, normalized_trie_tokens_, &segs);
  for (const Segment& s : segs) {
    if (ids->size() > limit) return;
    if (s.id >= 0) {
      ids->push_back(s.id);
    } else {
      EncodeNormalized(normalized.substr(s.start, s.end - s.start), at_start && s.start == 0, limit,
                       ids);
    }
  }
}

void TokenizerImpl::EncodeNormalized(std::string text, bool at_start, size_t limit,
                                     std::vector<int32_t>* ids) const {
  if (text.empty()) return;
  BpeModel::WordCache* cache = model_->ThreadCache();
  if (!pre_tokenizer_) {
    model_->Tokenize(text, byte_mode_, cache, ids);
    return;
  }
  std::vector<Piece> pieces;
  Arena arena;
  pieces.push_back(Piece{text, at_start});
  pre_tokenizer_->PreTokenize(&pieces, &arena);
  for (const Piece& p : pieces) {
    if (ids->size() > limit) return;
    model_->Tokenize(p.text, byte_mode_, cache, ids);
  }
}

std::string TokenizerImpl::Decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    auto it = added_by_id_.find(id);
    if (it != added_by_id_.end()) {
      const AddedToken& a = added_[it->second];
      if (skip_special_tokens && a.special) continue;
      tokens.push_back(a.content);
      continue;
    }
    const std::string* s = model_->IdToToken(id);
    if (s != nullptr) tokens.push_back(*s);
  }
  std::string out;
  if (decoder_) {
    decoder_->DecodeChain(&tokens);
    for (const auto& t : tokens) out += t;
  } else {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) out += ' ';
      out += tokens[i];
    }
  }
  return out;
}

}  // namespace tok

// ------------------------------------------------------------------------------ Tokenizer

namespace {

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<tok::TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path_or_dir) {
  namespace fs = std::filesystem;
  fs::path path(path_or_dir);
  std::error_code ec;
  if (fs::is_directory(path, ec)) path /= "tokenizer.json";
  if (!fs::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat("tokenizer file not found: ", path.string()));
  }
  TP_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  std::string config;
  fs::path config_path = path.parent_path() / "tokenizer_config.json";
  if (fs::exists(config_path, ec)) {
    TP_ASSIGN_OR_RETURN(config, ReadFile(config_path));
  }
  return FromJson(text, config, path.string());
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view tokenizer_json,
                                                               std::string_view config_json,
                                                               std::string_view source_name) {
  std::string source(source_name);
  tok::json tj = tok::json::parse(tokenizer_json, nullptr, /*allow_exceptions=*/false);
  if (tj.is_discarded()) return absl::InvalidArgumentError(source + ": invalid JSON");
  tok::json cfg = tok::json::object();
  if (!config_json.empty()) {
    cfg = tok::json::parse(config_json, nullptr, false);
    if (cfg.is_discarded()) {
      return absl::InvalidArgumentError(source + ": tokenizer_config.json: invalid JSON");
    }
  }
  auto impl = std::make_unique<tok::TokenizerImpl>();
  try {
    TP_RETURN_IF_ERROR(impl->Init(tj, cfg, source));
  } catch (const tok::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": unexpected JSON value: ", e.what()));
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  impl_->Encode(text, add_special_tokens, std::numeric_limits<size_t>::max(), &ids);
  return ids;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special_tokens,
                                       size_t max_tokens) const {
  std::vector<int32_t> ids;
  ids.reserve(std::min(text.size() / 3, max_tokens) + 4);
  impl_->Encode(text, add_special_tokens, max_tokens, &ids);
  return ids;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  return impl_->Decode(ids, skip_special_tokens);
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  return impl_->TokenToId(token);
}
std::optional<std::string> Tokenizer::IdToToken(int32_t id) const { return impl_->IdToToken(id); }
bool Tokenizer::IsSpecial(int32_t id) const { return impl_->IsSpecial(id); }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos_id; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos_id; }
bool Tokenizer::config_add_bos_token() const { return impl_->add_bos; }
bool Tokenizer::config_add_eos_token() const { return impl_->add_eos; }
int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

// ----------------------------------------------------------------------- IncrementalDecoder

IncrementalDecoder::IncrementalDecoder(const Tokenizer* tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string IncrementalDecoder::Add(int32_t id) {
  ids_.push_back(id);
  std::vector<int32_t> window(ids_.begin() + prefix_offset_, ids_.begin() + read_offset_);
  std::string prefix_text = tokenizer_->Decode(window, skip_special_tokens_);
  window.assign(ids_.begin() + prefix_offset_, ids_.end());
  std::string new_text = tokenizer_->Decode(window, skip_special_tokens_);
  // Text ending in U+FFFD may still be an incomplete character: hold it back. A UTF-8 character
  // spans at most 4 bytes, so after kMaxHeldTokens tokens the U+FFFD is final (this also bounds
  // the window, keeping Add O(1) per token on garbage streams).
  constexpr size_t kMaxHeldTokens = 16;
  bool held_long = ids_.size() - read_offset_ > kMaxHeldTokens;
  if (new_text.size() > prefix_text.size() &&
      (held_long || !tok::EndsWithReplacementChar(new_text)) &&
      new_text.compare(0, prefix_text.size(), prefix_text) == 0) {
    prefix_offset_ = read_offset_;
    read_offset_ = ids_.size();
    return new_text.substr(prefix_text.size());
  }
  return "";
}

std::string IncrementalDecoder::Finish() {
  std::vector<int32_t> window(ids_.begin() + prefix_offset_, ids_.begin() + read_offset_);
  std::string prefix_text = tokenizer_->Decode(window, skip_special_tokens_);
  window.assign(ids_.begin() + prefix_offset_, ids_.end());
  std::string new_text = tokenizer_->Decode(window, skip_special_tokens_);
  prefix_offset_ = read_offset_ = ids_.size();
  if (new_text.size() > prefix_text.size() &&
      new_text.compare(0, prefix_text.size(), prefix_text) == 0) {
    return new_text.substr(prefix_text.size());
  }
  return "";
}

}  // namespace tpserve
