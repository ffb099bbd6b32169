// Deterministic mode of the CUDA ops (Ops::SetDeterministic): a GEMM row has the same bits for
// every M from 1 to 256 (and a 2048-row prefill) at any position of the batch, and a token's
// attention has the same bits in a prefill chunk of any size as in a decode step of any batch,
// over a bf16 or a quantized (fp8 / int8 / int4) KV cache.
// Without a CUDA device every test prints "no CUDA device, test skipped" and is skipped.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/bf16.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/launchers.h"
#include "kernels/kv_quant.h"
#include "kernels/ops.h"

namespace tpserve {
namespace {

std::vector<uint16_t> RandomBf16Bits(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = F32ToBf16(dist(rng));
  return v;
}

class DeterministicOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      std::cout << "no CUDA device, test skipped" << std::endl;
      GTEST_SKIP() << "no CUDA device";
    }
    const uint32_t seed = std::random_device{}();
    rng_.seed(seed);
    RecordProperty("seed", std::to_string(seed));
    std::cout << "seed " << seed << std::endl;
    ops_ = MakeCudaOps(0);
    ops_->SetDeterministic(true);
  }
  Tensor Upload(const std::vector<uint16_t>& h, std::initializer_list<int64_t> shape) {
    bufs_.emplace_back(ops_.get(), h.size() * 2);
    ops_->CopyToDevice(bufs_.back().get(), h.data(), h.size() * 2);
    return Tensor(bufs_.back().get(), shape, DType::kBF16, Device::kCuda);
  }
  // A random KV pool [blocks, bs, hk, d] of dtype `kv`: bf16, or normal values quantized one
  // token's head at a time by QuantizeKvHead (codes and scales).
  Tensor UploadKv(std::initializer_list<int64_t> shape, DType kv) {
    Tensor t(nullptr, shape, kv, Device::kCuda);
    if (kv == DType::kBF16) return Upload(RandomBf16Bits(rng_, t.numel(), 1.0f), shape);
    const int d = static_cast<int>(t.dim(3));
    const int64_t heads = t.numel() / d, head_bytes = int64_t{d} * DTypeBits(kv) / 8;
    const int groups = KvScaleGroups(kv, d);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> x(d);
    std::vector<uint8_t> codes(heads * head_bytes, 0);
    std::vector<float> scales(heads * groups);
    for (int64_t h = 0; h < heads; ++h) {
      for (float& e : x) e = dist(rng_);
      QuantizeKvHead(kv, x.data(), d, codes.data() + h * head_bytes, scales.data() + h * groups);
    }
    bufs_.emplace_back(ops_.get(), codes.size());
    ops_->CopyToDevice(bufs_.back().get(), codes.data(), codes.size());
    t.data = bufs_.back().get();
    bufs_.emplace_back(ops_.get(), scales.size() * 4);
    ops_->CopyToDevice(bufs_.back().get(), scales.data(), scales.size() * 4);
    t.scales = bufs_.back().get();
    return t;
  }
  Tensor Out(std::initializer_list<int64_t> shape) {
    Tensor t(nullptr, shape, DType::kBF16, Device::kCuda);
    bufs_.emplace_back(ops_.get(), t.bytes());
    t.data = bufs_.back().get();
    EXPECT_EQ(cudaMemset(t.data, 0xFF, t.bytes()), cudaSuccess);  // NaN: unwritten rows show
    return t;
  }
  std::vector<uint16_t> Bits(const Tensor& t, int64_t offset_elems, int64_t n) {
    ops_->Synchronize();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    std::vector<uint16_t> h(n);
    ops_->CopyToHost(h.data(), static_cast<const uint16_t*>(t.data) + offset_elems, n * 2);
    return h;
  }

  std::mt19937 rng_;
  std::unique_ptr<Ops> ops_;
  std::vector<DeviceBuffer> bufs_;
};

// The GEMMs of the 6.7B shape and of tiny-coder (with a bias, as Qwen2's q/k/v), M = 1..256 at
// a random first row, and M = 2048: every row equals the same row of one 256-row GEMM (through
// Ops::Gemm: with TPSERVE_DETERMINISTIC_GEMM=cublaslt, the default, the chain GEMMs up to M = 2
// and cuBLASLt's fixed algorithm above; or cuBLASLt alone, or the fixed-order kernel).
TEST_F(DeterministicOpsTest, GemmRowsDoNotDependOnM) {
  struct Shape {
    int64_t n, k;
    bool bias;
  };
  const Shape shapes[] = {// 6.7B: q/k/v, o, gate/up, down, lm_head.
                          {12288, 4096, false},
                          {4096, 4096, false},
                          {22016, 4096, false},
                          {4096, 11008, false},
                          {32256, 4096, false},
                          // tiny-coder: q/k/v (with and without a bias), o, gate/up, down, lm_head.
                          {384, 256, false},
                          {384, 256, true},
                          {256, 256, false},
                          {1280, 256, false},
                          {256, 640, false},
                          {4096, 256, false}};
  constexpr int64_t kRows = 256, kPrefill = 2048;
  for (const Shape& s : shapes) {
    SCOPED_TRACE("N=" + std::to_string(s.n) + " K=" + std::to_string(s.k));
    auto xh = RandomBf16Bits(rng_, size_t{kPrefill} * s.k, 1.0f);
    Tensor x = Upload(xh, {kPrefill, s.k});
    Tensor w = Upload(RandomBf16Bits(rng_, size_t{1} * s.n * s.k, 0.05f), {s.n, s.k});
    // With TPSERVE_DETERMINISTIC_TILES=on the M <= 2 rows read the weight's tiles.
    std::unique_ptr<Ops::PreparedWeight> prepared = ops_->PrepareGemmWeight(w);
    Tensor bias_t = Upload(RandomBf16Bits(rng_, s.n, 0.5f), {s.n});
    const Tensor* bias = s.bias ? &bias_t : nullptr;
    Tensor full = Out({kRows, s.n});
    ops_->Gemm(Tensor(x.data, {kRows, s.k}, DType::kBF16, Device::kCuda), w, bias, full);
    const std::vector<uint16_t> want = Bits(full, 0, kRows * s.n);
    Tensor y = Out({kPrefill, s.n});
    int mismatched_m = 0;
    for (int64_t m = 1; m <= kRows; ++m) {
      const int64_t r0 = static_cast<int64_t>(rng_() % (kRows - m + 1));
      Tensor xm(static_cast<uint16_t*>(x.data) + r0 * s.k, {m, s.k}, DType::kBF16, Device::kCuda);
      Tensor ym(static_cast<uint16_t*>(y.data) + r0 * s.n, {m, s.n}, DType::kBF16, Device::kCuda);
      ops_->Gemm(xm, w, bias, ym);
      const std::vector<uint16_t> got = Bits(y, r0 * s.n, m * s.n);
      if (std::memcmp(got.data(), want.data() + r0 * s.n, got.size() * 2) != 0) {
        if (mismatched_m++ < 3) ADD_FAILURE() << "M=" << m << " rows from " << r0 << " differ";
      }
    }
    EXPECT_EQ(mismatched_m, 0);
    ops_->Gemm(x, w, bias, y);  // a prefill of 2048 rows
    const std::vector<uint16_t> got = Bits(y, 0, kRows * s.n);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 2), 0) << "M=2048";
    prepared.reset();
    bufs_.clear();
  }
}

// The fixed-order GEMM itself: each row of every M, through either variant, has the bits of the
// same row computed alone (M = 1, split variant), and the values are the product: against an
// fp64 host sum, |y - ref| <= 2^-7 |ref| + 2^-12 sum_k |x w| (bf16 output rounding is 2^-9
// relative; the rest is fp32 accumulation over up to 11008 terms). The shapes cover N not a
// multiple of 16 or 128, K not a multiple of 32 (a zero-filled last chunk), fewer than 8 chunks
// (fewer slices than warps), and a bias.
TEST_F(DeterministicOpsTest, FixedOrderGemmVariantsAgreeAndAreExact) {
  struct Shape {
    int64_t n, k;
    bool bias;
  };
  const Shape shapes[] = {{4096, 4096, false}, {4096, 11008, false}, {384, 256, true},
                          {1000, 4104, false}, {24, 72, true},       {200, 8, false}};
  constexpr int64_t kRows = 300;
  const int64_t ms[] = {1, 2, 3, 8, 9, 16, 17, 31, 32, 33, 48, 64, 65, 130, 300};
  cudaStream_t stream = static_cast<CudaOps*>(ops_.get())->stream();
  for (const Shape& s : shapes) {
    SCOPED_TRACE("N=" + std::to_string(s.n) + " K=" + std::to_string(s.k));
    const std::vector<uint16_t> xh = RandomBf16Bits(rng_, size_t{kRows} * s.k, 1.0f);
    const std::vector<uint16_t> wh = RandomBf16Bits(rng_, size_t{1} * s.n * s.k, 0.05f);
    const std::vector<uint16_t> bh = RandomBf16Bits(rng_, s.n, 0.5f);
    Tensor x = Upload(xh, {kRows, s.k});
    Tensor w = Upload(wh, {s.n, s.k});
    Tensor bias_t = Upload(bh, {s.n});
    const Tensor* bias = s.bias ? &bias_t : nullptr;
    auto rows = [&](Tensor t, int64_t r0, int64_t m, int64_t width) {
      return Tensor(static_cast<uint16_t*>(t.data) + r0 * width, {m, width}, DType::kBF16,
                    Device::kCuda);
    };
    // Every row alone.
    Tensor alone = Out({kRows, s.n});
    for (int64_t r = 0; r < kRows; ++r) {
      cuda::LaunchFixedOrderGemm(rows(x, r, 1, s.k), w, bias, rows(alone, r, 1, s.n), stream,
                                 cuda::FixedOrderGemmVariant::kSplit);
    }
    const std::vector<uint16_t> want = Bits(alone, 0, kRows * s.n);
    // The values, for a few rows.
    for (int64_t r : {int64_t{0}, int64_t{137}, kRows - 1}) {
      for (int64_t n = 0; n < s.n; ++n) {
        double ref = s.bias ? Bf16ToF32(bh[n]) : 0.0, mag = std::fabs(ref);
        for (int64_t k = 0; k < s.k; ++k) {
          const double p = double(Bf16ToF32(xh[r * s.k + k])) * Bf16ToF32(wh[n * s.k + k]);
          ref += p;
          mag += std::fabs(p);
        }
        const double got = Bf16ToF32(want[r * s.n + n]);
        ASSERT_LE(std::fabs(got - ref), std::ldexp(std::fabs(ref), -7) + std::ldexp(mag, -12))
            << "row " << r << " column " << n;
      }
    }
    Tensor y = Out({kRows, s.n});
    for (int64_t m : ms) {
      for (auto variant :
           {cuda::FixedOrderGemmVariant::kAuto, cuda::FixedOrderGemmVariant::kSplit,
            cuda::FixedOrderGemmVariant::kSliced, cuda::FixedOrderGemmVariant::kTiled}) {
        const int64_t r0 = static_cast<int64_t>(rng_() % (kRows - m + 1));
        cuda::LaunchFixedOrderGemm(rows(x, r0, m, s.k), w, bias, rows(y, r0, m, s.n), stream,
                                   variant);
        const std::vector<uint16_t> got = Bits(y, r0 * s.n, m * s.n);
        EXPECT_EQ(std::memcmp(got.data(), want.data() + r0 * s.n, got.size() * 2), 0)
            << "M=" << m << " rows from " << r0 << ", variant " << static_cast<int>(variant);
      }
    }
    bufs_.clear();
  }
}

// cuBLASLt's fixed algorithm (deterministic mode) against one chain of mma.m16n8k16 per output
// over K in order (LaunchChainGemmReference, w in the A or the B operand): whether the unsplit
// cuBLASLt kernel's arithmetic is that chain, bit for bit.
TEST_F(DeterministicOpsTest, ChainGemmAgainstTheFixedCublasLtAlgorithm) {
  struct Shape {
    int64_t n, k;
  };
  const Shape shapes[] = {{12288, 4096}, {4096, 4096}, {22016, 4096}, {4096, 11008},
                          {32256, 4096}, {384, 256},   {256, 640}};
  cudaStream_t stream = static_cast<CudaOps*>(ops_.get())->stream();
  cuda::LtGemm lt;
  lt.set_fixed_algorithm(true);
  for (const Shape& s : shapes) {
    for (int64_t m : {int64_t{1}, int64_t{8}, int64_t{64}, int64_t{300}}) {
      Tensor x = Upload(RandomBf16Bits(rng_, size_t(m * s.k), 1.0f), {m, s.k});
      Tensor w = Upload(RandomBf16Bits(rng_, size_t(s.n * s.k), 0.05f), {s.n, s.k});
      Tensor y_lt = Out({m, s.n}), y_a = Out({m, s.n}), y_b = Out({m, s.n});
      lt.Run(x, w, nullptr, y_lt, stream);
      cuda::LaunchChainGemmReference(x, w, nullptr, y_a, /*weights_a=*/true, stream);
      cuda::LaunchChainGemmReference(x, w, nullptr, y_b, /*weights_a=*/false, stream);
      const auto lt_bits = Bits(y_lt, 0, m * s.n), a_bits = Bits(y_a, 0, m * s.n),
                 b_bits = Bits(y_b, 0, m * s.n);
      int64_t diff_a = 0, diff_b = 0, diff_ab = 0;
      for (int64_t i = 0; i < m * s.n; ++i) {
        diff_a += lt_bits[i] != a_bits[i];
        diff_b += lt_bits[i] != b_bits[i];
        diff_ab += a_bits[i] != b_bits[i];
      }
      std::cout << "N=" << s.n << " K=" << s.k << " M=" << m << " [" << lt.DescribePlan(m, s.n, s.k)
                << "] differ from cuBLASLt: w as A " << diff_a << ", w as B " << diff_b << " of "
                << m * s.n << " (A vs B " << diff_ab << ")" << std::endl;
      EXPECT_TRUE(diff_a == 0 || diff_b == 0) << "N=" << s.n << " K=" << s.k << " M=" << m;
      // Every pipeline configuration of the chain GEMV (tpserve-cuda-bench --chain compares their
      // speed; the others than 0 exist for M <= 2) has the fixed algorithm's bits too; at M = 1
      // also with the weight's tile-contiguous copy registered (config 0 then reads it too).
      auto check_configs = [&](bool tiled) {
        for (int c = 0; c < cuda::ChainGemvNumConfigs(m, tiled); ++c) {
          Tensor y_c = Out({m, s.n});
          cuda::LaunchChainGemv(x, w, nullptr, y_c, stream, c);
          const auto c_bits = Bits(y_c, 0, m * s.n);
          int64_t diff_c = 0;
          for (int64_t i = 0; i < m * s.n; ++i) diff_c += lt_bits[i] != c_bits[i];
          EXPECT_EQ(diff_c, 0) << "chain GEMV config " << c << (tiled ? " (tiled)" : "")
                               << ", N=" << s.n << " K=" << s.k << " M=" << m;
        }
      };
      check_configs(false);
      if (m == 1) {
        bufs_.emplace_back(ops_.get(), cuda::ChainTileBytes(s.n, s.k));
        cuda::MakeChainTiles(w, bufs_.back().get(), stream);
        cuda::RegisterChainTiles(w, bufs_.back().get());
        check_configs(true);
        cuda::UnregisterChainTiles(w.data);
      }
      bufs_.clear();
    }
  }
}

// One sequence's cache: `ctx` tokens in shuffled blocks of `pool`.
std::vector<int32_t> RandomTable(int ctx, int bs, std::vector<int32_t>& free_blocks) {
  std::vector<int32_t> t;
  for (int i = 0; i < (ctx + bs - 1) / bs; ++i) {
    t.push_back(free_blocks.back());
    free_blocks.pop_back();
  }
  return t;
}

struct SeqSpec {
  int qlen, ctx;
  std::vector<int32_t> table;
};

BatchMeta MetaOf(const std::vector<SeqSpec>& seqs, int bs, int width) {
  BatchMeta m;
  m.block_size = bs;
  m.max_blocks_per_seq = width;
  m.query_start.push_back(0);
  for (const SeqSpec& s : seqs) {
    for (int b = 0; b < width; ++b) {
      m.block_tables.push_back(b < static_cast<int>(s.table.size()) ? s.table[b] : -1);
    }
    for (int i = 0; i < s.qlen; ++i) {
      const int pos = s.ctx == 0 ? 0 : s.ctx - s.qlen + i;
      m.positions.push_back(pos);
      m.slot_mapping.push_back(s.ctx == 0 ? -1 : s.table[pos / bs] * bs + pos % bs);
      m.token_ids.push_back(0);
    }
    m.query_start.push_back(m.query_start.back() + s.qlen);
    m.context_lens.push_back(s.ctx);
    m.logits_rows.push_back(m.query_start.back() - 1);
  }
  m.num_seqs = static_cast<int>(seqs.size());
  m.num_tokens = m.query_start.back();
  return m;
}

// A prompt chunk of `chunk` tokens (positions ctx - chunk .. ctx - 1) run through
// AttentionPrefill beside other sequences, then each of its tokens as a decode step of a
// random batch (random others, a random place, a padded block-table width, padding
// sequences as CUDA graphs add): every token's output rows have the same bits. The batches
// take both decode forms of the bf16 tensor-core kernel: a block a split merged by the last
// (under kDecodeLoopMinBlocks blocks), and a block a (sequence, head group) looping over its
// splits (at 32 heads, batches of 32 and more).
TEST_F(DeterministicOpsTest, PrefillTokensEqualTheirDecodeSteps) {
  struct Case {
    int hq, hk, d, ctx, chunk;
    DType kv = DType::kBF16;
  };
  const Case cases[] = {
      {32, 32, 128, 700, 300},  // the 6.7B shape; > 256 tokens: two launches of token queries
      {32, 32, 128, 1300, 64},  // a later chunk of a long prompt
      {16, 2, 64, 513, 513},    // GQA, the whole prompt at once
      {16, 4, 128, 600, 250},   // GQA with 4 heads a block: groups of 2 tokens (bf16 mma)
      {8, 2, 32, 129, 40},      // tiny-coder's head_dim
      // Quantized caches (int4 at head_dim 128: two scale groups a head).
      {32, 32, 128, 400, 80, DType::kF8E4M3},
      {16, 2, 64, 300, 120, DType::kI8},
      {8, 2, 128, 700, 100, DType::kI4},
  };
  constexpr int kBs = 16, kPool = 1200;
  const bool env_mma = cuda::DeterministicDecodeMma();
  const bool env_loop = cuda::DeterministicSplitLoop();
  // A bf16 cache at head_dim 64 and 128 runs each of deterministic mode's two kernels (the
  // tensor-core one, TPSERVE_DETERMINISTIC_DECODE=mma, and the two-phase one).
  std::vector<std::pair<Case, bool>> runs;
  for (const Case& c : cases) {
    const bool both = c.kv == DType::kBF16 && c.d >= 64;
    runs.push_back({c, true});
    if (both) runs.push_back({c, false});
  }
  for (const auto& [c, mma] : runs) {
    cuda::SetDeterministicDecodeMma(mma);
    SCOPED_TRACE("heads " + std::to_string(c.hq) + "/" + std::to_string(c.hk) + " d " +
                 std::to_string(c.d) + " ctx " + std::to_string(c.ctx) + " kv " +
                 std::string(DTypeName(c.kv)) + (mma ? " mma" : " twophase"));
    const int qw = c.hq * c.d;
    std::vector<int32_t> free_blocks(kPool);
    std::iota(free_blocks.begin(), free_blocks.end(), 0);
    std::shuffle(free_blocks.begin(), free_blocks.end(), rng_);
    Tensor kc = UploadKv({kPool, kBs, c.hk, c.d}, c.kv);
    Tensor vc = UploadKv({kPool, kBs, c.hk, c.d}, c.kv);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    const SeqSpec target{c.chunk, c.ctx, RandomTable(c.ctx, kBs, free_blocks)};
    auto target_q = RandomBf16Bits(rng_, size_t{1} * c.chunk * qw, 1.0f);

    // The chunk among a prefill of another sequence and two decode rows.
    std::vector<SeqSpec> prefill = {{17, 90, RandomTable(90, kBs, free_blocks)},
                                    target,
                                    {1, 333, RandomTable(333, kBs, free_blocks)},
                                    {1, 5, RandomTable(5, kBs, free_blocks)}};
    size_t prefill_width = 0;  // every sequence's table fits, plus a few unused columns
    for (const SeqSpec& s : prefill) prefill_width = std::max(prefill_width, s.table.size());
    BatchMeta pm = MetaOf(prefill, kBs, static_cast<int>(prefill_width) + 3);
    const int t0 = pm.query_start[1];
    auto q_all = RandomBf16Bits(rng_, size_t{1} * pm.num_tokens * qw, 1.0f);
    std::copy(target_q.begin(), target_q.end(), q_all.begin() + size_t{1} * t0 * qw);
    ops_->SetBatch(pm);
    Tensor out = Out({pm.num_tokens, qw});
    Tensor gq = Upload(q_all, {pm.num_tokens, qw});
    ops_->AttentionPrefill(gq, kc, vc, c.hq, c.hk, c.d, scale, out);
    const std::vector<uint16_t> chunk_out = Bits(out, int64_t{t0} * qw, int64_t{c.chunk} * qw);
    if (mma && c.kv == DType::kBF16 && c.d >= 64) {
      // The tensor-core kernel's other prefill form (a block looping over a group's splits, or a
      // block a split merged through the workspace): the same bits.
      cuda::SetDeterministicSplitLoop(!env_loop);
      Tensor out2 = Out({pm.num_tokens, qw});
      ops_->AttentionPrefill(gq, kc, vc, c.hq, c.hk, c.d, scale, out2);
      cuda::SetDeterministicSplitLoop(env_loop);
      EXPECT_EQ(Bits(out2, int64_t{t0} * qw, int64_t{c.chunk} * qw), chunk_out)
          << "split loop " << !env_loop << " against " << env_loop;
    }

    int mismatched = 0;
    for (int i = 0; i < c.chunk; ++i) {
      // The first two steps fix one batch of each decode form (40 and 3 at 32 heads).
      const int batch = i == 0 ? 40 : i == 1 ? 3 : 1 + static_cast<int>(rng_() % 70);
      const int place = static_cast<int>(rng_() % batch);
      std::vector<SeqSpec> seqs;
      std::vector<int32_t> spare = free_blocks;
      for (int b = 0; b < batch; ++b) {
        if (b == place) {
          seqs.push_back({1, c.ctx - c.chunk + i + 1, target.table});
        } else if (rng_() % 8 == 0) {
          seqs.push_back({1, 0, {}});  // padding
        } else {
          const int ctx = 1 + static_cast<int>(rng_() % 200);
          seqs.push_back({1, ctx, RandomTable(ctx, kBs, spare)});
        }
      }
      // Wide enough for the target and the others (contexts up to 200), plus unused columns.
      const int width = std::max(c.ctx, 200) / kBs + 1 + static_cast<int>(rng_() % 40);
      BatchMeta dm = MetaOf(seqs, kBs, width);
      auto q = RandomBf16Bits(rng_, size_t{1} * batch * qw, 1.0f);
      std::copy(target_q.begin() + size_t{1} * i * qw, target_q.begin() + size_t{1} * (i + 1) * qw,
                q.begin() + size_t{1} * place * qw);
      ops_->SetBatch(dm);
      Tensor dout = Out({batch, qw});
      ops_->AttentionDecode(Upload(q, {batch, qw}), kc, vc, c.hq, c.hk, c.d, scale, dout);
      const std::vector<uint16_t> got = Bits(dout, int64_t{place} * qw, qw);
      if (std::memcmp(got.data(), chunk_out.data() + size_t{1} * i * qw, qw * 2) != 0) {
        if (mismatched++ < 3) {
          ADD_FAILURE() << "token " << i << " (batch " << batch << ", place " << place
                        << ") differs from its prefill row";
        }
      }
      bufs_.resize(bufs_.size() - 2);  // this step's q and output
    }
    EXPECT_EQ(mismatched, 0);
    bufs_.clear();
  }
  cuda::SetDeterministicDecodeMma(env_mma);
}

}  // namespace
}  // namespace tpserve
