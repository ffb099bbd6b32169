// Decode attention over the paged KV cache (one query per sequence), flash-decoding style:
// the context is cut into partitions (DecodePartition keys), one block per (partition, group
// of G query heads sharing a KV head, sequence); a second kernel merges the partitions with
// their softmax maxima and sums. K and V are each read once with 16-byte loads; fp32 math.
// The grid depends only on (num_seqs, max_blocks_per_seq), so a decode step can be captured
// in a CUDA graph and replayed for any context lengths up to that capacity.
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kSub = 64;  // keys whose K and V are in flight at once (sub-tile kernel)
constexpr int kMaxTwoPhasePartition = 256;
constexpr float kLog2e = 1.4426950408889634f;

// Large batches: one block per split of up to 256 keys, three phases (all scores, softmax, PV)
// with few registers, so that many blocks stay resident and their loads overlap.
template <int kD, int kG>
__global__ void __launch_bounds__(kThreads)
    DecodeTwoPhaseKernel(const __nv_bfloat16* __restrict__ q,
                         const __nv_bfloat16* __restrict__ k_cache,
                         const __nv_bfloat16* __restrict__ v_cache,
                         const int32_t* __restrict__ query_start,
                         const int32_t* __restrict__ context_lens,
                         const int32_t* __restrict__ block_tables, int max_blocks_per_seq,
                         int block_size, int num_heads, int num_kv_heads, int partition,
                         float scale_log2, float* __restrict__ workspace) {
  constexpr int kLanesPerToken = kD / 8;                     // 16-byte chunks per row
  constexpr int kTokensPerStep = kThreads / kLanesPerToken;  // tokens read per block step
  constexpr int kUnroll = 4;
  __shared__ float q_s[kG][kD];
  __shared__ float p_s[kG][kMaxTwoPhasePartition];
  __shared__ float o_s[kG][kD];
  __shared__ float m_s[kG], l_s[kG];

  const int split = blockIdx.x, group = blockIdx.y, seq = blockIdx.z;
  const int num_splits = gridDim.x;
  const int ctx = context_lens[seq];
  const int start = split * partition;
  if (start >= ctx) return;
  const int n = min(partition, ctx - start);
  const int head0 = group * kG;
  const int kv_head = head0 / (num_heads / num_kv_heads);
  const int tid = threadIdx.x;
  const int64_t q_row = query_start[seq];
  const int32_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;

  for (int i = tid; i < kG * kD; i += kThreads) {
    int g = i / kD, d = i % kD;
    q_s[g][d] = __bfloat162float(q[(q_row * num_heads + head0 + g) * kD + d]) * scale_log2;
    o_s[g][d] = 0.0f;
  }
  __syncthreads();

  const int chunk = tid % kLanesPerToken, tok_lane = tid / kLanesPerToken;
  auto row_ptr = [&](const __nv_bfloat16* cache, int tok) {
    int pos = start + tok;
    int64_t page = table[pos / block_size];
    int64_t slot = page * block_size + pos % block_size;
    return cache + (slot * num_kv_heads + kv_head) * kD + chunk * 8;
  };

  // Phase 1: scores (log2 domain) of the partition's keys.
  float qf[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[g][e] = q_s[g][chunk * 8 + e];
  }
  for (int base = 0; base < n; base += kTokensPerStep * kUnroll) {
    uint4 kv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = base + u * kTokensPerStep + tok_lane;
      kv[u] = tok < n ? LoadStreaming(row_ptr(k_cache, tok)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = base + u * kTokensPerStep + tok_lane;
      float kf[8];
      Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&kv[u]), kf);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(qf[g][e], kf[e], s);
#pragma unroll
        for (int o = kLanesPerToken / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (chunk == 0 && tok < n) p_s[g][tok] = s;
      }
    }
  }
  __syncthreads();

  // Phase 2: softmax numerators of the partition, per head (one warp per head).
  const int warp = tid / 32, lane = tid % 32;
  for (int g = warp; g < kG; g += kThreads / 32) {
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, p_s[g][i]);
    m = WarpMax(m);
    float l = 0.0f;
    for (int i = lane; i < n; i += 32) {
      float p = exp2f(p_s[g][i] - m);
      p_s[g][i] = p;
      l += p;
    }
    l = WarpSum(l);
    if (lane == 0) {
      m_s[g] = m;
      l_s[g] = l;
    }
  }
  __syncthreads();

  // Phase 3: o = sum_t p_t v_t; token groups accumulate in registers, then in shared memory.
  float acc[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  }
  for (int base = 0; base < n; base += kTokensPerStep * kUnroll) {
    uint4 vv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = base + u * kTokensPerStep + tok_lane;
      vv[u] = tok < n ? LoadStreaming(row_ptr(v_cache, tok)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = base + u * kTokensPerStep + tok_lane;
      if (tok < n) {
        float vf[8];
        Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&vv[u]), vf);
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          float p = p_s[g][tok];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) atomicAdd(&o_s[g][chunk * 8 + e], acc[g][e]);
  }
  __syncthreads();

  // Partial result: [seq][head][split] -> o[kD], m, l.
  for (int i = tid; i < kG * (kD + 2); i += kThreads) {
    int g = i / (kD + 2), j = i % (kD + 2);
    int64_t rec = (static_cast<int64_t>(seq) * num_heads + head0 + g) * num_splits + split;
    float v = j < kD ? o_s[g][j] : (j == kD ? m_s[g] : l_s[g]);
    workspace[rec * (kD + 2) + j] = v;
  }
}

// Small batches: one block per split of `partition` keys, kG query heads of one KV head, one
// sequence. Keys are processed 64 at a time: every thread issues all its K and V loads of the
// sub-tile before using any (32 KB in flight per block at head_dim 128), scores go to shared
// memory, and the softmax is online across sub-tiles.
template <int kD, int kG>
__global__ void __launch_bounds__(kThreads)
    DecodePartitionKernel(const __nv_bfloat16* __restrict__ q,
                          const __nv_bfloat16* __restrict__ k_cache,
                          const __nv_bfloat16* __restrict__ v_cache,
                          const int32_t* __restrict__ query_start,
                          const int32_t* __restrict__ context_lens,
                          const int32_t* __restrict__ block_tables, int max_blocks_per_seq,
                          int block_size, int num_heads, int num_kv_heads, int partition,
                          float scale_log2, float* __restrict__ workspace) {
  constexpr int kLanesPerToken = kD / 8;                     // 16-byte chunks per row
  constexpr int kTokensPerStep = kThreads / kLanesPerToken;  // rows read per block step
  constexpr int kUnroll = kSub / kTokensPerStep;
  __shared__ float q_s[kG][kD];
  __shared__ float s_s[kG][kSub];
  __shared__ float o_s[kG][kD];
  __shared__ float m_s[kG], l_s[kG], alpha_s[kG];

  const int split = blockIdx.x, group = blockIdx.y, seq = blockIdx.z;
  const int num_splits = gridDim.x;
  const int ctx = context_lens[seq];
  const int start = split * partition;
  if (start >= ctx) return;
  const int n = min(partition, ctx - start);
  const int head0 = group * kG;
  const int kv_head = head0 / (num_heads / num_kv_heads);
  const int tid = threadIdx.x;
  const int64_t q_row = query_start[seq];
  const int32_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;

  for (int i = tid; i < kG * kD; i += kThreads) {
    int g = i / kD, d = i % kD;
    q_s[g][d] = __bfloat162float(q[(q_row * num_heads + head0 + g) * kD + d]) * scale_log2;
    o_s[g][d] = 0.0f;
  }
  if (tid < kG) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  __syncthreads();

  const int chunk = tid % kLanesPerToken, tok_lane = tid / kLanesPerToken;
  const int warp = tid / 32, lane = tid % 32;
  float qf[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[g][e] = q_s[g][chunk * 8 + e];
  }
  float acc[kG][8];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  }

  for (int sub = 0; sub < n; sub += kSub) {
    const int cnt = min(kSub, n - sub);
    uint4 kv[kUnroll], vv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = u * kTokensPerStep + tok_lane;
      if (tok < cnt) {
        int pos = start + sub + tok;
        int64_t slot =
            static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
        int64_t off = (slot * num_kv_heads + kv_head) * kD + chunk * 8;
        kv[u] = LoadStreaming(k_cache + off);
        vv[u] = LoadStreaming(v_cache + off);
      } else {
        kv[u] = vv[u] = make_uint4(0, 0, 0, 0);
      }
    }
    // Scores (log2 domain).
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = u * kTokensPerStep + tok_lane;
      float kf[8];
      Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&kv[u]), kf);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        float sc = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) sc = fmaf(qf[g][e], kf[e], sc);
#pragma unroll
        for (int o = kLanesPerToken / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
        if (chunk == 0 && tok < cnt) s_s[g][tok] = sc;
      }
    }
    __syncthreads();
    // Online softmax update, one warp per head.
    for (int g = warp; g < kG; g += kThreads / 32) {
      float a = lane < cnt ? s_s[g][lane] : -INFINITY;
      float b = lane + 32 < cnt ? s_s[g][lane + 32] : -INFINITY;
      float m_old = m_s[g];
      float m_new = fmaxf(m_old, WarpMax(fmaxf(a, b)));
      float pa = lane < cnt ? exp2f(a - m_new) : 0.0f;
      float pb = lane + 32 < cnt ? exp2f(b - m_new) : 0.0f;
      if (lane < cnt) s_s[g][lane] = pa;
      if (lane + 32 < cnt) s_s[g][lane + 32] = pb;
      float sum = WarpSum(pa + pb);
      if (lane == 0) {
        float alpha = exp2f(m_old - m_new);  // 0 on the first sub-tile (m_old = -inf)
        alpha_s[g] = alpha;
        l_s[g] = l_s[g] * alpha + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();
    // o = alpha * o + sum_t p_t v_t.
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      float alpha = alpha_s[g];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int tok = u * kTokensPerStep + tok_lane;
      if (tok < cnt) {
        float vf[8];
        Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&vv[u]), vf);
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          float p = s_s[g][tok];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
        }
      }
    }
    __syncthreads();  // s_s is rewritten by the next sub-tile
  }
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) atomicAdd(&o_s[g][chunk * 8 + e], acc[g][e]);
  }
  __syncthreads();

  // Partial result: [seq][head][split] -> o[kD] (relative to m), m, l.
  for (int i = tid; i < kG * (kD + 2); i += kThreads) {
    int g = i / (kD + 2), j = i % (kD + 2);
    int64_t rec = (static_cast<int64_t>(seq) * num_heads + head0 + g) * num_splits + split;
    float v = j < kD ? o_s[g][j] : (j == kD ? m_s[g] : l_s[g]);
    workspace[rec * (kD + 2) + j] = v;
  }
}

template <int kD>
__global__ void DecodeCombineKernel(const float* __restrict__ workspace,
                                    const int32_t* __restrict__ query_start,
                                    const int32_t* __restrict__ context_lens, int num_heads,
                                    int num_splits, int partition,
                                    __nv_bfloat16* __restrict__ out) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const int used = min(num_splits, (context_lens[seq] + partition - 1) / partition);
  const float* rec =
      workspace + (static_cast<int64_t>(seq) * num_heads + head) * num_splits * (kD + 2);
  float m = -INFINITY;
  for (int s = 0; s < used; ++s) m = fmaxf(m, rec[s * (kD + 2) + kD]);
  const int64_t row = query_start[seq];
  for (int d = threadIdx.x; d < kD; d += blockDim.x) {
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < used; ++s) {
      const float* r = rec + s * (kD + 2);
      float w = exp2f(r[kD] - m);
      num += w * r[d];
      den += w * r[kD + 1];
    }
    out[(row * num_heads + head) * kD + d] = __float2bfloat16(den > 0.0f ? num / den : 0.0f);
  }
}

template <int kD, int kG>
void LaunchTyped(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int num_heads,
                 int num_kv_heads, float scale, const DeviceBatch& b, float* workspace, Tensor out,
                 cudaStream_t stream) {
  int splits = DecodeNumSplits(b, num_heads, num_kv_heads);
  int partition = DecodePartition(b.num_seqs, num_heads, num_kv_heads);
  dim3 grid(splits, num_heads / kG, b.num_seqs);
  auto kernel = partition == kSub ? DecodePartitionKernel<kD, kG> : DecodeTwoPhaseKernel<kD, kG>;
  kernel<<<grid, kThreads, 0, stream>>>(
      q.ptr<const __nv_bfloat16>(), k_cache.ptr<const __nv_bfloat16>(),
      v_cache.ptr<const __nv_bfloat16>(), b.query_start, b.context_lens, b.block_tables,
      b.max_blocks_per_seq, b.block_size, num_heads, num_kv_heads, partition, scale * kLog2e,
      workspace);
  TP_CUDA_CHECK_LAUNCH();
  DecodeCombineKernel<kD><<<dim3(num_heads, b.num_seqs), kD, 0, stream>>>(
      workspace, b.query_start, b.context_lens, num_heads, splits, partition,
      out.ptr<__nv_bfloat16>());
  TP_CUDA_CHECK_LAUNCH();
}

template <int kD>
void LaunchForDim(int group, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                  int num_heads, int num_kv_heads, float scale, const DeviceBatch& b,
                  float* workspace, Tensor out, cudaStream_t stream) {
  const int g = DecodeHeadsPerBlock(num_heads, num_kv_heads);
  if (g == 8) {
    LaunchTyped<kD, 8>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, workspace, out,
                       stream);
  } else if (g == 4) {
    LaunchTyped<kD, 4>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, workspace, out,
                       stream);
  } else if (g == 2) {
    LaunchTyped<kD, 2>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, workspace, out,
                       stream);
  } else {
    LaunchTyped<kD, 1>(q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, workspace, out,
                       stream);
  }
}

}  // namespace

void LaunchAttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                           int num_heads, int num_kv_heads, int head_dim, float scale,
                           const DeviceBatch& b, float* workspace, Tensor out,
                           cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(q, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(k_cache, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(v_cache, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(out, DType::kBF16);
  TP_CHECK(b.num_tokens == b.num_seqs)
      << "AttentionDecode needs one query per sequence (tokens " << b.num_tokens << ", seqs "
      << b.num_seqs << "); use AttentionPrefill";
  TP_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
           (head_dim == 64 || head_dim == 128) && k_cache.ndim == 4 &&
           k_cache.dim(1) == b.block_size && k_cache.dim(2) == num_kv_heads &&
           k_cache.dim(3) == head_dim && v_cache.numel() == k_cache.numel() &&
           q.numel() == int64_t{b.num_tokens} * num_heads * head_dim && out.numel() == q.numel())
      << "AttentionDecode: q " << q.ShapeString() << ", k_cache " << k_cache.ShapeString()
      << ", out " << out.ShapeString() << ", heads " << num_heads << "/" << num_kv_heads
      << ", head_dim " << head_dim << " (64 or 128), block_size " << b.block_size;
  TP_CHECK(workspace != nullptr) << "AttentionDecode: no workspace";
  if (b.num_seqs == 0) return;
  int group = num_heads / num_kv_heads;
  if (head_dim == 64) {
    LaunchForDim<64>(group, q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, workspace, out,
                     stream);
  } else {
    LaunchForDim<128>(group, q, k_cache, v_cache, num_heads, num_kv_heads, scale, b, workspace, out,
                      stream);
  }
}

}  // namespace tpserve::cuda
