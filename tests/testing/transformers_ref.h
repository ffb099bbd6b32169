// The comparison of our logits with Hugging Face transformers on the random
// DeepSeek-Coder-6.7B-shaped checkpoint (tools/hf_reference.py; the GPU job makes the files):
// an fp32 greedy run (the truth: the prompt, the greedy ids and the logits that chose them) and a
// bf16 run teacher-forced over the same ids.
//
// A random-weight model has low-signal logits, so bf16 rounding alone moves them by several
// percent; a fixed tolerance would be a guess. The bar is transformers' own bf16 run: row by
// row, our error against fp32 must stay within kMaxErrRatio of transformers bf16's error against
// fp32 (different but equally valid rounding points: a wrong RoPE, mask, KV slot or shard gives
// errors many times larger). A row's argmax is checked unless the fp32 top-2 gap is within
// kNoiseGaps x the RMS difference between transformers bf16 and fp32 on that row (a near-tie at
// bf16's noise level).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/safetensors.h"

namespace tpserve::hf_ref {

inline constexpr double kMaxErrRatio = 1.5;
inline constexpr double kNoiseGaps = 4.0;

template <typename T>
std::vector<T> ReadTensor(const SafetensorsFile& f, const std::string& name) {
  const SafetensorsTensorInfo* info = f.Find(name);
  EXPECT_NE(info, nullptr) << name;
  if (info == nullptr) return {};
  std::vector<T> out(info->numel());
  if (info->dtype == DType::kI32) {
    auto raw = f.RawBytes(name);
    std::memcpy(out.data(), raw->data(), raw->size());
  } else {
    EXPECT_TRUE(f.Read(name, info->shape, DType::kF32, out.data()).ok());
  }
  return out;
}

inline double RelErr(const float* got, const float* want, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += double(got[i] - want[i]) * (got[i] - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / den);
}

inline size_t Argmax(const float* v, size_t n) { return std::max_element(v, v + n) - v; }

inline double Top2Gap(const float* v, size_t n) {
  float a = -INFINITY, b = -INFINITY;
  for (size_t i = 0; i < n; ++i) {
    if (v[i] > a) {
      b = a;
      a = v[i];
    } else if (v[i] > b) {
      b = v[i];
    }
  }
  return a - b;
}

// The two runs, row by row: row i holds the logits that chose greedy[i] (prefill's last row,
// then the decode rows).
struct Refs {
  std::vector<int32_t> prompt, greedy;
  std::vector<std::vector<float>> fp32, bf16;
  // prompt + greedy[:-1]: scored in one prefill, its row prompt.size() - 1 + i is row i.
  std::vector<int32_t> ScoredIds() const {
    std::vector<int32_t> ids = prompt;
    ids.insert(ids.end(), greedy.begin(), greedy.end() - 1);
    return ids;
  }
};

// Reads the fp32 run `ref_path` and the teacher-forced bf16 run `bf16_path` (checked to share
// the fp32 run's ids) for a vocabulary of `vocab`.
inline absl::StatusOr<Refs> Load(const std::string& ref_path, const std::string& bf16_path,
                                 size_t vocab) {
  auto ref = SafetensorsFile::Open(ref_path);
  if (!ref.ok()) return ref.status();
  auto hf16 = SafetensorsFile::Open(bf16_path);
  if (!hf16.ok()) return hf16.status();
  Refs r;
  r.prompt = ReadTensor<int32_t>(**ref, "prompt_ids");
  r.greedy = ReadTensor<int32_t>(**ref, "greedy_ids");
  if (ReadTensor<int32_t>(**hf16, "decode_ids") != r.greedy) {
    return absl::InvalidArgumentError(
        absl::StrCat(bf16_path, " was not teacher-forced over the fp32 greedy ids of ", ref_path));
  }
  if (r.greedy.size() < 2) return absl::InvalidArgumentError("fewer than 2 greedy steps");
  auto rows_of = [&](const SafetensorsFile& f) {
    auto prefill = ReadTensor<float>(f, "prefill_logits");
    auto decode = ReadTensor<float>(f, "decode_logits");
    std::vector<std::vector<float>> rows;
    rows.emplace_back(prefill.end() - vocab, prefill.end());
    for (size_t i = 0; i + 1 < r.greedy.size(); ++i) {
      rows.emplace_back(decode.begin() + i * vocab, decode.begin() + (i + 1) * vocab);
    }
    return rows;
  };
  r.fp32 = rows_of(**ref);
  r.bf16 = rows_of(**hf16);
  return r;
}

struct Summary {
  double worst_ours = 0, mean_ours = 0, worst_hf = 0, mean_hf = 0;
  int checked = 0, near_ties = 0, hf_flips = 0;
  std::vector<double> tie_gap;  // per row: the near-tie bar
};

// Checks our rows (ours(i): the logits that chose greedy[i]) against the rule above and prints
// one line labelled `label`.
inline Summary ExpectMatches(const Refs& r, size_t vocab,
                             const std::function<const float*(size_t)>& ours,
                             const std::string& label) {
  Summary s;
  s.tie_gap.resize(r.fp32.size());
  for (size_t i = 0; i < r.fp32.size(); ++i) {
    const float* got = ours(i);
    const double e_ours = RelErr(got, r.fp32[i].data(), vocab);
    const double e_hf = RelErr(r.bf16[i].data(), r.fp32[i].data(), vocab);
    s.worst_ours = std::max(s.worst_ours, e_ours);
    s.worst_hf = std::max(s.worst_hf, e_hf);
    s.mean_ours += e_ours;
    s.mean_hf += e_hf;
    EXPECT_LE(e_ours, kMaxErrRatio * e_hf)
        << label << " step " << i << ": ours " << e_ours << " vs transformers bf16 " << e_hf;
    double sq = 0;
    for (size_t v = 0; v < vocab; ++v) {
      sq += double(r.bf16[i][v] - r.fp32[i][v]) * (r.bf16[i][v] - r.fp32[i][v]);
    }
    s.tie_gap[i] = kNoiseGaps * std::sqrt(sq / vocab);
    if (Argmax(r.bf16[i].data(), vocab) != static_cast<size_t>(r.greedy[i])) ++s.hf_flips;
    if (Top2Gap(r.fp32[i].data(), vocab) < s.tie_gap[i]) {
      ++s.near_ties;
      continue;
    }
    ++s.checked;
    EXPECT_EQ(Argmax(got, vocab), static_cast<size_t>(r.greedy[i]))
        << label << " step " << i << " (fp32 top-2 gap " << Top2Gap(r.fp32[i].data(), vocab)
        << ", near-tie bar " << s.tie_gap[i] << ")";
  }
  const double n = static_cast<double>(r.fp32.size());
  s.mean_ours /= n;
  s.mean_hf /= n;
  std::printf(
      "%s: %zu steps; relative error vs fp32: ours worst %.3e mean %.3e, transformers bf16 worst "
      "%.3e mean %.3e; argmax checked on %d, %d near-ties; transformers bf16's own argmax "
      "differs from fp32 on %d\n",
      label.c_str(), r.fp32.size(), s.worst_ours, s.mean_ours, s.worst_hf, s.mean_hf, s.checked,
      s.near_ties, s.hf_flips);
  std::fflush(stdout);
  return s;
}

}  // namespace tpserve::hf_ref
