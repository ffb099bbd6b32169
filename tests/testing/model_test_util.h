// Helpers of the multiprocess model tests: random model directories and a single-rank
// reference (prompt logits and Generate results) packed into flat arrays so that one rank can
// compute it and broadcast it to the others.
#pragma once

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/logging.h"
#include "common/model_config.h"
#include "tests/testing/mp_test_util.h"
#include "tools/random_model.h"
#include "worker/engine.h"

namespace tpserve::mp_test {

// Writes a random model (fp32 weights) for `config` into `dir`.
inline bool WriteModelDir(const ModelConfig& config, const std::string& dir, uint64_t seed) {
  std::filesystem::create_directories(dir);
  const std::string config_path = dir + "/source_config.json";
  std::ofstream(config_path) << ModelConfigToJson(config);
  RandomModelOptions options;
  options.config_path = config_path;
  options.out_dir = dir;
  options.seed = seed;
  options.dtype = DType::kF32;
  options.threads = 1;
  absl::Status s = WriteRandomModel(options);
  EXPECT_TRUE(s.ok()) << s;
  return s.ok();
}

struct Reference {
  std::vector<std::vector<float>> prompt_logits;  // [prompt tokens][vocab]
  std::vector<GenerateResult> results;            // ids, finish reason, step logits, logprobs
};

// floats: the logits rows and logprobs; ints: the counts, ids and finish reasons.
inline void Pack(const Reference& ref, std::vector<float>& f, std::vector<int32_t>& n) {
  n.push_back(static_cast<int32_t>(ref.prompt_logits.size()));
  for (const auto& row : ref.prompt_logits) f.insert(f.end(), row.begin(), row.end());
  n.push_back(static_cast<int32_t>(ref.results.size()));
  for (const GenerateResult& r : ref.results) {
    n.push_back(r.finish_reason == "length" ? 1 : 2);
    n.push_back(static_cast<int32_t>(r.output_ids.size()));
    n.insert(n.end(), r.output_ids.begin(), r.output_ids.end());
    n.push_back(static_cast<int32_t>(r.step_logits.size()));
    for (const auto& row : r.step_logits) f.insert(f.end(), row.begin(), row.end());
    n.push_back(static_cast<int32_t>(r.logprobs.size()));
    for (const TokenLogprobs& t : r.logprobs) {
      f.push_back(t.logprob);
      n.push_back(static_cast<int32_t>(t.top.size()));
      for (const TokenLogprob& a : t.top) {
        n.push_back(a.id);
        f.push_back(a.logprob);
      }
    }
  }
}

inline Reference Unpack(const std::vector<float>& f, const std::vector<int32_t>& n, int64_t vocab) {
  Reference ref;
  size_t fi = 0, ni = 0;
  auto rows = [&](int count) {
    std::vector<std::vector<float>> out;
    for (int i = 0; i < count; ++i) {
      TP_CHECK(fi + vocab <= f.size()) << "reference blob too short";
      out.emplace_back(f.begin() + fi, f.begin() + fi + vocab);
      fi += vocab;
    }
    return out;
  };
  ref.prompt_logits = rows(n.at(ni++));
  const int num_results = n.at(ni++);
  for (int i = 0; i < num_results; ++i) {
    GenerateResult r;
    r.finish_reason = n.at(ni++) == 1 ? "length" : "stop";
    const int ids = n.at(ni++);
    r.output_ids.assign(n.begin() + ni, n.begin() + ni + ids);
    ni += ids;
    r.step_logits = rows(n.at(ni++));
    r.logprobs.resize(n.at(ni++));
    for (TokenLogprobs& t : r.logprobs) {
      t.logprob = f.at(fi++);
      t.top.resize(n.at(ni++));
      for (TokenLogprob& a : t.top) {
        a.id = n.at(ni++);
        a.logprob = f.at(fi++);
      }
    }
    ref.results.push_back(std::move(r));
  }
  TP_CHECK(fi == f.size() && ni == n.size()) << "reference blob of unexpected size";
  return ref;
}

// Collective: rank 0 computes `model`'s single-rank reference with `compute` and broadcasts
// it; every rank calls this with the same model, in the same order. Results are kept in
// `cache`. Null (with a test failure) when rank 0 could not compute it.
inline const Reference* SharedReference(Communicator& world,
                                        std::map<std::string, Reference>& cache,
                                        const std::string& model, int64_t vocab,
                                        const std::function<absl::StatusOr<Reference>()>& compute) {
  auto it = cache.find(model);
  if (it != cache.end()) return &it->second;
  std::vector<float> f;
  std::vector<int32_t> n;
  bool ok = true;
  if (WorldRank() == 0) {
    absl::StatusOr<Reference> ref = compute();
    ok = ref.ok();
    if (ok) {
      Pack(*ref, f, n);
    } else {
      ADD_FAILURE() << "single-rank reference of " << model << ": " << ref.status();
    }
  }
  absl::Status s = BroadcastBlob(world, 0, ok, f, n);
  if (!s.ok()) {
    ADD_FAILURE() << s;
    return nullptr;
  }
  return &(cache[model] = Unpack(f, n, vocab));
}

}  // namespace tpserve::mp_test
