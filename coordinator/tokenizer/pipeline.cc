// Normalizers, pre-tokenizers, decoders and post-processors, built from tokenizer.json and
// behaving like their HF tokenizers (Rust) counterparts.
#include "coordinator/tokenizer/pipeline.h"

#include <utf8proc.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "coordinator/tokenizer/bpe.h"
#include "coordinator/tokenizer/text_util.h"

namespace tpserve::tok {
namespace {

using json = nlohmann::json;

absl::Status Unsupported(const std::string& where, const std::string& type) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": unsupported type \"", type, "\""));
}

std::string TypeOf(const json& j) {
  if (j.is_object() && j.contains("type") && j["type"].is_string()) return j["type"];
  return "";
}

// Reads a {"String": s} / {"Regex": r} pattern object.
absl::StatusOr<std::unique_ptr<Regex>> MakePattern(const json& j, const std::string& where) {
  if (j.is_object() && j.contains("String") && j["String"].is_string()) {
    return Regex::Compile(j["String"].get<std::string>(), /*literal=*/true);
  }
  if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
    auto re = Regex::Compile(j["Regex"].get<std::string>(), /*literal=*/false);
    if (!re.ok())
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", re.status().message()));
    return re;
  }
  if (j.is_string()) return Regex::Compile(j.get<std::string>(), /*literal=*/true);
  return absl::InvalidArgumentError(absl::StrCat(where, ": expected {\"String\"|\"Regex\": ...}"));
}

// Replaces every match of `re` in `s` by `content`.
void ReplaceAll(const Regex& re, const std::string& content, std::string* s) {
  thread_local std::vector<std::pair<size_t, size_t>> matches;
  matches.clear();
  re.FindAll(*s, &matches);
  if (matches.empty()) return;
  std::string out;
  out.reserve(s->size());
  size_t prev = 0;
  for (auto [a, b] : matches) {
    out.append(*s, prev, a - prev);
    out.append(content);
    prev = b;
  }
  out.append(*s, prev, std::string::npos);
  *s = std::move(out);
}

bool IsAscii(std::string_view s) {
  for (unsigned char c : s) {
    if (c >= 0x80) return false;
  }
  return true;
}

// ------------------------------------------------------------------------------- normalizers

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(int options) : options_(options) {}
  void Normalize(std::string* s) const override {
    if (IsAscii(*s)) return;
    utf8proc_uint8_t* out = nullptr;
    utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s->data()), s->size(), &out,
                     static_cast<utf8proc_option_t>(options_ | UTF8PROC_STABLE));
    if (n >= 0) s->assign(reinterpret_cast<char*>(out), n);
    std::free(out);
  }

 private:
  int options_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  void Normalize(std::string* s) const override {
    std::string out;
    out.reserve(s->size());
    for (size_t i = 0; i < s->size();) {
      unsigned char c = (*s)[i];
      if (c < 0x80) {
        out.push_back(c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : static_cast<char>(c));
        ++i;
        continue;
      }
      int len;
      int32_t cp = DecodeCodePoint(*s, i, &len);
      if (cp == 0x130) {  // Rust's full lowercase mapping of U+0130 is "i\u0307"
        out.append("i\xCC\x87");
      } else {
        AppendCodePoint(&out, utf8proc_tolower(cp));
      }
      i += len;
    }
    *s = std::move(out);
  }
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string p) : prepend_(std::move(p)) {}
  void Normalize(std::string* s) const override {
    if (!s->empty()) s->insert(0, prepend_);
  }

 private:
  std::string prepend_;
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(std::unique_ptr<Regex> re, std::string content)
      : re_(std::move(re)), content_(std::move(content)) {}
  void Normalize(std::string* s) const override { ReplaceAll(*re_, content_, s); }

 private:
  std::unique_ptr<Regex> re_;
  std::string content_;
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void Normalize(std::string* s) const override {
    size_t a = 0, b = s->size();
    if (left_) {
      while (a < b) {
        int len;
        int32_t cp = DecodeCodePoint(*s, a, &len);
        if (!IsWhitespace(cp)) break;
        a += len;
      }
    }
    if (right_) {
      while (b > a) {
        size_t p = b - 1;
        while (p > a && ((*s)[p] & 0xC0) == 0x80) --p;
        int len;
        if (!IsWhitespace(DecodeCodePoint(*s, p, &len))) break;
        b = p;
      }
    }
    *s = s->substr(a, b - a);
  }

 private:
  bool left_, right_;
};

class StripAccentsNormalizer : public Normalizer {
 public:
  void Normalize(std::string* s) const override {
    if (IsAscii(*s)) return;
    std::string out;
    for (size_t i = 0; i < s->size();) {
      int len;
      int32_t cp = DecodeCodePoint(*s, i, &len);
      if (utf8proc_category(cp) != UTF8PROC_CATEGORY_MN) out.append(*s, i, len);
      i += len;
    }
    *s = std::move(out);
  }
};

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> items)
      : items_(std::move(items)) {}
  void Normalize(std::string* s) const override {
    for (const auto& n : items_) n->Normalize(s);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> items_;
};

// --------------------------------------------------------------------------- pre-tokenizers

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Span {
  size_t start, end;
  bool is_match;
};

absl::StatusOr<Behavior> ParseBehavior(const json& j, const std::string& where) {
  std::string b = j.is_string() ? j.get<std::string>() : "";
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  return absl::InvalidArgumentError(absl::StrCat(where, ".behavior: unknown \"", b, "\""));
}

// Splits `piece` given HF-style spans (covering the text) and a behaviour; appends non-empty
// parts to `out`. Mirrors NormalizedString::split.
void ApplySpans(const Piece& piece, std::vector<Span>* spans, Behavior behavior, bool invert,
                std::vector<Piece>* out) {
  if (invert) {
    for (auto& s : *spans) s.is_match = !s.is_match;
  }
  // (start, end, remove)
  thread_local std::vector<Span> res;
  res.clear();
  switch (behavior) {
    case Behavior::kIsolated:
      for (auto& s : *spans) res.push_back({s.start, s.end, false});
      break;
    case Behavior::kRemoved:
      for (auto& s : *spans) res.push_back({s.start, s.end, s.is_match});
      break;
    case Behavior::kContiguous: {
      bool prev_match = false;
      for (auto& s : *spans) {
        if (s.is_match == prev_match && !res.empty()) {
          res.back().end = s.end;
        } else {
          res.push_back({s.start, s.end, false});
        }
        prev_match = s.is_match;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool prev_match = false;
      for (auto& s : *spans) {
        if (s.is_match && !prev_match && !res.empty()) {
          res.back().end = s.end;
        } else {
          res.push_back({s.start, s.end, false});
        }
        prev_match = s.is_match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool prev_match = false;
      for (auto it = spans->rbegin(); it != spans->rend(); ++it) {
        if (it->is_match && !prev_match && !res.empty()) {
          res.back().start = it->start;
        } else {
          res.push_back({it->start, it->end, false});
        }
        prev_match = it->is_match;
      }
      std::reverse(res.begin(), res.end());
      break;
    }
  }
  for (const auto& r : res) {
    if (r.is_match /* remove */ || r.end == r.start) continue;
    out->push_back(
        Piece{piece.text.substr(r.start, r.end - r.start), piece.at_start && r.start == 0});
  }
}

// Spans for regex matches (HF's Pattern for Regex).
void RegexSpans(const Regex& re, std::string_view s, std::vector<Span>* spans) {
  spans->clear();
  if (s.empty()) {
    spans->push_back({0, 0, false});
    return;
  }
  thread_local std::vector<std::pair<size_t, size_t>> m;
  m.clear();
  re.FindAll(s, &m);
  size_t prev = 0;
  for (auto [a, b] : m) {
    if (prev != a) spans->push_back({prev, a, false});
    spans->push_back({a, b, true});
    prev = b;
  }
  if (prev != s.size()) spans->push_back({prev, s.size(), false});
}

// Spans for a character predicate (HF's Pattern for Fn(char) -> bool): each matching character
// is its own match.
template <typename Pred>
void CharSpans(std::string_view s, Pred pred, std::vector<Span>* spans) {
  spans->clear();
  size_t last_offset = 0, last_seen = 0;
  for (size_t i = 0; i < s.size();) {
    int len;
    int32_t cp = DecodeCodePoint(s, i, &len);
    last_seen = i + len;
    if (pred(cp)) {
      if (last_offset < i) spans->push_back({last_offset, i, false});
      spans->push_back({i, i + len, true});
      last_offset = i + len;
    }
    i += len;
  }
  if (last_seen > last_offset) spans->push_back({last_offset, last_seen, false});
}

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(std::unique_ptr<Regex> re, Behavior b, bool invert)
      : re_(std::move(re)), behavior_(b), invert_(invert) {}
  void PreTokenize(std::vector<Piece>* pieces, Arena* arena) const override {
    thread_local std::vector<Span> spans;
    std::vector<Piece> out;
    out.reserve(pieces->size() * 4);
    for (const Piece& p : *pieces) {
      RegexSpans(*re_, p.text, &spans);
      ApplySpans(p, &spans, behavior_, invert_, &out);
    }
    *pieces = std::move(out);
  }

 private:
  std::unique_ptr<Regex> re_;
  Behavior behavior_;
  bool invert_;
};

template <typename Pred>
class CharSplitPreTokenizer : public PreTokenizer {
 public:
  CharSplitPreTokenizer(Pred pred, Behavior b) : pred_(pred), behavior_(b) {}
  void PreTokenize(std::vector<Piece>* pieces, Arena* arena) const override {
    thread_local std::vector<Span> spans;
    std::vector<Piece> out;
    for (const Piece& p : *pieces) {
      CharSpans(p.text, pred_, &spans);
      ApplySpans(p, &spans, behavior_, false, &out);
    }
    *pieces = std::move(out);
  }

 private:
  Pred pred_;
  Behavior behavior_;
};

template <typename Pred>
std::unique_ptr<PreTokenizer> MakeCharSplit(Pred pred, Behavior b) {
  return std::make_unique<CharSplitPreTokenizer<Pred>>(pred, b);
}

constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::unique_ptr<Regex> re)
      : add_prefix_space_(add_prefix_space), re_(std::move(re)) {}
  void PreTokenize(std::vector<Piece>* pieces, Arena* arena) const override {
    thread_local std::vector<Span> spans;
    if (add_prefix_space_) {
      for (Piece& p : *pieces) {
        if (p.text.empty() || p.text[0] != ' ') {
          arena->push_back(absl::StrCat(" ", AbslView(p.text)));
          p.text = arena->back();
        }
      }
    }
    if (re_) {
      std::vector<Piece> out;
      for (const Piece& p : *pieces) {
        RegexSpans(*re_, p.text, &spans);
        ApplySpans(p, &spans, Behavior::kIsolated, false, &out);
      }
      *pieces = std::move(out);
    }
    if (map_bytes_) {
      const auto& table = ByteToCodePoint();
      for (Piece& p : *pieces) {
        std::string mapped;
        mapped.reserve(p.text.size() * 2);
        for (unsigned char c : p.text) AppendCodePoint(&mapped, table[c]);
        arena->push_back(std::move(mapped));
        p.text = arena->back();
      }
    }
  }
  bool IsByteLevel() const override { return true; }
  void set_map_bytes(bool m) { map_bytes_ = m; }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> re_;
  bool map_bytes_ = true;
};

enum class PrependScheme { kAlways, kFirst, kNever };

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void PreTokenize(std::vector<Piece>* pieces, Arena* arena) const override {
    std::vector<Piece> out;
    thread_local std::vector<Span> spans;
    int32_t rep_cp = 0;
    int len;
    if (!replacement_.empty()) rep_cp = DecodeCodePoint(replacement_, 0, &len);
    for (Piece& p : *pieces) {
      std::string t = absl::StrReplaceAll(AbslView(p.text), {{" ", replacement_}});
      bool starts = t.rfind(replacement_, 0) == 0;
      if (!starts &&
          (scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && p.at_start))) {
        t.insert(0, replacement_);
      }
      arena->push_back(std::move(t));
      p.text = arena->back();
      if (split_) {
        CharSpans(
            p.text, [rep_cp](int32_t cp) { return cp == rep_cp; }, &spans);
        ApplySpans(p, &spans, Behavior::kMergedWithNext, false, &out);
      } else if (!p.text.empty()) {
        out.push_back(p);
      }
    }
    *pieces = std::move(out);
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> items)
      : items_(std::move(items)) {}
  void PreTokenize(std::vector<Piece>* pieces, Arena* arena) const override {
    for (const auto& p : items_) p->PreTokenize(pieces, arena);
  }
  PreTokenizer* Last() override { return items_.empty() ? this : items_.back()->Last(); }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> items_;
};

// ------------------------------------------------------------------------------- decoders

class ByteLevelDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::string bytes;
    for (const std::string& t : *tokens) {
      size_t before = bytes.size();
      bool ok = true;
      for (size_t i = 0; i < t.size();) {
        int len;
        int b = ByteFromCodePoint(DecodeCodePoint(t, i, &len));
        if (b < 0) {
          ok = false;
          break;
        }
        bytes.push_back(static_cast<char>(b));
        i += len;
      }
      if (!ok) {
        bytes.resize(before);
        bytes.append(t);
      }
    }
    tokens->assign(1, Utf8Lossy(bytes));
  }
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, bool strip_first)
      : replacement_(std::move(replacement)), strip_first_(strip_first) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t i = 0; i < tokens->size(); ++i) {
      std::string& t = (*tokens)[i];
      t = absl::StrReplaceAll(t, {{replacement_, " "}});
      if (i == 0 && strip_first_ && !t.empty() && t[0] == ' ') t.erase(0, 1);
    }
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

class ByteFallbackDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (IsValidUtf8(pending)) {
        out.push_back(pending);
      } else {
        for (size_t i = 0; i < pending.size(); ++i) out.push_back("\xEF\xBF\xBD");
      }
      pending.clear();
    };
    for (std::string& t : *tokens) {
      int byte = -1;
      if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
        char* end = nullptr;
        std::string hex = t.substr(3, 2);
        long v = std::strtol(hex.c_str(), &end, 16);
        if (end == hex.c_str() + 2) byte = static_cast<int>(v);
      }
      if (byte >= 0) {
        pending.push_back(static_cast<char>(byte));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    *tokens = std::move(out);
  }
};

class FuseDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::string all;
    for (const auto& t : *tokens) all += t;
    tokens->assign(1, std::move(all));
  }
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(int32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) {
      std::vector<std::pair<size_t, int32_t>> chars;  // (byte offset, cp)
      for (size_t i = 0; i < t.size();) {
        int len;
        chars.emplace_back(i, DecodeCodePoint(t, i, &len));
        i += len;
      }
      size_t start_cut = 0;
      for (size_t i = 0; i < chars.size() && i < start_; ++i) {
        if (chars[i].second != content_) break;
        start_cut = i + 1;
      }
      size_t stop_cut = chars.size();
      for (size_t i = 0; i < stop_ && i < chars.size(); ++i) {
        size_t idx = chars.size() - 1 - i;
        if (chars[idx].second != content_) break;
        stop_cut = idx;
      }
      if (stop_cut < start_cut) stop_cut = start_cut;
      size_t a = start_cut < chars.size() ? chars[start_cut].first : t.size();
      size_t b = stop_cut < chars.size() ? chars[stop_cut].first : t.size();
      t = t.substr(a, b - a);
    }
  }

 private:
  int32_t content_;
  size_t start_, stop_;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(std::unique_ptr<Regex> re, std::string content)
      : re_(std::move(re)), content_(std::move(content)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) ReplaceAll(*re_, content_, &t);
  }

 private:
  std::unique_ptr<Regex> re_;
  std::string content_;
};

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> items)
      : items_(std::move(items)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (const auto& d : items_) d->DecodeChain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> items_;
};

absl::StatusOr<PrependScheme> ParsePrependScheme(const json& j, const std::string& where) {
  if (j.contains("prepend_scheme") && j["prepend_scheme"].is_string()) {
    std::string s = j["prepend_scheme"];
    if (s == "always") return PrependScheme::kAlways;
    if (s == "first") return PrependScheme::kFirst;
    if (s == "never") return PrependScheme::kNever;
    return absl::InvalidArgumentError(absl::StrCat(where, ".prepend_scheme: unknown \"", s, "\""));
  }
  return j.value("add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
}

const json& ArrayField(const json& j, std::initializer_list<const char*> names) {
  static const json kEmpty = json::array();
  for (const char* n : names) {
    if (j.contains(n) && j[n].is_array()) return j[n];
  }
  return kEmpty;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Normalizer>> MakeNormalizer(const json& j,
                                                           const std::string& where) {
  std::string type = TypeOf(j);
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(UTF8PROC_COMPOSE);
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(UTF8PROC_DECOMPOSE);
  if (type == "NFKC") {
    return std::make_unique<UnicodeNormalizer>(UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  }
  if (type == "NFKD") {
    return std::make_unique<UnicodeNormalizer>(UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  }
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(j.value("prepend", ""));
  if (type == "Replace") {
    auto re = MakePattern(j.value("pattern", json()), where + ".pattern");
    if (!re.ok()) return re.status();
    return std::make_unique<ReplaceNormalizer>(std::move(*re), j.value("content", ""));
  }
  if (type == "Strip") {
    return std::make_unique<StripNormalizer>(j.value("strip_left", true),
                                             j.value("strip_right", true));
  }
  if (type == "StripAccents") return std::make_unique<StripAccentsNormalizer>();
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> items;
    const json& arr = ArrayField(j, {"normalizers"});
    for (size_t i = 0; i < arr.size(); ++i) {
      auto n = MakeNormalizer(arr[i], absl::StrCat(where, ".normalizers[", i, "]"));
      if (!n.ok()) return n.status();
      items.push_back(std::move(*n));
    }
    return std::make_unique<SequenceNormalizer>(std::move(items));
  }
  return Unsupported(where, type);
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> MakePreTokenizer(const json& j,
                                                               const std::string& where) {
  std::string type = TypeOf(j);
  if (type == "Split") {
    auto re = MakePattern(j.value("pattern", json()), where + ".pattern");
    if (!re.ok()) return re.status();
    auto b = ParseBehavior(j.value("behavior", json()), where);
    if (!b.ok()) return b.status();
    return std::make_unique<SplitPreTokenizer>(std::move(*re), *b, j.value("invert", false));
  }
  if (type == "ByteLevel") {
    std::unique_ptr<Regex> re;
    if (j.value("use_regex", true)) {
      auto r = Regex::Compile(kGpt2Pattern, false);
      if (!r.ok()) return r.status();
      re = std::move(*r);
    }
    return std::make_unique<ByteLevelPreTokenizer>(j.value("add_prefix_space", true),
                                                   std::move(re));
  }
  if (type == "Digits") {
    Behavior b = j.value("individual_digits", false) ? Behavior::kIsolated : Behavior::kContiguous;
    return MakeCharSplit([](int32_t cp) { return IsNumeric(cp); }, b);
  }
  if (type == "Punctuation") {
    Behavior b = Behavior::kIsolated;
    if (j.contains("behavior")) {
      auto pb = ParseBehavior(j["behavior"], where);
      if (!pb.ok()) return pb.status();
      b = *pb;
    }
    return MakeCharSplit([](int32_t cp) { return IsPunctuation(cp); }, b);
  }
  if (type == "WhitespaceSplit") {
    return MakeCharSplit([](int32_t cp) { return IsWhitespace(cp); }, Behavior::kRemoved);
  }
  if (type == "Whitespace") {
    auto re = Regex::Compile(R"(\w+|[^\w\s]+)", false);
    if (!re.ok()) return re.status();
    return std::make_unique<SplitPreTokenizer>(std::move(*re), Behavior::kRemoved, true);
  }
  if (type == "BertPreTokenizer") {
    std::vector<std::unique_ptr<PreTokenizer>> items;
    items.push_back(MakeCharSplit([](int32_t cp) { return IsWhitespace(cp); }, Behavior::kRemoved));
    items.push_back(
        MakeCharSplit([](int32_t cp) { return IsPunctuation(cp); }, Behavior::kIsolated));
    return std::make_unique<SequencePreTokenizer>(std::move(items));
  }
  if (type == "Metaspace") {
    auto scheme = ParsePrependScheme(j, where);
    if (!scheme.ok()) return scheme.status();
    return std::make_unique<MetaspacePreTokenizer>(j.value("replacement", "\xE2\x96\x81"), *scheme,
                                                   j.value("split", true));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> items;
    const json& arr = ArrayField(j, {"pretokenizers", "pre_tokenizers"});
    for (size_t i = 0; i < arr.size(); ++i) {
      auto p = MakePreTokenizer(arr[i], absl::StrCat(where, ".pretokenizers[", i, "]"));
      if (!p.ok()) return p.status();
      items.push_back(std::move(*p));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(items));
  }
  return Unsupported(where, type);
}

void SetByteLevelMapping(PreTokenizer* byte_level, bool map_bytes) {
  static_cast<ByteLevelPreTokenizer*>(byte_level)->set_map_bytes(map_bytes);
}

absl::StatusOr<std::unique_ptr<Decoder>> MakeDecoder(const json& j, const std::string& where) {
  std::string type = TypeOf(j);
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    auto scheme = ParsePrependScheme(j, where);
    if (!scheme.ok()) return scheme.status();
    return std::make_unique<MetaspaceDecoder>(j.value("replacement", "\xE2\x96\x81"),
                                              *scheme != PrependScheme::kNever);
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    std::string content = j.value("content", " ");
    int len = 0;
    int32_t cp = content.empty() ? ' ' : DecodeCodePoint(content, 0, &len);
    return std::make_unique<StripDecoder>(cp, j.value("start", 0), j.value("stop", 0));
  }
  if (type == "Replace") {
    auto re = MakePattern(j.value("pattern", json()), where + ".pattern");
    if (!re.ok()) return re.status();
    return std::make_unique<ReplaceDecoder>(std::move(*re), j.value("content", ""));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> items;
    const json& arr = ArrayField(j, {"decoders"});
    for (size_t i = 0; i < arr.size(); ++i) {
      auto d = MakeDecoder(arr[i], absl::StrCat(where, ".decoders[", i, "]"));
      if (!d.ok()) return d.status();
      items.push_back(std::move(*d));
    }
    return std::make_unique<SequenceDecoder>(std::move(items));
  }
  return Unsupported(where, type);
}

absl::StatusOr<PostProcessor> MakePostProcessor(
    const json& j, const std::string& where,
    const std::function<std::optional<int32_t>(const std::string&)>& token_to_id) {
  std::string type = TypeOf(j);
  PostProcessor pp;
  if (type == "ByteLevel") return pp;
  if (type == "TemplateProcessing") {
    const json& single = ArrayField(j, {"single"});
    bool seen_sequence = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const json& item = single[i];
      if (item.contains("Sequence")) {
        seen_sequence = true;
        continue;
      }
      if (!item.contains("SpecialToken")) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".single[", i, "]: unknown item"));
      }
      std::string name = item["SpecialToken"].value("id", "");
      const json& specials = j.value("special_tokens", json::object());
      if (!specials.contains(name) || !specials[name].contains("ids")) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".special_tokens: missing \"", name, "\""));
      }
      auto& dst = seen_sequence ? pp.suffix : pp.prefix;
      for (const auto& id : specials[name]["ids"]) dst.push_back(id.get<int32_t>());
    }
    return pp;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    for (const char* key : {"cls", "sep"}) {
      if (!j.contains(key) || !j[key].is_array() || j[key].size() != 2) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".", key, ": expected [token, id]"));
      }
    }
    pp.prefix.push_back(j["cls"][1].get<int32_t>());
    pp.suffix.push_back(j["sep"][1].get<int32_t>());
    return pp;
  }
  if (type == "Sequence") {
    const json& arr = ArrayField(j, {"processors"});
    for (size_t i = 0; i < arr.size(); ++i) {
      auto p = MakePostProcessor(arr[i], absl::StrCat(where, ".processors[", i, "]"), token_to_id);
      if (!p.ok()) return p.status();
      // Each processor wraps the output of the previous one.
      pp.prefix.insert(pp.prefix.begin(), p->prefix.begin(), p->prefix.end());
      pp.suffix.insert(pp.suffix.end(), p->suffix.begin(), p->suffix.end());
    }
    return pp;
  }
  return Unsupported(where, type);
}

}  // namespace tpserve::tok
