// Unit tests for tpserve::Tokenizer: pipeline parts on HF's documented examples, added-token
// options, BPE details, invalid UTF-8, load errors and the tokenize/detokenize commands.
#include "coordinator/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>

#include "coordinator/tokenizer/pipeline.h"
#include "coordinator/tokenizer/text_util.h"
#include "nlohmann/json.hpp"
#include "tools/tokenize_cmd.h"

namespace tpserve {
namespace {

using json = nlohmann::json;
using tok::Piece;

std::vector<std::string> PreTokenize(const json& config, const std::string& text) {
  auto p = tok::MakePreTokenizer(config, "pre_tokenizer");
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return {};
  std::vector<Piece> pieces = {Piece{text, true}};
  tok::Arena arena;
  (*p)->PreTokenize(&pieces, &arena);
  std::vector<std::string> out;
  for (const auto& piece : pieces) out.emplace_back(piece.text);
  return out;
}

std::string Normalize(const json& config, std::string text) {
  auto n = tok::MakeNormalizer(config, "normalizer");
  EXPECT_TRUE(n.ok()) << n.status();
  if (n.ok()) (*n)->Normalize(&text);
  return text;
}

std::string DecodeTokens(const json& config, std::vector<std::string> tokens) {
  auto d = tok::MakeDecoder(config, "decoder");
  EXPECT_TRUE(d.ok()) << d.status();
  if (!d.ok()) return "";
  (*d)->DecodeChain(&tokens);
  std::string out;
  for (const auto& t : tokens) out += t;
  return out;
}

using V = std::vector<std::string>;

TEST(PreTokenizer, SplitBehaviours) {
  // The examples of the HF tokenizers documentation for SplitDelimiterBehavior.
  auto split = [](const char* behavior) {
    return PreTokenize({{"type", "Split"},
                        {"pattern", {{"String", "-"}}},
                        {"behavior", behavior},
                        {"invert", false}},
                       "the-final--countdown");
  };
  EXPECT_EQ(split("Removed"), (V{"the", "final", "countdown"}));
  EXPECT_EQ(split("Isolated"), (V{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(split("MergedWithPrevious"), (V{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(split("MergedWithNext"), (V{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(split("Contiguous"), (V{"the", "-", "final", "--", "countdown"}));
  // Inverted: the letters become the delimiters; HF's Contiguous then joins any two adjacent
  // spans of the same kind (NormalizedString::split: is_match == previous_match).
  EXPECT_EQ(PreTokenize({{"type", "Split"},
                         {"pattern", {{"String", "-"}}},
                         {"behavior", "Contiguous"},
                         {"invert", true}},
                        "a--b"),
            (V{"a", "--", "b"}));
}

TEST(PreTokenizer, SplitRegexInvertAndUnicode) {
  json inv = {{"type", "Split"},
              {"pattern", {{"Regex", "\\p{L}+"}}},
              {"behavior", "Removed"},
              {"invert", true}};
  EXPECT_EQ(PreTokenize(inv, "héllo, 世界! x"), (V{"héllo", "世界", "x"}));
  // Case-insensitive group and lookahead, as in the Llama 3 pattern.
  json l3 = {{"type", "Split"},
             {"pattern", {{"Regex", "(?i:'s|'t)|\\p{L}+|\\s+(?!\\S)|\\s+"}}},
             {"behavior", "Isolated"},
             {"invert", false}};
  EXPECT_EQ(PreTokenize(l3, "IT'S  ok"), (V{"IT", "'S", " ", " ", "ok"}));
}

TEST(PreTokenizer, WhitespaceDigitsPunctuationMetaspace) {
  EXPECT_EQ(PreTokenize({{"type", "Whitespace"}}, "Hey friend!     How are you?!?"),
            (V{"Hey", "friend", "!", "How", "are", "you", "?!?"}));
  EXPECT_EQ(PreTokenize({{"type", "WhitespaceSplit"}}, " a\tb\u3000c "), (V{"a", "b", "c"}));
  EXPECT_EQ(PreTokenize({{"type", "Digits"}, {"individual_digits", true}}, "Call 123 please"),
            (V{"Call ", "1", "2", "3", " please"}));
  EXPECT_EQ(PreTokenize({{"type", "Digits"}, {"individual_digits", false}}, "Call 123 please"),
            (V{"Call ", "123", " please"}));
  EXPECT_EQ(PreTokenize({{"type", "Punctuation"}, {"behavior", "Isolated"}}, "Hey friend!?"),
            (V{"Hey friend", "!", "?"}));
  EXPECT_EQ(PreTokenize({{"type", "Metaspace"},
                         {"replacement", "▁"},
                         {"prepend_scheme", "always"},
                         {"split", true}},
                        "Hey friend!"),
            (V{"▁Hey", "▁friend!"}));
  EXPECT_EQ(PreTokenize({{"type", "Metaspace"},
                         {"replacement", "▁"},
                         {"prepend_scheme", "never"},
                         {"split", false}},
                        "Hey friend!"),
            (V{"Hey▁friend!"}));
}

TEST(PreTokenizer, ByteLevel) {
  EXPECT_EQ(PreTokenize({{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}},
                        "Hello my friend, how's it going?"),
            (V{"ĠHello", "Ġmy", "Ġfriend", ",", "Ġhow", "'s", "Ġit", "Ġgoing", "?"}));
  EXPECT_EQ(PreTokenize({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}},
                        "é\n"),
            (V{"Ã©Ċ"}));
}

TEST(Normalizer, UnicodeAndText) {
  EXPECT_EQ(Normalize({{"type", "NFC"}}, "e\u0301"), "\u00e9");
  EXPECT_EQ(Normalize({{"type", "NFD"}}, "\u00e9"), "e\u0301");
  EXPECT_EQ(Normalize({{"type", "NFKC"}}, "ﬁ①ＡＢ"), "fi1AB");
  EXPECT_EQ(Normalize({{"type", "Lowercase"}}, "HeLLo ÀÉ ΣΑΣ"), "hello àé σασ");
  EXPECT_EQ(Normalize({{"type", "Sequence"},
                       {"normalizers",
                        {{{"type", "Prepend"}, {"prepend", "▁"}},
                         {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}},
                      "a b"),
            "▁a▁b");
  EXPECT_EQ(Normalize({{"type", "Prepend"}, {"prepend", "▁"}}, ""), "");
  EXPECT_EQ(Normalize({{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}}, " \t x \n"),
            "x");
  EXPECT_EQ(Normalize({{"type", "Replace"}, {"pattern", {{"Regex", "\\s+"}}}, {"content", " "}},
                      "a \t\n b"),
            "a b");
}

TEST(Decoder, SentencePieceChain) {
  json llama = {{"type", "Sequence"},
                {"decoders",
                 {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                  {{"type", "ByteFallback"}},
                  {{"type", "Fuse"}},
                  {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  EXPECT_EQ(DecodeTokens(llama, {"▁Hey", "▁friend", "<0xE2>", "<0x82>", "<0xAC>", "!"}),
            "Hey friend€!");
  // An incomplete byte sequence gives one U+FFFD per byte, like HF.
  EXPECT_EQ(DecodeTokens(llama, {"▁a", "<0xE2>", "<0x82>"}), "a\uFFFD\uFFFD");
  EXPECT_EQ(
      DecodeTokens({{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "always"}},
                   {"▁Hey", "▁friend"}),
      "Hey friend");
  EXPECT_EQ(DecodeTokens({{"type", "ByteLevel"}}, {"ĠHello", "Ġw", "Ã©", "<|x|>"}),
            " Hello wé<|x|>");
  // Byte-level bytes that are not UTF-8 decode lossily.
  EXPECT_EQ(DecodeTokens({{"type", "ByteLevel"}}, {"a", "Ã"}), "a\uFFFD");
}

// A small SentencePiece-style BPE with byte fallback and added tokens.
json SmallTokenizer() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}, {"▁", 3},    {"a", 4},  {"b", 5}, {"c", 6},
                {"▁a", 7},    {"ab", 8},  {"▁ab", 9},  {"abc", 10}, {" ", 11}, {"x", 12}};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    vocab[buf] = 100 + b;
  }
  return {{"model",
           {{"type", "BPE"},
            {"vocab", vocab},
            {"merges", {"▁ a", "a b", "▁a b", "ab c"}},
            {"unk_token", "<unk>"},
            {"byte_fallback", true},
            {"fuse_unk", true}}},
          {"normalizer",
           {{"type", "Sequence"},
            {"normalizers",
             {{{"type", "Prepend"}, {"prepend", "▁"}},
              {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}}},
          {"pre_tokenizer", nullptr},
          {"post_processor",
           {{"type", "TemplateProcessing"},
            {"single",
             {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
              {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}},
            {"special_tokens",
             {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}},
              {"</s>", {{"id", "</s>"}, {"ids", {2}}, {"tokens", {"</s>"}}}}}}}},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders",
             {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
              {{"type", "ByteFallback"}},
              {{"type", "Fuse"}},
              {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
          {"added_tokens",
           {{{"id", 0}, {"content", "<unk>"}, {"special", true}, {"normalized", false}},
            {{"id", 1}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
            {{"id", 2}, {"content", "</s>"}, {"special", true}, {"normalized", false}}}}};
}

std::unique_ptr<Tokenizer> Make(const json& j, const json& config = json::object()) {
  auto t = Tokenizer::FromJson(j.dump(), config.dump(), "test");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(Tokenizer, BpeMergesByteFallbackAndPostProcessor) {
  auto t = Make(SmallTokenizer());
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->Encode("abc ab", false), (std::vector<int32_t>{9, 6, 9}));  // ▁ab c ▁ab
  EXPECT_EQ(t->Encode("abc ab", true), (std::vector<int32_t>{1, 9, 6, 9, 2}));
  // "€" is not in the vocab: byte fallback <0xE2><0x82><0xAC>.
  EXPECT_EQ(t->Encode("a€", false), (std::vector<int32_t>{7, 100 + 0xE2, 100 + 0x82, 100 + 0xAC}));
  EXPECT_EQ(t->Decode(t->Encode("a€ ab", false), false), "a€ ab");
  // Added special tokens are matched before the normalizer, and each text part is normalized
  // on its own (so "b" after </s> gets its own ▁ prefix).
  EXPECT_EQ(t->Encode("<s>a</s>b", false), (std::vector<int32_t>{1, 7, 2, 3, 5}));
  EXPECT_EQ(t->Decode({1, 7, 2, 3, 5}, true), "a b");
  EXPECT_EQ(t->Decode({1, 7, 2, 3, 5}, false), "<s> a</s> b");
  EXPECT_EQ(t->vocab_size(), 356);
  EXPECT_EQ(t->TokenToId("abc"), 10);
  EXPECT_EQ(t->IdToToken(10), "abc");
  EXPECT_FALSE(t->IdToToken(99).has_value());
  EXPECT_TRUE(t->IsSpecial(1));
  EXPECT_FALSE(t->IsSpecial(7));
}

TEST(Tokenizer, UnknownTokensFuse) {
  json j = SmallTokenizer();
  j["model"]["byte_fallback"] = false;
  auto t = Make(j);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->Encode("a€€b", false), (std::vector<int32_t>{7, 0, 5}));  // fused <unk>
  j["model"]["fuse_unk"] = false;
  t = Make(j);
  EXPECT_EQ(t->Encode("a€€b", false), (std::vector<int32_t>{7, 0, 0, 5}));
}

TEST(Tokenizer, AddedTokenOptions) {
  auto with_added = [](json opts) {
    json j = SmallTokenizer();
    j["normalizer"] = nullptr;
    j["post_processor"] = nullptr;
    json a = {{"id", 50},        {"content", "<m>"}, {"special", true},     {"normalized", false},
              {"lstrip", false}, {"rstrip", false},  {"single_word", false}};
    for (auto& [k, v] : opts.items()) a[k] = v;
    j["added_tokens"].push_back(a);
    j["model"]["vocab"]["<m>"] = 50;
    j["model"]["byte_fallback"] = false;
    j["model"]["fuse_unk"] = false;
    return Make(j);
  };
  // 11 is " ", 4 "a", 5 "b", 0 <unk>.
  EXPECT_EQ(with_added({})->Encode("a <m> b", false), (std::vector<int32_t>{4, 11, 50, 11, 5}));
  EXPECT_EQ(with_added({{"lstrip", true}})->Encode("a  <m> b", false),
            (std::vector<int32_t>{4, 50, 11, 5}));
  EXPECT_EQ(with_added({{"rstrip", true}})->Encode("a <m>  b", false),
            (std::vector<int32_t>{4, 11, 50, 5}));
  auto sw = with_added({{"single_word", true}});
  EXPECT_EQ(sw->Encode("a <m> b", false), (std::vector<int32_t>{4, 11, 50, 11, 5}));
  EXPECT_EQ(sw->Encode("a<m> b", false), (std::vector<int32_t>{4, 0, 0, 0, 11, 5}));
  // normalized=true: matched after normalization (here a Lowercase normalizer).
  json j = SmallTokenizer();
  j["normalizer"] = {{"type", "Lowercase"}};
  j["post_processor"] = nullptr;
  j["added_tokens"].push_back(
      {{"id", 51}, {"content", "<x>"}, {"special", false}, {"normalized", true}});
  j["model"]["vocab"]["<x>"] = 51;
  auto t = Make(j);
  EXPECT_EQ(t->Encode("A<X>B", false), (std::vector<int32_t>{4, 51, 5}));
  EXPECT_EQ(t->Decode({4, 51, 5}, true), "a<x>b");  // not special: kept
}

TEST(Tokenizer, ConfigBosEos) {
  json j = SmallTokenizer();
  j["post_processor"] = nullptr;
  json cfg = {{"bos_token", {{"__type", "AddedToken"}, {"content", "<s>"}}},
              {"eos_token", "</s>"},
              {"add_bos_token", true},
              {"add_eos_token", false}};
  auto t = Make(j, cfg);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->bos_id(), 1);
  EXPECT_EQ(t->eos_id(), 2);
  EXPECT_TRUE(t->config_add_bos_token());
  EXPECT_FALSE(t->config_add_eos_token());
  // Like HF tokenizers: only the post-processor adds special tokens.
  EXPECT_EQ(t->Encode("ab", true), (std::vector<int32_t>{9}));
  t = Make(SmallTokenizer(), cfg);
  EXPECT_EQ(t->Encode("ab", true), (std::vector<int32_t>{1, 9, 2}));
  EXPECT_EQ(t->Encode("ab", false), (std::vector<int32_t>{9}));
}

TEST(Tokenizer, InvalidUtf8IsReplacedLikeFromUtf8Lossy) {
  EXPECT_EQ(tok::Utf8Lossy("a\xff"
                           "b"),
            "a\uFFFD"
            "b");
  EXPECT_EQ(tok::Utf8Lossy("\xe2\x82"), "\uFFFD");                  // truncated: one U+FFFD
  EXPECT_EQ(tok::Utf8Lossy("\xed\xa0\x80"), "\uFFFD\uFFFD\uFFFD");  // surrogate: per byte
  EXPECT_EQ(tok::Utf8Lossy("\xc0\xaf"), "\uFFFD\uFFFD");            // overlong
  EXPECT_EQ(tok::Utf8Lossy("\xf0\x9f\x98"
                           "x"),
            "\uFFFDx");
  auto t = Make(SmallTokenizer());
  EXPECT_EQ(t->Encode("a\xff"
                      "b",
                      false),
            t->Encode("a\uFFFD"
                      "b",
                      false));
}

TEST(Tokenizer, StreamingNeverSplitsCharacters) {
  auto t = Make(SmallTokenizer());
  std::string text = "ab €€ a😀b abc";
  std::vector<int32_t> ids = t->Encode(text, true);
  IncrementalDecoder dec(t.get(), /*skip_special_tokens=*/true);
  std::string all;
  for (int32_t id : ids) {
    std::string piece = dec.Add(id);
    EXPECT_TRUE(tok::IsValidUtf8(piece)) << piece;
    EXPECT_EQ(piece.find("\uFFFD"), std::string::npos);
    all += piece;
  }
  all += dec.Finish();
  EXPECT_EQ(all, t->Decode(ids, true));
  EXPECT_EQ(all, text);
  // A stream cut inside a character: Finish() yields what Decode gives (U+FFFD per byte).
  IncrementalDecoder cut(t.get(), false);
  std::string s = cut.Add(7);
  s += cut.Add(100 + 0xE2);
  s += cut.Add(100 + 0x82);
  EXPECT_EQ(s, "a");
  EXPECT_EQ(s + cut.Finish(), t->Decode({7, 100 + 0xE2, 100 + 0x82}, false));
}

TEST(Tokenizer, LoadErrorsNameTheProblem) {
  auto missing = Tokenizer::Load("/nonexistent/dir");
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/dir"), std::string::npos);
  auto bad = Tokenizer::FromJson("{not json", "", "x.json");
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("x.json"), std::string::npos);
  json j = SmallTokenizer();
  j["model"]["type"] = "Unigram";
  auto uni = Tokenizer::FromJson(j.dump(), "", "x.json");
  EXPECT_FALSE(uni.ok());
  EXPECT_NE(uni.status().message().find("Unigram"), std::string::npos);
  j = SmallTokenizer();
  j["pre_tokenizer"] = {{"type", "UnicodeScripts"}};
  auto pt = Tokenizer::FromJson(j.dump(), "", "x.json");
  EXPECT_FALSE(pt.ok());
  EXPECT_NE(pt.status().message().find("pre_tokenizer"), std::string::npos);
  j = SmallTokenizer();
  j["model"]["merges"].push_back("zz q");
  auto mg = Tokenizer::FromJson(j.dump(), "", "x.json");
  EXPECT_FALSE(mg.ok());
  EXPECT_NE(mg.status().message().find("merges[4]"), std::string::npos);
}

// Runs a command with `input` on stdin; returns stdout.
std::string RunWithStdin(absl::Status (*cmd)(const std::vector<std::string>&),
                         const std::vector<std::string>& args, const std::string& input,
                         absl::Status* status) {
  std::istringstream in(input);
  std::ostringstream out;
  auto* old_in = std::cin.rdbuf(in.rdbuf());
  auto* old_out = std::cout.rdbuf(out.rdbuf());
  *status = cmd(args);
  std::cin.rdbuf(old_in);
  std::cout.rdbuf(old_out);
  return out.str();
}

// Encode with a token limit gives the exact ids when they fit and otherwise stops soon after the
// limit with a prefix of the full encoding (what the service refuses without reading on).
TEST(Tokenizer, EncodeWithALimitStopsEarlyWithAPrefix) {
  const char* src = std::getenv("TPSERVE_SOURCE_DIR");
  auto tokenizer =
      Tokenizer::Load((std::filesystem::path(src ? src : ".") / "models" / "tiny-coder").string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "def f" + std::to_string(i) + "(x):\n    return x * 2\n";
  for (bool special : {false, true}) {
    const std::vector<int32_t> full = (*tokenizer)->Encode(text, special);
    ASSERT_GT(full.size(), 10000u);
    for (size_t limit : {size_t{0}, size_t{1}, size_t{100}, size_t{5000}, full.size() - 1}) {
      const std::vector<int32_t> ids = (*tokenizer)->Encode(text, special, limit);
      EXPECT_GT(ids.size(), limit);
      EXPECT_LT(ids.size(), limit + 64) << "it should stop within a piece of the limit";
      ASSERT_LE(ids.size(), full.size());
      EXPECT_TRUE(std::equal(ids.begin(), ids.end(), full.begin())) << limit;
    }
    for (size_t limit : {full.size(), full.size() + 1, std::numeric_limits<size_t>::max()}) {
      EXPECT_EQ((*tokenizer)->Encode(text, special, limit), full) << limit;
    }
  }
}

TEST(TokenizeCommand, RoundTrip) {
  std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "tok_cmd_test";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << SmallTokenizer().dump();
  absl::Status st;
  std::string ids = RunWithStdin(RunTokenizeCommand, {"--tokenizer", dir.string()}, "abc ab", &st);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(ids, "[9,6,9]\n");
  ids = RunWithStdin(RunTokenizeCommand,
                     {"--tokenizer", (dir / "tokenizer.json").string(), "--add-special-tokens"},
                     "abc ab", &st);
  EXPECT_EQ(ids, "[1,9,6,9,2]\n");
  std::string text =
      RunWithStdin(RunDetokenizeCommand, {"--tokenizer", dir.string()}, "[1, 9, 6, 9, 2]", &st);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(text, "<s> abc ab</s>");
  RunWithStdin(RunDetokenizeCommand, {"--tokenizer", dir.string()}, "[1, \"x\"]", &st);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("element 1"), std::string::npos);
  RunWithStdin(RunDetokenizeCommand, {"--tokenizer", dir.string()}, "[999999]", &st);
  EXPECT_FALSE(st.ok());
  RunWithStdin(RunTokenizeCommand, {}, "x", &st);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("tokenizer"), std::string::npos);
}

}  // namespace
}  // namespace tpserve
