// The CPU reference of every op: fp32 storage and math, OpenBLAS for GEMM. Written for clarity
// first; it is the ground truth the CUDA kernels are tested against.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "common/logging.h"
#include "kernels/kv_quant.h"
#include "kernels/ops.h"
#include "kernels/philox.h"

namespace tpserve {
namespace {

void CheckF32(const Tensor& t, const char* what) {
  TP_CHECK(t.dtype == DType::kF32) << what << " must be f32 on the CPU, got " << t.ShapeString();
  TP_CHECK(t.device == Device::kCpu) << what << " must be host memory";
}

// A KV pool of the CPU ops: f32, or quantized with its scales (kernels/kv_quant.h).
void CheckKvCache(const Tensor& cache, const char* what) {
  TP_CHECK(cache.device == Device::kCpu) << what << " must be host memory";
  TP_CHECK(cache.dtype == DType::kF32 || (IsQuantizedKv(cache.dtype) && cache.scales != nullptr))
      << what << " must be f32 or quantized with scales on the CPU, got " << cache.ShapeString();
}

// Stores head `kvh` of one token (x: head_dim f32 values) at `slot` of a pool with `heads`
// heads per slot, quantizing when the pool is quantized.
void StoreKvHead(const Tensor& cache, int64_t slot, int64_t kvh, int64_t heads, int head_dim,
                 const float* x) {
  const int64_t index = slot * heads + kvh;
  if (cache.dtype == DType::kF32) {
    std::memcpy(cache.ptr<float>() + index * head_dim, x, head_dim * sizeof(float));
    return;
  }
  QuantizeKvHead(cache.dtype, x, head_dim,
                 cache.ptr<uint8_t>() + KvByteOffset(cache.dtype, index * head_dim),
                 static_cast<float*>(cache.scales) + index * KvScaleGroups(cache.dtype, head_dim));
}

// Head `kvh` of the token at `slot`: a pointer into an f32 pool, or the dequantized values in
// `buf` (head_dim floats).
const float* LoadKvHead(const Tensor& cache, int64_t slot, int64_t kvh, int64_t heads, int head_dim,
                        float* buf) {
  const int64_t index = slot * heads + kvh;
  if (cache.dtype == DType::kF32) return cache.ptr<float>() + index * head_dim;
  DequantizeKvHead(
      cache.dtype, cache.ptr<const uint8_t>() + KvByteOffset(cache.dtype, index * head_dim),
      static_cast<const float*>(cache.scales) + index * KvScaleGroups(cache.dtype, head_dim),
      head_dim, buf);
  return buf;
}

// Row-major [rows, cols] view of a tensor whose last dim is `cols`.
int64_t Rows(const Tensor& t) { return t.dim(-1) == 0 ? 0 : t.numel() / t.dim(-1); }

class CpuOps final : public Ops {
 public:
  Device device() const override { return Device::kCpu; }
  DType compute_dtype() const override { return DType::kF32; }
  bool SupportsKvCacheDType(DType t) const override { return t == DType::kF32 || IsQuantizedKv(t); }

  void* Alloc(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    TP_CHECK(p != nullptr) << "host allocation of " << bytes << " bytes failed";
    return p;
  }
  void Free(void* ptr) override { std::free(ptr); }
  void CopyToDevice(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void CopyToHost(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    std::memmove(dst, src, bytes);
  }
  void Synchronize() override {}

  void SetBatch(const BatchMeta& meta) override {
    TP_CHECK(static_cast<int>(meta.query_start.size()) == meta.num_seqs + 1);
    TP_CHECK(static_cast<int>(meta.positions.size()) == meta.num_tokens);
    meta_ = meta;
    ApplyFedTokens(meta_);
  }

  void Embedding(const Tensor& table, int64_t row_offset, Tensor out) override {
    CheckF32(table, "embedding table");
    CheckF32(out, "embedding out");
    const int64_t rows = table.dim(0), hidden = table.dim(1);
    TP_CHECK(out.dim(0) == meta_.num_tokens && out.dim(-1) == hidden) << out.ShapeString();
    for (int t = 0; t < meta_.num_tokens; ++t) {
      int64_t r = meta_.token_ids[t] - row_offset;
      float* dst = out.ptr<float>() + t * hidden;
      if (r >= 0 && r < rows) {
        std::memcpy(dst, table.ptr<float>() + r * hidden, hidden * sizeof(float));
      } else {
        std::fill(dst, dst + hidden, 0.0f);
      }
    }
  }

  void RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor out) override {
    CheckF32(x, "rms_norm x");
    const int64_t n = x.dim(-1), rows = Rows(x);
    TP_CHECK(weight.numel() == n && out.numel() == x.numel());
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x.ptr<float>() + r * n;
      float* o = out.ptr<float>() + r * n;
      float ss = 0.0f;
      for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
      float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i) o[i] = weight.ptr<float>()[i] * (xr[i] * inv);
    }
  }

  void AddRmsNorm(Tensor residual, const Tensor& x, const Tensor& weight, float eps,
                  Tensor out) override {
    Add(residual, x, residual);
    RmsNorm(residual, weight, eps, out);
  }

  void Gemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y) override {
    CheckF32(x, "gemm x");
    CheckF32(w, "gemm w");
    CheckF32(y, "gemm y");
    const int64_t k = x.dim(-1), m = Rows(x), n = w.dim(0);
    TP_CHECK(w.dim(1) == k) << "gemm: x " << x.ShapeString() << " w " << w.ShapeString();
    TP_CHECK(y.dim(-1) == n && Rows(y) == m) << "gemm: y " << y.ShapeString();
    if (m == 0) return;
    if (deterministic_) {
      // OpenBLAS sgemm picks its kernels and edge handling by M, so a row's bits depend on how
      // many rows are beside it (measured: row 0 differs between M = 1 and M = 4..300). One
      // GEMV per row has the same shape whatever M is.
      for (int64_t r = 0; r < m; ++r) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, w.ptr<float>(), k,
                    x.ptr<float>() + r * k, 1, 0.0f, y.ptr<float>() + r * n, 1);
      }
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x.ptr<float>(), k,
                  w.ptr<float>(), k, 0.0f, y.ptr<float>(), n);
    }
    if (bias != nullptr) {
      TP_CHECK(bias->numel() == n);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < n; ++c) y.ptr<float>()[r * n + c] += bias->ptr<float>()[c];
    }
  }

  void Rope(Tensor q, Tensor k, const Tensor& inv_freq, int head_dim) override {
    const int half = head_dim / 2;
    TP_CHECK(inv_freq.numel() == half);
    for (int t = 0; t < meta_.num_tokens; ++t) {
      const float pos = static_cast<float>(meta_.positions[t]);
      for (Tensor* x : {&q, &k}) {
        const int64_t width = x->dim(-1);
        float* row = x->ptr<float>() + t * width;
        for (int64_t h = 0; h < width / head_dim; ++h) {
          float* v = row + h * head_dim;
          for (int i = 0; i < half; ++i) {
            // As HF: freqs = pos * inv_freq in fp32, then cos/sin.
            const float angle = pos * inv_freq.ptr<float>()[i];
            const float c = std::cos(angle), s = std::sin(angle);
            const float a = v[i], b = v[i + half];
            v[i] = a * c - b * s;
            v[i + half] = b * c + a * s;
          }
        }
      }
    }
  }

  void KvWrite(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache) override {
    CheckF32(k, "kv_write k");
    CheckF32(v, "kv_write v");
    CheckKvCache(k_cache, "kv_write k_cache");
    CheckKvCache(v_cache, "kv_write v_cache");
    const int64_t width = k.dim(-1);
    const int64_t slots = k_cache.dim(0) * k_cache.dim(1);
    const int64_t heads = k_cache.dim(2);
    const int head_dim = static_cast<int>(k_cache.dim(3));
    TP_CHECK(k_cache.ndim == 4 && k_cache.numel() == slots * width &&
             v_cache.dtype == k_cache.dtype && v_cache.numel() == k_cache.numel())
        << "kv cache " << k_cache.ShapeString() << " / " << v_cache.ShapeString();
    for (int t = 0; t < meta_.num_tokens; ++t) {
      const int64_t slot = meta_.slot_mapping[t];
      TP_CHECK(slot >= 0 && slot < slots) << "slot " << slot << " outside the cache";
      for (int64_t h = 0; h < heads; ++h) {
        StoreKvHead(k_cache, slot, h, heads, head_dim, k.ptr<float>() + t * width + h * head_dim);
        StoreKvHead(v_cache, slot, h, heads, head_dim, v.ptr<float>() + t * width + h * head_dim);
      }
    }
  }

  void RopeKvWrite(const Tensor& qkv, const Tensor& inv_freq, int num_q_heads, int num_kv_heads,
                   int head_dim, Tensor q_out, Tensor k_cache, Tensor v_cache) override {
    CheckF32(qkv, "rope_kv_write qkv");
    CheckKvCache(k_cache, "rope_kv_write k_cache");
    CheckKvCache(v_cache, "rope_kv_write v_cache");
    const int half = head_dim / 2;
    const int64_t q_width = int64_t{num_q_heads} * head_dim;
    const int64_t kv_width = int64_t{num_kv_heads} * head_dim;
    const int64_t width = q_width + 2 * kv_width;
    const int64_t slots = k_cache.dim(0) * k_cache.dim(1);
    TP_CHECK(head_dim % 2 == 0 && inv_freq.numel() == half &&
             qkv.numel() == meta_.num_tokens * width &&
             q_out.numel() == meta_.num_tokens * q_width && k_cache.numel() == slots * kv_width &&
             v_cache.numel() == k_cache.numel() && v_cache.dtype == k_cache.dtype)
        << "rope_kv_write: qkv " << qkv.ShapeString() << ", q_out " << q_out.ShapeString()
        << ", k_cache " << k_cache.ShapeString() << ", heads " << num_q_heads << "/" << num_kv_heads
        << ", head_dim " << head_dim;
    std::vector<float> k(kv_width);
    for (int t = 0; t < meta_.num_tokens; ++t) {
      const float* row = qkv.ptr<float>() + t * width;
      float* q = q_out.ptr<float>() + t * q_width;
      std::memcpy(q, row, q_width * sizeof(float));
      std::memcpy(k.data(), row + q_width, kv_width * sizeof(float));
      const float pos = static_cast<float>(meta_.positions[t]);
      for (float* x : {q, k.data()}) {
        const int64_t heads = x == q ? num_q_heads : num_kv_heads;
        for (int64_t h = 0; h < heads; ++h) {
          float* v = x + h * head_dim;
          for (int i = 0; i < half; ++i) {
            const float angle = pos * inv_freq.ptr<float>()[i];  // as Rope
            const float c = std::cos(angle), s = std::sin(angle);
            const float a = v[i], b = v[i + half];
            v[i] = a * c - b * s;
            v[i + half] = b * c + a * s;
          }
        }
      }
      const int64_t slot = meta_.slot_mapping[t];
      if (slot < 0) continue;  // padding
      TP_CHECK(slot < slots) << "slot " << slot << " outside the cache";
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        StoreKvHead(k_cache, slot, h, num_kv_heads, head_dim, k.data() + h * head_dim);
        StoreKvHead(v_cache, slot, h, num_kv_heads, head_dim,
                    row + q_width + kv_width + h * head_dim);
      }
    }
  }

  void AttentionPrefill(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                        int num_heads, int num_kv_heads, int head_dim, float scale,
                        Tensor out) override {
    Attention(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale, out);
  }

  void AttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                       int num_kv_heads, int head_dim, float scale, Tensor out) override {
    TP_CHECK(meta_.all_decode()) << "AttentionDecode needs one query token per sequence";
    Attention(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, scale, out);
  }

  void SiluMul(const Tensor& gate_up, Tensor out) override {
    const int64_t inter = out.dim(-1), rows = Rows(out);
    TP_CHECK(gate_up.dim(-1) == 2 * inter && Rows(gate_up) == rows);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = gate_up.ptr<float>() + r * 2 * inter;
      const float* u = g + inter;
      float* o = out.ptr<float>() + r * inter;
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  }

  void Add(const Tensor& a, const Tensor& b, Tensor out) override {
    TP_CHECK(a.numel() == b.numel() && a.numel() == out.numel());
    for (int64_t i = 0; i < a.numel(); ++i)
      out.ptr<float>()[i] = a.ptr<float>()[i] + b.ptr<float>()[i];
  }

  void GatherLogitRows(const Tensor& in, Tensor out) override {
    const int64_t width = in.dim(-1);
    TP_CHECK(out.dim(0) == static_cast<int64_t>(meta_.logits_rows.size()));
    for (size_t i = 0; i < meta_.logits_rows.size(); ++i) {
      std::memcpy(out.ptr<float>() + i * width, in.ptr<float>() + meta_.logits_rows[i] * width,
                  width * sizeof(float));
    }
  }

  void InterleaveShards(const Tensor& in, Tensor out) override {
    const int64_t shards = in.dim(0), rows = in.dim(1), width = in.dim(2);
    TP_CHECK(out.dim(0) == rows && out.dim(1) == shards * width);
    for (int64_t s = 0; s < shards; ++s)
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(out.ptr<float>() + r * shards * width + s * width,
                    in.ptr<float>() + (s * rows + r) * width, width * sizeof(float));
  }

  using Ops::Sample;
  std::vector<int32_t> Sample(const Tensor& logits, int64_t vocab_size,
                              const std::vector<SamplingParams>& params,
                              std::vector<std::optional<TokenLogprobs>>* logprobs) override {
    CheckF32(logits, "sample logits");
    const int64_t width = logits.dim(-1);
    TP_CHECK(static_cast<int64_t>(params.size()) == Rows(logits) && vocab_size <= width);
    std::vector<int32_t> ids(params.size());
    if (logprobs != nullptr) logprobs->assign(params.size(), std::nullopt);
    for (size_t r = 0; r < params.size(); ++r) {
      const float* row = logits.ptr<float>() + r * width;
      ids[r] = SampleRow(row, vocab_size, params[r]);
      const int n = params[r].logprobs;
      if (n < 0) continue;
      TP_CHECK(n <= kMaxLogprobs && logprobs != nullptr)
          << "Sample: row " << r << " asks for " << n << " logprobs (at most " << kMaxLogprobs
          << ", and only with an output vector)";
      (*logprobs)[r] = ReferenceLogprobs(row, vocab_size, ids[r], n);
    }
    return ids;
  }

 private:
  static int32_t SampleRow(const float* row, int64_t vocab, const SamplingParams& p) {
    if (IsGreedy(p.temperature)) {
      return static_cast<int32_t>(std::max_element(row, row + vocab) - row);
    }
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [row](int32_t a, int32_t b) { return row[a] > row[b]; });
    int64_t keep = vocab;
    if (p.top_k > 0) keep = std::min<int64_t>(keep, p.top_k);
    const float max_logit = row[order[0]] / p.temperature;
    std::vector<float> probs(keep);
    float total = 0.0f;
    for (int64_t i = 0; i < keep; ++i) {
      probs[i] = std::exp(row[order[i]] / p.temperature - max_logit);
      total += probs[i];
    }
    if (p.top_p < 1.0f) {
      float cum = 0.0f;
      int64_t cut = keep;
      for (int64_t i = 0; i < keep; ++i) {
        cum += probs[i];
        if (cum >= p.top_p * total) {
          cut = i + 1;
          break;
        }
      }
      keep = cut;
      total = 0.0f;
      for (int64_t i = 0; i < keep; ++i) total += probs[i];
    }
    const float target = PhiloxUniform(p.seed, static_cast<uint64_t>(p.position)) * total;
    float cum = 0.0f;
    for (int64_t i = 0; i < keep; ++i) {
      cum += probs[i];
      if (cum > target) return order[i];
    }
    return order[keep - 1];
  }

  void Attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                 int num_kv_heads, int head_dim, float scale, Tensor out) {
    CheckF32(q, "attention q");
    CheckKvCache(k_cache, "attention k_cache");
    CheckKvCache(v_cache, "attention v_cache");
    TP_CHECK(k_cache.dtype == v_cache.dtype) << "attention: K and V caches of other dtypes";
    std::vector<float> kbuf, vbuf;  // a quantized context's rows, dequantized
    const int group = num_heads / num_kv_heads;
    const int64_t kv_width = static_cast<int64_t>(num_kv_heads) * head_dim;
    const int64_t q_width = static_cast<int64_t>(num_heads) * head_dim;
    TP_CHECK(q.dim(-1) == q_width && out.dim(-1) == q_width);
    TP_CHECK(k_cache.numel() % kv_width == 0 && v_cache.numel() == k_cache.numel())
        << "kv cache " << k_cache.ShapeString() << " for " << num_kv_heads << " heads of "
        << head_dim;
    // Per sequence and KV head: the context's K and V rows (pointers into an f32 pool, or
    // dequantized once into kbuf / vbuf), then every query row of the heads that read them.
    std::vector<float> scores;
    std::vector<const float*> krows, vrows;
    for (int s = 0; s < meta_.num_seqs; ++s) {
      const int q0 = meta_.query_start[s], qlen = meta_.query_start[s + 1] - q0;
      const int ctx = meta_.context_lens[s];
      const int32_t* table = meta_.block_tables.data() + s * meta_.max_blocks_per_seq;
      krows.resize(ctx);
      vrows.resize(ctx);
      if (k_cache.dtype != DType::kF32) {
        kbuf.resize(static_cast<size_t>(ctx) * head_dim);
        vbuf.resize(static_cast<size_t>(ctx) * head_dim);
      }
      for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
        for (int j = 0; j < ctx; ++j) {
          const int64_t slot =
              static_cast<int64_t>(table[j / meta_.block_size]) * meta_.block_size +
              j % meta_.block_size;
          const size_t row = static_cast<size_t>(j) * head_dim;  // in kbuf / vbuf when quantized
          krows[j] = LoadKvHead(k_cache, slot, kvh, num_kv_heads, head_dim,
                                kbuf.empty() ? nullptr : kbuf.data() + row);
          vrows[j] = LoadKvHead(v_cache, slot, kvh, num_kv_heads, head_dim,
                                vbuf.empty() ? nullptr : vbuf.data() + row);
        }
        for (int i = 0; i < qlen; ++i) {
          const int limit = ctx - qlen + i;  // last visible position
          scores.resize(limit + 1);
          for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
            const float* qv = q.ptr<float>() + (q0 + i) * q_width + h * head_dim;
            float max_score = -INFINITY;
            for (int j = 0; j <= limit; ++j) {
              const float* kv = krows[j];
              float dot = 0.0f;
              for (int d = 0; d < head_dim; ++d) dot += qv[d] * kv[d];
              scores[j] = dot * scale;
              max_score = std::max(max_score, scores[j]);
            }
            float denom = 0.0f;
            for (int j = 0; j <= limit; ++j) {
              scores[j] = std::exp(scores[j] - max_score);
              denom += scores[j];
            }
            float* o = out.ptr<float>() + (q0 + i) * q_width + h * head_dim;
            std::fill(o, o + head_dim, 0.0f);
            for (int j = 0; j <= limit; ++j) {
              const float* vv = vrows[j];
              const float w = scores[j] / denom;
              for (int d = 0; d < head_dim; ++d) o[d] += w * vv[d];
            }
          }
        }
      }
    }
  }

  BatchMeta meta_;
};

}  // namespace

std::unique_ptr<Ops> MakeCpuOps() { return std::make_unique<CpuOps>(); }

}  // namespace tpserve
