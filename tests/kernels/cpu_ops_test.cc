// Each CPU reference op against a direct formula (double precision) on fresh random inputs.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "kernels/ops.h"
#include "kernels/philox.h"

namespace tpserve {
namespace {

std::vector<float> RandomVec(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

Tensor View(std::vector<float>& v, std::initializer_list<int64_t> shape) {
  return Tensor(v.data(), shape, DType::kF32);
}

double RelErr(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

class CpuOpsTest : public ::testing::Test {
 protected:
  std::unique_ptr<Ops> ops_ = MakeCpuOps();
  std::mt19937 rng_{1234};
};

TEST_F(CpuOpsTest, RmsNormMatchesFormula) {
  const int rows = 5, n = 67;
  auto x = RandomVec(rng_, rows * n), w = RandomVec(rng_, n);
  std::vector<float> out(rows * n, NAN);
  ops_->RmsNorm(View(x, {rows, n}), View(w, {n}), 1e-5f, View(out, {rows, n}));
  std::vector<double> want(rows * n);
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += double(x[r * n + i]) * x[r * n + i];
    const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int i = 0; i < n; ++i) want[r * n + i] = x[r * n + i] * inv * w[i];
  }
  EXPECT_LT(RelErr(out, want), 1e-6);
}

TEST_F(CpuOpsTest, AddRmsNormUpdatesResidual) {
  const int rows = 3, n = 32;
  auto res = RandomVec(rng_, rows * n), x = RandomVec(rng_, rows * n), w = RandomVec(rng_, n);
  auto res0 = res;
  std::vector<float> out(rows * n, NAN);
  ops_->AddRmsNorm(View(res, {rows, n}), View(x, {rows, n}), View(w, {n}), 1e-6f,
                   View(out, {rows, n}));
  std::vector<double> want_res(rows * n);
  for (int i = 0; i < rows * n; ++i) want_res[i] = double(res0[i]) + x[i];
  EXPECT_LT(RelErr(res, want_res), 1e-7);
  std::vector<float> ref(rows * n);
  ops_->RmsNorm(View(res, {rows, n}), View(w, {n}), 1e-6f, View(ref, {rows, n}));
  EXPECT_EQ(out, ref);
}

TEST_F(CpuOpsTest, GemmWithBiasMatchesFormula) {
  const int m = 7, k = 33, n = 19;
  auto x = RandomVec(rng_, m * k), w = RandomVec(rng_, n * k), b = RandomVec(rng_, n);
  std::vector<float> y(m * n, NAN);
  Tensor bias = View(b, {n});
  ops_->Gemm(View(x, {m, k}), View(w, {n, k}), &bias, View(y, {m, n}));
  std::vector<double> want(m * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double acc = b[j];
      for (int p = 0; p < k; ++p) acc += double(x[i * k + p]) * w[j * k + p];
      want[i * n + j] = acc;
    }
  EXPECT_LT(RelErr(y, want), 1e-6);
}

TEST_F(CpuOpsTest, SiluMulAndAdd) {
  const int rows = 4, inter = 13;
  auto gu = RandomVec(rng_, rows * 2 * inter);
  std::vector<float> out(rows * inter, NAN);
  ops_->SiluMul(View(gu, {rows, 2 * inter}), View(out, {rows, inter}));
  std::vector<double> want(rows * inter);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < inter; ++i) {
      const double g = gu[r * 2 * inter + i], u = gu[r * 2 * inter + inter + i];
      want[r * inter + i] = g / (1 + std::exp(-g)) * u;
    }
  EXPECT_LT(RelErr(out, want), 1e-6);

  auto a = RandomVec(rng_, 50), b = RandomVec(rng_, 50);
  std::vector<float> sum(50, NAN);
  ops_->Add(View(a, {50}), View(b, {50}), View(sum, {50}));
  for (int i = 0; i < 50; ++i) EXPECT_FLOAT_EQ(sum[i], a[i] + b[i]);
}

BatchMeta OneSeqMeta(const std::vector<int32_t>& ids, const std::vector<int32_t>& positions) {
  BatchMeta m;
  m.num_seqs = 1;
  m.num_tokens = static_cast<int>(ids.size());
  m.token_ids = ids;
  m.positions = positions;
  m.query_start = {0, m.num_tokens};
  m.context_lens = {m.num_tokens};
  return m;
}

TEST_F(CpuOpsTest, EmbeddingHonoursVocabShardOffset) {
  const int rows = 10, hidden = 6;
  auto table = RandomVec(rng_, rows * hidden);
  std::vector<float> out(4 * hidden, NAN);
  ops_->SetBatch(OneSeqMeta({20, 25, 29, 30}, {0, 1, 2, 3}));
  ops_->Embedding(View(table, {rows, hidden}), 20, View(out, {4, hidden}));
  for (int i = 0; i < hidden; ++i) {
    EXPECT_EQ(out[0 * hidden + i], table[0 * hidden + i]);
    EXPECT_EQ(out[1 * hidden + i], table[5 * hidden + i]);
    EXPECT_EQ(out[2 * hidden + i], table[9 * hidden + i]);
    EXPECT_EQ(out[3 * hidden + i], 0.0f);  // id 30 belongs to the next shard
  }
}

TEST_F(CpuOpsTest, RopeRotatesPairsByPositionTimesFrequency) {
  const int tokens = 3, heads = 2, kv_heads = 1, d = 8;
  RopeConfig rope;
  rope.theta = 100000;
  rope.scaling = RopeScalingType::kLinear;
  rope.factor = 4.0;
  auto inv = RopeInvFreq(rope, d);
  for (int i = 0; i < d / 2; ++i) {
    EXPECT_NEAR(inv[i], 1.0 / std::pow(100000.0, 2.0 * i / d) / 4.0, 1e-6 * inv[0]);
  }
  auto q = RandomVec(rng_, tokens * heads * d), k = RandomVec(rng_, tokens * kv_heads * d);
  auto q0 = q, k0 = k;
  std::vector<int32_t> pos = {0, 7, 1234};
  ops_->SetBatch(OneSeqMeta({1, 2, 3}, pos));
  ops_->Rope(View(q, {tokens, heads * d}), View(k, {tokens, kv_heads * d}), View(inv, {d / 2}), d);
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d / 2; ++i) {
        const double angle = double(pos[t]) * inv[i];
        const double a = q0[(t * heads + h) * d + i], b = q0[(t * heads + h) * d + i + d / 2];
        EXPECT_NEAR(q[(t * heads + h) * d + i], a * std::cos(angle) - b * std::sin(angle), 2e-4);
        EXPECT_NEAR(q[(t * heads + h) * d + i + d / 2], b * std::cos(angle) + a * std::sin(angle),
                    2e-4);
      }
  EXPECT_NE(k, k0);
}

// The fused op equals Rope then KvWrite on the q, k, v column blocks of qkv, and leaves the
// cache alone for padding slots (-1).
TEST_F(CpuOpsTest, RopeKvWriteEqualsRopeThenKvWrite) {
  const int tokens = 3, heads = 4, kv_heads = 2, d = 8, bs = 4, blocks = 3;
  const int qw = heads * d, kvw = kv_heads * d, width = qw + 2 * kvw;
  RopeConfig rope;
  auto inv = RopeInvFreq(rope, d);
  auto qkv = RandomVec(rng_, tokens * width);
  BatchMeta m = OneSeqMeta({1, 2, 3}, {5, 6, 7});
  m.slot_mapping = {9, -1, 2};
  std::vector<float> q(tokens * qw), k(tokens * kvw), v(tokens * kvw);
  for (int t = 0; t < tokens; ++t) {
    std::copy_n(qkv.begin() + t * width, qw, q.begin() + t * qw);
    std::copy_n(qkv.begin() + t * width + qw, kvw, k.begin() + t * kvw);
    std::copy_n(qkv.begin() + t * width + qw + kvw, kvw, v.begin() + t * kvw);
  }
  auto kc = RandomVec(rng_, blocks * bs * kvw), vc = RandomVec(rng_, blocks * bs * kvw);
  auto kc_want = kc, vc_want = vc;
  ops_->SetBatch(m);
  ops_->Rope(View(q, {tokens, qw}), View(k, {tokens, kvw}), View(inv, {d / 2}), d);
  for (int t : {0, 2}) {  // KvWrite has no padding slots
    std::copy_n(k.begin() + t * kvw, kvw, kc_want.begin() + m.slot_mapping[t] * kvw);
    std::copy_n(v.begin() + t * kvw, kvw, vc_want.begin() + m.slot_mapping[t] * kvw);
  }
  std::vector<float> q_out(tokens * qw, NAN);
  ops_->RopeKvWrite(View(qkv, {tokens, width}), View(inv, {d / 2}), heads, kv_heads, d,
                    View(q_out, {tokens, qw}), View(kc, {blocks, bs, kv_heads, d}),
                    View(vc, {blocks, bs, kv_heads, d}));
  EXPECT_EQ(q_out, q);
  EXPECT_EQ(kc, kc_want);
  EXPECT_EQ(vc, vc_want);
}

// The default SiluMulGemm is SiluMul then Gemm.
TEST_F(CpuOpsTest, SiluMulGemmEqualsSiluMulThenGemm) {
  const int m = 3, n = 5, k = 7;
  auto gu = RandomVec(rng_, m * 2 * k), w = RandomVec(rng_, n * k);
  std::vector<float> act(m * k), want(m * n), act2(m * k), got(m * n);
  ops_->SiluMul(View(gu, {m, 2 * k}), View(act, {m, k}));
  ops_->Gemm(View(act, {m, k}), View(w, {n, k}), nullptr, View(want, {m, n}));
  ops_->SiluMulGemm(View(gu, {m, 2 * k}), View(w, {n, k}), View(act2, {m, k}), View(got, {m, n}));
  EXPECT_EQ(got, want);
}

TEST(RopeInvFreqTest, Llama3KeepsHighFrequenciesAndScalesLowOnes) {
  RopeConfig rope;
  rope.theta = 500000;
  rope.scaling = RopeScalingType::kLlama3;
  rope.factor = 8;
  rope.low_freq_factor = 1;
  rope.high_freq_factor = 4;
  rope.original_max_position_embeddings = 8192;
  RopeConfig plain;
  plain.theta = 500000;
  auto scaled = RopeInvFreq(rope, 128), base = RopeInvFreq(plain, 128);
  EXPECT_FLOAT_EQ(scaled[0], base[0]);        // wavelength 2*pi: high frequency, kept
  EXPECT_FLOAT_EQ(scaled[63], base[63] / 8);  // longest wavelength: divided by factor
  int smoothed = 0;
  for (int i = 0; i < 64; ++i) {
    EXPECT_LE(scaled[i], base[i]);
    EXPECT_GE(scaled[i], base[i] / 8 * (1 - 1e-6));
    if (scaled[i] < base[i] && scaled[i] > base[i] / 8 * (1 + 1e-6)) ++smoothed;
  }
  EXPECT_GT(smoothed, 0);  // the band in between is interpolated
}

// Dense causal attention over explicit K/V of one sequence, in double.
std::vector<double> DenseAttention(const std::vector<float>& q, const std::vector<float>& k,
                                   const std::vector<float>& v, int qlen, int ctx, int heads,
                                   int kv_heads, int d, float scale) {
  std::vector<double> out(qlen * heads * d, 0.0);
  const int group = heads / kv_heads;
  for (int i = 0; i < qlen; ++i)
    for (int h = 0; h < heads; ++h) {
      const int limit = ctx - qlen + i;
      std::vector<double> s(limit + 1);
      double mx = -1e300;
      for (int j = 0; j <= limit; ++j) {
        double dot = 0;
        for (int x = 0; x < d; ++x)
          dot += double(q[(i * heads + h) * d + x]) * k[(j * kv_heads + h / group) * d + x];
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
      }
      double den = 0;
      for (double& e : s) den += (e = std::exp(e - mx));
      for (int j = 0; j <= limit; ++j)
        for (int x = 0; x < d; ++x)
          out[(i * heads + h) * d + x] += s[j] / den * v[(j * kv_heads + h / group) * d + x];
    }
  return out;
}

TEST_F(CpuOpsTest, PagedAttentionMatchesDenseForChunksAndDecode) {
  const int heads = 8, kv_heads = 2, d = 16, bs = 4, blocks = 16;
  const float scale = 1.0f / std::sqrt(float(d));
  // Two sequences: A has 9 cached tokens and 5 new ones (a prefill chunk), B decodes 1 token
  // after 6 cached. Blocks are scattered so the block table matters.
  const int ctx_a = 14, new_a = 5, ctx_b = 7, new_b = 1;
  std::vector<int32_t> table_a = {11, 3, 7, 0}, table_b = {5, 9};
  auto ka = RandomVec(rng_, ctx_a * kv_heads * d), va = RandomVec(rng_, ctx_a * kv_heads * d);
  auto kb = RandomVec(rng_, ctx_b * kv_heads * d), vb = RandomVec(rng_, ctx_b * kv_heads * d);
  std::vector<float> kc(blocks * bs * kv_heads * d, NAN), vc(kc.size(), NAN);
  auto slot = [&](const std::vector<int32_t>& t, int p) { return t[p / bs] * bs + p % bs; };
  // Write the whole context through KvWrite, as one batch of all tokens.
  BatchMeta w;
  w.num_seqs = 2;
  w.num_tokens = ctx_a + ctx_b;
  w.block_size = bs;
  for (int p = 0; p < ctx_a; ++p) w.slot_mapping.push_back(slot(table_a, p));
  for (int p = 0; p < ctx_b; ++p) w.slot_mapping.push_back(slot(table_b, p));
  w.positions.assign(w.num_tokens, 0);
  w.query_start = {0, ctx_a, ctx_a + ctx_b};
  w.context_lens = {ctx_a, ctx_b};
  ops_->SetBatch(w);
  std::vector<float> kall = ka, vall = va;
  kall.insert(kall.end(), kb.begin(), kb.end());
  vall.insert(vall.end(), vb.begin(), vb.end());
  ops_->KvWrite(View(kall, {w.num_tokens, kv_heads * d}), View(vall, {w.num_tokens, kv_heads * d}),
                View(kc, {blocks, bs, kv_heads, d}), View(vc, {blocks, bs, kv_heads, d}));

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
  auto q = RandomVec(rng_, m.num_tokens * heads * d);
  std::vector<float> out(q.size(), NAN);
  ops_->AttentionPrefill(View(q, {m.num_tokens, heads * d}), View(kc, {blocks, bs, kv_heads, d}),
                         View(vc, {blocks, bs, kv_heads, d}), heads, kv_heads, d, scale,
                         View(out, {m.num_tokens, heads * d}));
  std::vector<float> qa(q.begin(), q.begin() + new_a * heads * d);
  std::vector<float> qb(q.begin() + new_a * heads * d, q.end());
  auto want_a = DenseAttention(qa, ka, va, new_a, ctx_a, heads, kv_heads, d, scale);
  auto want_b = DenseAttention(qb, kb, vb, new_b, ctx_b, heads, kv_heads, d, scale);
  std::vector<double> want = want_a;
  want.insert(want.end(), want_b.begin(), want_b.end());
  EXPECT_LT(RelErr(out, want), 1e-6);

  // Decode-only batch: both sequences with one query token.
  BatchMeta dm = m;
  dm.num_tokens = 2;
  dm.query_start = {0, 1, 2};
  dm.positions = {0, 0};
  dm.slot_mapping = {0, 0};
  ops_->SetBatch(dm);
  auto dq = RandomVec(rng_, 2 * heads * d);
  std::vector<float> dout(dq.size(), NAN);
  ops_->AttentionDecode(View(dq, {2, heads * d}), View(kc, {blocks, bs, kv_heads, d}),
                        View(vc, {blocks, bs, kv_heads, d}), heads, kv_heads, d, scale,
                        View(dout, {2, heads * d}));
  std::vector<float> dqa(dq.begin(), dq.begin() + heads * d), dqb(dq.begin() + heads * d, dq.end());
  auto dwa = DenseAttention(dqa, ka, va, 1, ctx_a, heads, kv_heads, d, scale);
  auto dwb = DenseAttention(dqb, kb, vb, 1, ctx_b, heads, kv_heads, d, scale);
  dwa.insert(dwa.end(), dwb.begin(), dwb.end());
  EXPECT_LT(RelErr(dout, dwa), 1e-6);
}

TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    uint32_t ctr[4] = {k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3]};
    uint32_t key[2] = {k.key[0], k.key[1]};
    Philox4x32(ctr, key);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(ctr[i], k.out[i]) << "word " << i;
  }
}

TEST_F(CpuOpsTest, SamplingRules) {
  const int vocab = 50;
  auto logits = RandomVec(rng_, 3 * vocab, 2.0f);
  Tensor t = View(logits, {3, vocab});
  // Greedy = argmax of each row.
  std::vector<SamplingParams> greedy(3);
  auto ids = ops_->Sample(t, vocab, greedy);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ids[r],
              std::max_element(&logits[r * vocab], &logits[(r + 1) * vocab]) - &logits[r * vocab]);
  }
  // A positive temperature at or below kGreedyTemperature is greedy too (1e-38 used to overflow
  // logits / T to +-inf and pick the least likely token), whatever the seed.
  for (float tiny : {1e-38f, 1e-20f, kGreedyTemperature}) {
    std::vector<SamplingParams> cold(3);
    for (int r = 0; r < 3; ++r) {
      cold[r].temperature = tiny;
      cold[r].seed = 7 + r;
      cold[r].position = 100 + r;
    }
    EXPECT_EQ(ops_->Sample(t, vocab, cold), ids) << "temperature " << tiny;
  }
  // Padded columns past the vocabulary are never chosen.
  std::vector<float> padded(vocab + 6, -1.0f);
  padded[vocab + 2] = 100.0f;
  padded[3] = 1.0f;
  EXPECT_EQ(ops_->Sample(View(padded, {1, vocab + 6}), vocab, {SamplingParams{}})[0], 3);

  // top_k = 1 and tiny top_p reduce to greedy for any seed.
  for (uint64_t seed = 0; seed < 20; ++seed) {
    SamplingParams p;
    p.temperature = 1.5f;
    p.seed = seed;
    p.position = seed * 3;
    p.top_k = 1;
    EXPECT_EQ(ops_->Sample(t.rows(0, 1), vocab, {p})[0], ids[0]);
    p.top_k = 0;
    p.top_p = 1e-6f;
    EXPECT_EQ(ops_->Sample(t.rows(0, 1), vocab, {p})[0], ids[0]);
  }
  // Same (seed, position) gives the same draw; top_k = 5 only returns the 5 largest; the
  // empirical distribution over positions follows the softmax.
  std::vector<int> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  std::map<int, int> counts;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) {
    SamplingParams p;
    p.temperature = 1.0f;
    p.seed = 42;
    p.position = i;
    p.top_k = 5;
    const int id = ops_->Sample(t.rows(0, 1), vocab, {p})[0];
    EXPECT_EQ(id, ops_->Sample(t.rows(0, 1), vocab, {p})[0]);
    counts[id]++;
  }
  double z = 0;
  for (int i = 0; i < 5; ++i) z += std::exp(double(logits[order[i]]) - logits[order[0]]);
  for (int i = 0; i < 5; ++i) {
    const double expect = std::exp(double(logits[order[i]]) - logits[order[0]]) / z;
    EXPECT_NEAR(counts[order[i]] / double(draws), expect, 0.015) << "rank " << i;
  }
  int in_top5 = 0;
  for (int i = 0; i < 5; ++i) in_top5 += counts[order[i]];
  EXPECT_EQ(in_top5, draws);
}

// log_softmax of row[0, vocab) in double precision (optionally of row / temperature).
std::vector<double> LogSoftmax(const float* row, int vocab, double temperature = 1.0) {
  double m = -INFINITY;
  for (int i = 0; i < vocab; ++i) m = std::max(m, row[i] / temperature);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(row[i] / temperature - m);
  std::vector<double> out(vocab);
  for (int i = 0; i < vocab; ++i) out[i] = row[i] / temperature - m - std::log(sum);
  return out;
}

// The top n ids of `lp` by (logprob desc, id asc).
std::vector<int32_t> TopIds(const std::vector<double>& lp, int n) {
  std::vector<int32_t> order(lp.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return lp[a] > lp[b]; });
  order.resize(std::min<size_t>(n, order.size()));
  return order;
}

TEST_F(CpuOpsTest, SampleLogprobsAreTheRawLogSoftmaxOfTheChosenToken) {
  const int vocab = 37, width = 41, rows = 7;
  auto logits = RandomVec(rng_, rows * width, 3.0f);
  for (int r = 0; r < rows; ++r) {
    for (int c = vocab; c < width; ++c) logits[r * width + c] = 50.0f;  // padding never counts
  }
  // Row 5 has ties: ids 4, 9 and 30 share the maximum, 2 and 11 the next value.
  float* tied = &logits[5 * width];
  for (int c = 0; c < vocab; ++c) tied[c] = -1.0f - 0.01f * c;
  tied[30] = tied[9] = tied[4] = 2.5f;
  tied[11] = tied[2] = 1.0f;
  std::vector<SamplingParams> params(rows);
  params[0].logprobs = 5;  // greedy
  // Row 1: greedy, no logprobs.
  params[2].temperature = 0.7f, params[2].seed = 3, params[2].position = 11;
  params[2].logprobs = 3;
  params[3].temperature = 1.3f, params[3].top_k = 4, params[3].seed = 5, params[3].position = 2;
  params[3].logprobs = 0;
  params[4].temperature = 0.9f, params[4].top_p = 0.5f, params[4].seed = 8, params[4].position = 7;
  params[4].logprobs = kMaxLogprobs;
  params[5].logprobs = 6;                                                     // greedy over ties
  params[6].temperature = 2.0f, params[6].seed = 1, params[6].position = 40;  // sampled, none
  Tensor t = View(logits, {rows, width});
  std::vector<std::optional<TokenLogprobs>> lps;
  const std::vector<int32_t> ids = ops_->Sample(t, vocab, params, &lps);
  ASSERT_EQ(lps.size(), size_t{rows});

  // Asking for logprobs never changes the tokens.
  std::vector<SamplingParams> plain = params;
  for (SamplingParams& p : plain) p.logprobs = -1;
  EXPECT_EQ(ops_->Sample(t, vocab, plain), ids);
  EXPECT_FALSE(lps[1].has_value());
  EXPECT_FALSE(lps[6].has_value());

  for (int r = 0; r < rows; ++r) {
    if (params[r].logprobs < 0) continue;
    SCOPED_TRACE(::testing::Message() << "row " << r);
    ASSERT_TRUE(lps[r].has_value());
    ASSERT_GE(ids[r], 0);
    ASSERT_LT(ids[r], vocab);
    const std::vector<double> want = LogSoftmax(&logits[r * width], vocab);
    EXPECT_NEAR(lps[r]->logprob, want[ids[r]], 1e-5);
    const std::vector<int32_t> top = TopIds(want, params[r].logprobs);
    ASSERT_EQ(lps[r]->top.size(), top.size());
    for (size_t k = 0; k < top.size(); ++k) {
      EXPECT_EQ(lps[r]->top[k].id, top[k]) << "rank " << k;
      EXPECT_NEAR(lps[r]->top[k].logprob, want[top[k]], 1e-5) << "rank " << k;
    }
    if (params[r].temperature == 0 && !top.empty()) {
      EXPECT_EQ(lps[r]->top[0].id, ids[r]);
    }
  }
  EXPECT_TRUE(lps[3]->top.empty());  // N = 0: the chosen token's logprob only
  // Ties: id ascending among equal logprobs; greedy takes the lowest id of the maximum.
  EXPECT_EQ(ids[5], 4);
  std::vector<int32_t> tied_ids;
  for (const TokenLogprob& a : lps[5]->top) tied_ids.push_back(a.id);
  EXPECT_EQ(tied_ids, (std::vector<int32_t>{4, 9, 30, 2, 11, 0}));
  EXPECT_EQ(lps[5]->top[0].logprob, lps[5]->top[2].logprob);
  // The sampled rows report the raw distribution, not the tempered one (which differs).
  const std::vector<double> tempered = LogSoftmax(&logits[2 * width], vocab, 0.7);
  EXPECT_GT(std::abs(tempered[ids[2]] - lps[2]->logprob), 1e-3);
  // The top-k row's token is among its 4 best.
  const std::vector<int32_t> top4 = TopIds(LogSoftmax(&logits[3 * width], vocab), 4);
  EXPECT_NE(std::find(top4.begin(), top4.end(), ids[3]), top4.end());
}

TEST_F(CpuOpsTest, SampleLogprobsOfMoreAlternativesThanTheVocabulary) {
  std::vector<float> logits = {0.5f, -1.0f, 2.0f, 9.0f};  // vocab 3, one padded column
  SamplingParams p;
  p.logprobs = kMaxLogprobs;
  std::vector<std::optional<TokenLogprobs>> lps;
  EXPECT_EQ(ops_->Sample(View(logits, {1, 4}), 3, {p}, &lps)[0], 2);
  ASSERT_TRUE(lps[0].has_value());
  ASSERT_EQ(lps[0]->top.size(), 3u);
  double mass = 0;
  for (const TokenLogprob& a : lps[0]->top) mass += std::exp(double(a.logprob));
  EXPECT_NEAR(mass, 1.0, 1e-6);
  EXPECT_EQ(lps[0]->top[0].id, 2);
  EXPECT_EQ(lps[0]->top[1].id, 0);
  EXPECT_EQ(lps[0]->top[2].id, 1);
}

}  // namespace
}  // namespace tpserve
