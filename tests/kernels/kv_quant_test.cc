// The quantized KV cache on the CPU reference: the e4m3 codec against a brute-force nearest
// value, the int8/int4 error bounds, the pool sizes, and the CPU ops (KvWrite, RopeKvWrite,
// attention) over quantized pools against the same ops over f32 pools holding the dequantized
// values.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/kv_quant.h"
#include "kernels/ops.h"
#include "worker/kv_cache.h"

namespace tpserve {
namespace {

// Every finite e4m3 value, indexed by code (NaN codes 0x7f, 0xff excluded by the callers).
float CodeValue(int c) { return E4M3ToFloat(static_cast<uint8_t>(c)); }

// The nearest finite e4m3 code by brute force: ties to the even code, saturating at 448.
uint8_t NearestE4M3(float x) {
  if (std::fabs(x) >= 448.0f) return x > 0 ? 0x7e : 0xfe;
  int best = -1;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    if ((c & 0x80) != (std::signbit(x) ? 0x80 : 0)) continue;  // same sign (keeps -0 -> 0x80)
    const double d = std::fabs(static_cast<double>(CodeValue(c)) - x);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(KvQuantTest, E4M3DecodesTheFormat) {
  EXPECT_EQ(E4M3ToFloat(0x00), 0.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(E4M3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0xfe), -448.0f);
  EXPECT_TRUE(std::isnan(E4M3ToFloat(0x7f)));
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(FloatToE4M3(CodeValue(c)), c) << "code " << c << " does not round-trip";
  }
}

TEST(KvQuantTest, E4M3EncodesToTheNearestValueTiesToEvenSaturating) {
  // Midpoints: 1.0625 lies between 1.0 (0x38) and 1.125 (0x39): even 0x38; 1.1875 between
  // 0x39 and 1.25 (0x3a): even 0x3a. Subnormal midpoints: 0.5 and 1.5 units of 2^-9.
  EXPECT_EQ(FloatToE4M3(1.0625f), 0x38);
  EXPECT_EQ(FloatToE4M3(1.1875f), 0x3a);
  EXPECT_EQ(FloatToE4M3(std::ldexp(0.5f, -9)), 0x00);
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.5f, -9)), 0x02);
  EXPECT_EQ(FloatToE4M3(464.0f), 0x7e);  // the midpoint to the (absent) 480 saturates
  EXPECT_EQ(FloatToE4M3(1e30f), 0x7e);
  EXPECT_EQ(FloatToE4M3(-INFINITY), 0xfe);
  EXPECT_EQ(FloatToE4M3(NAN) & 0x7f, 0x7f);
  // Every midpoint between neighbouring codes, and random values over the whole range.
  for (int c = 0; c < 0x7e; ++c) {
    const float mid = (CodeValue(c) + CodeValue(c + 1)) / 2;  // exact in f32
    EXPECT_EQ(FloatToE4M3(mid), NearestE4M3(mid)) << "midpoint " << mid;
    EXPECT_EQ(FloatToE4M3(-mid), NearestE4M3(-mid)) << "midpoint " << -mid;
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-14.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::exp2(exponent(rng)) * (i % 2 ? -1.0f : 1.0f);
    ASSERT_EQ(FloatToE4M3(x), NearestE4M3(x)) << "x = " << x;
  }
}

// The extreme of x[begin, end) by brute force: the largest magnitude, the negative one of a tie.
float GroupExtreme(const std::vector<float>& x, int begin, int end) {
  float m = 0.0f;
  for (int i = begin; i < end; ++i) {
    if (std::fabs(x[i]) > std::fabs(m) || (std::fabs(x[i]) == std::fabs(m) && x[i] < m)) m = x[i];
  }
  return m;
}

// fp8 / int8: scale = absmax / qmax, every element within half a step (fp8: half an e4m3 ulp).
// int4: the extreme m reads back exactly as code 0 (q = -8), scale = -m / 8, every element
// within half a step |scale| / 2, except the other side's elements past 7.5 steps, which clamp
// to 7 steps: within one step.
TEST(KvQuantTest, EveryElementIsWithinItsBoundOfItsGroupScale) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (DType t : {DType::kI8, DType::kI4, DType::kF8E4M3}) {
    for (int d : {32, 64, 128}) {
      for (float outlier : {40.0f, -40.0f}) {  // an outlier channel, as keys have
        std::vector<float> x(d), back(d);
        for (float& v : x) v = dist(rng);
        x[5] = outlier;
        if (d == 128) {  // int4: a group whose extreme is a tie of both signs
          x[70] = x[80] = std::fabs(x[70]) + 20.0f;
          x[100] = -x[70];
        }
        const int groups = KvScaleGroups(t, d), group = KvScaleGroup(t, d);
        ASSERT_EQ(groups * group, d);
        EXPECT_EQ(groups, t == DType::kI4 ? std::max(1, d / kKvInt4Group) : 1);
        std::vector<uint8_t> codes(d);
        std::vector<float> scales(groups);
        QuantizeKvHead(t, x.data(), d, codes.data(), scales.data());
        DequantizeKvHead(t, codes.data(), scales.data(), d, back.data());
        for (int g = 0; g < groups; ++g) {
          const float m = GroupExtreme(x, g * group, (g + 1) * group);
          SCOPED_TRACE(testing::Message()
                       << DTypeName(t) << " d " << d << " group " << g << " extreme " << m);
          if (t == DType::kI4) {
            EXPECT_EQ(scales[g], -m / 8);  // exact
          } else {
            EXPECT_FLOAT_EQ(scales[g], std::fabs(m) / KvQuantMax(t));
          }
          const float step = std::fabs(scales[g]);
          for (int i = g * group; i < (g + 1) * group; ++i) {
            if (t == DType::kI4 && x[i] == m) {
              EXPECT_EQ((codes[i / 2] >> (4 * (i & 1))) & 15, 0) << "the extreme is q = -8";
              EXPECT_EQ(back[i], m);
            }
            // int: half a step of the scale (plus the f32 rounding of x * inv), a clamped int4
            // element one step; fp8: half an e4m3 ulp of the scaled value (2^-4 relative), or
            // half a subnormal step.
            float bound = step * 0.5001f;
            if (t == DType::kF8E4M3) {
              bound = std::max(std::fabs(x[i]) / 16.0f, step * 0x1p-10f) * 1.001f;
            } else if (t == DType::kI4 && x[i] / scales[g] > 7.5f) {
              bound = step * 1.0001f;
              EXPECT_EQ(back[i], 7 * scales[g]);
            }
            EXPECT_LE(std::fabs(back[i] - x[i]), bound)
                << "element " << i << ": " << x[i] << " -> " << back[i];
          }
        }
        if (t == DType::kI4 && d == 128) {
          // Group 1's extreme is the tie of x[70] = x[80] and x[100] = -x[70]: the negative one
          // maps to -8 (a positive scale), the positive ones clamp to 7.
          EXPECT_GT(scales[1], 0.0f);
          EXPECT_EQ(back[100], x[100]);
          EXPECT_EQ(back[70], 7 * scales[1]);
        }
      }
    }
  }
  // An all-zero group: scale +0 (not -0), reads back as zeros.
  for (DType t : {DType::kI8, DType::kI4}) {
    std::vector<float> zeros(64, 0.0f), back(64, 1.0f);
    zeros[3] = -0.0f;
    std::vector<uint8_t> codes(64);
    float scale = -1;
    QuantizeKvHead(t, zeros.data(), 64, codes.data(), &scale);
    DequantizeKvHead(t, codes.data(), &scale, 64, back.data());
    EXPECT_EQ(scale, 0.0f);
    EXPECT_FALSE(std::signbit(scale)) << DTypeName(t);
    EXPECT_EQ(back, std::vector<float>(64, 0.0f));
  }
}

// KvExtreme is order-free: a sequential fold (QuantizeKvHead), the same fold backwards and a
// warp's xor-shuffle tree over 32 lanes of 1, 2 or 4 elements (kv_quant.cuh) give the same
// bits, with ties of both signs, repeated values, zeros of both signs and NaNs mixed in.
TEST(KvQuantTest, ExtremeIsTheSameInAnyReductionOrder) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> pick(-6, 6);
  for (int epl : {1, 2, 4}) {
    for (int trial = 0; trial < 2000; ++trial) {
      const int n = 32 * epl;
      std::vector<float> x(n);
      for (float& v : x) {
        const int p = pick(rng);  // a few magnitudes only: many ties
        v = p == 0 ? (rng() % 2 ? -0.0f : 0.0f) : static_cast<float>(p) * 0.75f;
      }
      if (trial % 7 == 0) x[rng() % n] = NAN;
      float forward = 0.0f, backward = 0.0f;
      for (int i = 0; i < n; ++i) forward = KvExtreme(forward, x[i]);
      for (int i = n - 1; i >= 0; --i) backward = KvExtreme(backward, x[i]);
      std::vector<float> lane(32, 0.0f);
      for (int l = 0; l < 32; ++l)
        for (int e = 0; e < epl; ++e) lane[l] = KvExtreme(lane[l], x[l * epl + e]);
      for (int o = 16; o > 0; o >>= 1) {
        std::vector<float> next(32);
        for (int l = 0; l < 32; ++l) next[l] = KvExtreme(lane[l], lane[l ^ o]);
        lane = next;
      }
      std::vector<float> finite;
      for (float v : x)
        if (!std::isnan(v)) finite.push_back(v);
      const float want = GroupExtreme(finite, 0, static_cast<int>(finite.size()));
      ASSERT_EQ(std::fabs(forward), std::fabs(want));
      if (want != 0.0f) {
        ASSERT_EQ(forward, want);
      }
      for (float got : {backward, lane[0], lane[31]}) {
        // Bit for bit, except the sign of a zero extreme (fminf(+0, -0) may be either), which
        // KvScale and KvInvScale map to +0 and 0 alike.
        if (want == 0.0f) {
          ASSERT_EQ(got, 0.0f);
          ASSERT_EQ(KvScale(DType::kI4, got), 0.0f);
          ASSERT_FALSE(std::signbit(KvScale(DType::kI4, got)));
        } else {
          ASSERT_EQ(std::memcmp(&got, &forward, sizeof(float)), 0)
              << "epl " << epl << " trial " << trial << ": " << got << " vs " << forward;
        }
      }
    }
  }
}

// Why int4 maps the extreme to -8: 16 levels instead of the 15 of a symmetric [-7, 7] grid.
// Over many Gaussian groups of 32 the squared error is about 0.8 of the symmetric grid's (the
// step shrinks by 7/8; the other side's elements past 7.5 steps clamp).
TEST(KvQuantTest, Int4SixteenLevelsBeatTheSymmetricGrid) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  double err16 = 0, err15 = 0;
  std::vector<float> x(32), back(32);
  std::vector<uint8_t> codes(16);
  for (int trial = 0; trial < 4000; ++trial) {
    for (float& v : x) v = dist(rng);
    float scale;
    QuantizeKvHead(DType::kI4, x.data(), 32, codes.data(), &scale);
    DequantizeKvHead(DType::kI4, codes.data(), &scale, 32, back.data());
    float absmax = 0;
    for (float v : x) absmax = std::max(absmax, std::fabs(v));
    for (int i = 0; i < 32; ++i) {
      err16 += (back[i] - x[i]) * static_cast<double>(back[i] - x[i]);
      const float sym = std::clamp(std::rint(x[i] * 7 / absmax), -7.0f, 7.0f) * (absmax / 7);
      err15 += (sym - x[i]) * static_cast<double>(sym - x[i]);
    }
  }
  std::printf("int4 squared error: 16 levels / symmetric 15 levels = %.3f\n", err16 / err15);
  EXPECT_LT(err16, 0.85 * err15);
}

TEST(KvQuantTest, PoolSizesCountScalesAndGiveTheCapacityGains) {
  // DeepSeek-Coder-6.7B: 32 layers, 32 KV heads of 128, blocks of 16 tokens.
  const size_t bf16 = KvCache::BlockBytes(32, 16, 32, 128, DType::kBF16);
  EXPECT_EQ(bf16, 2ull * 32 * 16 * 32 * 128 * 2);
  const size_t fp8 = KvCache::BlockBytes(32, 16, 32, 128, DType::kF8E4M3);
  const size_t int8 = KvCache::BlockBytes(32, 16, 32, 128, DType::kI8);
  const size_t int4 = KvCache::BlockBytes(32, 16, 32, 128, DType::kI4);
  EXPECT_EQ(fp8, 2ull * 32 * 16 * 32 * (128 + 4));  // one f32 scale per token and head
  EXPECT_EQ(int8, fp8);
  EXPECT_EQ(int4, 2ull * 32 * 16 * 32 * (64 + 8));  // two f32 scales per token and head
  // Tokens per byte against bf16: 256 / 132 = 1.94x, 256 / 72 = 3.56x.
  EXPECT_NEAR(static_cast<double>(bf16) / fp8, 1.939, 1e-3);
  EXPECT_NEAR(static_cast<double>(bf16) / int4, 3.556, 1e-3);

  std::unique_ptr<Ops> ops = MakeCpuOps();
  KvCache cache(ops.get(), 2, 3, 16, 2, 64, DType::kI4);
  const Tensor k = cache.k(1);
  EXPECT_EQ(k.dtype, DType::kI4);
  EXPECT_EQ(k.bytes(), 3u * 16 * 2 * 64 / 2);
  ASSERT_NE(k.scales, nullptr);
  EXPECT_GE(static_cast<char*>(k.scales), static_cast<char*>(k.data) + k.bytes());
  EXPECT_LE(static_cast<char*>(cache.v(1).scales) + 3 * 16 * 2 * sizeof(float),
            static_cast<char*>(cache.k(0).data) + cache.bytes());
  EXPECT_EQ(KvCache(ops.get(), 2, 3, 16, 2, 64, DType::kF32).k(0).scales, nullptr);
}

// A CPU pool of `dtype` (quantized with scales, or f32) and an f32 pool that holds what the
// quantized one reads back as.
struct Pool {
  Pool(DType dtype, int blocks, int bs, int heads, int d)
      : t(dtype), n(static_cast<int64_t>(blocks) * bs * heads * d), shape{blocks, bs, heads, d} {
    bytes.assign(static_cast<size_t>(n * DTypeBits(t) / 8), 0);
    scales.assign(static_cast<size_t>(blocks) * bs * heads * KvScaleGroups(t, d), 0.0f);
  }
  Tensor View() {
    Tensor v(bytes.data(), {shape[0], shape[1], shape[2], shape[3]}, t);
    if (IsQuantizedKv(t)) v.scales = scales.data();
    return v;
  }
  // The dequantized contents as an f32 pool.
  std::vector<float> Dequantized() const {
    const int d = static_cast<int>(shape[3]);
    std::vector<float> out(static_cast<size_t>(n));
    for (int64_t h = 0; h < n / d; ++h) {
      DequantizeKvHead(t, bytes.data() + KvByteOffset(t, h * d),
                       scales.data() + h * KvScaleGroups(t, d), d, out.data() + h * d);
    }
    return out;
  }
  DType t;
  int64_t n;
  int64_t shape[4];
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
};

std::vector<float> Randn(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

class QuantizedKvOpsTest : public ::testing::TestWithParam<DType> {
 protected:
  std::unique_ptr<Ops> ops_ = MakeCpuOps();
  std::mt19937 rng_{99};
};

// RopeKvWrite into a quantized pool stores exactly what RopeKvWrite into an f32 pool stores,
// quantized head by head; KvWrite likewise.
TEST_P(QuantizedKvOpsTest, WritesQuantizeWhatTheF32WritesStore) {
  const DType t = GetParam();
  ASSERT_TRUE(ops_->SupportsKvCacheDType(t));
  const int tokens = 3, heads = 4, kv_heads = 2, d = 128, bs = 4, blocks = 3;
  const int qw = heads * d, kvw = kv_heads * d, width = qw + 2 * kvw;
  std::vector<float> inv = RopeInvFreq(RopeConfig(), d);
  std::vector<float> qkv = Randn(rng_, tokens * width);
  BatchMeta m;
  m.num_seqs = 1;
  m.num_tokens = tokens;
  m.positions = {5, 6, 7};
  m.slot_mapping = {9, -1, 2};
  m.query_start = {0, tokens};
  m.context_lens = {8};
  m.block_size = bs;
  ops_->SetBatch(m);
  std::vector<float> q_f32(tokens * qw), q_quant(tokens * qw);
  std::vector<float> kf(blocks * bs * kvw, 0.0f), vf(kf.size(), 0.0f);
  Pool kq(t, blocks, bs, kv_heads, d), vq(t, blocks, bs, kv_heads, d);
  Tensor qkv_t(qkv.data(), {tokens, width}, DType::kF32);
  Tensor inv_t(inv.data(), {d / 2}, DType::kF32);
  ops_->RopeKvWrite(qkv_t, inv_t, heads, kv_heads, d,
                    Tensor(q_f32.data(), {tokens, qw}, DType::kF32),
                    Tensor(kf.data(), {blocks, bs, kv_heads, d}, DType::kF32),
                    Tensor(vf.data(), {blocks, bs, kv_heads, d}, DType::kF32));
  ops_->RopeKvWrite(qkv_t, inv_t, heads, kv_heads, d,
                    Tensor(q_quant.data(), {tokens, qw}, DType::kF32), kq.View(), vq.View());
  EXPECT_EQ(q_quant, q_f32);
  Pool kw(t, blocks, bs, kv_heads, d), vw(t, blocks, bs, kv_heads, d);
  for (int slot : {9, 2}) {
    for (int h = 0; h < kv_heads; ++h) {
      const int64_t head = static_cast<int64_t>(slot) * kv_heads + h;
      const int groups = KvScaleGroups(t, d);
      QuantizeKvHead(t, kf.data() + head * d, d, kw.bytes.data() + KvByteOffset(t, head * d),
                     kw.scales.data() + head * groups);
      QuantizeKvHead(t, vf.data() + head * d, d, vw.bytes.data() + KvByteOffset(t, head * d),
                     vw.scales.data() + head * groups);
    }
  }
  EXPECT_EQ(kq.bytes, kw.bytes);
  EXPECT_EQ(kq.scales, kw.scales);
  EXPECT_EQ(vq.bytes, vw.bytes);
  EXPECT_EQ(vq.scales, vw.scales);

  // KvWrite (no padding slots): the same quantization of the given rows.
  BatchMeta w = m;
  w.slot_mapping = {9, 0, 2};
  ops_->SetBatch(w);
  std::vector<float> k(tokens * kvw), v(tokens * kvw);
  for (int i = 0; i < tokens; ++i) {
    std::copy_n(qkv.begin() + i * width + qw, kvw, k.begin() + i * kvw);
    std::copy_n(qkv.begin() + i * width + qw + kvw, kvw, v.begin() + i * kvw);
  }
  Pool kk(t, blocks, bs, kv_heads, d), vk(t, blocks, bs, kv_heads, d);
  ops_->KvWrite(Tensor(k.data(), {tokens, kvw}, DType::kF32),
                Tensor(v.data(), {tokens, kvw}, DType::kF32), kk.View(), vk.View());
  const int groups = KvScaleGroups(t, d);
  for (int i = 0; i < tokens; ++i) {
    for (int h = 0; h < kv_heads; ++h) {
      const int64_t head = static_cast<int64_t>(w.slot_mapping[i]) * kv_heads + h;
      std::vector<uint8_t> codes(d);
      std::vector<float> scales(groups);
      QuantizeKvHead(t, v.data() + i * kvw + h * d, d, codes.data(), scales.data());
      EXPECT_EQ(0, std::memcmp(codes.data(), vk.bytes.data() + KvByteOffset(t, head * d),
                               d * DTypeBits(t) / 8));
      EXPECT_EQ(scales[0], vk.scales[head * groups]);
    }
  }
}

// Attention over a quantized pool is attention over the values it reads back as (bit for bit:
// the CPU dequantizes with the same function), and stays close to attention over the
// unquantized values: within the bounds below for normal keys and values.
TEST_P(QuantizedKvOpsTest, AttentionReadsTheDequantizedValues) {
  const DType t = GetParam();
  const int heads = 8, kv_heads = 2, d = 128, bs = 4, blocks = 16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // Sequence A: 14 cached tokens, 5 of them new (a prefill chunk); B decodes after 6 cached.
  const int ctx_a = 14, new_a = 5, ctx_b = 7, new_b = 1;
  const std::vector<int32_t> table_a = {11, 3, 7, 0}, table_b = {5, 9};
  BatchMeta w;
  w.num_seqs = 2;
  w.num_tokens = ctx_a + ctx_b;
  w.block_size = bs;
  for (int p = 0; p < ctx_a; ++p) w.slot_mapping.push_back(table_a[p / bs] * bs + p % bs);
  for (int p = 0; p < ctx_b; ++p) w.slot_mapping.push_back(table_b[p / bs] * bs + p % bs);
  w.positions.assign(w.num_tokens, 0);
  w.query_start = {0, ctx_a, ctx_a + ctx_b};
  w.context_lens = {ctx_a, ctx_b};
  ops_->SetBatch(w);
  std::vector<float> k = Randn(rng_, w.num_tokens * kv_heads * d);
  std::vector<float> v = Randn(rng_, k.size());
  const Tensor kt(k.data(), {w.num_tokens, kv_heads * d}, DType::kF32);
  const Tensor vt(v.data(), {w.num_tokens, kv_heads * d}, DType::kF32);
  Pool kq(t, blocks, bs, kv_heads, d), vq(t, blocks, bs, kv_heads, d);
  ops_->KvWrite(kt, vt, kq.View(), vq.View());
  std::vector<float> kexact(blocks * bs * kv_heads * d, 0.0f), vexact(kexact.size(), 0.0f);
  ops_->KvWrite(kt, vt, Tensor(kexact.data(), {blocks, bs, kv_heads, d}, DType::kF32),
                Tensor(vexact.data(), {blocks, bs, kv_heads, d}, DType::kF32));
  std::vector<float> kdq = kq.Dequantized(), vdq = vq.Dequantized();
  auto f32 = [&](std::vector<float>& pool) {
    return Tensor(pool.data(), {blocks, bs, kv_heads, d}, DType::kF32);
  };

  BatchMeta m;
  m.num_seqs = 2;
  m.num_tokens = new_a + new_b;
  m.block_size = bs;
  m.query_start = {0, new_a, new_a + new_b};
  m.context_lens = {ctx_a, ctx_b};
  m.max_blocks_per_seq = 4;
  m.block_tables = {11, 3, 7, 0, 5, 9, -1, -1};
  m.positions.assign(m.num_tokens, 0);
  m.slot_mapping.assign(m.num_tokens, 0);
  ops_->SetBatch(m);
  std::vector<float> q = Randn(rng_, m.num_tokens * heads * d);
  const Tensor qt(q.data(), {m.num_tokens, heads * d}, DType::kF32);
  std::vector<float> out(q.size()), out_dq(q.size()), out_exact(q.size());
  auto view = [&](std::vector<float>& o) {
    return Tensor(o.data(), {m.num_tokens, heads * d}, DType::kF32);
  };
  ops_->AttentionPrefill(qt, kq.View(), vq.View(), heads, kv_heads, d, scale, view(out));
  ops_->AttentionPrefill(qt, f32(kdq), f32(vdq), heads, kv_heads, d, scale, view(out_dq));
  ops_->AttentionPrefill(qt, f32(kexact), f32(vexact), heads, kv_heads, d, scale, view(out_exact));
  EXPECT_EQ(out, out_dq);
  // The quantization error of the output, measured on this data: int8 0.0083, fp8 0.032,
  // int4 0.121 (16 levels; 0.143 with the symmetric 15 it had before); random normal keys spread
  // attention thinly; bounds 2x above.
  const double bound = t == DType::kI8 ? 0.017 : (t == DType::kF8E4M3 ? 0.065 : 0.25);
  const double err = RelErr(out, out_exact);
  EXPECT_LT(err, bound) << DTypeName(t);
  std::printf("%s: attention output relative error vs the f32 cache %.4f\n",
              std::string(DTypeName(t)).c_str(), err);

  BatchMeta dm = m;
  dm.num_tokens = 2;
  dm.query_start = {0, 1, 2};
  dm.positions = {0, 0};
  dm.slot_mapping = {0, 0};
  ops_->SetBatch(dm);
  std::vector<float> dq = Randn(rng_, 2 * heads * d), dout(dq.size()), dout_dq(dq.size());
  const Tensor dqt(dq.data(), {2, heads * d}, DType::kF32);
  ops_->AttentionDecode(dqt, kq.View(), vq.View(), heads, kv_heads, d, scale,
                        Tensor(dout.data(), {2, heads * d}, DType::kF32));
  ops_->AttentionDecode(dqt, f32(kdq), f32(vdq), heads, kv_heads, d, scale,
                        Tensor(dout_dq.data(), {2, heads * d}, DType::kF32));
  EXPECT_EQ(dout, dout_dq);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizedKvOpsTest,
                         ::testing::Values(DType::kF8E4M3, DType::kI8, DType::kI4),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(KvCacheDTypeName(info.param));
                         });

TEST(KvCacheDTypeTest, ParsesTheFlagAndTheCpuRefusesBf16) {
  EXPECT_FALSE(ParseKvCacheDType("auto")->has_value());
  EXPECT_EQ(**ParseKvCacheDType("fp8"), DType::kF8E4M3);
  EXPECT_EQ(**ParseKvCacheDType("int8"), DType::kI8);
  EXPECT_EQ(**ParseKvCacheDType("int4"), DType::kI4);
  EXPECT_EQ(**ParseKvCacheDType("bf16"), DType::kBF16);
  const auto bad = ParseKvCacheDType("fp4");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("auto, bf16, fp32, fp8, int8 or int4"), std::string::npos);
  std::unique_ptr<Ops> ops = MakeCpuOps();
  EXPECT_TRUE(ops->SupportsKvCacheDType(DType::kF32));
  EXPECT_FALSE(ops->SupportsKvCacheDType(DType::kBF16));
}

}  // namespace
}  // namespace tpserve
