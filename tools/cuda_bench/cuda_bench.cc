// Op-level benchmarks of the CUDA kernels on one GPU: device-to-device copy bandwidth (the
// ceiling for decode), skinny GEMM vs cuBLASLt at decode sizes for the DeepSeek-Coder-6.7B
// shapes, prefill attention TFLOP/s and decode attention GB/s. Times are medians of CUDA-event
// timed repetitions after warm-up; weights rotate over copies larger than the L2 cache.
//   tpserve-cuda-bench [--m1 | --attention | --decode | --det-gemm]   (--m1: only the batch-1
//   decode kernels, a short run; --attention: copy bandwidth and the attention kernels; --decode:
//   the same with every decode-attention kernel and partition for each KV-cache dtype;
//   --det-gemm: the GEMMs of deterministic mode against the default path at M = 1 .. 2048;
//   --shards: one decode layer's GEMMs and attention at the shard shapes of TP = 1, 2, 4, 8;
//   --split-k: cuBLASLt at M = 32 / 64 / 128 with split-K forced to 1..8; --det-split-k: whether a
//   fixed cuBLASLt algorithm made split (2, 4, 8; each reduction scheme) keeps a row's bits across
//   M, and its speed at M = 1 and 64 (issue 22); --chain: the chain GEMM
//   (deterministic mode's cuBLASLt bits, gemm_lt_chain.cu) in each pipeline configuration against
//   the default and the fixed cuBLASLt algorithm at M = 1, 2, 8, 16; --stream: the weight-streaming
//   wgmma GEMM, gemm_stream.cu, in each configuration against cuBLASLt at M = 3 .. 128, and its
//   fixed-grid variant of deterministic mode at M = 1 .. 128, at M = 1 beside the skinny kernel;
//   --lt-sweep: cuBLASLt's first 32 heuristic candidates at M = 4 .. 2048, weights cold; with
//   --lt-table-out=FILE the ones two sweeps confirmed alike are written as a cuBLASLt table,
//   gemm_table.h;
//   --pdl-gemm: whether cuBLASLt's GEMMs wait for their predecessor when launched as programmatic
//   dependents in a graph, and what such edges save).
//   A second argument, a regular expression, keeps only the rows of --stream, --det-gemm, --chain
//   and of the attention kernels whose label it matches (a short run for a profiler such as ncu).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/check.h"
#include "kernels/cuda/bench_knobs.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_table.h"
#include "kernels/cuda/launchers.h"
#include "kernels/kv_quant.h"
#include "nlohmann/json.hpp"
#include "tools/cuda_bench/pdl_probe.h"
#include "tools/cuda_bench/probes/probe_util.h"

namespace tpserve {
namespace {

struct Row {
  std::string what;
  double ms;
  std::string metric;
};
std::vector<Row> g_rows;
std::optional<std::regex> g_only;  // the rows to measure (all when empty)

bool Wanted(const std::string& label) { return !g_only || std::regex_search(label, *g_only); }

// Fills device memory with random bf16 (a host pattern repeated at shifting offsets).
void FillRandom(void* dst, size_t bytes, float scale) {
  static std::vector<uint16_t> pattern;
  if (pattern.empty()) {
    std::mt19937 rng(42);
    std::normal_distribution<float> d(0.0f, 1.0f);
    pattern.resize(size_t{8} << 20);
    for (auto& v : pattern) v = F32ToBf16(d(rng));
  }
  std::vector<uint16_t> scaled(pattern.size());
  for (size_t i = 0; i < pattern.size(); ++i) scaled[i] = F32ToBf16(Bf16ToF32(pattern[i]) * scale);
  size_t chunk = scaled.size() * 2, off = 0, shift = 0;
  while (off < bytes) {
    size_t n = std::min(chunk - shift, bytes - off);
    TP_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst) + off,
                             reinterpret_cast<char*>(scaled.data()) + shift, n,
                             cudaMemcpyHostToDevice));
    off += n;
    shift = (shift + 4096 + 16) % (chunk / 2);
  }
}

void Add(const std::string& what, double ms, const std::string& metric) {
  g_rows.push_back({what, ms, metric});
  std::printf("%-48s %9.4f ms  %s\n", what.c_str(), ms, metric.c_str());
  std::fflush(stdout);
}

std::string Fmt(const char* f, double a, double b = 0) {
  char buf[128];
  std::snprintf(buf, sizeof(buf), f, a, b);
  return buf;
}

// The GEMM shapes of the DeepSeek-Coder-6.7B layers and lm_head.
struct Shape {
  const char* name;
  int n, k;
};
constexpr Shape kShapes[] = {{"qkv 12288x4096", 12288, 4096},
                             {"o 4096x4096", 4096, 4096},
                             {"gate_up 22016x4096", 22016, 4096},
                             {"down 4096x11008", 4096, 11008},
                             {"lm_head 32256x4096", 32256, 4096}};

// Random copies of a weight [n, k] over >= 1 GiB, so that a timed loop reading At(i) streams
// them from HBM rather than L2.
struct RotatingWeights {
  RotatingWeights(CudaOps& ops, const Shape& sh)
      : ops(ops),
        shape(sh),
        bytes(size_t{2} * sh.n * sh.k),
        copies(static_cast<int>(std::max<size_t>(2, (size_t{1} << 30) / bytes + 1))),
        data(ops.Alloc(bytes * copies)) {
    FillRandom(data, bytes * copies, 0.02f);
  }
  ~RotatingWeights() { ops.Free(data); }
  RotatingWeights(const RotatingWeights&) = delete;
  RotatingWeights& operator=(const RotatingWeights&) = delete;
  Tensor At(int i) const {
    return Tensor(static_cast<char*>(data) + (i % copies) * bytes, {shape.n, shape.k}, DType::kBF16,
                  Device::kCuda);
  }
  CudaOps& ops;
  Shape shape;
  size_t bytes;
  int copies;
  void* data;
};

// A random K and V cache of `blocks` blocks of `bs` tokens x `hk` heads x `d` in dtype `kv`: random
// codes, and for a quantized dtype every scale 0.01.
struct RandomKvCache {
  RandomKvCache(CudaOps& ops, int64_t blocks, int bs, int hk, int d, DType kv)
      : ops(ops),
        code_bytes(static_cast<size_t>(blocks * bs * hk * d * DTypeBits(kv) / 8)),
        scale_bytes(static_cast<size_t>(blocks * bs * hk * KvScaleGroups(kv, d)) * sizeof(float)),
        k(ops.Alloc(code_bytes), {blocks, bs, hk, d}, kv, Device::kCuda),
        v(ops.Alloc(code_bytes), {blocks, bs, hk, d}, kv, Device::kCuda) {
    FillRandom(k.data, code_bytes, 1.0f);
    FillRandom(v.data, code_bytes, 1.0f);
    if (scale_bytes > 0) {
      const std::vector<float> scales(scale_bytes / sizeof(float), 0.01f);
      for (Tensor* t : {&k, &v}) {
        t->scales = ops.Alloc(scale_bytes);
        ops.CopyToDevice(t->scales, scales.data(), scale_bytes);
      }
    }
  }
  ~RandomKvCache() {
    for (const Tensor* t : {&k, &v}) {
      ops.Free(t->data);
      if (t->scales != nullptr) ops.Free(t->scales);
    }
  }
  RandomKvCache(const RandomKvCache&) = delete;
  RandomKvCache& operator=(const RandomKvCache&) = delete;
  double Bytes() const { return 2.0 * (code_bytes + scale_bytes); }  // K and V, codes and scales
  CudaOps& ops;
  size_t code_bytes, scale_bytes;
  Tensor k, v;
};

int PrintSummary(double copy_gbs) {
  std::printf("\n==== summary (copy %.0f GB/s) ====\n", copy_gbs);
  for (const Row& r : g_rows)
    std::printf("| %-44s | %8.4f ms | %s |\n", r.what.c_str(), r.ms, r.metric.c_str());
  return 0;
}

// Deterministic mode's GEMMs (issue 22) on the 6.7B shapes: the default path (skinny kernel up to
// M = 16, cuBLASLt's heuristic above), cuBLASLt's fixed unsplit algorithm, and the fixed-order
// kernel (automatic variant, and both variants forced where either could run). Weights rotate
// over >= 1 GiB of copies; GB/s counts the weight bytes, TFLOP/s 2 M N K.
void DeterministicGemms(CudaOps& ops, double copy_gbs, bool chain_only) {
  cudaStream_t s = ops.stream();
  cuda::LtGemm fixed_lt;
  fixed_lt.set_fixed_algorithm(true);
  const int kMaxM = 2048;
  void* xbuf = ops.Alloc(size_t{2} * kMaxM * 11008);
  void* ybuf = ops.Alloc(size_t{2} * kMaxM * 32256);
  FillRandom(xbuf, size_t{2} * kMaxM * 11008, 1.0f);
  for (const Shape& sh : kShapes) {
    RotatingWeights rw(ops, sh);
    const size_t wbytes = rw.bytes;
    auto wt = [&](int i) { return rw.At(i); };
    const std::vector<int> ms = chain_only
                                    ? std::vector<int>{1, 2, 8, 16}
                                    : std::vector<int>{1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 2048};
    for (int m : ms) {
      Tensor x(xbuf, {m, sh.k}, DType::kBF16, Device::kCuda);
      Tensor y(ybuf, {m, sh.n}, DType::kBF16, Device::kCuda);
      const int iters = m >= 1024 ? 20 : 50;
      // A row is measured only when the bench's row regex (its second argument) matches it, so
      // that ncu can profile one of them.
      auto report = [&](const std::string& label, const std::function<void(int)>& fn) {
        const std::string row = std::string(sh.name) + " M=" + std::to_string(m) + " " + label;
        if (!Wanted(row)) return;
        const double ms = MedianMs(s, iters, fn);
        const double gbs = wbytes / ms / 1e6;
        Add(row, ms,
            Fmt("%.0f GB/s = %.1f%% of copy, ", gbs, 100.0 * gbs / copy_gbs) +
                Fmt("%.0f TFLOP/s", 2.0 * m * sh.n * double(sh.k) / ms / 1e9));
      };
      report("default", [&](int i) { ops.Gemm(x, wt(i), nullptr, y); });
      report("fixed cublasLt", [&](int i) { fixed_lt.Run(x, wt(i), nullptr, y, s); });
      // The chain GEMM (cuBLASLt's bits) in each pipeline configuration it has at this M; at
      // M <= 2 then with every copy's tiles registered (config 0 and the tiled ones).
      for (int c = 0; c < cuda::ChainGemvNumConfigs(m); ++c) {
        report("chain cfg" + std::to_string(c),
               [&](int i) { cuda::LaunchChainGemv(x, wt(i), nullptr, y, s, c); });
      }
      if (m <= 2) {
        const size_t tile_bytes = cuda::ChainTileBytes(sh.n, sh.k);
        void* tiles = ops.Alloc(tile_bytes * rw.copies);
        for (int i = 0; i < rw.copies; ++i) {
          cuda::MakeChainTiles(wt(i), static_cast<char*>(tiles) + i * tile_bytes, s);
          cuda::RegisterChainTiles(wt(i), static_cast<char*>(tiles) + i * tile_bytes);
        }
        report("chain tiled", [&](int i) { cuda::LaunchChainGemv(x, wt(i), nullptr, y, s, 0); });
        for (int c = cuda::ChainGemvNumConfigs(m); c < cuda::ChainGemvNumConfigs(m, true); ++c) {
          report("chain tiled cfg" + std::to_string(c),
                 [&](int i) { cuda::LaunchChainGemv(x, wt(i), nullptr, y, s, c); });
        }
        for (int i = 0; i < rw.copies; ++i) cuda::UnregisterChainTiles(wt(i).data);
        ops.Synchronize();
        ops.Free(tiles);
      }
      if (chain_only) continue;
      report("fixed-order", [&](int i) { cuda::LaunchFixedOrderGemm(x, wt(i), nullptr, y, s); });
      if (m >= 8) {
        report("fixed-order split", [&](int i) {
          cuda::LaunchFixedOrderGemm(x, wt(i), nullptr, y, s, cuda::FixedOrderGemmVariant::kSplit);
        });
        report("fixed-order sliced", [&](int i) {
          cuda::LaunchFixedOrderGemm(x, wt(i), nullptr, y, s, cuda::FixedOrderGemmVariant::kSliced);
        });
        report("fixed-order tiled", [&](int i) {
          cuda::LaunchFixedOrderGemm(x, wt(i), nullptr, y, s, cuda::FixedOrderGemmVariant::kTiled);
        });
      }
    }
  }
  ops.Free(xbuf);
  ops.Free(ybuf);
}

// `seqs` sequences of `qlen` new tokens ending at context `ctx`, each with its own consecutive
// KV blocks of `bs` tokens.
BatchMeta PagedBatch(int seqs, int qlen, int ctx, int bs) {
  BatchMeta m;
  m.num_seqs = seqs;
  m.block_size = bs;
  m.max_blocks_per_seq = (ctx + bs - 1) / bs;
  m.query_start.push_back(0);
  for (int sq = 0; sq < seqs; ++sq) {
    for (int b = 0; b < m.max_blocks_per_seq; ++b)
      m.block_tables.push_back(sq * m.max_blocks_per_seq + b);
    for (int i = 0; i < qlen; ++i) {
      int pos = ctx - qlen + i;
      m.positions.push_back(pos);
      m.slot_mapping.push_back((sq * m.max_blocks_per_seq + pos / bs) * bs + pos % bs);
    }
    m.query_start.push_back(m.query_start.back() + qlen);
    m.context_lens.push_back(ctx);
  }
  m.num_tokens = seqs * qlen;
  return m;
}

// The kernels of one decode layer at the shard shapes of TP = 1, 2, 4, 8 (issue 21's scaling
// model): each GEMM of the 6.7B layer with N (column-parallel: qkv, gate_up, lm_head) or K
// (row-parallel: o, down) divided by TP, through the default path (ops.Gemm), at M = 1 and 64;
// decode attention over 32 / TP heads (bf16 KV) at batch 1, context 576 (the engine bench's
// batch-1 average: prompt 512 + 128 new tokens) and batch 64, context 1024. Weights and KV
// rotate / exceed the L2; the per-layer sums are what tools/scaling/tp_model.py reads.
void ShardShapes(CudaOps& ops, double copy_gbs) {
  cudaStream_t s = ops.stream();
  const int kMaxM = 64, hd = 128, bs = 16;
  void* xbuf = ops.Alloc(size_t{2} * kMaxM * 11008);
  void* ybuf = ops.Alloc(size_t{2} * kMaxM * 32256);
  FillRandom(xbuf, size_t{2} * kMaxM * 11008, 1.0f);
  for (int tp : {1, 2, 4, 8}) {
    const Shape shapes[] = {{"qkv", 12288 / tp, 4096},
                            {"o", 4096, 4096 / tp},
                            {"gate_up", 22016 / tp, 4096},
                            {"down", 4096, 11008 / tp},
                            {"lm_head", 32256 / tp, 4096}};
    double layer_us[2] = {0, 0};  // M = 1, M = 64: the four layer GEMMs
    for (const Shape& sh : shapes) {
      RotatingWeights rw(ops, sh);
      const size_t wbytes = rw.bytes;
      for (int mi = 0; mi < 2; ++mi) {
        const int m = mi == 0 ? 1 : kMaxM;
        Tensor x(xbuf, {m, sh.k}, DType::kBF16, Device::kCuda);
        Tensor y(ybuf, {m, sh.n}, DType::kBF16, Device::kCuda);
        const double ms = MedianMs(s, 50, [&](int i) { ops.Gemm(x, rw.At(i), nullptr, y); });
        const double gbs = wbytes / ms / 1e6;
        Add(Fmt("shard tp=%g ", tp) + sh.name + " " + std::to_string(sh.n) + "x" +
                std::to_string(sh.k) + " M=" + std::to_string(m),
            ms, Fmt("%.0f GB/s = %.1f%% of copy", gbs, 100.0 * gbs / copy_gbs));
        if (std::string(sh.name) != "lm_head") layer_us[mi] += ms * 1e3;
      }
    }
    const int heads = 32 / tp;
    double attn_us[2] = {0, 0};
    for (int ai = 0; ai < 2; ++ai) {
      const int B = ai == 0 ? 1 : 64, ctx = ai == 0 ? 576 : 1024;
      BatchMeta m = PagedBatch(B, 1, ctx, bs);
      const int64_t rows = int64_t{B} * m.max_blocks_per_seq * bs * heads;
      const size_t kv_bytes = size_t{2} * rows * hd;
      void *q = ops.Alloc(size_t{2} * B * heads * hd), *o = ops.Alloc(size_t{2} * B * heads * hd);
      void *kc = ops.Alloc(kv_bytes), *vc = ops.Alloc(kv_bytes);
      FillRandom(q, size_t{2} * B * heads * hd, 1.0f);
      FillRandom(kc, kv_bytes, 1.0f);
      FillRandom(vc, kv_bytes, 1.0f);
      ops.SetBatch(m);
      Tensor tq(q, {B, heads * hd}, DType::kBF16, Device::kCuda),
          to(o, {B, heads * hd}, DType::kBF16, Device::kCuda);
      Tensor tk(kc, {B * m.max_blocks_per_seq, bs, heads, hd}, DType::kBF16, Device::kCuda),
          tv(vc, {B * m.max_blocks_per_seq, bs, heads, hd}, DType::kBF16, Device::kCuda);
      const double ms = MedianMs(
          s, 50, [&](int) { ops.AttentionDecode(tq, tk, tv, heads, heads, hd, 0.0884f, to); });
      Add(Fmt("shard tp=%g decode attention B=%g", tp, B) + " ctx " + std::to_string(ctx) + " " +
              std::to_string(heads) + " heads",
          ms,
          Fmt("%.0f GB/s KV = %.1f%% of copy", 2.0 * kv_bytes / ms / 1e6,
              100.0 * 2.0 * kv_bytes / ms / 1e6 / copy_gbs));
      attn_us[ai] = ms * 1e3;
      for (void* p : {q, o, kc, vc}) ops.Free(p);
    }
    for (int i = 0; i < 2; ++i) {
      Add(Fmt("shard tp=%g layer ", tp) + (i == 0 ? "M=1" : "M=64"),
          (layer_us[i] + attn_us[i]) / 1e3,
          Fmt("GEMMs %.1f us + decode attention %.1f us", layer_us[i], attn_us[i]));
    }
  }
  ops.Free(xbuf);
  ops.Free(ybuf);
}

// Random activations x [M, K] and outputs y [M, N] for the decode-size GEMMs of the 6.7B shapes
// (M <= 128, K <= 11008, N <= 32256).
struct DecodeGemmOperands {
  static constexpr int kMaxM = 128;
  explicit DecodeGemmOperands(CudaOps& ops)
      : ops(ops), x(ops.Alloc(size_t{2} * kMaxM * 11008)), y(ops.Alloc(size_t{2} * kMaxM * 32256)) {
    FillRandom(x, size_t{2} * kMaxM * 11008, 1.0f);
  }
  ~DecodeGemmOperands() {
    ops.Free(x);
    ops.Free(y);
  }
  DecodeGemmOperands(const DecodeGemmOperands&) = delete;
  DecodeGemmOperands& operator=(const DecodeGemmOperands&) = delete;
  Tensor X(int m, int k) const { return Tensor(x, {m, k}, DType::kBF16, Device::kCuda); }
  Tensor Y(int m, int n) const { return Tensor(y, {m, n}, DType::kBF16, Device::kCuda); }
  CudaOps& ops;
  void *x, *y;
};

// cuBLASLt's first algorithm at decode batch sizes with split-K forced to 1..8 against its own
// choice, for the 6.7B shapes: the batch-64 GEMMs run at 58-86% of copy (o and down lowest).
void SplitKGemms(CudaOps& ops, double copy_gbs) {
  cudaStream_t s = ops.stream();
  DecodeGemmOperands io(ops);
  cuda::LtGemm lt;
  for (const Shape& sh : kShapes) {
    RotatingWeights rw(ops, sh);
    for (int m : {32, 64, 128}) {
      const Tensor x = io.X(m, sh.k), y = io.Y(m, sh.n);
      for (int split : {0, 1, 2, 3, 4, 6, 8}) {
        lt.set_split_k_override(split);
        const double ms = MedianMs(s, 50, [&](int i) { lt.Run(x, rw.At(i), nullptr, y, s); });
        if (split > 0 && lt.PlanSplitK(m, sh.n, sh.k) != split) continue;  // refused
        const double gbs = rw.bytes / ms / 1e6;
        Add(std::string(sh.name) + " M=" + std::to_string(m) +
                (split == 0 ? std::string(" heuristic") : " split-k " + std::to_string(split)),
            ms, Fmt("%.0f GB/s = %.1f%% of copy", gbs, 100.0 * gbs / copy_gbs));
      }
    }
  }
  lt.set_split_k_override(0);
}

// Issue 22: whether a fixed cuBLASLt algorithm with split-K forced to 2, 4 or 8 (each reduction
// scheme) keeps a row's bits whatever M is, as the unsplit one does, and what it costs. For each
// 6.7B shape: the heuristic's first unsplit candidate at M = 64 (as deterministic mode picks it),
// made split; y of M = 1, 2, 7, 16, 64 rows compared bit for bit with the same rows of a 256-row
// product; then the weights-cold time at M = 1 and M = 64 (% of copy). If some split is
// invariant and fast at M = 1, deterministic mode could take it at every M (a row-chunked
// prefill keeps the workspace bounded) instead of the unsplit chain (1.35-1.38x at batch 1).
void DetSplitK(CudaOps& ops, double copy_gbs) {
  cudaStream_t s = ops.stream();
  cublasLtHandle_t lt;
  TP_CUBLAS_CHECK(cublasLtCreate(&lt));
  constexpr int kRefRows = 256;
  const size_t ws_bytes = size_t{kRefRows} * 32256 * 4 * 8 + (size_t{64} << 20);
  void* ws = ops.Alloc(ws_bytes);
  void* xbuf = ops.Alloc(size_t{2} * kRefRows * 11008);
  void* yref = ops.Alloc(size_t{2} * kRefRows * 32256);
  void* ybuf = ops.Alloc(size_t{2} * kRefRows * 32256);
  FillRandom(xbuf, size_t{2} * kRefRows * 11008, 1.0f);
  using Desc = cuda::LtGemm::Problem;
  auto make = [](int m, int n, int k) { return cuda::LtGemm::MakeProblem(m, n, k, false); };
  auto destroy = [](Desc& d) { cuda::LtGemm::DestroyProblem(d); };
  auto split_of = [](const cublasLtMatmulAlgo_t& algo) {
    int32_t splits = 1;
    size_t written = 0;
    TP_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                         &splits, sizeof(splits), &written));
    return splits;
  };
  struct Scheme {
    const char* name;
    uint32_t value;
  };
  const Scheme kSchemes[] = {{"compute", CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE},
                             {"output", CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE},
                             {"inplace", CUBLASLT_REDUCTION_SCHEME_INPLACE}};
  const int kRows[] = {1, 2, 7, 16, 64};
  for (const Shape& sh : kShapes) {
    RotatingWeights rw(ops, sh);
    // The base algorithm: the heuristic's first unsplit candidate at M = 64.
    Desc ref = make(64, sh.n, sh.k);
    cublasLtMatmulPreference_t pref;
    TP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    TP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    std::vector<cublasLtMatmulHeuristicResult_t> results(16);
    int found = 0;
    TP_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, ref.desc, ref.a, ref.b, ref.c, ref.c, pref,
                                                   16, results.data(), &found));
    cublasLtMatmulPreferenceDestroy(pref);
    destroy(ref);
    const cublasLtMatmulAlgo_t* base = nullptr;
    for (int i = 0; i < found && base == nullptr; ++i) {
      if (results[i].state == CUBLAS_STATUS_SUCCESS && split_of(results[i].algo) == 1)
        base = &results[i].algo;
    }
    if (base == nullptr) {
      std::printf("det-split-k %s: no unsplit candidate among %d\n", sh.name, found);
      continue;
    }
    std::printf("det-split-k %s: base %s\n", sh.name, cuda::LtGemm::DescribeAlgo(*base).c_str());
    for (int split : {1, 2, 4, 8}) {
      for (const Scheme& sc : kSchemes) {
        if (split == 1 && sc.value != CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE) continue;
        cublasLtMatmulAlgo_t algo = *base;
        const int32_t sp = split;
        const uint32_t scheme =
            split == 1 ? static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE) : sc.value;
        TP_CUBLAS_CHECK(cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                             &sp, sizeof(sp)));
        TP_CUBLAS_CHECK(cublasLtMatmulAlgoConfigSetAttribute(
            &algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme)));
        const std::string label = std::string("det-split-k ") + sh.name + " s" +
                                  std::to_string(split) +
                                  (split > 1 ? std::string(" ") + sc.name : "");
        if (!Wanted(label)) continue;
        auto run = [&](Desc& d, const void* w, void* y) {
          const float alpha = 1.0f, beta = 0.0f;
          TP_CUBLAS_CHECK(cublasLtMatmul(lt, d.desc, &alpha, w, d.a, xbuf, d.b, &beta, y, d.c, y,
                                         d.c, &algo, ws, ws_bytes, s));
        };
        bool accepted = true;
        std::vector<Desc> descs;
        for (int m : {kRefRows, 1, 2, 7, 16, 64}) {
          descs.push_back(make(m, sh.n, sh.k));
          cublasLtMatmulHeuristicResult_t check{};
          const Desc& d = descs.back();
          if (cublasLtMatmulAlgoCheck(lt, d.desc, d.a, d.b, d.c, d.c, &algo, &check) !=
                  CUBLAS_STATUS_SUCCESS ||
              check.workspaceSize > ws_bytes) {
            accepted = false;
          }
        }
        if (!accepted) {
          std::printf("%-48s refused by cuBLASLt at some M\n", label.c_str());
          for (auto& d : descs) destroy(d);
          continue;
        }
        const Tensor w0 = rw.At(0);
        run(descs[0], w0.data, yref);
        std::vector<uint16_t> ref_host(size_t{kRefRows} * sh.n), got(ref_host.size());
        TP_CUDA_CHECK(
            cudaMemcpyAsync(ref_host.data(), yref, ref_host.size() * 2, cudaMemcpyDeviceToHost, s));
        std::string bits;
        int64_t differ_total = 0;
        for (size_t i = 1; i < descs.size(); ++i) {
          const int m = kRows[i - 1];
          run(descs[i], w0.data, ybuf);
          TP_CUDA_CHECK(
              cudaMemcpyAsync(got.data(), ybuf, size_t{2} * m * sh.n, cudaMemcpyDeviceToHost, s));
          TP_CUDA_CHECK(cudaStreamSynchronize(s));
          int64_t differ = 0;
          for (size_t j = 0; j < size_t{1} * m * sh.n; ++j) differ += got[j] != ref_host[j];
          differ_total += differ;
          bits += " M" + std::to_string(m) + ":" + std::to_string(differ);
        }
        for (int t = 0; t < 2; ++t) {
          const int m = t == 0 ? 1 : 64;
          Desc& d = descs[t == 0 ? 1 : 5];
          const double ms = MedianMs(s, 50, [&](int i) { run(d, rw.At(i).data, ybuf); });
          const double gbs = rw.bytes / ms / 1e6;
          char metric[256];
          std::snprintf(metric, sizeof(metric),
                        "%.0f GB/s = %.1f%% of copy; %s (outputs differing from the %d-row "
                        "product:%s)",
                        gbs, 100.0 * gbs / copy_gbs,
                        differ_total == 0 ? "M-invariant" : "NOT M-invariant", kRefRows,
                        bits.c_str());
          Add(label + " M=" + std::to_string(m), ms, metric);
        }
        for (auto& d : descs) destroy(d);
      }
    }
  }
  ops.Free(ws);
  ops.Free(xbuf);
  ops.Free(yref);
  ops.Free(ybuf);
  cublasLtDestroy(lt);
}

// cuBLASLt's heuristic candidates (its first 32, as they come, split-K included) at the decode
// graphs' batch sizes (M = 4 .. 256; M <= 2 runs the skinny kernel) and at prefill chunks (512,
// 1024, 2048 rows; not lm_head, which a prefill runs on its last rows only), weights cold:
// whether another algorithm than its first is faster (issue 17: the batch-64 GEMMs at 55-83% of
// copy). The row label names the candidate's configuration; the summary's last rows give the
// first and the fastest of each shape and M. A fastest candidate at least 2% faster than the
// first is timed against it again, alternately (five rounds each); if it still is, it is that
// sweep's choice. The whole sweep runs twice, and the choices both made alike are the cuBLASLt
// table written to `table_out` (kernels/cuda/gemm_table.h), which TPSERVE_CUBLASLT_TABLE can
// name and kernels/cuda/cublaslt_table.json builds in.
void LtSweep(CudaOps& ops, double copy_gbs, const std::string& table_out) {
  cudaStream_t s = ops.stream();
  constexpr int kMaxM = 2048;
  void* xbuf = ops.Alloc(size_t{2} * kMaxM * 11008);
  void* ybuf = ops.Alloc(size_t{2} * kMaxM * 22016);
  FillRandom(xbuf, size_t{2} * kMaxM * 11008, 1.0f);
  cuda::LtGemm lt;
  lt.set_table(nullptr);  // "first" is the heuristic's own first choice
  std::vector<nlohmann::json> pass_entries[2];
  std::vector<Row> best_rows;
  for (int pass = 0; pass < 2; ++pass) {
    for (const Shape& sh : kShapes) {
      RotatingWeights rw(ops, sh);
      const bool lm_head = sh.n == 32256;
      std::vector<int> ms = {4, 8, 16, 32, 64, 128, 256};
      if (!lm_head) ms.insert(ms.end(), {512, 1024, 2048});
      for (int m : ms) {
        const Tensor x(xbuf, {m, sh.k}, DType::kBF16, Device::kCuda);
        const Tensor y(ybuf, {m, sh.n}, DType::kBF16, Device::kCuda);
        const std::string name = std::string(sh.name) + " M=" + std::to_string(m);
        if (!Wanted(name)) continue;
        const std::string prefix = "sweep " + std::to_string(pass + 1) + ": " + name;
        // Round-robin: every candidate is timed once a round, five rounds, its figure the median
        // of its rounds. Prefill sizes are compute-bound and the board's clock follows its power
        // draw, so timing one candidate after another would favour whichever ran coolest.
        const int iters = m >= 512 ? 4 : 10;
        auto time = [&](int c) {
          lt.set_candidate_override(c);
          return MedianMs(s, iters, [&](int i) { lt.Run(x, rw.At(i), nullptr, y, s); });
        };
        std::vector<std::string> configs;
        std::vector<std::vector<double>> rounds;
        for (int c = 0; c < 32; ++c) {
          const double ms = time(c);
          if (lt.PlanCandidate(m, sh.n, sh.k) != c) break;  // no such candidate
          configs.push_back(lt.DescribePlan(m, sh.n, sh.k));
          rounds.push_back({ms});
        }
        for (int round = 1; round < 5; ++round) {
          for (size_t c = 0; c < configs.size(); ++c)
            rounds[c].push_back(time(static_cast<int>(c)));
        }
        double first_ms = 0, best_ms = 0;
        int best = 0;
        std::string best_label, first_config, best_config;
        for (size_t c = 0; c < configs.size(); ++c) {
          std::sort(rounds[c].begin(), rounds[c].end());
          const double ms = rounds[c][rounds[c].size() / 2];
          const std::string& config = configs[c];
          const std::string label = prefix + " cand " + std::to_string(c) + " " + config;
          const double gbs = rw.bytes / ms / 1e6;
          const double tflops = 2.0 * m * sh.n * sh.k / ms / 1e9;
          Add(label, ms,
              m >= 512 ? Fmt("%.0f TFLOP/s", tflops)
                       : Fmt("%.0f GB/s = %.1f%% of copy", gbs, 100.0 * gbs / copy_gbs));
          if (c == 0) {
            first_ms = ms;
            first_config = config;
          }
          if (c == 0 || ms < best_ms) {
            best_ms = ms;
            best = static_cast<int>(c);
            best_label = label;
            best_config = config;
          }
        }
        if (first_ms <= 0) continue;
        std::string verdict = "the first is kept";
        if (best > 0 && first_ms / best_ms >= 1.02) {
          std::vector<double> firsts, bests;
          for (int round = 0; round < 5; ++round) {
            firsts.push_back(time(0));
            bests.push_back(time(best));
          }
          std::sort(firsts.begin(), firsts.end());
          std::sort(bests.begin(), bests.end());
          const double f = firsts[2], b = bests[2];
          if (f / b >= 1.02) {
            verdict = Fmt("again %.3fx: chosen", f / b);
            pass_entries[pass].push_back(
                {{"device", lt.device_name()},
                 {"sms", lt.device_sms()},
                 {"cublaslt", lt.cublaslt_version()},
                 {"m", m},
                 {"n", sh.n},
                 {"k", sh.k},
                 {"bias", false},
                 {"alignment", cuda::LtGemm::OperandAlignment(xbuf, rw.At(0).data, ybuf)},
                 {"candidate", best},
                 {"config", best_config},
                 {"first_config", first_config},
                 {"first_us", std::round(f * 1e4) / 10},
                 {"best_us", std::round(b * 1e4) / 10}});
          } else {
            verdict = Fmt("again %.3fx: not kept", f / b);
          }
        }
        best_rows.push_back(
            {"fastest of " + best_label, best_ms,
             Fmt("first %.4f ms, fastest %.3fx faster", first_ms, first_ms / best_ms) + ", " +
                 verdict});
      }
    }
  }
  lt.set_candidate_override(-1);
  ops.Free(xbuf);
  ops.Free(ybuf);
  for (const Row& r : best_rows) Add(r.what, r.ms, r.metric);
  // The table: the entries both sweeps chose alike (LtTable::Agreement).
  auto table_of = [](const std::vector<nlohmann::json>& entries) {
    nlohmann::json t;
    t["entries"] = nlohmann::json::array();
    for (const nlohmann::json& e : entries) t["entries"].push_back(e);
    return t.dump();
  };
  absl::StatusOr<std::string> table =
      cuda::LtTable::Agreement(table_of(pass_entries[0]), table_of(pass_entries[1]),
                               "tpserve-cuda-bench --lt-sweep on " + lt.device_name() +
                                   ": the choices two sweeps made alike");
  TP_CHECK(table.ok()) << table.status();
  const size_t agreed = nlohmann::json::parse(*table)["entries"].size();
  std::printf("cuBLASLt table: sweep 1 chose %zu, sweep 2 %zu, both alike %zu\n",
              pass_entries[0].size(), pass_entries[1].size(), agreed);
  if (!table_out.empty()) {
    std::ofstream out(table_out);
    out << *table;
    TP_CHECK(out.good()) << "cannot write " << table_out;
    std::printf("cuBLASLt table: %zu entries written to %s\n", agreed, table_out.c_str());
  }
}

// Whether cuBLASLt's GEMM kernels may be launched as programmatic dependents of the kernel before
// them in a decode graph (tpserve's own kernels are; a GEMM still waits for the full completion
// of its predecessor and then ramps up), and what that saves. First a probe: a kernel that
// triggers its dependents at once, spins 200 us, then writes ones into x; the GEMM after it on a
// programmatic edge reads x times a weight of ones: K everywhere if the GEMM's kernel waits for
// its predecessor (griddepcontrol.wait), zeros or a mix if it does not (then such an edge would
// be wrong). Then a graph of 32 x (a small PDL kernel, then the GEMM, weights cold) with the
// edges into the GEMMs as captured (full completion) and made programmatic.
void PdlGemm(CudaOps& ops) {
  cudaStream_t s = ops.stream();
  constexpr int kMaxM = 2048;
  void* xbuf = ops.Alloc(size_t{2} * kMaxM * 11008);
  void* ybuf = ops.Alloc(size_t{2} * kMaxM * 22016);
  TP_CUDA_CHECK(cudaMemset(ybuf, 0, size_t{2} * kMaxM * 22016));
  cuda::LtGemm lt;
  auto graph_of = [&](const std::function<void()>& body, const void* from_func, int* changed) {
    cudaGraph_t g = nullptr;
    TP_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    body();
    TP_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    *changed = from_func == nullptr ? 0 : cuda_bench::MakeEdgesFromProgrammatic(g, from_func);
    cudaGraphExec_t exec = nullptr;
    TP_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    TP_CUDA_CHECK(cudaGraphDestroy(g));
    return exec;
  };
  for (const Shape& sh : kShapes) {
    if (sh.n == 32256) continue;
    RotatingWeights rw(ops, sh);
    const size_t wbytes = size_t{2} * sh.n * sh.k;
    void* ones = ops.Alloc(wbytes);
    {
      std::vector<uint16_t> h(size_t{1} * sh.n * sh.k, F32ToBf16(1.0f));
      TP_CUDA_CHECK(cudaMemcpy(ones, h.data(), wbytes, cudaMemcpyHostToDevice));
    }
    for (int m : {64, 2048}) {
      const Tensor x(xbuf, {m, sh.k}, DType::kBF16, Device::kCuda);
      const Tensor y(ybuf, {m, sh.n}, DType::kBF16, Device::kCuda);
      const Tensor w1(ones, {sh.n, sh.k}, DType::kBF16, Device::kCuda);
      const std::string prefix = std::string(sh.name) + " M=" + std::to_string(m);
      lt.Run(x, w1, nullptr, y, s);  // the plan, before capture
      TP_CUDA_CHECK(cudaStreamSynchronize(s));
      // 1. The probe.
      int changed = 0;
      cudaGraphExec_t probe = graph_of(
          [&] {
            cuda_bench::LaunchSpinThenOnes(xbuf, int64_t{m} * sh.k, 200, s);
            lt.Run(x, w1, nullptr, y, s);
          },
          cuda_bench::SpinThenOnesFunc(), &changed);
      TP_CUDA_CHECK(cudaMemsetAsync(xbuf, 0, size_t{2} * m * sh.k, s));
      TP_CUDA_CHECK(cudaMemsetAsync(ybuf, 0, size_t{2} * m * sh.n, s));
      TP_CUDA_CHECK(cudaGraphLaunch(probe, s));
      TP_CUDA_CHECK(cudaStreamSynchronize(s));
      TP_CUDA_CHECK(cudaGraphExecDestroy(probe));
      std::vector<uint16_t> got(size_t{1} * m * sh.n);
      TP_CUDA_CHECK(cudaMemcpy(got.data(), ybuf, got.size() * 2, cudaMemcpyDeviceToHost));
      const uint16_t want = F32ToBf16(static_cast<float>(sh.k));
      size_t right = 0;
      for (uint16_t v : got) right += v == want;
      std::printf("%s probe: %d edges made programmatic; %zu of %zu outputs = K (%s)\n",
                  prefix.c_str(), changed, right, got.size(),
                  right == got.size() ? "the GEMM waited for its predecessor"
                                      : "the GEMM did NOT wait: such an edge is wrong");
      // 2. The timing: 32 pairs a graph.
      for (bool programmatic : {false, true}) {
        int edges = 0;
        cudaGraphExec_t exec = graph_of(
            [&] {
              for (int i = 0; i < 32; ++i) {
                cuda_bench::LaunchPdlTouch(ybuf, xbuf, int64_t{m} * sh.k, s);
                lt.Run(x, rw.At(i), nullptr, y, s);
              }
            },
            programmatic ? cuda_bench::PdlTouchFunc() : nullptr, &edges);
        const double ms = MedianMs(s, 20, [&](int) { TP_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
        TP_CUDA_CHECK(cudaGraphExecDestroy(exec));
        Add(prefix + (programmatic ? " 32 x (PDL kernel, GEMM), programmatic edges (" +
                                         std::to_string(edges) + ")"
                                   : " 32 x (PDL kernel, GEMM), as captured"),
            ms, Fmt("%.2f us a pair", ms * 1e3 / 32));
      }
    }
    ops.Free(ones);
  }
  ops.Free(xbuf);
  ops.Free(ybuf);
}

// The weight-streaming GEMM against cuBLASLt (the path it replaces) at decode batch sizes, 6.7B
// shapes; % of copy counts the weight bytes.
void StreamGemms(CudaOps& ops, double copy_gbs) {
  cudaStream_t s = ops.stream();
  DecodeGemmOperands io(ops);
  for (const Shape& sh : kShapes) {
    RotatingWeights rw(ops, sh);
    for (int m : {1, 3, 8, 16, 32, 48, 64, 96, 128}) {
      const Tensor x = io.X(m, sh.k), y = io.Y(m, sh.n);
      auto add = [&](const std::string& what, const std::function<void(int)>& fn) {
        const std::string label = std::string(sh.name) + " M=" + std::to_string(m) + " " + what;
        if (!Wanted(label)) return;
        const double ms = MedianMs(s, 50, fn);
        const double gbs = rw.bytes / ms / 1e6;
        Add(label, ms, Fmt("%.0f GB/s = %.1f%% of copy", gbs, 100.0 * gbs / copy_gbs));
      };
      add("cuBLASLt", [&](int i) { ops.GemmCublasLt(x, rw.At(i), nullptr, y); });
      // Deterministic mode's variant (TPSERVE_DETERMINISTIC_GEMM=stream): auto config, a fixed
      // grid of 2 blocks an SM; at M = 1 beside the skinny kernel, the default there.
      add("stream fixed grid (deterministic)",
          [&](int i) { ops.GemmStreamFixed(x, rw.At(i), nullptr, y); });
      if (m == 1) {
        add("skinny (default config)", [&](int i) { ops.GemmSkinny(x, rw.At(i), nullptr, y, 0); });
        continue;
      }
      for (int c = 0; c < cuda::StreamGemmNumConfigs(); ++c) {
        const int tokens = cuda::StreamGemmConfigTokens(c);
        // Each configuration at the batches it would take (and the next smaller token count).
        if (m > tokens || m * 4 <= tokens) continue;
        const std::string name = std::string("stream ") +
                                 (c == cuda::StreamGemmAutoConfig(m) ? "(auto) " : "") +
                                 cuda::StreamGemmConfigName(c);
        add(name, [&](int i) { ops.GemmStream(x, rw.At(i), nullptr, y, c); });
        // The same on a grid of one block a tile (no tile split, no fixup) and of two.
        const int tiles = static_cast<int>((sh.n + cuda::StreamGemmConfigRows(c) - 1) /
                                           cuda::StreamGemmConfigRows(c));
        for (int per : {1, 2}) {
          add(name + ", grid " + std::to_string(per) + " x tiles", [&](int i) {
            ops.GemmStream(x, rw.At(i), nullptr, y, c, per * tiles, /*exact_grid=*/true);
          });
        }
      }
      // The auto configuration on smaller grids (one block an SM and 1.5): fewer, longer ranges.
      for (int grid : {132, 198}) {
        add("stream (auto) grid " + std::to_string(grid), [&](int i) {
          ops.GemmStream(x, rw.At(i), nullptr, y, cuda::StreamGemmAutoConfig(m), grid);
        });
      }
    }
  }
}

int Main(const std::string& mode, const std::string& table_out) {
  const bool m1_only = mode == "--m1", decode_sweep = mode == "--decode";
  const bool attention_only = mode == "--attention" || decode_sweep;
  const bool det_gemm = mode == "--det-gemm", shards = mode == "--shards";
  const bool split_k = mode == "--split-k", chain = mode == "--chain", stream = mode == "--stream";
  const bool lt_sweep = mode == "--lt-sweep", pdl_gemm = mode == "--pdl-gemm";
  if (CudaDeviceCount() == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  CudaOps ops(0);
  if (absl::Status knobs = ApplyBenchKnobs(&ops); !knobs.ok()) {
    std::fprintf(stderr, "tpserve-cuda-bench: %s\n", std::string(knobs.message()).c_str());
    return 2;
  }
  cudaStream_t s = ops.stream();
  cudaDeviceProp prop;
  TP_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);

  // 1. Copy bandwidth (bytes read + written).
  const size_t copy_bytes = size_t{1} << 30;
  void *src = ops.Alloc(copy_bytes), *dst = ops.Alloc(copy_bytes);
  FillRandom(src, copy_bytes, 1.0f);
  double copy_ms = MedianMs(s, 20, [&](int) {
    TP_CUDA_CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, s));
  });
  const double copy_gbs = 2.0 * copy_bytes / copy_ms / 1e6;
  Add("d2d copy 1 GiB", copy_ms, Fmt("%.0f GB/s (read+write)", copy_gbs));
  ops.Free(src);
  ops.Free(dst);
  if (det_gemm || chain) {
    DeterministicGemms(ops, copy_gbs, chain);
    return PrintSummary(copy_gbs);
  }
  if (shards) {
    ShardShapes(ops, copy_gbs);
    return PrintSummary(copy_gbs);
  }
  if (mode == "--det-split-k") {
    DetSplitK(ops, copy_gbs);
    return PrintSummary(copy_gbs);
  }
  if (split_k) {
    SplitKGemms(ops, copy_gbs);
    return PrintSummary(copy_gbs);
  }
  if (stream) {
    StreamGemms(ops, copy_gbs);
    return PrintSummary(copy_gbs);
  }
  if (pdl_gemm) {
    PdlGemm(ops);
    return PrintSummary(copy_gbs);
  }
  if (lt_sweep) {
    LtSweep(ops, copy_gbs, table_out);
    return PrintSummary(copy_gbs);
  }

  // 2. GEMMs at decode sizes, 6.7B shapes. Weights rotate over >= 1 GiB of copies.
  void* xbuf = ops.Alloc(16 * 11008 * 2 * 2);
  void* ybuf = ops.Alloc(size_t{16} * 32256 * 2);
  FillRandom(xbuf, 16 * 11008 * 2 * 2, 1.0f);
  for (const Shape& sh : kShapes) {
    if (attention_only) break;
    RotatingWeights rw(ops, sh);
    const size_t wbytes = rw.bytes;
    auto wt = [&](int i) { return rw.At(i); };
    for (int m : {1, 2, 4, 8, 16}) {
      if (m1_only && m > 1) break;
      Tensor x(xbuf, {m, sh.k}, DType::kBF16, Device::kCuda);
      Tensor y(ybuf, {m, sh.n}, DType::kBF16, Device::kCuda);
      auto report = [&](const std::string& label, double ms) {
        double gbs = wbytes / ms / 1e6;
        Add(std::string(sh.name) + " M=" + std::to_string(m) + " " + label, ms,
            Fmt("%.0f GB/s = %.1f%% of copy", gbs, 100.0 * gbs / copy_gbs));
      };
      report("cublasLt", MedianMs(s, 50, [&](int i) { ops.GemmCublasLt(x, wt(i), nullptr, y); }));
      // All variants at M = 1; the automatic choice at larger M.
      for (int c = 0; c < (m == 1 ? 7 : 1); ++c) {
        report("skinny cfg" + std::to_string(c),
               MedianMs(s, 50, [&](int i) { ops.GemmSkinny(x, wt(i), nullptr, y, c); }));
      }
      // The down projection reading silu(gate) * up from gate_up [M, 2K] (SiluMulGemm).
      if (sh.n == 4096 && sh.k == 11008 && m <= 2) {
        Tensor gu(xbuf, {m, 2 * sh.k}, DType::kBF16, Device::kCuda);
        for (int c = 0; c < 7; ++c) {
          report("swiglu cfg" + std::to_string(c),
                 MedianMs(s, 50, [&](int i) { ops.SiluMulGemmSkinny(gu, wt(i), y, c); }));
        }
      }
    }
  }
  ops.Free(xbuf);
  ops.Free(ybuf);

  // 3. cuBLAS bf16 peak and a prefill-sized GEMM.
  for (auto [m, n, k] : {std::tuple{4096, 4096, 4096}, std::tuple{2048, 12288, 4096},
                         std::tuple{2048, 4096, 11008}}) {
    if (m1_only || attention_only) break;
    void* a = ops.Alloc(size_t{2} * m * k);
    void* b = ops.Alloc(size_t{2} * n * k);
    void* c = ops.Alloc(size_t{2} * m * n);
    FillRandom(a, size_t{2} * m * k, 1.0f);
    FillRandom(b, size_t{2} * n * k, 0.02f);
    Tensor x(a, {m, k}, DType::kBF16, Device::kCuda), w(b, {n, k}, DType::kBF16, Device::kCuda),
        y(c, {m, n}, DType::kBF16, Device::kCuda);
    double ms = MedianMs(s, 30, [&](int) { ops.GemmCublasLt(x, w, nullptr, y); });
    Add("cublasLt GEMM " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k),
        ms, Fmt("%.0f TFLOP/s", 2.0 * m * n * k / ms / 1e9));
    ops.Free(a);
    ops.Free(b);
    ops.Free(c);
  }

  // 4. Attention. 6.7B: 32 heads, 32 KV heads, head_dim 128, block size 16.
  const int hq = 32, hk = 32, d = 128, bs = 16;
  auto batch = [&](int seqs, int qlen, int ctx) { return PagedBatch(seqs, qlen, ctx, bs); };
  // Prefill attention: the mma.sync kernel (the unsuffixed rows) and the wgmma kernels, over a
  // bf16 and an fp8 cache (one cache and q per dtype, for every kernel's row).
  // 8192 tokens (bf16, the mma, wgmma and fa3 kernels): four times the key tiles a block, so a
  // fixed cost per block (its Q and first tiles' loads, its store, the tail of the grid) weighs a
  // quarter as much as at 2048.
  const cuda::PrefillKernel env_prefill = cuda::PrefillKernelChoice();
  for (auto [T, kv] : {std::pair{2048, DType::kBF16}, std::pair{2048, DType::kF8E4M3},
                       std::pair{8192, DType::kBF16}}) {
    std::vector<std::pair<cuda::PrefillKernel, std::string>> rows;
    for (const auto& [kernel, name] : cuda::kPrefillKernels) {
      std::string label = "prefill attention " + std::to_string(T) + " tok, 32 heads, d128";
      if (kv != DType::kBF16) label += std::string(" ") + std::string(KvCacheDTypeName(kv));
      // The mma kernel's rows are the unsuffixed ones.
      if (kernel != cuda::PrefillKernel::kMma) label += std::string(" ") + name;
      if (m1_only || !Wanted(label)) continue;
      // The wgmma kernels where they run (pipe, ws, tma and fa3 for bf16 caches only).
      if (kernel != cuda::PrefillKernel::kMma && !cuda::WgmmaPrefillFits(kv, d)) continue;
      if (kernel != cuda::PrefillKernel::kMma && kernel != cuda::PrefillKernel::kWgmma &&
          kv != DType::kBF16) {
        continue;
      }
      if (T != 2048 && kernel != cuda::PrefillKernel::kMma &&
          kernel != cuda::PrefillKernel::kWgmma && kernel != cuda::PrefillKernel::kWgmmaFa3 &&
          kernel != cuda::PrefillKernel::kWgmmaFa3Pp && kernel != cuda::PrefillKernel::kWgmmaFa3P) {
        continue;
      }
      rows.emplace_back(kernel, label);
    }
    if (rows.empty()) continue;
    BatchMeta m = batch(1, T, T);
    RandomKvCache cache(ops, m.max_blocks_per_seq, bs, hk, d, kv);
    void *q = ops.Alloc(size_t{2} * T * hq * d), *o = ops.Alloc(size_t{2} * T * hq * d);
    FillRandom(q, size_t{2} * T * hq * d, 1.0f);
    ops.SetBatch(m);
    Tensor tq(q, {T, hq * d}, DType::kBF16, Device::kCuda),
        to(o, {T, hq * d}, DType::kBF16, Device::kCuda);
    const double flops = 4.0 * d * hq * (double(T) * (T + 1) / 2);
    for (const auto& [kernel, label] : rows) {
      cuda::SetPrefillKernel(kernel);
      const double ms = MedianMs(
          s, 20, [&](int) { ops.AttentionPrefill(tq, cache.k, cache.v, hq, hk, d, 0.0884f, to); });
      Add(label, ms, Fmt("%.0f TFLOP/s (causal FLOPs)", flops / ms / 1e9));
    }
    cuda::SetPrefillKernel(env_prefill);
    for (void* p : {q, o}) ops.Free(p);
  }
  // Decode attention: each KV-cache dtype through the kernel and partition the batch picks
  // (auto), and with --decode every kernel variant (TPSERVE_DECODE_KERNEL/PARTITION's choices).
  struct Variant {
    const char* name;
    cuda::DecodeKernel kernel;
    int partition;
    int prefetch = -1;  // the mma kernel's L2 prefetch distance (-1: TPSERVE_DECODE_PREFETCH's)
  };
  std::vector<Variant> variants = {{"auto", cuda::DecodeKernel::kAuto, 0}};
  const int env_prefetch = cuda::DecodePrefetch();
  if (decode_sweep) {
    variants.push_back({"subtile p64", cuda::DecodeKernel::kSubTile, 64});
    variants.push_back({"twophase p128", cuda::DecodeKernel::kTwoPhase, 128});
    variants.push_back({"twophase p256", cuda::DecodeKernel::kTwoPhase, 256});
    variants.push_back({"twophase p512", cuda::DecodeKernel::kTwoPhase, 512});
    variants.push_back({"mma p256", cuda::DecodeKernel::kMma, 256});
    variants.push_back({"mma p512", cuda::DecodeKernel::kMma, 512});
    variants.push_back({"mma p1024", cuda::DecodeKernel::kMma, 1024});
    variants.push_back({"mma p512 prefetch 1", cuda::DecodeKernel::kMma, 512, 1});
    variants.push_back({"mma p512 prefetch 2", cuda::DecodeKernel::kMma, 512, 2});
    variants.push_back({"mma p512 prefetch 4", cuda::DecodeKernel::kMma, 512, 4});
    variants.push_back({"mma-bf16 p128", cuda::DecodeKernel::kMmaBf16, 128});
    variants.push_back({"mma-bf16 p256", cuda::DecodeKernel::kMmaBf16, 256});
  }
  const DType kv_dtypes[] = {DType::kBF16, DType::kF8E4M3, DType::kI8, DType::kI4};
  for (auto [B, ctx] :
       {std::pair{1, 1024}, std::pair{8, 1024}, std::pair{32, 1024}, std::pair{64, 1024},
        std::pair{128, 1024}, std::pair{1, 4096}, std::pair{8, 4096}}) {
    if (m1_only && B != 1 && B != 64) continue;
    if (!decode_sweep && B == 128) continue;
    BatchMeta m = batch(B, 1, ctx);
    void *q = ops.Alloc(size_t{2} * B * hq * d), *o = ops.Alloc(size_t{2} * B * hq * d);
    FillRandom(q, size_t{2} * B * hq * d, 1.0f);
    ops.SetBatch(m);
    Tensor tq(q, {B, hq * d}, DType::kBF16, Device::kCuda),
        to(o, {B, hq * d}, DType::kBF16, Device::kCuda);
    for (DType kv : kv_dtypes) {
      if (m1_only && kv != DType::kBF16) continue;
      RandomKvCache cache(ops, int64_t{B} * m.max_blocks_per_seq, bs, hk, d, kv);
      const Tensor &tk = cache.k, &tv = cache.v;
      const double bytes = cache.Bytes();
      for (const Variant& v : variants) {
        const std::string label = "decode attention B=" + std::to_string(B) + " ctx " +
                                  std::to_string(ctx) + " " + std::string(KvCacheDTypeName(kv)) +
                                  " " + v.name;
        if (!Wanted(label)) continue;
        cuda::SetDecodeOverride(v.kernel, v.partition);
        cuda::SetDecodePrefetch(v.prefetch >= 0 ? v.prefetch : env_prefetch);
        double ms =
            MedianMs(s, 50, [&](int) { ops.AttentionDecode(tq, tk, tv, hq, hk, d, 0.0884f, to); });
        Add(label, ms,
            Fmt("%.0f GB/s KV = %.1f%% of copy", bytes / ms / 1e6,
                100.0 * bytes / ms / 1e6 / copy_gbs));
      }
      cuda::SetDecodeOverride(cuda::DecodeKernel::kAuto, 0);
      cuda::SetDecodePrefetch(env_prefetch);
    }
    for (void* p : {q, o}) ops.Free(p);
  }

  return PrintSummary(copy_gbs);
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) {
  // --lt-table-out=FILE (with --lt-sweep) may stand anywhere after the mode.
  std::string table_out;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (i > 0 && a.rfind("--lt-table-out=", 0) == 0) {
      table_out = a.substr(std::strlen("--lt-table-out="));
    } else {
      args.push_back(argv[i]);
    }
  }
  argc = static_cast<int>(args.size());
  argv = args.data();
  const std::string mode = argc > 1 ? argv[1] : "";
  if ((!mode.empty() && mode != "--m1" && mode != "--attention" && mode != "--decode" &&
       mode != "--det-gemm" && mode != "--shards" && mode != "--split-k" && mode != "--chain" &&
       mode != "--stream" && mode != "--lt-sweep" && mode != "--pdl-gemm" &&
       mode != "--det-split-k") ||
      argc > 3 || (!table_out.empty() && mode != "--lt-sweep")) {
    std::fprintf(
        stderr,
        "usage: tpserve-cuda-bench [--m1 | --attention | --decode | --det-gemm | --shards "
        "| --split-k | --det-split-k | --chain | --stream | --lt-sweep [--lt-table-out=FILE] "
        "| --pdl-gemm] "
        "[ROW-REGEX]\n");
    return 2;
  }
  if (argc == 3) {
    try {
      tpserve::g_only.emplace(argv[2]);
    } catch (const std::regex_error& e) {
      std::fprintf(stderr, "tpserve-cuda-bench: bad row regex '%s': %s\n", argv[2], e.what());
      return 2;
    }
  }
  return tpserve::Main(mode, table_out);
}
