// Every CUDA op against the CPU reference (kernels/cpu) on fresh random bf16-representable
// inputs: both backends see the same values (the CPU in fp32, the GPU in bf16), and outputs are
// compared by relative L2 error. Tolerance: 1e-2 for ops whose output is rounded to bf16 or
// that use bf16 operands (bf16 has an 8-bit mantissa: one rounding is <= 2^-9 relative); exact
// equality for pure copies. Without a CUDA device every test prints "no CUDA device, test
// skipped" and is skipped.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/bf16.h"
#include "kernels/cuda/bench_knobs.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_table.h"
#include "kernels/cuda/launchers.h"
#include "kernels/kv_quant.h"
#include "kernels/ops.h"
#include "kernels/philox.h"
#include "nlohmann/json.hpp"

namespace tpserve {
namespace {

constexpr double kBf16Tol = 1e-2;

uint32_t FreshSeed() {
  static uint32_t seed = std::random_device{}();
  return seed++;
}

std::vector<float> RandomBf16(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = Bf16ToF32(F32ToBf16(dist(rng)));
  return v;
}

// Relative L2 error; fails on NaN and on an all-zero reference.
double RelL2(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ADD_FAILURE() << "non-finite output at " << i << ": " << got[i];
      return INFINITY;
    }
    double d = double(got[i]) - want[i];
    num += d * d;
    den += double(want[i]) * want[i];
  }
  EXPECT_GT(den, 0.0) << "reference is all zeros";
  return std::sqrt(num / std::max(den, 1e-300));
}

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      std::cout << "no CUDA device, test skipped" << std::endl;
      GTEST_SKIP() << "no CUDA device";
    }
    uint32_t seed = FreshSeed();
    rng_.seed(seed);
    RecordProperty("seed", std::to_string(seed));
    std::cout << "seed " << seed << std::endl;
    ops_ = MakeCudaOps(0);
    gpu_ = static_cast<CudaOps*>(ops_.get());
    cpu_ = MakeCpuOps();
  }

  // A bf16 device copy of `v` (freed with the test).
  Tensor Gpu(const std::vector<float>& v, std::initializer_list<int64_t> shape) {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = F32ToBf16(v[i]);
    bufs_.emplace_back(ops_.get(), h.size() * 2);
    ops_->CopyToDevice(bufs_.back().get(), h.data(), h.size() * 2);
    return Tensor(bufs_.back().get(), shape, DType::kBF16, Device::kCuda);
  }
  Tensor GpuF32(const std::vector<float>& v, std::initializer_list<int64_t> shape) {
    bufs_.emplace_back(ops_.get(), v.size() * 4);
    ops_->CopyToDevice(bufs_.back().get(), v.data(), v.size() * 4);
    return Tensor(bufs_.back().get(), shape, DType::kF32, Device::kCuda);
  }
  // An output buffer poisoned with NaN (0xFFFF bf16 / 0xFFFFFFFF f32) to catch unwritten data.
  Tensor GpuOut(std::initializer_list<int64_t> shape, DType dt = DType::kBF16) {
    Tensor t(nullptr, shape, dt, Device::kCuda);
    bufs_.emplace_back(ops_.get(), t.bytes());
    t.data = bufs_.back().get();
    EXPECT_EQ(cudaMemset(t.data, 0xFF, t.bytes()), cudaSuccess);
    return t;
  }
  // A KV pool [blocks, bs, hk, d] of dtype `kv` on the device holding `v`: bf16, or quantized
  // (codes and scales) one token's head at a time by QuantizeKvHead. `held` gets the values the
  // pool holds (DequantizeKvHead), the input of the CPU reference.
  Tensor GpuKv(const std::vector<float>& v, std::initializer_list<int64_t> shape, DType kv,
               std::vector<float>* held) {
    if (kv == DType::kBF16) {
      *held = v;
      return Gpu(v, shape);
    }
    Tensor t(nullptr, shape, kv, Device::kCuda);
    const int d = static_cast<int>(t.dim(3));
    const int64_t heads = t.numel() / d;
    const int groups = KvScaleGroups(kv, d);
    const int64_t head_bytes = int64_t{d} * DTypeBits(kv) / 8;
    std::vector<uint8_t> codes(heads * head_bytes, 0);
    std::vector<float> scales(heads * groups);
    held->resize(v.size());
    for (int64_t h = 0; h < heads; ++h) {
      QuantizeKvHead(kv, v.data() + h * d, d, codes.data() + h * head_bytes,
                     scales.data() + h * groups);
      DequantizeKvHead(kv, codes.data() + h * head_bytes, scales.data() + h * groups, d,
                       held->data() + h * d);
    }
    bufs_.emplace_back(ops_.get(), codes.size());
    ops_->CopyToDevice(bufs_.back().get(), codes.data(), codes.size());
    t.data = bufs_.back().get();
    bufs_.emplace_back(ops_.get(), scales.size() * 4);
    ops_->CopyToDevice(bufs_.back().get(), scales.data(), scales.size() * 4);
    t.scales = bufs_.back().get();
    return t;
  }
  std::vector<float> Host(const Tensor& t) {
    ops_->Synchronize();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    std::vector<float> out(t.numel());
    if (t.dtype == DType::kF32) {
      ops_->CopyToHost(out.data(), t.data, t.bytes());
    } else {
      std::vector<uint16_t> h(t.numel());
      ops_->CopyToHost(h.data(), t.data, t.bytes());
      for (size_t i = 0; i < h.size(); ++i) out[i] = Bf16ToF32(h[i]);
    }
    return out;
  }
  // A quantized KV pool [blocks, bs, hk, d] of dtype t on the device whose codes and scales
  // start random (rows a write must leave alone stay recognizable); *codes and *scales get what
  // was uploaded.
  Tensor GpuQuantCache(DType t, int blocks, int bs, int hk, int d, std::vector<uint8_t>* codes,
                       std::vector<float>* scales) {
    Tensor c(nullptr, {blocks, bs, hk, d}, t, Device::kCuda);
    codes->resize(c.bytes());
    for (uint8_t& b : *codes) b = static_cast<uint8_t>(rng_());
    scales->resize(size_t{1} * blocks * bs * hk * KvScaleGroups(t, d));
    std::uniform_real_distribution<float> dist(0.25f, 4.0f);
    for (float& s : *scales) s = dist(rng_);
    bufs_.emplace_back(ops_.get(), codes->size());
    c.data = bufs_.back().get();
    ops_->CopyToDevice(c.data, codes->data(), codes->size());
    bufs_.emplace_back(ops_.get(), scales->size() * sizeof(float));
    c.scales = bufs_.back().get();
    ops_->CopyToDevice(c.scales, scales->data(), scales->size() * sizeof(float));
    return c;
  }
  std::vector<uint8_t> HostCodes(const Tensor& c) {
    ops_->Synchronize();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    std::vector<uint8_t> out(c.bytes());
    ops_->CopyToHost(out.data(), c.data, out.size());
    return out;
  }
  std::vector<float> HostScales(const Tensor& c) {
    ops_->Synchronize();
    std::vector<float> out(c.dim(0) * c.dim(1) * c.dim(2) * KvScaleGroups(c.dtype, c.dim(3)));
    ops_->CopyToHost(out.data(), c.scales, out.size() * sizeof(float));
    return out;
  }
  static Tensor Cpu(std::vector<float>& v, std::initializer_list<int64_t> shape) {
    return Tensor(v.data(), shape, DType::kF32);
  }
  void SetBatch(const BatchMeta& m) {
    cpu_->SetBatch(m);
    ops_->SetBatch(m);
  }
  // DecodeStepReplaysAsCudaGraph over a cache of dtype kv.
  void DecodeStepReplay(DType kv);

  std::mt19937 rng_;
  std::unique_ptr<Ops> ops_;
  CudaOps* gpu_ = nullptr;
  std::unique_ptr<Ops> cpu_;
  std::vector<DeviceBuffer> bufs_;
};

// A batch of sequences with (query_len, context_len) pairs over a shuffled paged cache.
BatchMeta MakeBatch(const std::vector<std::pair<int, int>>& seqs, int block_size, int num_blocks,
                    std::mt19937& rng, int vocab = 1000) {
  BatchMeta m;
  m.num_seqs = static_cast<int>(seqs.size());
  m.block_size = block_size;
  int max_ctx = 1;
  for (auto [q, c] : seqs) max_ctx = std::max(max_ctx, c);
  m.max_blocks_per_seq = (max_ctx + block_size - 1) / block_size;
  std::vector<int32_t> free_blocks(num_blocks);
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
  size_t next = 0;
  m.query_start.push_back(0);
  for (auto [qlen, ctx] : seqs) {
    int nb = (ctx + block_size - 1) / block_size;
    std::vector<int32_t> table(m.max_blocks_per_seq, -1);
    for (int b = 0; b < nb; ++b) table[b] = free_blocks.at(next++);
    m.block_tables.insert(m.block_tables.end(), table.begin(), table.end());
    for (int i = 0; i < qlen; ++i) {
      if (ctx == 0) {  // padding sequence: no keys, no cache slot
        m.positions.push_back(0);
        m.slot_mapping.push_back(-1);
        m.token_ids.push_back(0);
        continue;
      }
      int pos = ctx - qlen + i;
      m.positions.push_back(pos);
      m.slot_mapping.push_back(table[pos / block_size] * block_size + pos % block_size);
      m.token_ids.push_back(static_cast<int32_t>(rng() % vocab));
    }
    m.query_start.push_back(m.query_start.back() + qlen);
    m.context_lens.push_back(ctx);
    m.logits_rows.push_back(m.query_start.back() - 1);
  }
  m.num_tokens = m.query_start.back();
  return m;
}

TEST_F(CudaOpsTest, EmbeddingWithRowOffset) {
  const int rows = 500, hidden = 264, offset = 300;
  BatchMeta m = MakeBatch({{37, 37}, {1, 5}}, 16, 8, rng_, 1000);
  auto table = RandomBf16(rng_, rows * hidden);
  std::vector<float> want(m.num_tokens * hidden);
  SetBatch(m);
  cpu_->Embedding(Cpu(table, {rows, hidden}), offset, Cpu(want, {m.num_tokens, hidden}));
  Tensor out = GpuOut({m.num_tokens, hidden});
  ops_->Embedding(Gpu(table, {rows, hidden}), offset, out);
  auto got = Host(out);
  EXPECT_EQ(got, want);  // a copy: exact
  int in_range = 0;
  for (int t : m.token_ids) in_range += (t >= offset && t < offset + rows);
  EXPECT_GT(in_range, 0);
  EXPECT_LT(in_range, m.num_tokens);
}

TEST_F(CudaOpsTest, RmsNormAndAddRmsNorm) {
  for (int hidden : {4096, 296, 8192}) {
    SCOPED_TRACE(hidden);
    const int rows = 7;
    auto x = RandomBf16(rng_, rows * hidden), w = RandomBf16(rng_, hidden, 0.5f);
    auto res = RandomBf16(rng_, rows * hidden, 2.0f);
    std::vector<float> want(rows * hidden), res_want = res, want2(rows * hidden);
    cpu_->RmsNorm(Cpu(x, {rows, hidden}), Cpu(w, {hidden}), 1e-5f, Cpu(want, {rows, hidden}));
    Tensor gx = Gpu(x, {rows, hidden}), gw = Gpu(w, {hidden}), out = GpuOut({rows, hidden});
    ops_->RmsNorm(gx, gw, 1e-5f, out);
    EXPECT_LT(RelL2(Host(out), want), kBf16Tol);

    cpu_->AddRmsNorm(Cpu(res_want, {rows, hidden}), Cpu(x, {rows, hidden}), Cpu(w, {hidden}), 1e-5f,
                     Cpu(want2, {rows, hidden}));
    Tensor gres = Gpu(res, {rows, hidden}), out2 = GpuOut({rows, hidden});
    ops_->AddRmsNorm(gres, gx, gw, 1e-5f, out2);
    EXPECT_LT(RelL2(Host(gres), res_want), kBf16Tol);
    EXPECT_LT(RelL2(Host(out2), want2), kBf16Tol);
  }
}

// TPSERVE_ABLATE_OPS's list (benchmarks only, bench_knobs.h): known names, or an error.
TEST(BenchKnobsTest, AblatedOpsListIsParsedAndChecked) {
  auto ops = ParseAblatedOps("AddRmsNorm,,Gemm.square");
  ASSERT_TRUE(ops.ok()) << ops.status();
  EXPECT_EQ(*ops, (std::set<std::string, std::less<>>{"AddRmsNorm", "Gemm.square"}));
  auto bad = ParseAblatedOps("AddRmsNorm,Softmax");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("unknown op 'Softmax'"), std::string::npos);
}

// Ablation (TPSERVE_ABLATE_OPS in the benchmarks): the named ops launch nothing, the others
// still run.
TEST_F(CudaOpsTest, AblatedOpsLaunchNothing) {
  std::unique_ptr<Ops> ablated = MakeCudaOps(0);
  auto* cuda = static_cast<CudaOps*>(ablated.get());
  auto names = ParseAblatedOps("AddRmsNorm,Gemm.square");
  ASSERT_TRUE(names.ok()) << names.status();
  cuda->set_ablated_ops(*names);
  EXPECT_TRUE(cuda->Ablated("AddRmsNorm"));
  EXPECT_TRUE(cuda->Ablated("Gemm.square"));
  EXPECT_FALSE(cuda->Ablated("AttentionDecode"));
  EXPECT_FALSE(gpu_->Ablated("AddRmsNorm"));
  const int rows = 3, hidden = 64;
  auto x = RandomBf16(rng_, rows * hidden), w = RandomBf16(rng_, hidden);
  auto sq = RandomBf16(rng_, hidden * hidden), rect = RandomBf16(rng_, 2 * hidden * hidden);
  Tensor gx = Gpu(x, {rows, hidden}), gw = Gpu(w, {hidden}), res = Gpu(x, {rows, hidden});
  Tensor out = GpuOut({rows, hidden});
  ablated->AddRmsNorm(res, gx, gw, 1e-5f, out);
  ablated->Gemm(gx, Gpu(sq, {hidden, hidden}), nullptr, out);
  ablated->Synchronize();
  for (float v : Host(out)) ASSERT_TRUE(std::isnan(v)) << "an ablated op wrote its output";
  EXPECT_EQ(Host(res), Host(gx));  // the residual was not updated either
  Tensor out2 = GpuOut({rows, 2 * hidden});
  ablated->Gemm(gx, Gpu(rect, {2 * hidden, hidden}), nullptr, out2);  // not square: runs
  ablated->Synchronize();
  for (float v : Host(out2)) ASSERT_TRUE(std::isfinite(v));
}

TEST_F(CudaOpsTest, GemmSkinnyAllConfigsAndCublasLt) {
  struct Shape {
    int m, n, k;
  };
  for (Shape s :
       {Shape{1, 4096, 4096}, Shape{1, 333, 264}, Shape{2, 1000, 1032}, Shape{3, 259, 4104},
        Shape{5, 777, 11008}, Shape{8, 96, 520}, Shape{16, 130, 2056}, Shape{17, 200, 264},
        Shape{100, 4096, 1024}, Shape{257, 384, 4096}}) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(testing::Message()
                   << "M=" << s.m << " N=" << s.n << " K=" << s.k << " bias=" << with_bias);
      auto x = RandomBf16(rng_, size_t{1} * s.m * s.k),
           w = RandomBf16(rng_, size_t{1} * s.n * s.k, 0.05f);
      auto bias = RandomBf16(rng_, s.n);
      std::vector<float> want(size_t{1} * s.m * s.n);
      Tensor cb = Cpu(bias, {s.n});
      cpu_->Gemm(Cpu(x, {s.m, s.k}), Cpu(w, {s.n, s.k}), with_bias ? &cb : nullptr,
                 Cpu(want, {s.m, s.n}));
      Tensor gx = Gpu(x, {s.m, s.k}), gw = Gpu(w, {s.n, s.k}), gb = Gpu(bias, {s.n});
      const Tensor* bp = with_bias ? &gb : nullptr;
      Tensor out = GpuOut({s.m, s.n});
      ops_->Gemm(gx, gw, bp, out);
      EXPECT_LT(RelL2(Host(out), want), kBf16Tol) << "dispatch";
      out = GpuOut({s.m, s.n});
      gpu_->GemmCublasLt(gx, gw, bp, out);
      EXPECT_LT(RelL2(Host(out), want), kBf16Tol) << "cuBLASLt";
      if (s.m <= 16) {
        for (int c = 0; c < 7; ++c) {
          out = GpuOut({s.m, s.n});
          gpu_->GemmSkinny(gx, gw, bp, out, c);
          EXPECT_LT(RelL2(Host(out), want), kBf16Tol) << "skinny config " << c;
        }
      }
      bufs_.clear();
    }
  }
}

// The cuBLASLt table (kernels/cuda/gemm_table.h): an entry whose candidate still describes as
// recorded makes the plan take that candidate (checked against the CPU reference); one whose
// configuration does not match is ignored (the heuristic's first, and a warning); other GPUs'
// and problems' entries are not taken; and every entry of the built-in table that names this GPU
// and cuBLASLt is taken by the plan of its problem.
TEST_F(CudaOpsTest, CublasLtTableChoosesTheCandidate) {
  const int m = 64, n = 1536, k = 1024;
  auto x = RandomBf16(rng_, size_t{1} * m * k), w = RandomBf16(rng_, size_t{1} * n * k, 0.05f);
  std::vector<float> want(size_t{1} * m * n);
  cpu_->Gemm(Cpu(x, {m, k}), Cpu(w, {n, k}), nullptr, Cpu(want, {m, n}));
  Tensor gx = Gpu(x, {m, k}), gw = Gpu(w, {n, k});
  cudaStream_t s = gpu_->stream();
  cuda::LtGemm probe;
  probe.set_table(nullptr);
  std::vector<std::string> configs;
  for (int c = 0; c < 4; ++c) {
    probe.set_candidate_override(c);
    Tensor out = GpuOut({m, n});
    probe.Run(gx, gw, nullptr, out, s);
    if (probe.PlanCandidate(m, n, k) != c) break;
    configs.push_back(probe.DescribePlan(m, n, k));
  }
  ASSERT_GE(configs.size(), 2u) << "cuBLASLt offers one algorithm here: nothing to choose";
  const int c = static_cast<int>(configs.size()) - 1;
  auto table_json = [&](int candidate, const std::string& config, const std::string& device,
                        int64_t mm) {
    nlohmann::json entry = {{"device", device},
                            {"sms", probe.device_sms()},
                            {"cublaslt", probe.cublaslt_version()},
                            {"m", mm},
                            {"n", n},
                            {"k", k},
                            {"bias", false},
                            {"alignment", 256},
                            {"candidate", candidate},
                            {"config", config}};
    nlohmann::json doc;
    doc["entries"] = nlohmann::json::array({entry});
    return doc.dump();
  };
  struct Case {
    const char* what;
    std::string json;
    bool taken;
  };
  const Case cases[] = {
      {"matching entry", table_json(c, configs[c], probe.device_name(), m), true},
      {"stale configuration", table_json(c, configs[c] + " changed", probe.device_name(), m),
       false},
      {"another GPU", table_json(c, configs[c], "another GPU", m), false},
      {"another M", table_json(c, configs[c], probe.device_name(), m + 1), false},
  };
  for (const Case& tc : cases) {
    SCOPED_TRACE(tc.what);
    absl::StatusOr<cuda::LtTable> table = cuda::LtTable::Parse(tc.json, tc.what);
    ASSERT_TRUE(table.ok()) << table.status();
    cuda::LtGemm lt;
    lt.set_table(&*table);
    Tensor out = GpuOut({m, n});
    lt.Run(gx, gw, nullptr, out, s);
    EXPECT_LT(RelL2(Host(out), want), kBf16Tol);
    EXPECT_EQ(lt.PlanFromTable(m, n, k), tc.taken);
    EXPECT_EQ(lt.num_table_plans(), tc.taken ? 1 : 0);
    EXPECT_EQ(lt.DescribePlan(m, n, k), tc.taken ? configs[c] : configs[0]);
  }
  // The built-in table's entries for this GPU, each run at its problem's size.
  const cuda::LtTable& builtin = cuda::LtTable::Process();
  int applied = 0;
  for (const cuda::LtTableEntry& e : builtin.entries()) {
    if (e.device != probe.device_name() || e.sms != probe.device_sms() ||
        e.cublaslt != probe.cublaslt_version() || e.bias || e.alignment != 256) {
      continue;
    }
    SCOPED_TRACE(testing::Message() << "built-in entry M=" << e.m << " N=" << e.n << " K=" << e.k);
    cuda::LtGemm lt;
    lt.set_table(&builtin);
    bufs_.clear();
    Tensor ex = GpuOut({e.m, e.k}), ew = GpuOut({e.n, e.k}), ey = GpuOut({e.m, e.n});
    ASSERT_EQ(cudaMemset(ex.data, 0, ex.bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(ew.data, 0, ew.bytes()), cudaSuccess);
    lt.Run(ex, ew, nullptr, ey, s);
    ops_->Synchronize();
    EXPECT_TRUE(lt.PlanFromTable(e.m, e.n, e.k)) << e.config;
    EXPECT_EQ(lt.DescribePlan(e.m, e.n, e.k), e.config);
    ++applied;
  }
  std::cout << applied << " built-in cuBLASLt table entries apply to " << probe.device_name()
            << " (cuBLASLt " << probe.cublaslt_version() << ")" << std::endl;
}

// The weight-streaming wgmma GEMM (gemm_stream.cu) in every configuration against the CPU
// reference: N not a multiple of the 64- or 128-row tile, K not a multiple of the 64-K stage,
// M from 1 to the configuration's token count, with and without bias, on grids that split every
// tile over several blocks (stream-K: partial sums in the workspace, added by the last block)
// and on the full grid; a repeat gives the same bits, and the dispatch (set_stream_max_m) takes
// the kernel for 2 < M <= 128. Tolerance: the output is one bf16 rounding of an fp32 sum (2^-9
// relative; 4e-3 relative L2 leaves room for the sum order only).
TEST_F(CudaOpsTest, StreamGemmEveryConfigAndSplit) {
  if (!cuda::StreamGemmSupported()) GTEST_SKIP() << "the stream GEMM needs an sm_90 device";
  struct Shape {
    int n, k;
  };
  for (Shape s : {Shape{200, 1000}, Shape{4096, 1024}, Shape{640, 4104}}) {
    for (int config = 0; config < cuda::StreamGemmNumConfigs(); ++config) {
      const int tokens = cuda::StreamGemmConfigTokens(config);
      for (int m : {1, tokens / 2 + 1, tokens}) {
        const bool with_bias = (m + config) % 2 == 1;
        SCOPED_TRACE(testing::Message()
                     << "N=" << s.n << " K=" << s.k << " M=" << m << " config "
                     << cuda::StreamGemmConfigName(config) << " bias=" << with_bias);
        auto x = RandomBf16(rng_, size_t{1} * m * s.k),
             w = RandomBf16(rng_, size_t{1} * s.n * s.k, 0.05f);
        auto bias = RandomBf16(rng_, s.n);
        std::vector<float> want(size_t{1} * m * s.n);
        Tensor cb = Cpu(bias, {s.n});
        cpu_->Gemm(Cpu(x, {m, s.k}), Cpu(w, {s.n, s.k}), with_bias ? &cb : nullptr,
                   Cpu(want, {m, s.n}));
        Tensor gx = Gpu(x, {m, s.k}), gw = Gpu(w, {s.n, s.k}), gb = Gpu(bias, {s.n});
        const Tensor* bp = with_bias ? &gb : nullptr;
        std::vector<float> first;
        for (int max_grid : {0, 3, 37}) {
          SCOPED_TRACE(testing::Message() << "max_grid " << max_grid);
          Tensor out = GpuOut({m, s.n});
          gpu_->GemmStream(gx, gw, bp, out, config, max_grid);
          std::vector<float> got = Host(out);
          EXPECT_LT(RelL2(got, want), 4e-3);
          if (max_grid == 0) {
            first = got;
            out = GpuOut({m, s.n});
            gpu_->GemmStream(gx, gw, bp, out, config, max_grid);
            EXPECT_EQ(Host(out), first) << "a repeat gave other bits";
          }
        }
        bufs_.clear();
      }
    }
  }
  // The dispatch: M = 3 and 100 take the stream GEMM when enabled.
  const int saved = gpu_->stream_max_m();
  gpu_->set_stream_max_m(128);
  for (int m : {3, 100}) {
    auto x = RandomBf16(rng_, size_t{1} * m * 512),
         w = RandomBf16(rng_, size_t{1} * 384 * 512, 0.05f);
    std::vector<float> want(size_t{1} * m * 384);
    cpu_->Gemm(Cpu(x, {m, 512}), Cpu(w, {384, 512}), nullptr, Cpu(want, {m, 384}));
    Tensor out = GpuOut({m, 384});
    ops_->Gemm(Gpu(x, {m, 512}), Gpu(w, {384, 512}), nullptr, out);
    EXPECT_LT(RelL2(Host(out), want), 4e-3) << "dispatch M=" << m;
    bufs_.clear();
  }
  gpu_->set_stream_max_m(saved);
}

TEST_F(CudaOpsTest, RopeRotateHalf) {
  for (int head_dim : {128, 64}) {
    BatchMeta m = MakeBatch({{29, 4000}, {1, 7}, {3, 3}}, 16, 300, rng_);
    const int hq = 8, hk = 2, T = m.num_tokens;
    RopeConfig rc;
    rc.theta = 100000.0;
    auto inv = RopeInvFreq(rc, head_dim);
    auto q = RandomBf16(rng_, T * hq * head_dim), k = RandomBf16(rng_, T * hk * head_dim);
    auto qw = q, kw = k;
    SetBatch(m);
    cpu_->Rope(Cpu(qw, {T, hq * head_dim}), Cpu(kw, {T, hk * head_dim}), Cpu(inv, {head_dim / 2}),
               head_dim);
    Tensor gq = Gpu(q, {T, hq * head_dim}), gk = Gpu(k, {T, hk * head_dim});
    ops_->Rope(gq, gk, GpuF32(inv, {head_dim / 2}), head_dim);
    EXPECT_LT(RelL2(Host(gq), qw), kBf16Tol);
    EXPECT_LT(RelL2(Host(gk), kw), kBf16Tol);
  }
}

// Rope + KvWrite fused on the fused q/k/v projection: q_out and the rotated k within bf16
// tolerance (one rounding of the rotation), v an exact copy, padding slots (-1) untouched.
TEST_F(CudaOpsTest, RopeKvWriteMatchesCpu) {
  struct Case {
    int hq, hk, d;
  };
  // A small batch (blocks of 8 heads) and one of >= 256 tokens (a block per token, all heads),
  // each with a padding sequence.
  const std::vector<std::vector<std::pair<int, int>>> batches = {
      {{29, 4000}, {1, 7}, {1, 0}, {3, 3}}, {{300, 4000}, {1, 0}, {7, 7}}};
  for (const auto& seqs : batches)
    for (Case c : {Case{8, 2, 128}, Case{4, 4, 64}, Case{32, 32, 128}, Case{6, 2, 32}}) {
      SCOPED_TRACE(testing::Message() << "heads " << c.hq << "/" << c.hk << " d " << c.d
                                      << " sequences " << seqs.size());
      const int bs = 16, blocks = 300;
      BatchMeta m = MakeBatch(seqs, bs, blocks, rng_);
      const int T = m.num_tokens, width = (c.hq + 2 * c.hk) * c.d, kvw = c.hk * c.d;
      RopeConfig rc;
      rc.theta = 100000.0;
      auto inv = RopeInvFreq(rc, c.d);
      auto qkv = RandomBf16(rng_, size_t{1} * T * width);
      auto kc = RandomBf16(rng_, size_t{1} * blocks * bs * kvw);
      auto vc = RandomBf16(rng_, size_t{1} * blocks * bs * kvw);
      std::vector<float> q_want(size_t{1} * T * c.hq * c.d), kc_want = kc, vc_want = vc;
      SetBatch(m);
      cpu_->RopeKvWrite(Cpu(qkv, {T, width}), Cpu(inv, {c.d / 2}), c.hq, c.hk, c.d,
                        Cpu(q_want, {T, c.hq * c.d}), Cpu(kc_want, {blocks, bs, c.hk, c.d}),
                        Cpu(vc_want, {blocks, bs, c.hk, c.d}));
      Tensor gkc = Gpu(kc, {blocks, bs, c.hk, c.d}), gvc = Gpu(vc, {blocks, bs, c.hk, c.d});
      Tensor q_out = GpuOut({T, c.hq * c.d});
      ops_->RopeKvWrite(Gpu(qkv, {T, width}), GpuF32(inv, {c.d / 2}), c.hq, c.hk, c.d, q_out, gkc,
                        gvc);
      EXPECT_LT(RelL2(Host(q_out), q_want), kBf16Tol);
      EXPECT_LT(RelL2(Host(gkc), kc_want), kBf16Tol);
      EXPECT_EQ(Host(gvc), vc_want);  // a copy: exact
      // The rotation is not the identity on the rows written (positions > 0 exist).
      EXPECT_GT(RelL2(Host(gkc), kc), 1e-3);
      bufs_.clear();
    }
}

// QkvRopeKvWrite: the skinny GEMM with the RoPE/KV-write epilogue (M <= 2) and the unfused
// Gemm + RopeKvWrite, against the CPU's fp32 Gemm then RopeKvWrite. The rows written (q_out and
// the cache rows of the batch's slots) within kBf16Tol; every other cache row untouched.
TEST_F(CudaOpsTest, QkvRopeKvWriteFusedAndUnfused) {
  struct Case {
    std::vector<std::pair<int, int>> seqs;
    int hq, hk, d, hidden;
    bool bias;
  };
  for (const Case& c :
       {Case{{{1, 700}}, 32, 32, 128, 4096, false}, Case{{{1, 33}, {1, 0}}, 8, 2, 128, 520, true},
        Case{{{1, 5}, {1, 1000}}, 4, 4, 64, 264, false}, Case{{{1, 17}}, 12, 4, 128, 1024, true}}) {
    for (bool fused : {true, false}) {
      SCOPED_TRACE(testing::Message() << "heads " << c.hq << "/" << c.hk << " d " << c.d << " seqs "
                                      << c.seqs.size() << " bias " << c.bias << " fused " << fused);
      gpu_->set_fused_skinny(fused);
      const int bs = 16, blocks = 100;
      BatchMeta m = MakeBatch(c.seqs, bs, blocks, rng_);
      const int T = m.num_tokens, width = (c.hq + 2 * c.hk) * c.d, kvw = c.hk * c.d;
      RopeConfig rc;
      auto inv = RopeInvFreq(rc, c.d);
      auto x = RandomBf16(rng_, size_t{1} * T * c.hidden);
      auto w = RandomBf16(rng_, size_t{1} * width * c.hidden, 0.05f);
      auto bias = RandomBf16(rng_, width);
      auto kc = RandomBf16(rng_, size_t{1} * blocks * bs * kvw);
      auto vc = RandomBf16(rng_, size_t{1} * blocks * bs * kvw);
      std::vector<float> qkv(size_t{1} * T * width), q_want(size_t{1} * T * c.hq * c.d);
      std::vector<float> kc_want = kc, vc_want = vc;
      SetBatch(m);
      Tensor cb = Cpu(bias, {width});
      cpu_->QkvRopeKvWrite(
          Cpu(x, {T, c.hidden}), RowScale(), Cpu(w, {width, c.hidden}), c.bias ? &cb : nullptr,
          Cpu(inv, {c.d / 2}), c.hq, c.hk, c.d, Cpu(qkv, {T, width}), Cpu(q_want, {T, c.hq * c.d}),
          Cpu(kc_want, {blocks, bs, c.hk, c.d}), Cpu(vc_want, {blocks, bs, c.hk, c.d}));
      Tensor gb = Gpu(bias, {width});
      Tensor gkc = Gpu(kc, {blocks, bs, c.hk, c.d}), gvc = Gpu(vc, {blocks, bs, c.hk, c.d});
      Tensor q_out = GpuOut({T, c.hq * c.d}), gqkv = GpuOut({T, width});
      ops_->QkvRopeKvWrite(Gpu(x, {T, c.hidden}), RowScale(), Gpu(w, {width, c.hidden}),
                           c.bias ? &gb : nullptr, GpuF32(inv, {c.d / 2}), c.hq, c.hk, c.d, gqkv,
                           q_out, gkc, gvc);
      EXPECT_LT(RelL2(Host(q_out), q_want), kBf16Tol);
      const std::vector<float> got_k = Host(gkc), got_v = Host(gvc);
      std::vector<float> rows_got, rows_want;
      std::vector<bool> written(size_t{1} * blocks * bs, false);
      for (int t = 0; t < T; ++t) {
        const int64_t slot = m.slot_mapping[t];
        if (slot < 0) continue;
        written[slot] = true;
        for (const auto* pair : {&got_k, &got_v}) {
          rows_got.insert(rows_got.end(), pair->begin() + slot * kvw,
                          pair->begin() + (slot + 1) * kvw);
        }
        rows_want.insert(rows_want.end(), kc_want.begin() + slot * kvw,
                         kc_want.begin() + (slot + 1) * kvw);
        rows_want.insert(rows_want.end(), vc_want.begin() + slot * kvw,
                         vc_want.begin() + (slot + 1) * kvw);
      }
      EXPECT_LT(RelL2(rows_got, rows_want), kBf16Tol);
      size_t changed = 0;
      for (size_t slot = 0; slot < written.size(); ++slot) {
        if (written[slot]) continue;
        for (int64_t i = slot * kvw; i < int64_t(slot + 1) * kvw; ++i) {
          changed += got_k[i] != kc[i] || got_v[i] != vc[i];
        }
      }
      EXPECT_EQ(changed, 0u) << "cache rows outside the batch's slots were written";
      bufs_.clear();
    }
  }
  gpu_->set_fused_skinny(true);
}

// SiluMulGemm: the fused skinny kernel (M <= 2, every config) and the SiluMul + Gemm fallback
// against the CPU's fp32 SiluMul then Gemm. Tolerance kBf16Tol (bf16 activation and weights).
TEST_F(CudaOpsTest, SiluMulGemmFusedAndFallback) {
  struct Shape {
    int m, n, k;
  };
  for (Shape s : {Shape{1, 4096, 11008}, Shape{2, 333, 264}, Shape{1, 1000, 1032},
                  Shape{2, 4096, 2752}, Shape{3, 130, 520}, Shape{40, 256, 1024}}) {
    SCOPED_TRACE(testing::Message() << "M=" << s.m << " N=" << s.n << " K=" << s.k);
    auto gu = RandomBf16(rng_, size_t{2} * s.m * s.k, 2.0f);
    auto w = RandomBf16(rng_, size_t{1} * s.n * s.k, 0.05f);
    std::vector<float> act(size_t{1} * s.m * s.k), want(size_t{1} * s.m * s.n);
    cpu_->SiluMulGemm(Cpu(gu, {s.m, 2 * s.k}), Cpu(w, {s.n, s.k}), Cpu(act, {s.m, s.k}),
                      Cpu(want, {s.m, s.n}));
    Tensor ggu = Gpu(gu, {s.m, 2 * s.k}), gw = Gpu(w, {s.n, s.k});
    Tensor gact = GpuOut({s.m, s.k}), out = GpuOut({s.m, s.n});
    ops_->SiluMulGemm(ggu, gw, gact, out);
    EXPECT_LT(RelL2(Host(out), want), kBf16Tol) << "dispatch";
    if (s.m <= 2) {
      for (int c = 0; c < 7; ++c) {
        out = GpuOut({s.m, s.n});
        gpu_->SiluMulGemmSkinny(ggu, gw, out, c);
        EXPECT_LT(RelL2(Host(out), want), kBf16Tol) << "skinny config " << c;
      }
    }
    bufs_.clear();
  }
}

// The deferred norm: GemmAddRmsNorm / SiluMulGemmAddRmsNorm (a projection into the residual
// stream, then the next RMSNorm) followed by the projection that reads the norm, GemmScaledRows
// or QkvRopeKvWrite, against the CPU's separate ops. At M <= 2 CUDA defers the norm's row scale
// to the consumer (a non-empty RowScale); at M = 3 it runs the separate ops. y and the residual
// must be bit for bit those of the separate GPU ops (the same bf16 roundings); the consumer's
// output within kBf16Tol of the CPU's. Three batches in a row with different inputs check that
// the records are zeroed between batches; "materialize" consumes with the skinny path off
// (the rows are scaled in place first, then cuBLASLt).
TEST_F(CudaOpsTest, DeferredNormProducersAndConsumers) {
  struct Shape {
    int m, hidden, k, next;  // producer [m, k] -> hidden; consumer hidden -> next
  };
  const float eps = 1e-5f;
  for (Shape s : {Shape{1, 4096, 4096, 1024}, Shape{2, 1024, 520, 296}, Shape{1, 264, 1032, 40},
                  Shape{3, 512, 520, 64}}) {
    for (int variant = 0; variant < 4; ++variant) {
      const bool swiglu = variant & 1, materialize = variant == 2;
      const bool qkv = variant == 3;  // consumer: QkvRopeKvWrite (hq = hk = 2, d = 64)
      SCOPED_TRACE(testing::Message() << "M=" << s.m << " hidden=" << s.hidden << " K=" << s.k
                                      << " variant " << variant);
      const int in_cols = swiglu ? 2 * s.k : s.k;
      const int hq = 2, hk = 2, d = 64, width = qkv ? (hq + 2 * hk) * d : s.next;
      auto w = RandomBf16(rng_, size_t{1} * s.hidden * s.k, 0.05f);
      auto w2 = RandomBf16(rng_, size_t{1} * width * s.hidden, 0.05f);
      auto gamma = RandomBf16(rng_, s.hidden, 0.5f);
      Tensor gw = Gpu(w, {s.hidden, s.k}), gw2 = Gpu(w2, {width, s.hidden});
      Tensor gg = Gpu(gamma, {s.hidden});
      RopeConfig rc;
      auto inv = RopeInvFreq(rc, d);
      Tensor ginv = GpuF32(inv, {d / 2});
      const int bs = 16, blocks = 8;
      for (int rep = 0; rep < 3; ++rep) {
        SCOPED_TRACE(rep);
        std::vector<std::pair<int, int>> seqs(s.m, {1, 0});
        for (int i = 0; i < s.m; ++i) seqs[i].second = 5 + 11 * i + rep;
        BatchMeta meta = MakeBatch(seqs, bs, blocks, rng_);
        SetBatch(meta);
        auto x = RandomBf16(rng_, size_t{1} * s.m * in_cols, 2.0f);
        auto res = RandomBf16(rng_, size_t{1} * s.m * s.hidden, 1.0f + rep);
        // The CPU reference: the separate ops.
        std::vector<float> y_want(size_t{1} * s.m * s.hidden), res_want = res;
        std::vector<float> normed_want(size_t{1} * s.m * s.hidden), act(size_t{1} * s.m * s.k);
        if (swiglu) {
          cpu_->SiluMulGemm(Cpu(x, {s.m, in_cols}), Cpu(w, {s.hidden, s.k}), Cpu(act, {s.m, s.k}),
                            Cpu(y_want, {s.m, s.hidden}));
        } else {
          cpu_->Gemm(Cpu(x, {s.m, in_cols}), Cpu(w, {s.hidden, s.k}), nullptr,
                     Cpu(y_want, {s.m, s.hidden}));
        }
        cpu_->AddRmsNorm(Cpu(res_want, {s.m, s.hidden}), Cpu(y_want, {s.m, s.hidden}),
                         Cpu(gamma, {s.hidden}), eps, Cpu(normed_want, {s.m, s.hidden}));
        std::vector<float> out_want(size_t{1} * s.m * width), q_want(size_t{1} * s.m * hq * d);
        auto kc = RandomBf16(rng_, size_t{1} * blocks * bs * hk * d);
        auto vc = RandomBf16(rng_, size_t{1} * blocks * bs * hk * d);
        std::vector<float> kc_want = kc, vc_want = vc;
        if (qkv) {
          cpu_->QkvRopeKvWrite(
              Cpu(normed_want, {s.m, s.hidden}), RowScale(), Cpu(w2, {width, s.hidden}), nullptr,
              Cpu(inv, {d / 2}), hq, hk, d, Cpu(out_want, {s.m, width}), Cpu(q_want, {s.m, hq * d}),
              Cpu(kc_want, {blocks, bs, hk, d}), Cpu(vc_want, {blocks, bs, hk, d}));
        } else {
          cpu_->Gemm(Cpu(normed_want, {s.m, s.hidden}), Cpu(w2, {width, s.hidden}), nullptr,
                     Cpu(out_want, {s.m, width}));
        }
        // The separate GPU ops, for the bit-exact parts.
        Tensor gx = Gpu(x, {s.m, in_cols}), gact = GpuOut({s.m, s.k});
        Tensor res1 = Gpu(res, {s.m, s.hidden}), y1 = GpuOut({s.m, s.hidden});
        Tensor n1 = GpuOut({s.m, s.hidden});
        if (swiglu) {
          ops_->SiluMulGemm(gx, gw, gact, y1);
        } else {
          ops_->Gemm(gx, gw, nullptr, y1);
        }
        ops_->AddRmsNorm(res1, y1, gg, eps, n1);
        // The pair under test.
        Tensor res2 = Gpu(res, {s.m, s.hidden}), y2 = GpuOut({s.m, s.hidden});
        Tensor n2 = GpuOut({s.m, s.hidden}), out = GpuOut({s.m, width});
        RowScale scale = swiglu ? ops_->SiluMulGemmAddRmsNorm(gx, gw, gact, y2, res2, gg, eps, n2)
                                : ops_->GemmAddRmsNorm(gx, gw, nullptr, y2, res2, gg, eps, n2);
        EXPECT_EQ(scale.empty(), s.m > 2) << "deferred exactly when M <= 2";
        if (materialize) gpu_->set_skinny_max_m(0);
        Tensor gq = GpuOut({s.m, hq * d});
        Tensor gkc = Gpu(kc, {blocks, bs, hk, d}), gvc = Gpu(vc, {blocks, bs, hk, d});
        if (qkv) {
          ops_->QkvRopeKvWrite(n2, scale, gw2, nullptr, ginv, hq, hk, d, out, gq, gkc, gvc);
        } else {
          ops_->GemmScaledRows(n2, scale, gw2, nullptr, out);
        }
        gpu_->set_skinny_max_m(2);
        EXPECT_EQ(Host(y2), Host(y1));
        EXPECT_EQ(Host(res2), Host(res1));
        EXPECT_LT(RelL2(Host(res2), res_want), kBf16Tol);
        if (qkv) {
          EXPECT_LT(RelL2(Host(gq), q_want), kBf16Tol);
          EXPECT_LT(RelL2(Host(gkc), kc_want), kBf16Tol);
          EXPECT_LT(RelL2(Host(gvc), vc_want), kBf16Tol);
        } else {
          EXPECT_LT(RelL2(Host(out), out_want), kBf16Tol);
          // The consumer really applied the scale: without it the result is far off (the
          // residual's RMS is 1 + rep or more, not 1).
          if (!scale.empty() && !materialize) {
            std::vector<float> unscaled(size_t{1} * s.m * width), n2_host = Host(n2);
            cpu_->Gemm(Cpu(n2_host, {s.m, s.hidden}), Cpu(w2, {width, s.hidden}), nullptr,
                       Cpu(unscaled, {s.m, width}));
            EXPECT_GT(RelL2(unscaled, out_want), 0.1);
          }
        }
      }
      bufs_.clear();
    }
  }
}

// GemmAddRmsNorm / SiluMulGemmAddRmsNorm at prefill sizes (M > kResidualGemmMinM): cuBLASLt adds
// the product into the residual in its epilogue (one rounding of residual + the fp32 product),
// then RmsNorm. The residual and the norm against the CPU's separate ops (kBf16Tol), y left
// unwritten (still the 0xFF fill: the path was taken); with the fused norm off, and in
// deterministic mode, the separate GPU ops' bits (y written).
TEST_F(CudaOpsTest, ResidualAddedInPrefillGemm) {
  const float eps = 1e-5f;
  const int hidden = 512, k = 384;
  for (int m : {257, 600}) {
    for (int variant = 0; variant < 4; ++variant) {
      const bool swiglu = variant & 1, with_bias = variant == 2;
      const int in_cols = swiglu ? 2 * k : k;
      SCOPED_TRACE(testing::Message() << "M=" << m << " variant " << variant);
      auto x = RandomBf16(rng_, size_t{1} * m * in_cols, 2.0f);
      auto w = RandomBf16(rng_, size_t{1} * hidden * k, 0.05f);
      auto bias = RandomBf16(rng_, hidden, 0.5f);
      auto gamma = RandomBf16(rng_, hidden, 0.5f);
      auto res = RandomBf16(rng_, size_t{1} * m * hidden, 1.5f);
      std::vector<float> y_want(size_t{1} * m * hidden), res_want = res;
      std::vector<float> normed_want(size_t{1} * m * hidden), act(size_t{1} * m * k);
      if (swiglu) {
        cpu_->SiluMulGemm(Cpu(x, {m, in_cols}), Cpu(w, {hidden, k}), Cpu(act, {m, k}),
                          Cpu(y_want, {m, hidden}));
      } else {
        Tensor cb = Cpu(bias, {hidden});
        cpu_->Gemm(Cpu(x, {m, in_cols}), Cpu(w, {hidden, k}), with_bias ? &cb : nullptr,
                   Cpu(y_want, {m, hidden}));
      }
      cpu_->AddRmsNorm(Cpu(res_want, {m, hidden}), Cpu(y_want, {m, hidden}), Cpu(gamma, {hidden}),
                       eps, Cpu(normed_want, {m, hidden}));
      Tensor gx = Gpu(x, {m, in_cols}), gw = Gpu(w, {hidden, k}), gb = Gpu(bias, {hidden});
      Tensor gg = Gpu(gamma, {hidden});
      auto run = [&](Tensor y, Tensor residual, Tensor normed) {
        Tensor gact = GpuOut({m, k});
        RowScale scale =
            swiglu ? ops_->SiluMulGemmAddRmsNorm(gx, gw, gact, y, residual, gg, eps, normed)
                   : ops_->GemmAddRmsNorm(gx, gw, with_bias ? &gb : nullptr, y, residual, gg, eps,
                                          normed);
        EXPECT_TRUE(scale.empty()) << "no deferred norm at M = " << m;
      };
      Tensor y = GpuOut({m, hidden}), r = Gpu(res, {m, hidden}), n = GpuOut({m, hidden});
      run(y, r, n);
      const std::vector<float> y_host = Host(y);
      EXPECT_TRUE(std::all_of(y_host.begin(), y_host.end(), [](float v) { return std::isnan(v); }))
          << "y was written: the residual path did not run";
      EXPECT_LT(RelL2(Host(r), res_want), kBf16Tol);
      EXPECT_LT(RelL2(Host(n), normed_want), kBf16Tol);
      // The separate GPU ops, as the fused norm off and deterministic mode run them.
      Tensor y1 = GpuOut({m, hidden}), r1 = Gpu(res, {m, hidden}), n1 = GpuOut({m, hidden});
      Tensor act1 = GpuOut({m, k});
      if (swiglu) {
        ops_->SiluMulGemm(gx, gw, act1, y1);
      } else {
        ops_->Gemm(gx, gw, with_bias ? &gb : nullptr, y1);
      }
      ops_->AddRmsNorm(r1, y1, gg, eps, n1);
      // One rounding instead of two: near the separate ops, not their bits.
      EXPECT_LT(RelL2(Host(r), Host(r1)), 1e-2);
      for (int mode = 0; mode < 2; ++mode) {
        SCOPED_TRACE(mode == 0 ? "fused norm off" : "deterministic");
        if (mode == 0) gpu_->set_fused_norm(false);
        if (mode == 1) ops_->SetDeterministic(true);
        Tensor y2 = GpuOut({m, hidden}), r2 = Gpu(res, {m, hidden}), n2 = GpuOut({m, hidden});
        run(y2, r2, n2);
        if (mode == 0) {
          gpu_->set_fused_norm(true);
          EXPECT_EQ(Host(y2), Host(y1));
          EXPECT_EQ(Host(r2), Host(r1));
          EXPECT_EQ(Host(n2), Host(n1));
        } else {
          ops_->SetDeterministic(false);
          // Deterministic mode has its own GEMM algorithm and norm: the separate ops' roundings
          // (y written, the residual near the reference).
          EXPECT_LT(RelL2(Host(y2), y_want), kBf16Tol);
          EXPECT_LT(RelL2(Host(r2), res_want), kBf16Tol);
        }
      }
      bufs_.clear();
    }
  }
}

TEST_F(CudaOpsTest, KvWriteAndSiluMulAndAdd) {
  const int bs = 16, blocks = 20, hk = 4, d = 128;
  BatchMeta m = MakeBatch({{20, 35}, {1, 64}, {7, 7}}, bs, blocks, rng_);
  const int T = m.num_tokens, width = hk * d;
  auto k = RandomBf16(rng_, T * width), v = RandomBf16(rng_, T * width);
  auto kc = RandomBf16(rng_, blocks * bs * width), vc = RandomBf16(rng_, blocks * bs * width);
  auto kc_want = kc, vc_want = vc;
  SetBatch(m);
  cpu_->KvWrite(Cpu(k, {T, width}), Cpu(v, {T, width}), Cpu(kc_want, {blocks, bs, hk, d}),
                Cpu(vc_want, {blocks, bs, hk, d}));
  Tensor gkc = Gpu(kc, {blocks, bs, hk, d}), gvc = Gpu(vc, {blocks, bs, hk, d});
  ops_->KvWrite(Gpu(k, {T, width}), Gpu(v, {T, width}), gkc, gvc);
  EXPECT_EQ(Host(gkc), kc_want);
  EXPECT_EQ(Host(gvc), vc_want);

  for (int inter : {344, 11008}) {
    const int rows = 7;
    auto gu = RandomBf16(rng_, rows * 2 * inter, 2.0f);
    std::vector<float> want(rows * inter);
    cpu_->SiluMul(Cpu(gu, {rows, 2 * inter}), Cpu(want, {rows, inter}));
    Tensor out = GpuOut({rows, inter});
    ops_->SiluMul(Gpu(gu, {rows, 2 * inter}), out);
    EXPECT_LT(RelL2(Host(out), want), kBf16Tol);
  }
  for (int n : {1001, 4096 * 3}) {
    auto a = RandomBf16(rng_, n), b = RandomBf16(rng_, n);
    std::vector<float> want(n);
    cpu_->Add(Cpu(a, {n}), Cpu(b, {n}), Cpu(want, {n}));
    Tensor out = GpuOut({n});
    ops_->Add(Gpu(a, {n}), Gpu(b, {n}), out);
    EXPECT_LT(RelL2(Host(out), want), kBf16Tol);
  }
}

// Quantized KV caches (kernels/kv_quant.h): the host reference of what a write stores.
constexpr DType kQuantKvTypes[] = {DType::kF8E4M3, DType::kI8, DType::kI4};

// QuantizeKvHead of x (d floats) into cache row `row` (slot * hk + head) of host codes/scales.
void QuantizeRow(DType t, int d, int64_t row, const float* x, std::vector<uint8_t>* codes,
                 std::vector<float>* scales) {
  QuantizeKvHead(t, x, d, codes->data() + KvByteOffset(t, row * d),
                 scales->data() + row * KvScaleGroups(t, d));
}

// Code of element i of cache row `row`.
uint8_t CodeAt(DType t, const std::vector<uint8_t>& codes, int d, int64_t row, int i) {
  const int64_t e = row * d + i;
  return t == DType::kI4 ? static_cast<uint8_t>((codes[e / 2] >> (4 * (e & 1))) & 15) : codes[e];
}

// The position of a code on its dtype's ordered scale of values: adjacent values differ by 1.
int CodeOrdinal(DType t, uint8_t c) {
  if (t == DType::kF8E4M3) return (c & 0x80) ? -(c & 0x7f) : (c & 0x7f);  // +-0 both 0
  if (t == DType::kI8) return static_cast<int8_t>(c);
  return (c & 15) - 8;
}

::testing::AssertionResult SameBytes(const std::vector<uint8_t>& got,
                                     const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  size_t diff = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && diff++ == 0) first = i;
  }
  if (diff == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << diff << " of " << got.size() << " bytes differ, first at " << first << ": "
         << int(got[first]) << " want " << int(want[first]);
}

// Bit for bit (a scale of +0 is not -0, NaN is not anything).
::testing::AssertionResult SameFloatBits(const std::vector<float>& got,
                                         const std::vector<float>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  size_t diff = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && diff++ == 0) first = i;
  }
  if (diff == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << diff << " of " << got.size() << " scales differ, first at " << first << ": "
         << got[first] << " want " << want[first];
}

// Multiplies each run of `run` consecutive values by a random power of two (bf16 values stay
// bf16 values): groups of one head get different absmaxes, and a 2^-16 run next to a 2^5 one
// puts fp8 codes in the subnormal range.
void ScaleRuns(std::vector<float>* v, int run, std::mt19937& rng) {
  constexpr int kExp[] = {-16, -4, 0, 5};
  for (size_t i = 0; i < v->size(); i += run) {
    const float f = std::ldexp(1.0f, kExp[rng() % 4]);
    for (size_t j = i; j < std::min(v->size(), i + run); ++j) (*v)[j] *= f;
  }
}

// KvWrite into fp8 / int8 / int4 caches: every code and scale bit for bit QuantizeKvHead's on
// the bf16 inputs (the same rule, kv_quant.h, on both sides; no tolerance), padding slots and
// every row outside the batch untouched (the whole pool is compared with its starting bytes
// where nothing is written). Head dims 32 (int4: one nibble a lane), 64, 128 (int4: two groups),
// 256; Hk 1, 3 (idle warps), 8 (two blocks a token); an all-zero head (scale 0); a head whose
// first group's extreme is a tie of both signs (KvExtreme: the negative one).
TEST_F(CudaOpsTest, KvWriteQuantizedMatchesHostBitForBit) {
  for (DType t : kQuantKvTypes)
    for (int d : {32, 64, 128, 256})
      for (int hk : {1, 3, 8}) {
        SCOPED_TRACE(testing::Message() << DTypeName(t) << " d " << d << " hk " << hk);
        const int bs = 16, blocks = 12;
        BatchMeta m = MakeBatch({{20, 35}, {1, 0}, {7, 7}, {1, 64}}, bs, blocks, rng_);
        const int T = m.num_tokens, width = hk * d;
        auto k = RandomBf16(rng_, size_t{1} * T * width),
             v = RandomBf16(rng_, size_t{1} * T * width);
        ScaleRuns(&k, 32, rng_);
        ScaleRuns(&v, 32, rng_);
        std::fill(k.begin(), k.begin() + d, 0.0f);  // token 0 (a real slot), head 0
        // Token 2, head 0: its first group's extreme is a tie of both signs, in the group's first
        // and last elements (the first and the last lane of the group's shuffle tree).
        const int tie_at = KvScaleGroup(t, d) - 1;
        k[size_t{2} * width] = 4096.0f;
        k[size_t{2} * width + tie_at] = -4096.0f;
        std::vector<uint8_t> kc, vc;
        std::vector<float> ks, vs;
        Tensor gkc = GpuQuantCache(t, blocks, bs, hk, d, &kc, &ks);
        Tensor gvc = GpuQuantCache(t, blocks, bs, hk, d, &vc, &vs);
        std::vector<uint8_t> kc_want = kc, vc_want = vc;
        std::vector<float> ks_want = ks, vs_want = vs;
        int written = 0;
        for (int i = 0; i < T; ++i) {
          const int64_t slot = m.slot_mapping[i];
          if (slot < 0) continue;
          ++written;
          for (int h = 0; h < hk; ++h) {
            const size_t at = size_t{1} * i * width + h * d;
            QuantizeRow(t, d, slot * hk + h, &k[at], &kc_want, &ks_want);
            QuantizeRow(t, d, slot * hk + h, &v[at], &vc_want, &vs_want);
          }
        }
        ASSERT_EQ(written, T - 1);  // one padding token
        SetBatch(m);
        ops_->KvWrite(Gpu(k, {T, width}), Gpu(v, {T, width}), gkc, gvc);
        EXPECT_TRUE(SameBytes(HostCodes(gkc), kc_want)) << "K codes";
        EXPECT_TRUE(SameBytes(HostCodes(gvc), vc_want)) << "V codes";
        EXPECT_TRUE(SameFloatBits(HostScales(gkc), ks_want)) << "K scales";
        EXPECT_TRUE(SameFloatBits(HostScales(gvc), vs_want)) << "V scales";
        EXPECT_EQ(ks_want[m.slot_mapping[0] * hk * KvScaleGroups(t, d)], 0.0f);  // the zero head
        EXPECT_EQ(ks_want[m.slot_mapping[2] * hk * KvScaleGroups(t, d)],
                  t == DType::kI4 ? 512.0f : 4096.0f / KvQuantMax(t));  // the tie: -4096 -> -8
        bufs_.clear();
      }
}

// RopeKvWrite into fp8 / int8 / int4 caches against the CPU's fp32 rotation (same inv_freq and
// positions) quantized with QuantizeKvHead:
// - q_out as RopeKvWriteMatchesCpu checks it (kBf16Tol);
// - v: codes and scales bit for bit (quantized from the bf16 inputs on both sides);
// - k: the device's rotation (CUDA sincosf, max 2 ulp, fused multiply-adds) and the host's
//   (glibc, separate roundings) differ by a few ulp of the pair's magnitude, and the head's
//   absmax is not reduced by the rotation below 1/sqrt(2) of its pair's, so scales agree within
//   a relative 4e-6 (~32 ulp; a wrong rotation or a bf16 rounding before the absmax is off by
//   ~1e-3 or more). A code moves only where x * inv sits within that error of a rounding
//   boundary: at most one step (adjacent values), and rarely: int8 steps are the finest (127 per
//   absmax), a ~1e-6 relative error moves ~2e-4 of the codes, so the bound is 0.5% of the k
//   codes written. int4's scale carries the sign of the group's extreme (-m / 8): where the
//   largest magnitudes of both signs lie within that error of each other, the device may pick
//   the other one (a flipped scale, every code of the group changed). Such a group is accepted
//   only with that near tie in the host's values, its scale's magnitude within 4e-6, and every
//   element read back within one step of the host's value (the int4 bound of a clamped
//   element); expected in ~1e-5 of the groups, bounded at 1e-3;
// - every row outside the batch's slots (padding included) untouched.
// Both grids: blocks of 8 heads (small batch) and a block per token (>= 256 tokens).
TEST_F(CudaOpsTest, RopeKvWriteQuantizedMatchesHostRotation) {
  struct Case {
    int hq, hk, d;
  };
  const std::vector<std::vector<std::pair<int, int>>> batches = {
      {{29, 4000}, {1, 7}, {1, 0}, {3, 3}}, {{300, 4000}, {1, 0}, {7, 7}}};
  for (DType t : kQuantKvTypes)
    for (const auto& seqs : batches)
      for (Case c : {Case{8, 2, 128}, Case{4, 4, 64}, Case{16, 8, 64}, Case{6, 2, 32}}) {
        SCOPED_TRACE(testing::Message() << DTypeName(t) << " heads " << c.hq << "/" << c.hk << " d "
                                        << c.d << " sequences " << seqs.size());
        const int bs = 16, blocks = 300;
        BatchMeta m = MakeBatch(seqs, bs, blocks, rng_);
        const int T = m.num_tokens, width = (c.hq + 2 * c.hk) * c.d, kvw = c.hk * c.d;
        RopeConfig rc;
        rc.theta = 100000.0;
        auto inv = RopeInvFreq(rc, c.d);
        auto qkv = RandomBf16(rng_, size_t{1} * T * width);
        ScaleRuns(&qkv, c.d, rng_);  // a magnitude per head
        std::vector<float> q_want(size_t{1} * T * c.hq * c.d);
        std::vector<float> kf(size_t{1} * blocks * bs * kvw), vf(kf.size());
        SetBatch(m);
        cpu_->RopeKvWrite(Cpu(qkv, {T, width}), Cpu(inv, {c.d / 2}), c.hq, c.hk, c.d,
                          Cpu(q_want, {T, c.hq * c.d}), Cpu(kf, {blocks, bs, c.hk, c.d}),
                          Cpu(vf, {blocks, bs, c.hk, c.d}));
        std::vector<uint8_t> kc, vc;
        std::vector<float> ks, vs;
        Tensor gkc = GpuQuantCache(t, blocks, bs, c.hk, c.d, &kc, &ks);
        Tensor gvc = GpuQuantCache(t, blocks, bs, c.hk, c.d, &vc, &vs);
        std::vector<uint8_t> kc_want = kc, vc_want = vc;
        std::vector<float> ks_want = ks, vs_want = vs;
        std::vector<int64_t> rows;  // cache rows written
        for (int i = 0; i < T; ++i) {
          const int64_t slot = m.slot_mapping[i];
          if (slot < 0) continue;
          for (int h = 0; h < c.hk; ++h) {
            const int64_t row = slot * c.hk + h;
            rows.push_back(row);
            QuantizeRow(t, c.d, row, &kf[row * c.d], &kc_want, &ks_want);
            QuantizeRow(t, c.d, row, &vf[row * c.d], &vc_want, &vs_want);
          }
        }
        Tensor q_out = GpuOut({T, c.hq * c.d});
        ops_->RopeKvWrite(Gpu(qkv, {T, width}), GpuF32(inv, {c.d / 2}), c.hq, c.hk, c.d, q_out, gkc,
                          gvc);
        EXPECT_LT(RelL2(Host(q_out), q_want), kBf16Tol);
        EXPECT_TRUE(SameBytes(HostCodes(gvc), vc_want)) << "V codes";
        EXPECT_TRUE(SameFloatBits(HostScales(gvc), vs_want)) << "V scales";

        std::vector<uint8_t> k_got = HostCodes(gkc);
        std::vector<float> ks_got = HostScales(gkc);
        const int groups = KvScaleGroups(t, c.d);
        const int group = KvScaleGroup(t, c.d);
        size_t moved = 0, far = 0, scale_off = 0, flipped = 0;
        for (int64_t row : rows) {
          for (int g = 0; g < groups; ++g) {
            const float got = ks_got[row * groups + g], want = ks_want[row * groups + g];
            const float* x = &kf[row * c.d + g * group];  // the host's fp32 rotation
            bool flip = false;
            if (t == DType::kI4 && got * want < 0.0f) {
              float pos = 0.0f, neg = 0.0f;  // the largest magnitudes of either sign
              for (int i = 0; i < group; ++i) {
                pos = std::max(pos, x[i]);
                neg = std::max(neg, -x[i]);
              }
              flip = std::fabs(pos - neg) <= 4e-6f * std::max(pos, neg);
            }
            scale_off += !(std::fabs(std::fabs(got) - std::fabs(want)) <= 4e-6f * std::fabs(want));
            for (int i = 0; i < group; ++i) {
              const int e = g * group + i;
              if (flip) {
                const float back = KvDecode(t, CodeAt(t, k_got, c.d, row, e)) * got;
                far += !(std::fabs(back - x[i]) <= std::fabs(got) * 1.0001f);
                continue;
              }
              const int step = std::abs(CodeOrdinal(t, CodeAt(t, k_got, c.d, row, e)) -
                                        CodeOrdinal(t, CodeAt(t, kc_want, c.d, row, e)));
              moved += step != 0;
              far += step > 1;
            }
            flipped += flip;
            ks_got[row * groups + g] = want;  // compared; the rest must equal the start
          }
          const int64_t at = KvByteOffset(t, row * c.d), n = KvByteOffset(t, c.d);
          std::copy(kc_want.begin() + at, kc_want.begin() + at + n, k_got.begin() + at);
        }
        EXPECT_EQ(scale_off, 0u) << "k scales off by more than 4e-6 relative";
        EXPECT_EQ(far, 0u) << "k codes more than one step from the host's";
        EXPECT_LE(moved, rows.size() * c.d / 200) << "k codes one step off";
        EXPECT_LE(flipped, rows.size() * groups / 1000) << "int4 k groups of the other sign";
        EXPECT_TRUE(SameBytes(k_got, kc_want)) << "K codes outside the batch's rows";
        EXPECT_TRUE(SameFloatBits(ks_got, ks_want)) << "K scales outside the batch's rows";
        bufs_.clear();
      }
}

// A token's codes, scales and rotated q do not depend on the batch's size: the same 300 tokens
// written in one batch (kAllHeadsMinTokens or more: RopeKvWriteQuantWideKernel for fp8 and int8)
// and in batches of 150 and 149 + 1 (the warp-a-head kernel) give the same bytes, so a prompt
// computed in one chunk or several continues identically (deterministic mode relies on it).
TEST_F(CudaOpsTest, RopeKvWriteQuantizedSameBytesOnEveryPath) {
  struct Case {
    int hq, hk, d;
  };
  for (DType t : kQuantKvTypes)
    for (Case c : {Case{8, 2, 128}, Case{4, 4, 64}, Case{6, 2, 32}}) {
      SCOPED_TRACE(testing::Message()
                   << DTypeName(t) << " heads " << c.hq << "/" << c.hk << " d " << c.d);
      const int bs = 16, blocks = 24, T = 300;
      const BatchMeta whole = MakeBatch({{T, T}}, bs, blocks, rng_);
      const int width = (c.hq + 2 * c.hk) * c.d;
      RopeConfig rc;
      rc.theta = 100000.0;
      const auto inv = RopeInvFreq(rc, c.d);
      auto qkv = RandomBf16(rng_, size_t{1} * T * width);
      ScaleRuns(&qkv, c.d, rng_);
      std::vector<uint8_t> codes0;
      std::vector<float> scales0;
      Tensor caches[2][2];  // [path][k, v]
      std::vector<float> q_out[2];
      for (int path = 0; path < 2; ++path) {
        rng_.seed(7);  // the same starting bytes in both pools
        for (int kv = 0; kv < 2; ++kv) {
          caches[path][kv] = GpuQuantCache(t, blocks, bs, c.hk, c.d, &codes0, &scales0);
        }
        Tensor q = GpuOut({T, c.hq * c.d});
        // Path 0: one batch; path 1: tokens [0, 150), [150, 299), [299, 300) of the same sequence.
        std::vector<std::pair<int, int>> cuts =
            path == 0 ? std::vector<std::pair<int, int>>{{0, T}}
                      : std::vector<std::pair<int, int>>{{0, 150}, {150, 299}, {299, 300}};
        for (auto [lo, hi] : cuts) {
          BatchMeta m = whole;
          m.num_tokens = hi - lo;
          m.query_start = {0, hi - lo};
          m.context_lens = {hi};
          m.logits_rows = {hi - lo - 1};
          m.positions.assign(whole.positions.begin() + lo, whole.positions.begin() + hi);
          m.slot_mapping.assign(whole.slot_mapping.begin() + lo, whole.slot_mapping.begin() + hi);
          m.token_ids.assign(whole.token_ids.begin() + lo, whole.token_ids.begin() + hi);
          SetBatch(m);
          std::vector<float> part(qkv.begin() + size_t{1} * lo * width,
                                  qkv.begin() + size_t{1} * hi * width);
          Tensor q_part(static_cast<uint16_t*>(q.data) + size_t{1} * lo * c.hq * c.d,
                        {hi - lo, c.hq * c.d}, DType::kBF16, Device::kCuda);
          ops_->RopeKvWrite(Gpu(part, {hi - lo, width}), GpuF32(inv, {c.d / 2}), c.hq, c.hk, c.d,
                            q_part, caches[path][0], caches[path][1]);
        }
        q_out[path] = Host(q);
      }
      EXPECT_TRUE(SameFloatBits(q_out[0], q_out[1])) << "q";
      for (int kv = 0; kv < 2; ++kv) {
        EXPECT_TRUE(SameBytes(HostCodes(caches[0][kv]), HostCodes(caches[1][kv]))) << kv;
        EXPECT_TRUE(SameFloatBits(HostScales(caches[0][kv]), HostScales(caches[1][kv]))) << kv;
      }
      bufs_.clear();
    }
}

// Relative L2 error of a quantized cache's rows read back against the values quantized:
// uniform rounding error over a step is step / sqrt(12) rms. int8: step = absmax / 127, a
// Gaussian head's absmax ~3 sigma: ~0.007; fp8 e4m3 (3 mantissa bits): ~0.03; int4:
// step = absmax / 8 over groups of 64: ~0.1. Tolerances about twice that.
double KvQuantTol(DType t) { return t == DType::kI8 ? 0.02 : (t == DType::kF8E4M3 ? 0.06 : 0.2); }

// QkvRopeKvWrite with a quantized cache at M = 1 and 2 (where a bf16 cache takes the fused
// skinny epilogue), with and without a deferred norm's row scale: exactly GemmScaledRows into
// qkv then RopeKvWrite on the same inputs (q_out, codes and scales, bit for bit). And against
// the bf16 cache's fused path on the same inputs: q_out within kBf16Tol and the cache rows read
// back within KvQuantTol, so the scale and the projection really were applied.
TEST_F(CudaOpsTest, QkvRopeKvWriteQuantizedEqualsGemmThenRopeKvWrite) {
  const int hq = 8, hk = 2, d = 128, hidden = 1024, k0 = 520;
  const int width = (hq + 2 * hk) * d, kvw = hk * d, bs = 16, blocks = 8;
  const float eps = 1e-5f;
  RopeConfig rc;
  auto inv = RopeInvFreq(rc, d);
  for (DType t : kQuantKvTypes)
    for (int M : {1, 2})
      for (bool deferred : {false, true}) {
        SCOPED_TRACE(testing::Message() << DTypeName(t) << " M " << M << " deferred " << deferred);
        std::vector<std::pair<int, int>> seqs = {{1, 33}};
        if (M == 2) seqs.push_back({1, 70});
        BatchMeta m = MakeBatch(seqs, bs, blocks, rng_);
        SetBatch(m);
        auto w = RandomBf16(rng_, size_t{1} * width * hidden, 0.05f);
        auto bias = RandomBf16(rng_, width);
        Tensor gw = Gpu(w, {width, hidden}), gb = Gpu(bias, {width}), ginv = GpuF32(inv, {d / 2});
        // x: random, or the output of a deferred norm (GemmAddRmsNorm at M <= 2) with its scale.
        Tensor x = Gpu(RandomBf16(rng_, size_t{1} * M * hidden, 2.0f), {M, hidden});
        RowScale scale;
        if (deferred) {
          auto w0 = RandomBf16(rng_, size_t{1} * hidden * k0, 0.05f);
          auto res = RandomBf16(rng_, size_t{1} * M * hidden, 3.0f);
          Tensor y = GpuOut({M, hidden});
          scale = ops_->GemmAddRmsNorm(Gpu(RandomBf16(rng_, size_t{1} * M * k0, 2.0f), {M, k0}),
                                       Gpu(w0, {hidden, k0}), nullptr, y, Gpu(res, {M, hidden}),
                                       Gpu(RandomBf16(rng_, hidden, 0.5f), {hidden}), eps, x);
          ASSERT_FALSE(scale.empty()) << "GemmAddRmsNorm defers its norm at M <= 2";
        }
        std::vector<uint8_t> kc, vc, unused_c;
        std::vector<float> ks, vs, unused_s;
        Tensor kc1 = GpuQuantCache(t, blocks, bs, hk, d, &kc, &ks);
        Tensor vc1 = GpuQuantCache(t, blocks, bs, hk, d, &vc, &vs);
        Tensor kc2 = GpuQuantCache(t, blocks, bs, hk, d, &unused_c, &unused_s);
        Tensor vc2 = GpuQuantCache(t, blocks, bs, hk, d, &unused_c, &unused_s);
        ops_->CopyToDevice(kc2.data, kc.data(), kc.size());  // the same starting contents
        ops_->CopyToDevice(kc2.scales, ks.data(), ks.size() * sizeof(float));
        ops_->CopyToDevice(vc2.data, vc.data(), vc.size());
        ops_->CopyToDevice(vc2.scales, vs.data(), vs.size() * sizeof(float));
        Tensor qkv1 = GpuOut({M, width}), q1 = GpuOut({M, hq * d});
        ops_->QkvRopeKvWrite(x, scale, gw, &gb, ginv, hq, hk, d, qkv1, q1, kc1, vc1);
        Tensor qkv2 = GpuOut({M, width}), q2 = GpuOut({M, hq * d});
        ops_->GemmScaledRows(x, scale, gw, &gb, qkv2);
        ops_->RopeKvWrite(qkv2, ginv, hq, hk, d, q2, kc2, vc2);
        const std::vector<float> q1_host = Host(q1);
        EXPECT_EQ(q1_host, Host(q2));
        EXPECT_TRUE(SameBytes(HostCodes(kc1), HostCodes(kc2))) << "K codes";
        EXPECT_TRUE(SameBytes(HostCodes(vc1), HostCodes(vc2))) << "V codes";
        EXPECT_TRUE(SameFloatBits(HostScales(kc1), HostScales(kc2))) << "K scales";
        EXPECT_TRUE(SameFloatBits(HostScales(vc1), HostScales(vc2))) << "V scales";

        // The bf16 cache on the fused path, same inputs.
        Tensor kb = GpuOut({blocks, bs, hk, d}), vb = GpuOut({blocks, bs, hk, d});
        Tensor q3 = GpuOut({M, hq * d}), qkv3 = GpuOut({M, width});
        ops_->QkvRopeKvWrite(x, scale, gw, &gb, ginv, hq, hk, d, qkv3, q3, kb, vb);
        EXPECT_LT(RelL2(q1_host, Host(q3)), kBf16Tol);
        const std::vector<float> kb_host = Host(kb), vb_host = Host(vb);
        const std::vector<uint8_t> k_codes = HostCodes(kc1), v_codes = HostCodes(vc1);
        const std::vector<float> k_scales = HostScales(kc1), v_scales = HostScales(vc1);
        const int groups = KvScaleGroups(t, d);
        std::vector<float> got, want(size_t{2} * M * kvw);
        std::vector<float> head(d);
        for (int i = 0; i < M; ++i) {
          const int64_t slot = m.slot_mapping[i];
          for (int h = 0; h < hk; ++h) {
            const int64_t row = slot * hk + h;
            for (int which = 0; which < 2; ++which) {
              const auto& codes = which == 0 ? k_codes : v_codes;
              const auto& scales = which == 0 ? k_scales : v_scales;
              DequantizeKvHead(t, codes.data() + KvByteOffset(t, row * d),
                               scales.data() + row * groups, d, head.data());
              got.insert(got.end(), head.begin(), head.end());
              const auto& ref = which == 0 ? kb_host : vb_host;
              std::copy(ref.begin() + row * d, ref.begin() + (row + 1) * d,
                        want.begin() + got.size() - d);
            }
          }
        }
        EXPECT_LT(RelL2(got, want), KvQuantTol(t));
        bufs_.clear();
      }
}

TEST_F(CudaOpsTest, GatherLogitRowsAndInterleaveShards) {
  BatchMeta m = MakeBatch({{5, 5}, {1, 9}, {12, 40}}, 16, 10, rng_);
  const int T = m.num_tokens, V = 1003, R = static_cast<int>(m.logits_rows.size());
  auto logits = RandomBf16(rng_, T * V);
  std::vector<float> want(R * V);
  SetBatch(m);
  cpu_->GatherLogitRows(Cpu(logits, {T, V}), Cpu(want, {R, V}));
  Tensor out = GpuOut({R, V}, DType::kF32);
  ops_->GatherLogitRows(GpuF32(logits, {T, V}), out);
  EXPECT_EQ(Host(out), want);
  Tensor out16 = GpuOut({R, V});
  ops_->GatherLogitRows(Gpu(logits, {T, V}), out16);
  EXPECT_EQ(Host(out16), want);

  const int S = 3, B = 4, Vs = 517;
  auto in = RandomBf16(rng_, S * B * Vs);
  std::vector<float> iw(B * S * Vs);
  cpu_->InterleaveShards(Cpu(in, {S, B, Vs}), Cpu(iw, {B, S * Vs}));
  Tensor io = GpuOut({B, S * Vs}, DType::kF32);
  ops_->InterleaveShards(GpuF32(in, {S, B, Vs}), io);
  EXPECT_EQ(Host(io), iw);
  Tensor io2 = GpuOut({B, S * Vs}, DType::kF32);
  ops_->InterleaveShards(Gpu(in, {S, B, Vs}), io2);
  EXPECT_EQ(Host(io2), iw);
}

struct AttnCase {
  std::vector<std::pair<int, int>> seqs;  // (query_len, context_len)
  int hq, hk, d, bs;
};

// The attention ops against the CPU reference over an f32 cache holding the values the GPU's
// cache holds: for a quantized cache (fp8 / int8 / int4) the dequantized ones (GpuKv), so the
// reference needs no quantized-cache support. The bf16 tolerance holds for every cache dtype:
// the GPU decodes the codes exactly and applies the scales in fp32 (decode: to each partial dot
// product and softmax weight; prefill: to the fp32 scores, and to P before its one rounding to
// bf16, as the bf16 path rounds P), so the values and roundings are those of the bf16 case.
class CudaAttentionTest : public CudaOpsTest {
 protected:
  // Overwrites every row of the device caches that no sequence's context reaches (the rows of a
  // last page past its context and the unused blocks) with codes no kernel may use: NaN for
  // fp8 (e4m3 0x7f) and bf16 (0xffff), -128 for int8 (outside the quantizer's range), 0xff for
  // int4, and NaN scales. A kernel that reads them (a TMA page brings the whole last page) must
  // leave them out of every product: the output stays finite and equal to the reference.
  void PoisonUnreachedRows(const BatchMeta& m, const AttnCase& c, DType kv, int total_blocks,
                           Tensor& gk, Tensor& gv) {
    std::vector<bool> reached(size_t{1} * total_blocks * c.bs, false);
    for (int i = 0; i < m.num_seqs; ++i) {
      const int32_t* table = m.block_tables.data() + size_t{1} * i * m.max_blocks_per_seq;
      for (int pos = 0; pos < m.context_lens[i]; ++pos) {
        reached[size_t{1} * table[pos / c.bs] * c.bs + pos % c.bs] = true;
      }
    }
    const size_t row_bytes = size_t{1} * c.hk * c.d * DTypeBits(kv) / 8;
    const uint8_t code = kv == DType::kF8E4M3 ? 0x7f : kv == DType::kI8 ? 0x80 : 0xff;
    const std::vector<uint8_t> bad_codes(row_bytes, code);
    const size_t row_scales = kv == DType::kBF16 ? 0 : size_t{1} * c.hk * KvScaleGroups(kv, c.d);
    const std::vector<float> bad_scales(row_scales, std::numeric_limits<float>::quiet_NaN());
    for (size_t row = 0; row < reached.size(); ++row) {
      if (reached[row]) continue;
      for (Tensor* t : {&gk, &gv}) {
        ops_->CopyToDevice(static_cast<uint8_t*>(t->data) + row * row_bytes, bad_codes.data(),
                           row_bytes);
        if (row_scales > 0) {
          ops_->CopyToDevice(static_cast<float*>(t->scales) + row * row_scales, bad_scales.data(),
                             row_scales * sizeof(float));
        }
      }
    }
  }

  // poison: PoisonUnreachedRows before the kernels run (decode).
  void Run(const AttnCase& c, bool decode, DType kv = DType::kBF16, bool poison = false) {
    int total_blocks = 0;
    for (auto [q, ctx] : c.seqs) total_blocks += (ctx + c.bs - 1) / c.bs;
    total_blocks += 3;  // unused blocks hold garbage the kernels must not read
    BatchMeta m = MakeBatch(c.seqs, c.bs, total_blocks, rng_);
    const int T = m.num_tokens, qw = c.hq * c.d, kvw = c.hk * c.d;
    auto q = RandomBf16(rng_, size_t{1} * T * qw);
    const auto k_in = RandomBf16(rng_, size_t{1} * total_blocks * c.bs * kvw);
    const auto v_in = RandomBf16(rng_, size_t{1} * total_blocks * c.bs * kvw);
    std::vector<float> kc, vc;  // what the device caches hold
    Tensor gk = GpuKv(k_in, {total_blocks, c.bs, c.hk, c.d}, kv, &kc),
           gv = GpuKv(v_in, {total_blocks, c.bs, c.hk, c.d}, kv, &vc);
    if (poison) PoisonUnreachedRows(m, c, kv, total_blocks, gk, gv);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    std::vector<float> want(size_t{1} * T * qw);
    SetBatch(m);
    if (decode) {
      cpu_->AttentionDecode(Cpu(q, {T, qw}), Cpu(kc, {total_blocks, c.bs, c.hk, c.d}),
                            Cpu(vc, {total_blocks, c.bs, c.hk, c.d}), c.hq, c.hk, c.d, scale,
                            Cpu(want, {T, qw}));
    } else {
      cpu_->AttentionPrefill(Cpu(q, {T, qw}), Cpu(kc, {total_blocks, c.bs, c.hk, c.d}),
                             Cpu(vc, {total_blocks, c.bs, c.hk, c.d}), c.hq, c.hk, c.d, scale,
                             Cpu(want, {T, qw}));
    }
    Tensor gq = Gpu(q, {T, qw});
    Tensor out = GpuOut({T, qw});
    if (decode) {
      ops_->AttentionDecode(gq, gk, gv, c.hq, c.hk, c.d, scale, out);
    } else {
      ops_->AttentionPrefill(gq, gk, gv, c.hq, c.hk, c.d, scale, out);
    }
    const std::vector<float> got = Host(out);
    EXPECT_LT(RelL2(got, want), kBf16Tol);
    // Deterministic: the same inputs give the same bits (greedy decoding depends on it).
    for (int rep = 0; rep < 3; ++rep) {
      Tensor again = GpuOut({T, qw});
      if (decode) {
        ops_->AttentionDecode(gq, gk, gv, c.hq, c.hk, c.d, scale, again);
      } else {
        ops_->AttentionPrefill(gq, gk, gv, c.hq, c.hk, c.d, scale, again);
      }
      EXPECT_EQ(Host(again), got) << "repetition " << rep;
    }
    bufs_.clear();
  }
};

// The mma.sync prefill kernel (TPSERVE_PREFILL_KERNEL=mma; the default runs wgmma where it can,
// PrefillWgmmaKernel below checks it).
struct ScopedPrefillKernel {
  explicit ScopedPrefillKernel(cuda::PrefillKernel k) { cuda::SetPrefillKernel(k); }
  ~ScopedPrefillKernel() { cuda::SetPrefillKernel(before); }
  cuda::PrefillKernel before = cuda::PrefillKernelChoice();
};

TEST_F(CudaAttentionTest, PrefillVarlenCachedPrefixGqa) {
  ScopedPrefillKernel mma(cuda::PrefillKernel::kMma);
  std::vector<AttnCase> cases = {
      {{{77, 77}}, 4, 4, 128, 16},                                       // one odd prompt
      {{{130, 300}, {1, 45}, {64, 64}, {3, 17}, {1, 0}}, 8, 2, 64, 16},  // mixed, GQA, pad
      {{{200, 200}, {1, 1000}, {1, 33}}, 12, 4, 128, 16},                // prefill + decode rows
      {{{65, 129}, {128, 128}}, 6, 1, 128, 32},                          // block boundaries, MQA
      {{{300, 4096}}, 4, 2, 128, 16},                                    // long context chunk
      {{{119, 119}, {7, 40}, {1, 33}}, 8, 2, 32, 16},  // head_dim 32 (tiny-coder's shape)
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    Run(cases[i], /*decode=*/false);
  }
}

TEST_F(CudaAttentionTest, DecodePagedSplitGqa) {
  std::vector<AttnCase> cases = {
      {{{1, 1}, {1, 16}, {1, 0}, {1, 17}, {1, 300}, {1, 1023}}, 32, 32, 128, 16},  // pad
      {{{1, 257}, {1, 512}, {1, 513}}, 16, 2, 64, 16},                             // G=8
      {{{1, 100}, {1, 0}, {1, 700}}, 12, 4, 128, 16},                              // G=3
      {{{1, 4096}, {1, 3000}}, 8, 4, 128, 16},                                     // long, G=2
      {{{1, 31}, {1, 64}}, 8, 2, 128, 32},                                         // block size 32
      {{{1, 768}}, 32, 32, 128, 16},  // batch 1 of the 6.7B shape: 12 splits merged in-kernel
      // 192 sequence-head pairs: the two-phase kernel with 128-key splits.
      {{{1, 1}, {1, 129}, {1, 0}, {1, 640}, {1, 128}, {1, 1000}}, 32, 32, 128, 16},
      {{{1, 1}, {1, 40}, {1, 127}}, 8, 2, 32, 16},  // head_dim 32 (tiny-coder), sub-tile kernel
      // head_dim 32, 256 sequence-head pairs: the two-phase kernel.
      {{{1, 200}, {1, 17}, {1, 999}, {1, 64}, {1, 1}, {1, 300}, {1, 128}, {1, 77}}, 32, 32, 32, 16},
  };
  // A large batch (>= 512 sequence-head pairs: 256-key partitions) with random contexts.
  AttnCase big{{}, 32, 32, 64, 16};
  std::uniform_int_distribution<int> ctx_dist(1, 1500);
  for (int i = 0; i < 20; ++i) big.seqs.push_back({1, ctx_dist(rng_)});
  cases.push_back(big);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    Run(cases[i], /*decode=*/true);
  }
}

const DType kQuantizedKv[] = {DType::kF8E4M3, DType::kI8, DType::kI4};

// Quantized caches: head dims 128 (int4: two scale groups a head), 64 and 32 (one group), GQA
// and MQA, chunked prefill over a cached prefix beside decode rows, block sizes 16 and 32.
TEST_F(CudaAttentionTest, PrefillQuantizedKvCache) {
  ScopedPrefillKernel mma(cuda::PrefillKernel::kMma);
  const std::vector<AttnCase> cases = {
      {{{77, 77}}, 4, 4, 128, 16},                                       // one odd prompt
      {{{130, 300}, {1, 45}, {64, 64}, {3, 17}, {1, 0}}, 8, 2, 64, 16},  // mixed, GQA, pad
      {{{200, 700}, {1, 1000}, {1, 33}}, 12, 4, 128, 16},                // chunk + decode rows
      {{{65, 129}, {128, 128}}, 6, 1, 128, 32},                          // block boundaries, MQA
      {{{119, 119}, {7, 40}, {1, 33}}, 8, 2, 32, 16},                    // head_dim 32
  };
  for (DType kv : kQuantizedKv) {
    for (size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE(std::string(KvCacheDTypeName(kv)) + " case " + std::to_string(i));
      Run(cases[i], /*decode=*/false, kv);
    }
  }
}

// The wgmma prefill kernels (sm_90a; TPSERVE_PREFILL_KERNEL=wgmma, and wgmma-pipe, wgmma-ws,
// wgmma-tma, wgmma-fa3 and wgmma-fa3pp, which run wgmma for the 8-bit caches; wgmma-tma's TMA
// pages at block sizes 8, 16, 32 and 64, wgmma-ws at 24 and 128; wgmma-fa3's TMA
// pages at 8 (16 pages a 128-key tile), 16, 32, 64 and 128, the wgmma kernel at 24) on the cases
// above and longer causal prompts (several 128-key tiles, a tile's two warpgroups at different
// diagonal offsets), for bf16 and the 8-bit caches it reads; head_dim 32 and int4 go to the mma
// kernel (checked too). Same tolerance as the mma kernel: the same roundings, sums in another
// order. With 128-key tiles a warpgroup skips the tile past its last query where the prefix mod
// 128 is in [1, 64] (prefixes 170, 64, 40, 33 and 14 below), and warpgroup 1 has no rows at all
// in tiles of <= 64 queries (3, 1, 64, 7).
TEST_F(CudaAttentionTest, PrefillWgmmaKernel) {
  if (!cuda::WgmmaPrefillFits(DType::kBF16, 128)) GTEST_SKIP() << "needs an sm_90 device";
  ScopedPrefillKernel restore(cuda::PrefillKernelChoice());
  const std::vector<AttnCase> cases = {
      {{{77, 77}}, 4, 4, 128, 16},                                       // one odd prompt
      {{{130, 300}, {1, 45}, {64, 64}, {3, 17}, {1, 0}}, 8, 2, 64, 16},  // mixed, GQA, pad
      {{{200, 700}, {1, 1000}, {1, 33}}, 12, 4, 128, 16},                // chunk + decode rows
      {{{65, 129}, {128, 128}}, 6, 1, 128, 32},                          // block boundaries, MQA
      {{{1000, 1000}}, 4, 4, 128, 16},                                   // 8 tiles, causal
      {{{300, 4096}, {257, 257}}, 4, 2, 64, 16},                         // long prefix, d 64
      {{{150, 400}, {1, 30}}, 4, 2, 128, 24},          // block size 24 (page math by division)
      {{{119, 119}, {7, 40}, {1, 33}}, 8, 2, 32, 16},  // head_dim 32: mma
      {{{200, 240}, {70, 70}}, 4, 2, 128, 8},          // block size 8: 16 pages a 128-key tile
      {{{150, 200}, {1, 90}}, 4, 1, 128, 64},          // block size 64
      {{{260, 293}}, 4, 4, 64, 128},                   // block size 128: a page a tile, d 64
  };
  for (const auto& [kernel, name] : cuda::kPrefillKernels) {
    if (kernel == cuda::PrefillKernel::kMma) continue;  // PrefillVarlenCachedPrefixGqa's
    cuda::SetPrefillKernel(kernel);
    for (DType kv : {DType::kBF16, DType::kF8E4M3, DType::kI8, DType::kI4}) {
      for (size_t i = 0; i < cases.size(); ++i) {
        SCOPED_TRACE(std::string(name) + " " + std::string(KvCacheDTypeName(kv)) + " case " +
                     std::to_string(i));
        Run(cases[i], /*decode=*/false, kv);
      }
    }
  }
}

// The persistent FA3 kernel (wgmma-fa3p) computes each (query tile, head) as wgmma-fa3 does, so
// its output has the same bits; PrefillWgmmaKernel's cases give it fewer work items than SMs,
// these give it several a block (832 and 192 (query tile, head) items over at most 132 blocks):
// every block's K/V ring and Q buffer run on across items of different sizes (a 16-tile prompt
// tile, a chunk over a cached prefix, a decode row, a prompt of one partial tile), at head_dim 128
// and 64.
TEST_F(CudaAttentionTest, PrefillPersistentFa3MatchesFa3BitForBit) {
  if (!cuda::WgmmaPrefillFits(DType::kBF16, 128)) GTEST_SKIP() << "needs an sm_90 device";
  ScopedPrefillKernel restore(cuda::PrefillKernelChoice());
  const std::vector<AttnCase> cases = {
      {{{2048, 2048}, {700, 1500}, {1, 300}, {333, 333}}, 32, 8, 128, 16},
      {{{1000, 1000}, {300, 900}, {77, 77}}, 16, 16, 64, 64},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    const AttnCase& c = cases[i];
    int total_blocks = 3;
    for (auto [q, ctx] : c.seqs) total_blocks += (ctx + c.bs - 1) / c.bs;
    BatchMeta m = MakeBatch(c.seqs, c.bs, total_blocks, rng_);
    const int T = m.num_tokens, qw = c.hq * c.d, kvw = c.hk * c.d;
    Tensor gk = Gpu(RandomBf16(rng_, size_t{1} * total_blocks * c.bs * kvw),
                    {total_blocks, c.bs, c.hk, c.d});
    Tensor gv = Gpu(RandomBf16(rng_, size_t{1} * total_blocks * c.bs * kvw),
                    {total_blocks, c.bs, c.hk, c.d});
    Tensor gq = Gpu(RandomBf16(rng_, size_t{1} * T * qw), {T, qw});
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    SetBatch(m);
    std::vector<float> outs[2];
    for (int p = 0; p < 2; ++p) {
      cuda::SetPrefillKernel(p == 0 ? cuda::PrefillKernel::kWgmmaFa3
                                    : cuda::PrefillKernel::kWgmmaFa3P);
      Tensor out = GpuOut({T, qw});
      ops_->AttentionPrefill(gq, gk, gv, c.hq, c.hk, c.d, scale, out);
      outs[p] = Host(out);
    }
    ASSERT_EQ(outs[0].size(), outs[1].size());
    size_t differ = 0, nonzero = 0;
    for (size_t j = 0; j < outs[0].size(); ++j) {
      differ += std::memcmp(&outs[0][j], &outs[1][j], sizeof(float)) != 0;
      nonzero += outs[0][j] != 0.0f;
    }
    EXPECT_EQ(differ, 0u) << "of " << outs[0].size() << " outputs";
    EXPECT_GT(nonzero, outs[0].size() / 2) << "the outputs were computed";
    bufs_.clear();
  }
}

// Restores the process-wide prefill switches a test sets (cuda::SetPrefillDequant,
// cuda::SetMixedDecode).
struct ScopedPrefillModes {
  ~ScopedPrefillModes() {
    cuda::SetPrefillDequant(dequant);
    cuda::SetMixedDecode(mixed);
  }
  cuda::PrefillDequant dequant = cuda::PrefillDequantChoice();
  cuda::MixedDecode mixed = cuda::MixedDecodeChoice();
};

// Prefill over fp8 / int8 caches through the bf16 scratch (cuda::PrefillDequant,
// CudaOps::ReservePrefillScratch) with every wgmma kernel, against the CPU reference:
// - kAll with room for every page, the unreached rows poisoned: every sequence with a context
//   takes the scratch (decode rows and padding in the batch), so the kernels see only scratch
//   pages, whose rows past a context are zeros (the poisoned codes never reach a product);
//   block sizes 8-128 (24: the FA3 kernels fall back to wgmma), d 64 and 128, GQA and MQA;
// - kAll with room for some pages: the longest queries that fit take it, the others keep the
//   in-kernel decode, in one batch (two launches writing disjoint rows of `out`);
// - kAuto: only the sequence with enough query-key pairs a key.
// The tolerance is the bf16 one: the scratch holds bf16(code * scale), a relative 2^-9 from the
// reference's dequantized value (the bf16 path's K and V carry the same rounding of fp32).
TEST_F(CudaAttentionTest, PrefillDequantScratch) {
  if (!cuda::WgmmaPrefillFits(DType::kF8E4M3, 128)) GTEST_SKIP() << "needs an sm_90 device";
  ScopedPrefillKernel restore(cuda::PrefillKernelChoice());
  ScopedPrefillModes restore_modes;
  cuda::SetMixedDecode(cuda::MixedDecode::kOff);  // decode rows stay prefill work: kAll takes them
  const std::vector<AttnCase> all_fit = {
      {{{77, 77}}, 4, 4, 128, 16},
      {{{130, 300}, {1, 45}, {64, 64}, {3, 17}, {1, 0}}, 8, 2, 64, 16},  // padding: not taken
      {{{200, 700}, {1, 1000}, {1, 33}}, 12, 4, 128, 16},
      {{{65, 129}, {128, 128}}, 6, 1, 128, 32},
      {{{150, 400}, {1, 30}}, 4, 2, 128, 24},
      {{{200, 240}, {70, 70}}, 4, 2, 128, 8},
      {{{150, 200}, {1, 90}}, 4, 1, 128, 64},
      {{{260, 293}}, 4, 4, 64, 128},
  };
  const cuda::PrefillKernel kernels[] = {
      cuda::PrefillKernel::kWgmma, cuda::PrefillKernel::kWgmmaFa3, cuda::PrefillKernel::kWgmmaFa3P};
  for (DType kv : {DType::kF8E4M3, DType::kI8}) {
    for (cuda::PrefillKernel kernel : kernels) {
      cuda::SetPrefillKernel(kernel);
      cuda::SetPrefillDequant(cuda::PrefillDequant::kAll);
      for (size_t i = 0; i < all_fit.size(); ++i) {
        const AttnCase& c = all_fit[i];
        SCOPED_TRACE(std::string(KvCacheDTypeName(kv)) + " kernel " +
                     std::to_string(static_cast<int>(kernel)) + " all, case " + std::to_string(i));
        int pages = 0, with_context = 0;
        for (auto [q, ctx] : c.seqs) {
          pages += (ctx + c.bs - 1) / c.bs;
          with_context += ctx > 0;
        }
        gpu_->ReservePrefillScratch(kv, pages, c.bs, c.hk, c.d);
        Run(c, /*decode=*/false, kv, /*poison=*/true);
        EXPECT_EQ(gpu_->prefill_scratch_sequences(), with_context);
        EXPECT_EQ(gpu_->prefill_scratch_pages(), pages);
      }
      {
        // 256 + 17 + 2 pages; room for 20: the 257-query prompt and the decode row.
        SCOPED_TRACE(std::string(KvCacheDTypeName(kv)) + " some fit");
        const AttnCase c{{{300, 4096}, {257, 257}, {1, 30}}, 4, 2, 128, 16};
        gpu_->ReservePrefillScratch(kv, 20, c.bs, c.hk, c.d);
        Run(c, /*decode=*/false, kv);
        EXPECT_EQ(gpu_->prefill_scratch_sequences(), 2);
        EXPECT_EQ(gpu_->prefill_scratch_pages(), 19);
      }
      {
        // 600 x 601 / 2 query-key pairs >= 256 x 600 keys; 100 x 600 + 5050 < 256 x 700.
        SCOPED_TRACE(std::string(KvCacheDTypeName(kv)) + " auto");
        cuda::SetPrefillDequant(cuda::PrefillDequant::kAuto);
        const AttnCase c{{{600, 600}, {100, 700}, {1, 500}}, 4, 2, 128, 16};
        gpu_->ReservePrefillScratch(kv, 200, c.bs, c.hk, c.d);
        Run(c, /*decode=*/false, kv);
        EXPECT_EQ(gpu_->prefill_scratch_sequences(), 1);
        EXPECT_EQ(gpu_->prefill_scratch_pages(), 38);
      }
    }
  }
  // Off: no plan, whatever the reservation.
  cuda::SetPrefillDequant(cuda::PrefillDequant::kOff);
  const AttnCase c{{{600, 600}}, 4, 2, 128, 16};
  gpu_->ReservePrefillScratch(DType::kF8E4M3, 200, c.bs, c.hk, c.d);
  Run(c, /*decode=*/false, DType::kF8E4M3);
  EXPECT_EQ(gpu_->prefill_scratch_sequences(), 0);
  EXPECT_FALSE(cuda::PrefillDequantTakes(cuda::PrefillDequant::kAuto, 510, 510));
  EXPECT_TRUE(cuda::PrefillDequantTakes(cuda::PrefillDequant::kAuto, 511, 511));
}

// Continuous batching: the decode rows of a step with prompt tokens go through the decode
// kernel as token queries (cuda::MixedDecode: on, off, auto), the prompt chunks through the prefill
// kernel (with the fp8 / int8 scratch where it takes them), and both write their rows of one
// output; against the CPU reference for every cache dtype, with the split on and off, and the
// number of rows planned. Cases: many decode rows beside one chunk (the served shape), GQA,
// head_dim 32 / 64, padding rows (no context: left to the prefill kernel, which writes zeros),
// a chunk long enough for the scratch (600 queries), 300 decode rows (two launches of
// kDecodeQueryChunk token queries).
TEST_F(CudaAttentionTest, PrefillMixedDecodeRows) {
  ScopedPrefillModes restore_modes;
  cuda::SetPrefillDequant(cuda::PrefillDequant::kAuto);
  std::vector<AttnCase> cases;
  {
    AttnCase c{{{200, 264}}, 8, 8, 128, 16};  // one chunk over a prefix, 31 decode rows
    std::uniform_int_distribution<int> ctx(1, 1500);
    for (int i = 0; i < 31; ++i) c.seqs.push_back({1, ctx(rng_)});
    cases.push_back(c);
  }
  cases.push_back({{{1, 45}, {130, 300}, {1, 0}, {1, 1000}, {3, 17}, {1, 1}}, 8, 2, 64, 16});
  cases.push_back({{{1, 700}, {119, 119}, {1, 33}, {1, 0}}, 8, 2, 32, 16});
  cases.push_back({{{600, 600}, {1, 900}, {1, 77}}, 4, 2, 128, 16});
  {
    AttnCase c{{{64, 64}}, 4, 4, 64, 16};
    std::uniform_int_distribution<int> ctx(1, 400);
    for (int i = 0; i < 300; ++i) c.seqs.push_back({1, ctx(rng_)});
    cases.push_back(c);
  }
  for (DType kv : {DType::kBF16, DType::kF8E4M3, DType::kI8, DType::kI4}) {
    for (cuda::MixedDecode mode :
         {cuda::MixedDecode::kOn, cuda::MixedDecode::kOff, cuda::MixedDecode::kAuto}) {
      cuda::SetMixedDecode(mode);
      const bool on = mode != cuda::MixedDecode::kOff;  // planned (kAuto: run for 8/4-bit caches)
      for (size_t i = 0; i < cases.size(); ++i) {
        const AttnCase& c = cases[i];
        SCOPED_TRACE(std::string(KvCacheDTypeName(kv)) + (on ? " split" : " unsplit") + " case " +
                     std::to_string(i));
        int rows = 0, pages = 0;
        for (auto [q, ctx] : c.seqs) {
          rows += q == 1 && ctx > 0;
          pages += (ctx + c.bs - 1) / c.bs;
        }
        gpu_->ReservePrefillScratch(kv, pages, c.bs, c.hk, c.d);
        Run(c, /*decode=*/false, kv);
        EXPECT_EQ(gpu_->mixed_decode_rows(), on ? rows : 0);
        const bool scratch =
            i == 3 && (kv == DType::kF8E4M3 || kv == DType::kI8) && cuda::WgmmaPrefillFits(kv, c.d);
        EXPECT_EQ(gpu_->prefill_scratch_sequences(), scratch ? 1 : 0);
      }
    }
  }
}

// Quantized caches through the kernels the batch picks: the sub-tile kernel (one and several
// 64-key partitions merged in-kernel), from 128 sequence-head pairs the mma kernel (head_dim 64
// and 128) or the two-phase kernel (head_dim 32; 16 elements a lane at G <= 2), with 512-key
// partitions; DecodeEveryKernelAndPartition forces the other partitions.
TEST_F(CudaAttentionTest, DecodeQuantizedKvCache) {
  std::vector<AttnCase> cases = {
      {{{1, 1}, {1, 16}, {1, 0}, {1, 17}, {1, 300}, {1, 1023}}, 8, 2, 128, 16},  // sub-tile, G=4
      {{{1, 257}, {1, 512}, {1, 513}}, 16, 2, 64, 16},                           // G=8
      {{{1, 100}, {1, 0}, {1, 700}}, 12, 4, 128, 32},                            // G=3, bs 32
      {{{1, 768}}, 32, 32, 128, 16},  // batch 1 of the 6.7B shape: 12 splits merged in-kernel
      // 192 sequence-head pairs: the two-phase kernel.
      {{{1, 1}, {1, 129}, {1, 0}, {1, 640}, {1, 128}, {1, 1000}}, 32, 32, 128, 16},
      {{{1, 1}, {1, 40}, {1, 127}}, 8, 2, 32, 16},  // head_dim 32
  };
  // >= 512 sequence-head pairs: the two-phase kernel.
  AttnCase big{{}, 32, 32, 64, 16};
  std::uniform_int_distribution<int> ctx_dist(1, 1500);
  for (int i = 0; i < 20; ++i) big.seqs.push_back({1, ctx_dist(rng_)});
  cases.push_back(big);
  for (DType kv : kQuantizedKv) {
    for (size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE(std::string(KvCacheDTypeName(kv)) + " case " + std::to_string(i));
      Run(cases[i], /*decode=*/true, kv);
    }
  }
}

// Every decode kernel (sub-tile, two-phase, mma; the mma kernel also with L2 prefetches, which
// must not change a result) at forced partitions, for each cache dtype (the
// two-phase kernel reads 16 elements a lane from a quantized cache at G <= 2, 8 at G = 8; the
// mma kernel runs for fp8, int8 and int4 at head_dim 64 and 128, G = 1, 2 and 8, and falls back
// to the two-phase kernel for the other cases; so does mma-bf16, deterministic mode's kernel
// for bf16 caches at head_dim 64 and 128):
// contexts of one key, of part of a partition and of many, padding, a block size that is not
// a power of two (page math by division instead of shifts).
TEST_F(CudaAttentionTest, DecodeEveryKernelAndPartition) {
  const std::vector<AttnCase> cases = {
      {{{1, 1}, {1, 63}, {1, 0}, {1, 129}, {1, 700}, {1, 1500}}, 32, 32, 128, 16},  // G=1
      {{{1, 257}, {1, 1024}, {1, 1025}}, 16, 2, 64, 16},                            // G=8
      {{{1, 100}, {1, 0}, {1, 777}}, 8, 4, 128, 32},                                // G=2, bs 32
      {{{1, 300}, {1, 31}, {1, 2049}}, 8, 8, 32, 16},                               // head_dim 32
      {{{1, 300}, {1, 24}, {1, 1100}}, 8, 8, 128, 24},  // block size 24 (not a power of two)
  };
  struct Variant {
    cuda::DecodeKernel kernel;
    int partition;
    int prefetch = 0;  // the mma kernel's L2 prefetch distance (TPSERVE_DECODE_PREFETCH)
  };
  const Variant variants[] = {
      {cuda::DecodeKernel::kSubTile, 64},   {cuda::DecodeKernel::kSubTile, 256},
      {cuda::DecodeKernel::kTwoPhase, 128}, {cuda::DecodeKernel::kTwoPhase, 256},
      {cuda::DecodeKernel::kTwoPhase, 512}, {cuda::DecodeKernel::kMma, 64},
      {cuda::DecodeKernel::kMma, 512},      {cuda::DecodeKernel::kMma, 1024},
      {cuda::DecodeKernel::kMma, 64, 1},    {cuda::DecodeKernel::kMma, 512, 4},
      {cuda::DecodeKernel::kMmaBf16, 64},   {cuda::DecodeKernel::kMmaBf16, 128},
      {cuda::DecodeKernel::kMmaBf16, 512},
  };
  const int env_prefetch = cuda::DecodePrefetch();
  for (DType kv : {DType::kBF16, DType::kF8E4M3, DType::kI8, DType::kI4}) {
    for (const Variant& v : variants) {
      cuda::SetDecodeOverride(v.kernel, v.partition);
      cuda::SetDecodePrefetch(v.prefetch);
      for (size_t i = 0; i < cases.size(); ++i) {
        SCOPED_TRACE(std::string(KvCacheDTypeName(kv)) + " kernel " +
                     std::to_string(static_cast<int>(v.kernel)) + " partition " +
                     std::to_string(v.partition) + " prefetch " + std::to_string(v.prefetch) +
                     " case " + std::to_string(i));
        Run(cases[i], /*decode=*/true, kv);
      }
    }
  }
  cuda::SetDecodeOverride(cuda::DecodeKernel::kAuto, 0);
  cuda::SetDecodePrefetch(env_prefetch);
}

// The 8-bit caches with every row that no context reaches poisoned (PoisonUnreachedRows: NaN
// fp8 codes, NaN scales) through the tensor-core kernel at 512-key splits (auto's): no stale row
// of a last page may reach a product (0 x NaN is NaN). Block sizes 12,
// 16, 24 and 32, G = 1, 2 and 8, head_dim 64 and 128, contexts of 1 key, inside a page, a page's
// end, several splits, and padding. (Written for session 20's TMA-fed decode kernel, which loaded
// whole pages; it lost to the mma kernel and is not kept: kernels/cuda/NOTES.md.)
TEST_F(CudaAttentionTest, DecodeStaleRowsPoisoned) {
  const std::vector<AttnCase> cases = {
      {{{1, 1}, {1, 5}, {1, 0}, {1, 16}, {1, 300}, {1, 1027}}, 32, 32, 128, 16},  // G=1
      {{{1, 17}, {1, 513}, {1, 250}}, 16, 2, 64, 16},                             // G=8, d 64
      {{{1, 100}, {1, 0}, {1, 777}, {1, 32}}, 8, 4, 128, 32},                     // G=2, bs 32
      {{{1, 23}, {1, 25}, {1, 1100}}, 8, 8, 64, 24},  // G=1, bs 24: splits start inside pages
      {{{1, 11}, {1, 400}}, 8, 4, 128, 12},           // bs 12
  };
  struct Variant {
    cuda::DecodeKernel kernel;
    int partition;
  };
  const Variant variants[] = {{cuda::DecodeKernel::kMma, 512}};
  for (DType kv : {DType::kF8E4M3, DType::kI8}) {
    for (const Variant& v : variants) {
      cuda::SetDecodeOverride(v.kernel, v.partition);
      for (size_t i = 0; i < cases.size(); ++i) {
        SCOPED_TRACE(std::string(KvCacheDTypeName(kv)) + " kernel " +
                     std::to_string(static_cast<int>(v.kernel)) + " partition " +
                     std::to_string(v.partition) + " case " + std::to_string(i));
        Run(cases[i], /*decode=*/true, kv, /*poison=*/true);
      }
    }
  }
  cuda::SetDecodeOverride(cuda::DecodeKernel::kAuto, 0);
}

// A decode step captured once replays correctly for new contexts and tokens (same sizes): a
// bf16 cache through the kernel the batch picks, and 8-bit caches through the tensor-core
// kernel (G = 4).
TEST_F(CudaOpsTest, DecodeStepReplaysAsCudaGraph) {
  struct Variant {
    DType kv;
    cuda::DecodeKernel kernel;
    int partition;
  };
  for (const Variant& v : {Variant{DType::kBF16, cuda::DecodeKernel::kAuto, 0},
                           Variant{DType::kF8E4M3, cuda::DecodeKernel::kMma, 0},
                           Variant{DType::kI8, cuda::DecodeKernel::kMma, 64}}) {
    SCOPED_TRACE(std::string(KvCacheDTypeName(v.kv)) + " kernel " +
                 std::to_string(static_cast<int>(v.kernel)));
    cuda::SetDecodeOverride(v.kernel, v.partition);
    DecodeStepReplay(v.kv);
    cuda::SetDecodeOverride(cuda::DecodeKernel::kAuto, 0);
    bufs_.clear();
  }
}

void CudaOpsTest::DecodeStepReplay(DType kv) {
  const int hq = 8, hk = 2, d = 128, bs = 16, hidden = hq * d, blocks = 200, B = 4;
  const int max_blocks = 64;
  auto wq = RandomBf16(rng_, hidden * hidden, 0.05f);
  Tensor gwq = Gpu(wq, {hidden, hidden});
  std::vector<float> kc, vc;  // what the device caches hold
  Tensor gk = GpuKv(RandomBf16(rng_, blocks * bs * hk * d), {blocks, bs, hk, d}, kv, &kc),
         gv = GpuKv(RandomBf16(rng_, blocks * bs * hk * d), {blocks, bs, hk, d}, kv, &vc);
  Tensor qo = GpuOut({B, hidden}), out = GpuOut({B, hidden});
  const float scale = 0.088f;
  // Build metas directly: contexts change, capacity fixed.
  auto meta = [&](const std::vector<int>& ctxs) {
    BatchMeta m;
    m.num_seqs = B;
    m.num_tokens = B;
    m.block_size = bs;
    m.max_blocks_per_seq = max_blocks;
    std::vector<int32_t> perm(blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    size_t next = 0;
    for (int i = 0; i < B; ++i) {
      m.query_start.push_back(i);
      m.context_lens.push_back(ctxs[i]);
      m.positions.push_back(ctxs[i] - 1);
      m.token_ids.push_back(i);
      m.logits_rows.push_back(i);
      std::vector<int32_t> row(max_blocks, -1);
      for (int b = 0; b < (ctxs[i] + bs - 1) / bs; ++b) row[b] = perm[next++];
      m.slot_mapping.push_back(row[(ctxs[i] - 1) / bs] * bs + (ctxs[i] - 1) % bs);
      m.block_tables.insert(m.block_tables.end(), row.begin(), row.end());
    }
    m.query_start.push_back(B);
    return m;
  };
  auto xs = RandomBf16(rng_, B * hidden);
  Tensor gx = Gpu(xs, {B, hidden});
  auto step = [&] {
    ops_->Gemm(gx, gwq, nullptr, qo);
    ops_->AttentionDecode(qo, gk, gv, hq, hk, d, scale, out);
  };
  auto reference = [&](const BatchMeta& m) {
    std::vector<float> q(B * hidden), o(B * hidden);
    cpu_->SetBatch(m);
    cpu_->Gemm(Cpu(xs, {B, hidden}), Cpu(wq, {hidden, hidden}), nullptr, Cpu(q, {B, hidden}));
    for (float& v : q) v = Bf16ToF32(F32ToBf16(v));  // the GPU rounds q to bf16
    cpu_->AttentionDecode(Cpu(q, {B, hidden}), Cpu(kc, {blocks, bs, hk, d}),
                          Cpu(vc, {blocks, bs, hk, d}), hq, hk, d, scale, Cpu(o, {B, hidden}));
    return o;
  };
  BatchMeta m1 = meta({5, 700, 1024, 33});
  ops_->SetBatch(m1);
  step();  // warm-up: sizes workspaces and cuBLAS plans outside capture
  ops_->Synchronize();
  uint64_t gen = gpu_->layout_generation();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(gpu_->stream(), cudaStreamCaptureModeThreadLocal), cudaSuccess);
  step();
  ASSERT_EQ(cudaStreamEndCapture(gpu_->stream(), &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (auto ctxs : {std::vector<int>{5, 700, 1024, 33}, std::vector<int>{1000, 1, 257, 512},
                    std::vector<int>{17, 16, 15, 1023}}) {
    BatchMeta m = meta(ctxs);
    ops_->SetBatch(m);
    ASSERT_EQ(gpu_->layout_generation(), gen);
    ASSERT_EQ(cudaGraphLaunch(exec, gpu_->stream()), cudaSuccess);
    EXPECT_LT(RelL2(Host(out), reference(m)), kBf16Tol);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// One decode layer's attention half as the model runs it (skinny q/k/v GEMM, RopeKvWrite,
// single-kernel decode attention, skinny o projection), captured once as a CUDA graph and
// replayed over new contexts, with programmatic dependent launch on and off: the kernels that
// start before the previous one finishes must still see its q and this step's K/V row. The
// reference rounds to bf16 where the GPU stores bf16 (qkv, q, k); tolerance kBf16Tol.
TEST_F(CudaOpsTest, DecodeChainReplaysWithProgrammaticLaunch) {
  const int hq = 8, hk = 2, d = 128, bs = 16, blocks = 200, max_blocks = 64, hidden = 512;
  const int width = (hq + 2 * hk) * d;
  RopeConfig rc;
  auto inv = RopeInvFreq(rc, d);
  auto wqkv = RandomBf16(rng_, size_t{1} * width * hidden, 0.05f);
  auto wo = RandomBf16(rng_, size_t{1} * hidden * hq * d, 0.05f);
  auto kc0 = RandomBf16(rng_, size_t{1} * blocks * bs * hk * d);
  auto vc0 = RandomBf16(rng_, size_t{1} * blocks * bs * hk * d);
  Tensor gwqkv = Gpu(wqkv, {width, hidden}), gwo = Gpu(wo, {hidden, hq * d});
  Tensor ginv = GpuF32(inv, {d / 2});
  Tensor gk = Gpu(kc0, {blocks, bs, hk, d}), gv = Gpu(vc0, {blocks, bs, hk, d});
  const float scale = 1.0f / std::sqrt(float(d));
  for (int B : {1, 2}) {
    for (bool pdl : {true, false}) {
      SCOPED_TRACE(testing::Message() << "batch " << B << " PDL " << pdl);
      CudaOps::set_programmatic_launch(pdl);
      auto xs = RandomBf16(rng_, size_t{1} * B * hidden);
      Tensor gx = Gpu(xs, {B, hidden});
      Tensor qkv = GpuOut({B, width}), q = GpuOut({B, hq * d}), attn = GpuOut({B, hq * d});
      Tensor out = GpuOut({B, hidden});
      auto meta = [&](const std::vector<int>& ctxs) {
        BatchMeta m;
        m.num_seqs = B;
        m.num_tokens = B;
        m.block_size = bs;
        m.max_blocks_per_seq = max_blocks;
        for (int i = 0; i < B; ++i) {
          m.query_start.push_back(i);
          m.context_lens.push_back(ctxs[i]);
          m.positions.push_back(ctxs[i] - 1);
          m.token_ids.push_back(i);
          m.logits_rows.push_back(i);
          std::vector<int32_t> row(max_blocks, -1);
          for (int b = 0; b < (ctxs[i] + bs - 1) / bs; ++b) row[b] = (i * 97 + b * 3) % blocks;
          m.slot_mapping.push_back(row[(ctxs[i] - 1) / bs] * bs + (ctxs[i] - 1) % bs);
          m.block_tables.insert(m.block_tables.end(), row.begin(), row.end());
        }
        m.query_start.push_back(B);
        return m;
      };
      auto step = [&] {
        ops_->Gemm(gx, gwqkv, nullptr, qkv);
        ops_->RopeKvWrite(qkv, ginv, hq, hk, d, q, gk, gv);
        ops_->AttentionDecode(q, gk, gv, hq, hk, d, scale, attn);
        ops_->Gemm(attn, gwo, nullptr, out);
      };
      auto round = [](std::vector<float>& v) {
        for (float& x : v) x = Bf16ToF32(F32ToBf16(x));
      };
      auto reference = [&](const BatchMeta& m) {
        std::vector<float> r_qkv(size_t{1} * B * width), r_q(size_t{1} * B * hq * d);
        std::vector<float> r_attn(r_q.size()), r_out(size_t{1} * B * hidden);
        std::vector<float> kc = Host(gk), vc = Host(gv);  // the cache before this step
        cpu_->SetBatch(m);
        cpu_->Gemm(Cpu(xs, {B, hidden}), Cpu(wqkv, {width, hidden}), nullptr,
                   Cpu(r_qkv, {B, width}));
        round(r_qkv);
        cpu_->RopeKvWrite(Cpu(r_qkv, {B, width}), Cpu(inv, {d / 2}), hq, hk, d,
                          Cpu(r_q, {B, hq * d}), Cpu(kc, {blocks, bs, hk, d}),
                          Cpu(vc, {blocks, bs, hk, d}));
        round(r_q);
        round(kc);
        cpu_->AttentionDecode(Cpu(r_q, {B, hq * d}), Cpu(kc, {blocks, bs, hk, d}),
                              Cpu(vc, {blocks, bs, hk, d}), hq, hk, d, scale,
                              Cpu(r_attn, {B, hq * d}));
        round(r_attn);
        cpu_->Gemm(Cpu(r_attn, {B, hq * d}), Cpu(wo, {hidden, hq * d}), nullptr,
                   Cpu(r_out, {B, hidden}));
        return r_out;
      };
      std::vector<int> first = B == 1 ? std::vector<int>{768} : std::vector<int>{700, 1024};
      BatchMeta m1 = meta(first);
      ops_->SetBatch(m1);
      step();  // warm-up outside capture (workspace, cuBLAS)
      ops_->Synchronize();
      uint64_t gen = gpu_->layout_generation();
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      ASSERT_EQ(cudaStreamBeginCapture(gpu_->stream(), cudaStreamCaptureModeThreadLocal),
                cudaSuccess);
      step();
      ASSERT_EQ(cudaStreamEndCapture(gpu_->stream(), &graph), cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      for (auto ctxs : {first, std::vector<int>{33, 1000}, std::vector<int>{1024, 64},
                        std::vector<int>{65, 1}}) {
        ctxs.resize(B);
        BatchMeta m = meta(ctxs);
        std::vector<float> want = reference(m);
        ops_->SetBatch(m);
        ASSERT_EQ(gpu_->layout_generation(), gen);
        ASSERT_EQ(cudaGraphLaunch(exec, gpu_->stream()), cudaSuccess);
        EXPECT_LT(RelL2(Host(out), want), kBf16Tol) << "context " << ctxs[0];
        // Eagerly too, twice (the arrival counters must be back at zero).
        for (int rep = 0; rep < 2; ++rep) {
          ops_->SetBatch(m);
          step();
          EXPECT_LT(RelL2(Host(out), want), kBf16Tol) << "eager, context " << ctxs[0];
        }
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
  }
  CudaOps::set_programmatic_launch(true);
}

// The op profiler times eager ops per (op, shape), records nothing while capturing, and costs
// nothing once off.
TEST_F(CudaOpsTest, OpProfilerTimesEagerOps) {
  const int n = 1024, k = 2048;
  auto x = RandomBf16(rng_, k), w = RandomBf16(rng_, size_t{1} * n * k, 0.05f);
  Tensor gx = Gpu(x, {1, k}), gw = Gpu(w, {n, k}), y = GpuOut({1, n});
  gpu_->set_op_profiling(true);
  gpu_->BeginProfiledStep();
  for (int i = 0; i < 3; ++i) ops_->Gemm(gx, gw, nullptr, y);
  gpu_->EndProfiledStep();
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(gpu_->stream(), cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ops_->Gemm(gx, gw, nullptr, y);
  ASSERT_EQ(cudaStreamEndCapture(gpu_->stream(), &graph), cudaSuccess);
  cudaGraphDestroy(graph);
  std::vector<OpProfileRow> rows = gpu_->TakeOpProfile();
  ASSERT_EQ(rows.size(), 2u);
  const OpProfileRow& gemm = rows[0].op == "step" ? rows[1] : rows[0];
  const OpProfileRow& step = rows[0].op == "step" ? rows[0] : rows[1];
  EXPECT_EQ(gemm.op, "Gemm.skinny");
  EXPECT_EQ(gemm.shape, "M=1 N=1024 K=2048");
  EXPECT_EQ(gemm.calls, 3);
  EXPECT_GT(gemm.total_us, 0.0);
  EXPECT_GE(step.total_us, gemm.total_us * 0.99);
  std::cout << FormatOpProfile(rows, 1);
  gpu_->set_op_profiling(false);
  ops_->Gemm(gx, gw, nullptr, y);
  EXPECT_TRUE(gpu_->TakeOpProfile().empty());
}

// The sampling rule of ops.h evaluated with double-precision sums (the GPU sums float
// probabilities in double; the CPU reference sums in float, so near a boundary the two may
// legitimately differ by rounding).
int32_t RuleReference(const float* row, int vocab, const SamplingParams& p) {
  if (IsGreedy(p.temperature)) {
    return static_cast<int32_t>(std::max_element(row, row + vocab) - row);
  }
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
  int keep = p.top_k > 0 ? std::min(vocab, p.top_k) : vocab;
  const float xmax = row[order[0]] / p.temperature;
  std::vector<double> probs(keep);
  double total = 0;
  for (int i = 0; i < keep; ++i) {
    probs[i] = std::exp(row[order[i]] / p.temperature - xmax);
    total += probs[i];
  }
  if (p.top_p < 1.0f) {
    double cum = 0;
    for (int i = 0; i < keep; ++i) {
      cum += probs[i];
      if (cum >= double(p.top_p) * total) {
        keep = i + 1;
        break;
      }
    }
    total = 0;
    for (int i = 0; i < keep; ++i) total += probs[i];
  }
  double target = double(PhiloxUniform(p.seed, static_cast<uint64_t>(p.position))) * total;
  double cum = 0;
  for (int i = 0; i < keep; ++i) {
    cum += probs[i];
    if (cum > target) return order[i];
  }
  return order[keep - 1];
}

// Checks GPU ids against the double-precision rule exactly, and against the CPU reference:
// greedy rows exactly, sampled rows on at least 95% of the draws (float-sum rounding).
void CheckSamples(const std::vector<int32_t>& got, const std::vector<int32_t>& cpu,
                  const std::vector<float>& logits, int width, int vocab,
                  const std::vector<SamplingParams>& params, int* draws, int* cpu_mismatch) {
  for (size_t r = 0; r < params.size(); ++r) {
    int32_t want = RuleReference(logits.data() + r * width, vocab, params[r]);
    EXPECT_EQ(got[r], want) << "row " << r << " T=" << params[r].temperature
                            << " top_k=" << params[r].top_k << " top_p=" << params[r].top_p;
    if (IsGreedy(params[r].temperature)) {
      EXPECT_EQ(got[r], cpu[r]) << "greedy row " << r;
    } else {
      ++*draws;
      *cpu_mismatch += got[r] != cpu[r];
    }
  }
}

TEST_F(CudaOpsTest, SampleMatchesRuleAndCpuAndIsDeterministic) {
  const int rows = 24, width = 1040, vocab = 1000;
  // Logits on a 1/8 grid (exact in fp32 and bf16) with repeats, so ties exist.
  std::vector<float> logits(rows * width);
  std::uniform_int_distribution<int> grid(-64, 64);
  for (float& v : logits) v = grid(rng_) / 8.0f;
  for (int r = 0; r < rows; ++r) {
    for (int i = vocab; i < width; ++i) logits[r * width + i] = 100.0f;  // padding: ignored
  }
  std::vector<SamplingParams> params(rows);
  const float temps[] = {0.0f, 0.7f, 1.0f, 1.5f};
  const int top_ks[] = {0, 1, 5, 50};
  const float top_ps[] = {1.0f, 0.9f, 0.5f};
  for (int r = 0; r < rows; ++r) {
    // Every 8th row: a tiny positive temperature, which must be greedy (IsGreedy).
    params[r].temperature = r % 8 == 5 ? 1e-38f : temps[r % 4];
    params[r].top_k = top_ks[(r / 4) % 4];
    params[r].top_p = top_ps[r % 3];
    params[r].seed = 1000 + r * 7919;
    params[r].position = 17 + r;
  }
  Tensor cpu_logits = Cpu(logits, {rows, width});
  Tensor g32 = GpuF32(logits, {rows, width});
  Tensor g16 = Gpu(logits, {rows, width});
  int draws = 0, mismatch = 0;
  for (int trial = 0; trial < 8; ++trial) {
    for (auto& p : params) p.position += 13;
    auto cpu = cpu_->Sample(cpu_logits, vocab, params);
    auto got = ops_->Sample(g32, vocab, params);
    CheckSamples(got, cpu, logits, width, vocab, params, &draws, &mismatch);
    EXPECT_EQ(ops_->Sample(g16, vocab, params), got) << "bf16 logits, trial " << trial;
    EXPECT_EQ(ops_->Sample(g32, vocab, params), got) << "not deterministic";
  }
  std::cout << "sampled draws " << draws << ", differing from the CPU (float sums) " << mismatch
            << std::endl;
  EXPECT_LE(mismatch * 20, draws);
  // The same (seed, position) gives the same token whatever the row order.
  std::vector<int> perm(rows);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng_);
  std::vector<float> shuffled(rows * width);
  std::vector<SamplingParams> sp(rows);
  for (int r = 0; r < rows; ++r) {
    std::copy_n(logits.begin() + perm[r] * width, width, shuffled.begin() + r * width);
    sp[r] = params[perm[r]];
  }
  auto base = ops_->Sample(g32, vocab, params);
  auto moved = ops_->Sample(GpuF32(shuffled, {rows, width}), vocab, sp);
  for (int r = 0; r < rows; ++r) EXPECT_EQ(moved[r], base[perm[r]]);
}

// Sampling one step ahead: SampleAsync returns before the ids reach the host; the next SetBatch
// takes some of its input tokens from those ids on the device (BatchMeta::fed_tokens) and the
// embedding reads them; two samplings may be in flight, SampleWait returns them in order, with
// the logprobs Sample gives.
TEST_F(CudaOpsTest, SampleAsyncFeedsTheNextBatchOnTheDevice) {
  EXPECT_TRUE(ops_->AsyncSampling());
  const int rows = 5, vocab = 1000, hidden = 64;
  // Row r's argmax is id 100 r + 7 (step 1) and 100 r + 42 (step 2): greedy picks them.
  auto logits_with_max = [&](int offset) {
    std::vector<float> l = RandomBf16(rng_, size_t{1} * rows * vocab);
    for (int r = 0; r < rows; ++r) l[r * vocab + 100 * r + offset] = 50.0f;
    return l;
  };
  std::vector<float> l1 = logits_with_max(7), l2 = logits_with_max(42);
  std::vector<SamplingParams> params(rows);
  for (int r = 0; r < rows; ++r) params[r].position = r;
  params[2].logprobs = 3;
  ops_->SampleAsync(GpuF32(l1, {rows, vocab}), vocab, params, /*logprobs=*/true);
  // The next step: five decode tokens, three of them fed from rows 3, 1 and 0.
  BatchMeta m = MakeBatch({{1, 3}, {1, 9}, {1, 17}, {1, 2}, {1, 40}}, 16, 16, rng_, vocab);
  m.fed_tokens = {0, 2, 4};
  m.fed_rows = {3, 1, 0};
  for (int t : m.fed_tokens) m.token_ids[t] = 0;  // placeholders
  ops_->SetBatch(m);
  auto table = RandomBf16(rng_, size_t{1} * vocab * hidden);
  Tensor out = GpuOut({m.num_tokens, hidden});
  ops_->Embedding(Gpu(table, {vocab, hidden}), 0, out);
  // A second sampling in flight before the first is waited for.
  ops_->SampleAsync(GpuF32(l2, {rows, vocab}), vocab, params, /*logprobs=*/true);
  BatchMeta resolved = m;
  resolved.fed_tokens.clear();
  resolved.fed_rows.clear();
  for (size_t i = 0; i < m.fed_tokens.size(); ++i) {
    resolved.token_ids[m.fed_tokens[i]] = 100 * m.fed_rows[i] + 7;
  }
  cpu_->SetBatch(resolved);
  std::vector<float> want(size_t{1} * m.num_tokens * hidden);
  cpu_->Embedding(Cpu(table, {vocab, hidden}), 0, Cpu(want, {m.num_tokens, hidden}));
  EXPECT_EQ(Host(out), want) << "the fed tokens' embeddings";
  std::vector<std::optional<TokenLogprobs>> lp1, lp2;
  const std::vector<int32_t> ids1 = ops_->SampleWait(&lp1);
  const std::vector<int32_t> ids2 = ops_->SampleWait(&lp2);
  EXPECT_TRUE(ops_->SampleReady());
  ASSERT_EQ(ids1.size(), size_t{rows});
  ASSERT_EQ(ids2.size(), size_t{rows});
  for (int r = 0; r < rows; ++r) {
    EXPECT_EQ(ids1[r], 100 * r + 7) << r;
    EXPECT_EQ(ids2[r], 100 * r + 42) << r;
  }
  // The logprobs of the asynchronous samplings are Sample's.
  std::vector<std::optional<TokenLogprobs>> sync_lp;
  ops_->Sample(GpuF32(l1, {rows, vocab}), vocab, params, &sync_lp);
  ASSERT_EQ(lp1.size(), size_t{rows});
  for (int r = 0; r < rows; ++r) {
    ASSERT_EQ(lp1[r].has_value(), r == 2) << r;
    ASSERT_EQ(lp2[r].has_value(), r == 2) << r;
  }
  EXPECT_EQ(lp1[2]->logprob, sync_lp[2]->logprob);
  ASSERT_EQ(lp1[2]->top.size(), size_t{3});
  for (int k = 0; k < 3; ++k) EXPECT_EQ(lp1[2]->top[k].id, sync_lp[2]->top[k].id) << k;
  EXPECT_EQ(lp2[2]->top[0].id, 242);
}

TEST_F(CudaOpsTest, SampleLargeVocabTopKTopP) {
  // A realistic vocabulary: a few hundred likely tokens and a long flat tail that top-p must
  // cut, plus one row with a flat distribution where top-p keeps thousands of candidates.
  const int rows = 7, vocab = 32256;
  std::vector<float> logits(rows * vocab);
  std::uniform_int_distribution<int> head(0, 40), tail(-200, -100), flat(-8, 8);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < vocab; ++i) {
      float v = r == rows - 1 ? flat(rng_) / 8.0f
                              : (rng_() % 100 == 0 ? head(rng_) / 8.0f : tail(rng_) / 16.0f);
      logits[r * vocab + i] = v;
    }
  }
  std::vector<SamplingParams> params(rows);
  for (int r = 0; r < rows; ++r) {
    params[r] = {r == 0 ? 0.0f : 0.8f, r == 2 ? 40 : 0, r >= 3 ? 0.95f : 1.0f,
                 static_cast<uint64_t>(r * 31 + 5), 100 + r};
  }
  Tensor g = GpuF32(logits, {rows, vocab});
  int draws = 0, mismatch = 0;
  for (int trial = 0; trial < 6; ++trial) {
    for (auto& p : params) p.position += 1;
    auto got = ops_->Sample(g, vocab, params);
    auto cpu = cpu_->Sample(Cpu(logits, {rows, vocab}), vocab, params);
    // The flat row sums ~30k float probabilities on the CPU: its rounding (~1e-5 relative) is
    // comparable to one candidate's mass, so that row is checked against the rule alone.
    cpu[rows - 1] = got[rows - 1];
    CheckSamples(got, cpu, logits, vocab, vocab, params, &draws, &mismatch);
  }
  std::cout << "sampled draws " << draws << ", differing from the CPU (float sums) " << mismatch
            << std::endl;
  EXPECT_LE(mismatch * 20, draws);
}

// Log-probabilities: the GPU's fp32 logsumexp and top N against the double-precision reference
// (ReferenceLogprobs, what the CPU op returns) for the id the GPU chose. Tolerance: 1e-4
// absolute on every logprob (fp32 sums over up to 50k exponentials). The alternatives' ids must
// match exactly: both sides order the same logit values by (value desc, id asc), ties included
// (bf16-representable logits repeat often; one row is constant).
TEST_F(CudaOpsTest, SampleLogprobsMatchReference) {
  constexpr double kLogprobTol = 1e-4;
  struct Shape {
    int rows, vocab, width;
  };
  const Shape shapes[] = {{9, 7, 7},         {9, 151, 160},     {9, 1000, 1040}, {9, 32000, 32000},
                          {9, 32256, 32256}, {9, 50257, 50304}, {130, 517, 517}};
  const int asks[] = {-1, 0, 1, 5, kMaxLogprobs, 3, -1, kMaxLogprobs, 2};
  const float temps[] = {0.0f, 0.8f, 0.0f, 1.2f, 0.7f, 0.0f, 1.0f, 1.0f, 0.5f};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message()
                 << s.rows << " rows, vocab " << s.vocab << ", width " << s.width);
    std::vector<float> logits = RandomBf16(rng_, static_cast<size_t>(s.rows) * s.width, 4.0f);
    for (int r = 0; r < s.rows; ++r) {
      for (int c = s.vocab; c < s.width; ++c) logits[r * s.width + c] = 100.0f;  // padding
    }
    for (int c = 0; c < s.vocab; ++c) logits[8 * s.width + c] = 0.5f;  // a constant row
    std::vector<SamplingParams> params(s.rows), plain;
    for (int r = 0; r < s.rows; ++r) {
      SamplingParams& p = params[r];
      p.temperature = temps[r % 9];
      p.top_k = r % 9 == 3 ? 10 : 0;
      p.top_p = r % 9 == 4 || r % 9 == 7 ? 0.9f : 1.0f;
      p.seed = 77 + r;
      p.position = 5 + 3 * r;
      p.logprobs = asks[r % 9];
    }
    plain = params;
    for (SamplingParams& p : plain) p.logprobs = -1;
    const Tensor cpu_logits = Cpu(logits, {s.rows, s.width});
    const std::vector<int32_t> cpu_ids = cpu_->Sample(cpu_logits, s.vocab, plain);
    for (DType dt : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(dt == DType::kF32 ? "f32 logits" : "bf16 logits");
      const Tensor g =
          dt == DType::kF32 ? GpuF32(logits, {s.rows, s.width}) : Gpu(logits, {s.rows, s.width});
      std::vector<std::optional<TokenLogprobs>> lps;
      const std::vector<int32_t> ids = ops_->Sample(g, s.vocab, params, &lps);
      ASSERT_EQ(lps.size(), static_cast<size_t>(s.rows));
      EXPECT_EQ(ops_->Sample(g, s.vocab, plain), ids) << "asking for logprobs changed tokens";
      for (int r = 0; r < s.rows; ++r) {
        const SamplingParams& p = params[r];
        if (p.temperature == 0.0f) {
          EXPECT_EQ(ids[r], cpu_ids[r]) << "greedy row " << r;
        }
        if (p.logprobs < 0) {
          EXPECT_FALSE(lps[r].has_value()) << "row " << r << " did not ask";
          continue;
        }
        ASSERT_TRUE(lps[r].has_value()) << "row " << r;
        ASSERT_TRUE(ids[r] >= 0 && ids[r] < s.vocab) << "row " << r;
        const TokenLogprobs want = ReferenceLogprobs(&logits[static_cast<size_t>(r) * s.width],
                                                     s.vocab, ids[r], p.logprobs);
        EXPECT_NEAR(lps[r]->logprob, want.logprob, kLogprobTol) << "row " << r;
        ASSERT_EQ(lps[r]->top.size(), want.top.size()) << "row " << r;
        for (size_t k = 0; k < want.top.size(); ++k) {
          EXPECT_EQ(lps[r]->top[k].id, want.top[k].id) << "row " << r << " rank " << k;
          EXPECT_NEAR(lps[r]->top[k].logprob, want.top[k].logprob, kLogprobTol)
              << "row " << r << " rank " << k;
        }
        if (p.temperature == 0.0f && !want.top.empty()) {
          EXPECT_EQ(lps[r]->top[0].id, ids[r]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace tpserve
