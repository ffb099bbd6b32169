// Helpers of the service tests: a small random model with a byte-level tokenizer, and a
// coordinator process (with its spawned workers) that is always cleaned up.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/model_config.h"
#include "tests/testing/test_models.h"
#include "tools/random_model.h"

namespace tpserve::service_test {

namespace fs = std::filesystem;

inline std::string Utf8(int cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// A byte-level BPE tokenizer without merges: ids 0..2 are <unk>, <s>, </s>; byte b is id 3 + b.
inline std::string ByteTokenizerJson() {
  std::vector<int> bs, cs;
  for (int b = 33; b <= 126; ++b) bs.push_back(b);
  for (int b = 161; b <= 172; ++b) bs.push_back(b);
  for (int b = 174; b <= 255; ++b) bs.push_back(b);
  cs = bs;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
      bs.push_back(b);
      cs.push_back(256 + n++);
    }
  }
  nlohmann::json vocab = nlohmann::json::object();
  vocab["<unk>"] = 0;
  vocab["<s>"] = 1;
  vocab["</s>"] = 2;
  for (size_t i = 0; i < bs.size(); ++i) vocab[Utf8(cs[i])] = 3 + bs[i];
  auto special = [](int id, const char* content) {
    return nlohmann::json{{"id", id},        {"content", content}, {"single_word", false},
                          {"lstrip", false}, {"rstrip", false},    {"normalized", false},
                          {"special", true}};
  };
  nlohmann::json level = {{"type", "ByteLevel"},
                          {"add_prefix_space", false},
                          {"trim_offsets", true},
                          {"use_regex", true}};
  nlohmann::json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", {special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")}},
      {"normalizer", nullptr},
      {"pre_tokenizer", level},
      {"post_processor", nullptr},
      {"decoder", level},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"vocab", vocab},
        {"merges", nlohmann::json::array()}}}};
  return j.dump();
}

inline ModelConfig ServiceModelConfig() {
  // The worker tests' awkward GQA model, with a vocabulary of 256 bytes + 3 specials for the
  // byte-level test tokenizer and plain RoPE.
  ModelConfig c = testing_util::AwkwardConfig();
  c.vocab_size = 259;
  c.rope = RopeConfig();
  c.rope.theta = 10000;
  return c;
}

// models/tiny-coder when it exists, else (or with TPSERVE_SERVICE_TEST_MODEL=random) a random
// model with the byte tokenizer in the temp dir.
inline std::string ServiceModelDir() {
  const char* src = std::getenv("TPSERVE_SOURCE_DIR");
  const char* choice = std::getenv("TPSERVE_SERVICE_TEST_MODEL");
  const bool random = choice != nullptr && std::string(choice) == "random";
  const fs::path tiny = fs::path(src ? src : ".") / "models" / "tiny-coder";
  if (!random && fs::exists(tiny / "config.json") && fs::exists(tiny / "tokenizer.json")) {
    return tiny.string();
  }
  const fs::path dir = fs::path(::testing::TempDir()) / "tpserve_service_model";
  if (fs::exists(dir / "model.safetensors") && fs::exists(dir / "tokenizer.json")) {
    return dir.string();
  }
  fs::create_directories(dir);
  std::ofstream(dir / "source_config.json") << ModelConfigToJson(ServiceModelConfig());
  RandomModelOptions o;
  o.config_path = (dir / "source_config.json").string();
  o.out_dir = dir.string();
  o.seed = 11;
  o.dtype = DType::kF32;
  o.threads = 1;
  absl::Status st = WriteRandomModel(o);
  EXPECT_TRUE(st.ok()) << st;
  std::ofstream(dir / "tokenizer.json") << ByteTokenizerJson();
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"add_bos_token": true, "bos_token": "<s>", "eos_token": "</s>"})";
  return dir.string();
}

// Starts `args` (argv[0] a path) with stdout and stderr in `log_file` and one BLAS thread;
// `own_group`: in a new process group (so that killing the group takes its children too).
// Returns the child's pid (-1 when fork fails).
inline pid_t SpawnLogged(std::vector<std::string> args, const std::string& log_file,
                         bool own_group) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (own_group) setpgid(0, 0);
    FILE* log = std::fopen(log_file.c_str(), "w");
    dup2(fileno(log), 1);
    dup2(fileno(log), 2);
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// A tpserve-coordinator with --spawn-workers (CPU), on a free port. Killed (with its workers)
// when destroyed.
class ServerProcess {
 public:
  // `on_spawned` (optional) runs with the coordinator's pid right after it is started, before
  // it is ready (e.g. to start a thread that probes it during startup).
  static std::unique_ptr<ServerProcess> Start(
      const std::string& model_dir, std::vector<std::string> extra, int timeout_s = 90,
      const std::function<void(pid_t)>& on_spawned = nullptr) {
    auto p = std::unique_ptr<ServerProcess>(new ServerProcess());
    static int counter = 0;
    const fs::path tmp =
        fs::path(::testing::TempDir()) /
        ("tpserve_server_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    // A folder of an earlier run whose process had the same pid would hold a stale ready file
    // (an address nobody listens on): start from an empty one.
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    p->ready_file_ = (tmp / "ready").string();
    p->log_file_ = (tmp / "log").string();
    std::vector<std::string> args = {TPSERVE_COORDINATOR_BIN,
                                     "--model",
                                     model_dir,
                                     "--host",
                                     "127.0.0.1",
                                     "--port",
                                     "0",
                                     "--ready-file",
                                     p->ready_file_,
                                     "--spawn-workers",
                                     "--device",
                                     "cpu",
                                     "--worker-binary",
                                     TPSERVE_WORKER_BIN};
    // HTTP is off unless the test asks for it (its default port would collide between tests).
    if (std::find(extra.begin(), extra.end(), "--http-port") == extra.end()) {
      args.insert(args.end(), {"--http-port", "0"});
    }
    args.insert(args.end(), extra.begin(), extra.end());
    p->pid_ = SpawnLogged(std::move(args), p->log_file_, /*own_group=*/true);
    if (on_spawned) on_spawned(p->pid_);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    while (std::chrono::steady_clock::now() < end) {
      if (fs::exists(p->ready_file_)) {
        std::ifstream(p->ready_file_) >> p->address_;
        return p;
      }
      int status;
      if (waitpid(p->pid_, &status, WNOHANG) == p->pid_) {
        p->pid_ = -1;
        ADD_FAILURE() << "the coordinator exited during startup:\n" << p->Log();
        return nullptr;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << "the coordinator was not ready within " << timeout_s << " s:\n" << p->Log();
    return nullptr;
  }

  ~ServerProcess() { Stop(); }

  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }
  std::string Log() const {
    std::ifstream in(log_file_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  std::shared_ptr<grpc::Channel> Channel() const {
    return grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
  }

  // Pids of this server's worker processes (tpserve-worker processes descending from it).
  std::vector<pid_t> WorkerPids() const {
    auto parent = [](pid_t pid) {
      std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
      std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const size_t close = stat.rfind(')');
      int ppid = 0;
      if (close != std::string::npos) {
        std::istringstream fields(stat.substr(close + 2));
        char state;
        fields >> state >> ppid;
      }
      return static_cast<pid_t>(ppid);
    };
    auto descends = [&](pid_t pid) {
      for (int depth = 0; depth < 8 && pid > 1; ++depth) {
        pid = parent(pid);
        if (pid == pid_) return true;
      }
      return false;
    };
    std::vector<pid_t> pids;
    for (const auto& e : fs::directory_iterator("/proc")) {
      const std::string name = e.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream in(e.path() / "cmdline");
      std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      for (char& c : cmd) c = c == '\0' ? ' ' : c;
      if (cmd.find("tpserve-worker") != std::string::npos &&
          cmd.find(" --coordinator ") != std::string::npos &&
          cmd.find("mpirun") == std::string::npos && descends(std::stoi(name))) {
        pids.push_back(std::stoi(name));
      }
    }
    return pids;
  }

  // Waits up to `timeout` for the coordinator to exit by itself; returns its wait status, or -1
  // when it is still running (it is left running then). Its workers are killed either way.
  int WaitExit(std::chrono::milliseconds timeout) {
    if (pid_ <= 0) return -1;
    const std::vector<pid_t> workers = WorkerPids();
    const auto end = std::chrono::steady_clock::now() + timeout;
    int status = -1;
    while (waitpid(pid_, &status, WNOHANG) != pid_) {
      if (std::chrono::steady_clock::now() >= end) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    for (pid_t w : workers) kill(w, SIGKILL);
    kill(-pid_, SIGKILL);
    pid_ = -1;
    return status;
  }

  // SIGTERM (drain), then SIGKILL of the whole process group after `grace`; returns the exit
  // status (or -1).
  int Stop(std::chrono::seconds grace = std::chrono::seconds(20)) {
    if (pid_ <= 0) return -1;
    const std::vector<pid_t> workers = WorkerPids();
    kill(pid_, SIGTERM);
    int status = -1;
    const auto end = std::chrono::steady_clock::now() + grace;
    bool exited = false;
    while (std::chrono::steady_clock::now() < end) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!exited) {
      ADD_FAILURE() << "the coordinator did not exit within " << grace.count() << " s of SIGTERM:\n"
                    << Log();
      kill(-pid_, SIGKILL);
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
    }
    for (pid_t w : workers) kill(w, SIGKILL);  // no-op when they exited
    kill(-pid_, SIGKILL);
    pid_ = -1;
    return status;
  }

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  std::string ready_file_, log_file_, address_;
};

}  // namespace tpserve::service_test
