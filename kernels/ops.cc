// Shared pieces of the ops interface: batch metadata helpers, RoPE frequencies, the default
// (synchronous) weight uploader, the reference log-probabilities of a sampled token.
#include "kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "common/check.h"

namespace tpserve {
namespace {

// Copies at once through Ops::CopyToDevice (the default when a backend has nothing faster).
class SyncUploader final : public DeviceUploader {
 public:
  explicit SyncUploader(Ops* ops) : ops_(ops) {}
  void Upload(void* dst, const void* src, size_t bytes) override {
    ops_->CopyToDevice(dst, src, bytes);
    stats_.bytes += static_cast<int64_t>(bytes);
  }
  void UploadRows(void* dst, const void* src, size_t rows, size_t row_bytes,
                  size_t src_pitch) override {
    std::vector<char> packed(rows * row_bytes);
    for (size_t r = 0; r < rows; ++r) {
      std::memcpy(packed.data() + r * row_bytes, static_cast<const char*>(src) + r * src_pitch,
                  row_bytes);
    }
    Upload(dst, packed.data(), packed.size());
  }
  void Flush() override {}
  Stats stats() const override { return stats_; }

 private:
  Ops* ops_;
  Stats stats_;
};

}  // namespace

std::unique_ptr<DeviceUploader> Ops::MakeUploader() { return std::make_unique<SyncUploader>(this); }

void Ops::SampleAsync(const Tensor& logits, int64_t vocab_size,
                      const std::vector<SamplingParams>& params, bool logprobs) {
  TP_CHECK(static_cast<int>(async_samples_.size()) < kMaxAsyncSamples)
      << "SampleAsync: " << async_samples_.size() << " samplings already in flight";
  AsyncSample a;
  a.ids = Sample(logits, vocab_size, params, logprobs ? &a.logprobs : nullptr);
  latest_async_ids_ = a.ids;
  async_samples_.push_back(std::move(a));
}

std::vector<int32_t> Ops::SampleWait(std::vector<std::optional<TokenLogprobs>>* logprobs) {
  TP_CHECK(!async_samples_.empty()) << "SampleWait without a SampleAsync in flight";
  AsyncSample a = std::move(async_samples_.front());
  async_samples_.erase(async_samples_.begin());
  if (logprobs != nullptr) *logprobs = std::move(a.logprobs);
  return std::move(a.ids);
}

void Ops::ApplyFedTokens(BatchMeta& meta) const {
  TP_CHECK(meta.fed_tokens.size() == meta.fed_rows.size())
      << "BatchMeta: " << meta.fed_tokens.size() << " fed tokens, " << meta.fed_rows.size()
      << " rows";
  for (size_t i = 0; i < meta.fed_tokens.size(); ++i) {
    const int t = meta.fed_tokens[i], r = meta.fed_rows[i];
    TP_CHECK(t >= 0 && t < static_cast<int>(meta.token_ids.size()) && r >= 0 &&
             r < static_cast<int>(latest_async_ids_.size()))
        << "BatchMeta: fed token " << t << " from row " << r << " (" << meta.token_ids.size()
        << " tokens, " << latest_async_ids_.size() << " rows sampled)";
    meta.token_ids[t] = latest_async_ids_[r];
  }
}

void Ops::QkvRopeKvWrite(const Tensor& x, const RowScale& x_scale, const Tensor& w_qkv,
                         const Tensor* bias, const Tensor& inv_freq, int num_q_heads,
                         int num_kv_heads, int head_dim, Tensor qkv, Tensor q_out, Tensor k_cache,
                         Tensor v_cache) {
  TP_CHECK(x_scale.empty()) << "QkvRopeKvWrite: this backend defers no norms";
  Gemm(x, w_qkv, bias, qkv);
  RopeKvWrite(qkv, inv_freq, num_q_heads, num_kv_heads, head_dim, q_out, k_cache, v_cache);
}

RowScale Ops::GemmAddRmsNorm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                             Tensor residual, const Tensor& gamma, float eps, Tensor normed) {
  Gemm(x, w, bias, y);
  AddRmsNorm(residual, y, gamma, eps, normed);
  return RowScale();
}

RowScale Ops::SiluMulGemmAddRmsNorm(const Tensor& gate_up, const Tensor& w, Tensor act, Tensor y,
                                    Tensor residual, const Tensor& gamma, float eps,
                                    Tensor normed) {
  SiluMulGemm(gate_up, w, act, y);
  AddRmsNorm(residual, y, gamma, eps, normed);
  return RowScale();
}

void Ops::GemmScaledRows(const Tensor& x, const RowScale& x_scale, const Tensor& w,
                         const Tensor* bias, Tensor y) {
  TP_CHECK(x_scale.empty()) << "GemmScaledRows: this backend defers no norms";
  Gemm(x, w, bias, y);
}

int BatchMeta::max_query_len() const {
  int m = 0;
  for (int s = 0; s < num_seqs; ++s) m = std::max(m, query_start[s + 1] - query_start[s]);
  return m;
}

int BatchMeta::max_context_len() const {
  int m = 0;
  for (int s = 0; s < num_seqs; ++s) m = std::max(m, context_lens[s]);
  return m;
}

double LogSumExp(const float* row, int64_t n) {
  double max_logit = -INFINITY;
  for (int64_t i = 0; i < n; ++i) max_logit = std::max(max_logit, double{row[i]});
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(double{row[i]} - max_logit);
  return max_logit + std::log(sum);
}

TokenLogprobs ReferenceLogprobs(const float* row, int64_t vocab, int32_t chosen, int n) {
  const double log_z = LogSumExp(row, vocab);
  TokenLogprobs out;
  out.logprob = static_cast<float>(double{row[chosen]} - log_z);
  const int64_t k = std::min<int64_t>(std::max(n, 0), vocab);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [row](int32_t a, int32_t b) {
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  });
  for (int64_t i = 0; i < k; ++i) {
    out.top.push_back({order[i], static_cast<float>(double{row[order[i]]} - log_z)});
  }
  return out;
}

std::vector<float> RopeInvFreq(const RopeConfig& rope, int head_dim) {
  // As transformers' rope init functions: inv_freq = 1 / base^(2i/d), computed in fp32.
  std::vector<float> inv(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv[i] = 1.0f / std::pow(static_cast<float>(rope.theta), exponent);
  }
  if (rope.scaling == RopeScalingType::kLinear) {
    for (float& f : inv) f /= static_cast<float>(rope.factor);
  } else if (rope.scaling == RopeScalingType::kLlama3) {
    // _compute_llama3_parameters: long wavelengths scaled by factor, short kept, smooth between.
    const double low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor;
    const double high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor;
    for (float& f : inv) {
      double wavelen = 2 * M_PI / f;
      if (wavelen > low_freq_wavelen) {
        f = static_cast<float>(f / rope.factor);
      } else if (wavelen >= high_freq_wavelen) {
        double smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) /
                        (rope.high_freq_factor - rope.low_freq_factor);
        f = static_cast<float>((1 - smooth) * f / rope.factor + smooth * f);
      }
    }
  }
  return inv;
}

}  // namespace tpserve
