// Skinny GEMM for decode-sized products: y[M, N] = x[M, K] w[N, K]^T (+ bias), M <= 16.
// The weight is streamed once at close to copy bandwidth: each block owns R rows of w, its
// warps split K, every lane issues R * U independent 16-byte loads before using them; x stays
// in L1/L2. Partial sums are reduced across the warp by recursive halving, then across warps
// in shared memory. Launched with programmatic dependent launch: a block issues its first
// weight loads before waiting for the kernel that produces x, so the weight stream starts
// while that kernel drains. The SwiGLU variant reads x as silu(gate) * up from a [M, 2K]
// gate_up (the MLP's down projection without the separate SiluMul pass). The RoPE/KV variant is
// the fused q/k/v projection with RopeKvWrite as its epilogue: block b computes the rows
// (i, i + D/2) of head b / (D/2), the pair RoPE rotates together, and stores them rotated into
// q_out or the K cache (v unrotated into the V cache).
// The deferred-norm variants (Ops::GemmAddRmsNorm at M <= 2) split an RMSNorm between two
// GEMMs: the producer adds its output into the residual, stores residual * gamma and adds each
// block's sum of squares per row into a record of 64-bit fixed-point counters (integer atomics:
// the total does not depend on the order of arrival); the consumer reads the record after its
// wait and scales its dot products by rsqrt(mean + eps). No norm kernel runs between them.
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gemm_epilogue.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kChunk = 256;  // K elements per warp step (32 lanes x 8)

// Reduces v[kV] over the warp by recursive halving (kV - 1 + log shuffles instead of 5 kV):
// at step s the lanes with bit (16 >> s) set keep the upper half of the values. Afterwards
// lane `lane` holds in v[j] (j < max(1, kV / 32)) the total of index ReducedIndex(lane, j).
template <int kV, int kStep = 0>
__device__ __forceinline__ void WarpReduceHalving(float (&v)[kV], int lane) {
  if constexpr (kStep < 5) {
    constexpr int kOffset = 16 >> kStep;
    constexpr int kWidth = (kV >> kStep) >= 2 ? (kV >> kStep) : 1;
    if constexpr (kWidth >= 2) {
      bool upper = (lane & kOffset) != 0;
#pragma unroll
      for (int i = 0; i < kWidth / 2; ++i) {
        float keep = upper ? v[i + kWidth / 2] : v[i];
        float give = upper ? v[i] : v[i + kWidth / 2];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, give, kOffset);
      }
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], kOffset);
    }
    WarpReduceHalving<kV, kStep + 1>(v, lane);
  }
}

// Index of the value lane holds in slot j after WarpReduceHalving; -1 when the lane holds a
// duplicate (for kV < 32 several lanes end with the same total).
template <int kV>
__device__ __forceinline__ int ReducedIndex(int lane, int j) {
  int idx = j, width = kV;
#pragma unroll
  for (int s = 0; s < 5; ++s) {
    int o = 16 >> s;
    if (width >= 2) {
      width /= 2;
      if (lane & o) idx += width;
    } else if (lane & o) {
      return -1;
    }
  }
  return idx;
}

// Row m of the GEMM input at column k (8 values): x itself, or silu(gate) * up rounded to bf16
// as SiluMul would store it. x comes from the previous kernel, so it is read after PdlWait with a
// coherent load (ld.global.ca: kept in L1 for the block's other warps), never an ld.global.nc,
// which ptxas may move above the wait (cuda_util.cuh, LoadProduced). The same speed as __ldg on
// an H100 (kernels/cuda/NOTES.md, session 35).
template <bool kSwiGlu>
__device__ __forceinline__ void LoadInput(const __nv_bfloat16* __restrict__ x, int m, int K, int k,
                                          float xf[8]) {
  if constexpr (!kSwiGlu) {
    uint4 xr = __ldca(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * K + k));
    Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&xr), xf);
  } else {
    const __nv_bfloat16* row = x + static_cast<int64_t>(m) * 2 * K;
    uint4 gr = __ldca(reinterpret_cast<const uint4*>(row + k));
    uint4 ur = __ldca(reinterpret_cast<const uint4*>(row + K + k));
    float g[8], u[8];
    Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&gr), g);
    Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&ur), u);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      xf[e] = __bfloat162float(__float2bfloat16(__fdividef(g[e], 1.0f + __expf(-g[e])) * u[e]));
    }
  }
}

// The deferred norm's arguments. kNorm 1 (consumer): x still has to be scaled per row by
// rsqrt(in_sums[row] / dim + eps). kNorm 2 (producer): residual += y, normed = residual * gamma,
// sums of squares of the rows added into out_sums.
struct NormArgs {
  const unsigned long long* in_sums = nullptr;
  int dim = 0;
  float eps = 0.0f;
  __nv_bfloat16* residual = nullptr;
  const __nv_bfloat16* gamma = nullptr;
  __nv_bfloat16* normed = nullptr;
  unsigned long long* out_sums = nullptr;
};

template <int kMT, int kR, int kU, bool kSwiGlu, bool kRopeKv = false, int kNorm = 0>
__global__ void __launch_bounds__(kWarps * 32)
    SkinnyGemmKernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                     const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ y, int M,
                     int N, int K, RopeKvArgs rope, NormArgs norm) {
  static_assert(!kRopeKv || kR == 2, "the RoPE/KV epilogue takes one row pair per block");
  static_assert(kNorm != 2 || (!kRopeKv && kMT * kR <= 32), "the norm epilogue runs in one warp");
  constexpr int kV = kMT * kR;
  __shared__ float partial[kWarps][kV];
  __shared__ float row_scale[kMT];
  PdlLaunchDependents();
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Row r of this block: n0 + r, or for the RoPE/KV epilogue rows (i, i + D/2) of one head.
  int n0 = blockIdx.x * kR, row_step = 1;
  if constexpr (kRopeKv) {
    const int half = rope.head_dim / 2;
    n0 = (blockIdx.x / half) * rope.head_dim + blockIdx.x % half;
    row_step = half;
  }
  int num_chunks = (K + kChunk - 1) / kChunk;
  float acc[kV];
#pragma unroll
  for (int i = 0; i < kV; ++i) acc[i] = 0.0f;

  uint4 wv[kU][kR];
  auto load_w = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      int k = (c0 + u * kWarps) * kChunk + lane * 8;
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        const int n = n0 + r * row_step;
        wv[u][r] = k < K && n < N ? LoadStreaming(w + static_cast<int64_t>(n) * K + k)
                                  : make_uint4(0, 0, 0, 0);
      }
    }
  };
  // The weights do not depend on the previous kernel: the first loads go out before the wait.
  if (warp < num_chunks) load_w(warp);
  // The producer's epilogue operands (lane = m * kR + r of warp 0): gamma is a weight, loaded
  // before the wait; the residual after it (an earlier kernel of the chain writes it), both
  // hidden behind the main loop.
  const int norm_m = lane / kR, norm_n = n0 + lane % kR;
  const bool norm_lane = kNorm == 2 && warp == 0 && lane < kV && norm_m < M && norm_n < N;
  __nv_bfloat16 gamma_b{}, residual_b{};
  if constexpr (kNorm == 2) {
    if (norm_lane) gamma_b = norm.gamma[norm_n];
  }
  PdlWait();
  if constexpr (kNorm == 2) {
    if (norm_lane) residual_b = norm.residual[static_cast<int64_t>(norm_m) * N + norm_n];
  }
  // The consumer's row sums: loaded now, used after the main loop.
  unsigned long long sums[kMT];
  if constexpr (kNorm == 1) {
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
      sums[m] = warp == 0 && m < M ? __ldcg(norm.in_sums + m * kNormSumSlots + lane) : 0ull;
    }
  }

  for (int c0 = warp; c0 < num_chunks; c0 += kWarps * kU) {
    if (c0 != warp) load_w(c0);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      int k = (c0 + u * kWarps) * kChunk + lane * 8;
      if (k >= K) continue;
      float wf[kR][8];
#pragma unroll
      for (int r = 0; r < kR; ++r)
        Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&wv[u][r]), wf[r]);
#pragma unroll
      for (int m = 0; m < kMT; ++m) {
        if (m < M) {
          float xf[8];
          LoadInput<kSwiGlu>(x, m, K, k, xf);
#pragma unroll
          for (int r = 0; r < kR; ++r) {
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m * kR + r] = fmaf(xf[e], wf[r][e], acc[m * kR + r]);
          }
        }
      }
    }
  }

  WarpReduceHalving<kV>(acc, lane);
  constexpr int kSlots = kV >= 32 ? kV / 32 : 1;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    int idx = ReducedIndex<kV>(lane, j);
    if (idx >= 0) partial[warp][idx] = acc[j];
  }
  if constexpr (kNorm == 1) {
    if (warp == 0) {
#pragma unroll
      for (int m = 0; m < kMT; ++m) {
        const float scale = RowScaleOfSums(sums[m], norm.dim, norm.eps);
        if (lane == 0) row_scale[m] = scale;
      }
    }
  }
  __syncthreads();
  if constexpr (kRopeKv) {
    const int m = threadIdx.x;
    if (m < M) {
      float pair[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < kWarps; ++i) sum += partial[i][m * kR + r];
        if constexpr (kNorm == 1) sum *= row_scale[m];
        if (bias != nullptr) sum += __bfloat162float(bias[n0 + r * row_step]);
        pair[r] = __bfloat162float(__float2bfloat16(sum));  // as the GEMM would store it
      }
      const int half = rope.head_dim / 2;
      StoreRopeKvPair(rope, m, blockIdx.x / half, blockIdx.x % half, pair[0], pair[1]);
    }
    return;
  }
  if constexpr (kNorm == 2) {
    // residual += y and normed = residual * gamma for this block's rows, as AddRmsNorm rounds
    // them; the squares of the new residual are summed over the block's rows of each token and
    // added to one of kNormSumSlots counters (fewer collisions at the same address).
    if (warp != 0) return;
    float sq = 0.0f;
    if (norm_lane) {
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < kWarps; ++i) s += partial[i][lane];
      if (bias != nullptr) s += __bfloat162float(bias[norm_n]);
      const int64_t at = static_cast<int64_t>(norm_m) * N + norm_n;
      const __nv_bfloat16 yb = __float2bfloat16(s);
      y[at] = yb;
      const __nv_bfloat16 hb =
          __float2bfloat16(__bfloat162float(residual_b) + __bfloat162float(yb));
      norm.residual[at] = hb;
      const float h = __bfloat162float(hb);
      norm.normed[at] = __float2bfloat16(h * __bfloat162float(gamma_b));
      sq = h * h;
    }
#pragma unroll
    for (int o = 1; o < kR; o <<= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    if (norm_lane && lane % kR == 0) {
      atomicAdd(norm.out_sums + norm_m * kNormSumSlots + blockIdx.x % kNormSumSlots,
                static_cast<unsigned long long>(__float2ull_rn(sq * kNormSumScale)));
    }
  } else {
    for (int idx = threadIdx.x; idx < kV; idx += blockDim.x) {
      int m = idx / kR, r = idx % kR;
      int n = n0 + r;
      if (m < M && n < N) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < kWarps; ++i) s += partial[i][idx];
        if constexpr (kNorm == 1) s *= row_scale[m];
        if (bias != nullptr) s += __bfloat162float(bias[n]);
        y[static_cast<int64_t>(m) * N + n] = __float2bfloat16(s);
      }
    }
  }
}

// Zeroes the deferred norms' records of a step (a kernel in the PDL chain rather than a memset,
// so that the kernels after it still overlap their launch with it).
__global__ void __launch_bounds__(256) ZeroSumsKernel(uint4* __restrict__ p, int n) {
  PdlLaunchDependents();
  PdlWait();  // the previous step's consumers read these
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p[i] = make_uint4(0, 0, 0, 0);
  }
}

// Applies a deferred norm's row scale in place (x[m, :] *= rsqrt(sums[m] / K + eps)), for a
// consumer that cannot take it in its epilogue.
__global__ void __launch_bounds__(256)
    ApplyRowScaleKernel(__nv_bfloat16* __restrict__ x, int K, const unsigned long long* sums,
                        float eps) {
  __shared__ float scale_s;
  PdlLaunchDependents();
  PdlWait();
  const int m = blockIdx.x;
  if (threadIdx.x < 32) {
    const float scale = RowScaleOfSums(__ldcg(sums + m * kNormSumSlots + threadIdx.x), K, eps);
    if (threadIdx.x == 0) scale_s = scale;
  }
  __syncthreads();
  const float scale = scale_s;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const int64_t at = static_cast<int64_t>(m) * K + k;
    x[at] = __float2bfloat16(__bfloat162float(x[at]) * scale);
  }
}

struct Config {
  int rows;
  int unroll;
};
// Index 0 is the automatic choice; the rest are the variants the benchmark compares.
constexpr Config kConfigs[] = {{0, 0}, {1, 4}, {2, 2}, {2, 4}, {4, 2}, {4, 4}, {8, 1}};

template <int kMT, int kR, int kU, bool kSwiGlu, int kNorm = 0>
void LaunchTyped(const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* bias,
                 __nv_bfloat16* y, int M, int N, int K, cudaStream_t stream,
                 const NormArgs& norm = NormArgs{}) {
  LaunchPdl(SkinnyGemmKernel<kMT, kR, kU, kSwiGlu, false, kNorm>, dim3(CeilDiv(N, kR)),
            dim3(kWarps * 32), 0, stream, x, w, bias, y, M, N, K, RopeKvArgs{}, norm);
}

template <int kMT, bool kSwiGlu>
void LaunchForM(Config c, const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* bias,
                __nv_bfloat16* y, int M, int N, int K, cudaStream_t stream) {
  if (c.rows == 1) return LaunchTyped<kMT, 1, 4, kSwiGlu>(x, w, bias, y, M, N, K, stream);
  if (c.rows == 2 && c.unroll == 2) {
    return LaunchTyped<kMT, 2, 2, kSwiGlu>(x, w, bias, y, M, N, K, stream);
  }
  if (c.rows == 2) return LaunchTyped<kMT, 2, 4, kSwiGlu>(x, w, bias, y, M, N, K, stream);
  if (c.rows == 4 && c.unroll == 2) {
    return LaunchTyped<kMT, 4, 2, kSwiGlu>(x, w, bias, y, M, N, K, stream);
  }
  if (c.rows == 4) return LaunchTyped<kMT, 4, 4, kSwiGlu>(x, w, bias, y, M, N, K, stream);
  return LaunchTyped<kMT, 8, 1, kSwiGlu>(x, w, bias, y, M, N, K, stream);
}

template <bool kSwiGlu>
void LaunchForAnyM(Config c, const __nv_bfloat16* x, const __nv_bfloat16* w,
                   const __nv_bfloat16* bias, __nv_bfloat16* y, int M, int N, int K,
                   cudaStream_t stream) {
  if (M <= 1) {
    LaunchForM<1, kSwiGlu>(c, x, w, bias, y, M, N, K, stream);
  } else if (M <= 2) {
    LaunchForM<2, kSwiGlu>(c, x, w, bias, y, M, N, K, stream);
  } else if constexpr (!kSwiGlu) {  // the SwiGLU variant stops at kSkinnyFusedMaxM = 2
    if (M <= 4) {
      LaunchForM<4, false>(c, x, w, bias, y, M, N, K, stream);
    } else if (M <= 8) {
      LaunchForM<8, false>(c, x, w, bias, y, M, N, K, stream);
    } else {
      LaunchForM<16, false>(c, x, w, bias, y, M, N, K, stream);
    }
  }
}

// Measured on the H200 (M = 1, 6.7B shapes): 2 rows x unroll 2 is at or within 1% of the best
// variant on every shape (85-97% of the copy bandwidth, 60% on the small 4096 x 4096).
Config AutoConfig(int64_t M) { return M == 1 ? Config{2, 2} : Config{4, 2}; }
// The SwiGLU variant spends ~3x the instructions per input element (two loads, exp, divide), so
// more weight rows share each activation. Measured on the H200 (down 4096 x 11008, M = 1):
// 8 rows x 1 80.1% of copy bandwidth, 2 x 2 77.7%, 4 x 2 77.6%, 4 x 4 66.9% (plain GEMM: 83%).
// At M = 2, 8 rows take 145 registers (one block per SM): 4 rows x 2 there.
Config AutoSwiGluConfig(int64_t M) { return M == 1 ? Config{8, 1} : Config{4, 2}; }

}  // namespace

int SkinnyGemmNumConfigs() { return static_cast<int>(sizeof(kConfigs) / sizeof(kConfigs[0])); }

void LaunchSkinnyGemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                      cudaStream_t stream, int config) {
  TP_CHECK_CUDA_TENSOR(x, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(w, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  TP_CHECK(config >= 0 && config < SkinnyGemmNumConfigs()) << "skinny GEMM config " << config;
  int64_t K = x.dim(-1), M = x.numel() / std::max<int64_t>(K, 1);
  int64_t N = w.dim(0);
  TP_CHECK(w.ndim == 2 && w.dim(1) == K && y.numel() == M * N && y.dim(-1) == N &&
           M <= kSkinnyMaxM && K % 8 == 0 && IsAligned16(x.data) && IsAligned16(w.data))
      << "SkinnyGemm: x " << x.ShapeString() << ", w " << w.ShapeString() << ", y "
      << y.ShapeString() << " (needs M <= " << kSkinnyMaxM << ", K % 8 == 0, 16-byte aligned)";
  CheckGemmBias("SkinnyGemm", bias, N);
  if (M == 0 || N == 0) return;
  Config c = config == 0 ? AutoConfig(M) : kConfigs[config];
  LaunchForAnyM<false>(c, x.ptr<const __nv_bfloat16>(), w.ptr<const __nv_bfloat16>(),
                       bias ? bias->ptr<const __nv_bfloat16>() : nullptr, y.ptr<__nv_bfloat16>(),
                       static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), stream);
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchSkinnySwiGluGemm(const Tensor& gate_up, const Tensor& w, Tensor y, cudaStream_t stream,
                            int config) {
  TP_CHECK_CUDA_TENSOR(gate_up, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(w, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  TP_CHECK(config >= 0 && config < SkinnyGemmNumConfigs()) << "skinny GEMM config " << config;
  int64_t K = w.dim(-1), M = gate_up.numel() / std::max<int64_t>(2 * K, 1);
  int64_t N = w.dim(0);
  TP_CHECK(w.ndim == 2 && gate_up.dim(-1) == 2 * K && gate_up.numel() == M * 2 * K &&
           y.numel() == M * N && y.dim(-1) == N && M <= kSkinnyFusedMaxM && K % 8 == 0 &&
           IsAligned16(gate_up.data) && IsAligned16(w.data))
      << "SkinnySwiGluGemm: gate_up " << gate_up.ShapeString() << ", w " << w.ShapeString()
      << ", y " << y.ShapeString() << " (needs M <= " << kSkinnyFusedMaxM
      << ", K % 8 == 0, 16-byte aligned)";
  if (M == 0 || N == 0) return;
  Config c = config == 0 ? AutoSwiGluConfig(M) : kConfigs[config];
  LaunchForAnyM<true>(c, gate_up.ptr<const __nv_bfloat16>(), w.ptr<const __nv_bfloat16>(), nullptr,
                      y.ptr<__nv_bfloat16>(), static_cast<int>(M), static_cast<int>(N),
                      static_cast<int>(K), stream);
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchSkinnyQkvRopeKvWrite(const Tensor& x, const Tensor& w_qkv, const Tensor* bias,
                                const Tensor& inv_freq, int num_q_heads, int num_kv_heads,
                                int head_dim, const DeviceBatch& b, Tensor q_out, Tensor k_cache,
                                Tensor v_cache, cudaStream_t stream,
                                const unsigned long long* x_sums, float eps) {
  TP_CHECK_CUDA_TENSOR(x, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(w_qkv, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(inv_freq, DType::kF32);
  TP_CHECK_CUDA_TENSOR(q_out, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(k_cache, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(v_cache, DType::kBF16);
  const int64_t K = x.dim(-1), M = x.numel() / std::max<int64_t>(K, 1);
  const int64_t N = int64_t{num_q_heads + 2 * num_kv_heads} * head_dim;
  TP_CHECK(w_qkv.ndim == 2 && w_qkv.dim(0) == N && w_qkv.dim(1) == K && M == b.num_tokens &&
           M <= kSkinnyFusedMaxM && K % 8 == 0 && head_dim % 2 == 0 &&
           inv_freq.numel() == head_dim / 2 && q_out.numel() == M * num_q_heads * head_dim &&
           k_cache.ndim == 4 && k_cache.dim(1) == b.block_size && k_cache.dim(2) == num_kv_heads &&
           k_cache.dim(3) == head_dim && v_cache.numel() == k_cache.numel() &&
           IsAligned16(x.data) && IsAligned16(w_qkv.data))
      << "SkinnyQkvRopeKvWrite: x " << x.ShapeString() << ", w_qkv " << w_qkv.ShapeString()
      << ", q_out " << q_out.ShapeString() << ", k_cache " << k_cache.ShapeString() << ", heads "
      << num_q_heads << "/" << num_kv_heads << ", head_dim " << head_dim << ", tokens "
      << b.num_tokens << " (needs M <= " << kSkinnyFusedMaxM << ", K % 8 == 0, aligned)";
  CheckGemmBias("SkinnyQkvRopeKvWrite", bias, N);
  if (M == 0) return;
  RopeKvArgs rope;
  rope.inv_freq = inv_freq.ptr<const float>();
  rope.positions = b.positions;
  rope.slots = b.slot_mapping;
  rope.num_q_heads = num_q_heads;
  rope.num_kv_heads = num_kv_heads;
  rope.head_dim = head_dim;
  rope.num_slots = k_cache.dim(0) * k_cache.dim(1);
  rope.q_out = q_out.ptr<__nv_bfloat16>();
  rope.k_cache = k_cache.ptr<__nv_bfloat16>();
  rope.v_cache = v_cache.ptr<__nv_bfloat16>();
  NormArgs norm;
  norm.in_sums = x_sums;
  norm.dim = static_cast<int>(K);
  norm.eps = eps;
  // 2 rows x unroll 2, the automatic choice for M = 1 (86% of copy bandwidth on qkv 12288 x 4096).
  auto kernel = x_sums == nullptr ? (M == 1 ? SkinnyGemmKernel<1, 2, 2, false, true>
                                            : SkinnyGemmKernel<2, 2, 2, false, true>)
                                  : (M == 1 ? SkinnyGemmKernel<1, 2, 2, false, true, 1>
                                            : SkinnyGemmKernel<2, 2, 2, false, true, 1>);
  LaunchPdl(kernel, dim3(static_cast<unsigned>(N / 2)), dim3(kWarps * 32), 0, stream,
            x.ptr<const __nv_bfloat16>(), w_qkv.ptr<const __nv_bfloat16>(),
            bias ? bias->ptr<const __nv_bfloat16>() : nullptr, static_cast<__nv_bfloat16*>(nullptr),
            static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), rope, norm);
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchSkinnyGemmAddNorm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                             Tensor residual, const Tensor& gamma, Tensor normed, bool swiglu,
                             unsigned long long* record, cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(x, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(w, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(residual, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(gamma, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(normed, DType::kBF16);
  const int64_t K = w.dim(-1), N = w.dim(0);
  const int64_t M = x.numel() / std::max<int64_t>(swiglu ? 2 * K : K, 1);
  TP_CHECK(w.ndim == 2 && x.dim(-1) == (swiglu ? 2 * K : K) && y.numel() == M * N &&
           y.dim(-1) == N && residual.numel() == M * N && normed.numel() == M * N &&
           gamma.numel() == N && M >= 1 && M <= kSkinnyFusedMaxM && K % 8 == 0 &&
           IsAligned16(x.data) && IsAligned16(w.data) && record != nullptr)
      << "SkinnyGemmAddNorm: x " << x.ShapeString() << ", w " << w.ShapeString() << ", y "
      << y.ShapeString() << ", residual " << residual.ShapeString() << ", gamma "
      << gamma.ShapeString() << " (needs 1 <= M <= " << kSkinnyFusedMaxM
      << ", K % 8 == 0, 16-byte aligned)";
  CheckGemmBias("SkinnyGemmAddNorm", bias, N);
  NormArgs norm;
  norm.residual = residual.ptr<__nv_bfloat16>();
  norm.gamma = gamma.ptr<const __nv_bfloat16>();
  norm.normed = normed.ptr<__nv_bfloat16>();
  norm.out_sums = record;
  // The configurations of the automatic choice (AutoConfig, AutoSwiGluConfig).
  auto launch = swiglu ? (M == 1 ? LaunchTyped<1, 8, 1, true, 2> : LaunchTyped<2, 4, 2, true, 2>)
                       : (M == 1 ? LaunchTyped<1, 2, 2, false, 2> : LaunchTyped<2, 4, 2, false, 2>);
  launch(x.ptr<const __nv_bfloat16>(), w.ptr<const __nv_bfloat16>(),
         bias ? bias->ptr<const __nv_bfloat16>() : nullptr, y.ptr<__nv_bfloat16>(),
         static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), stream, norm);
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchSkinnyGemmScaledRows(const Tensor& x, const unsigned long long* record, float eps,
                                const Tensor& w, const Tensor* bias, Tensor y,
                                cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(x, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(w, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  const int64_t K = x.dim(-1), M = x.numel() / std::max<int64_t>(K, 1), N = w.dim(0);
  TP_CHECK(w.ndim == 2 && w.dim(1) == K && y.numel() == M * N && y.dim(-1) == N && M >= 1 &&
           M <= kSkinnyFusedMaxM && K % 8 == 0 && IsAligned16(x.data) && IsAligned16(w.data) &&
           record != nullptr)
      << "SkinnyGemmScaledRows: x " << x.ShapeString() << ", w " << w.ShapeString() << ", y "
      << y.ShapeString() << " (needs 1 <= M <= " << kSkinnyFusedMaxM
      << ", K % 8 == 0, 16-byte aligned)";
  CheckGemmBias("SkinnyGemmScaledRows", bias, N);
  NormArgs norm;
  norm.in_sums = record;
  norm.dim = static_cast<int>(K);
  norm.eps = eps;
  // The configuration of the automatic choice (AutoConfig).
  auto launch = M == 1 ? LaunchTyped<1, 2, 2, false, 1> : LaunchTyped<2, 4, 2, false, 1>;
  launch(x.ptr<const __nv_bfloat16>(), w.ptr<const __nv_bfloat16>(),
         bias ? bias->ptr<const __nv_bfloat16>() : nullptr, y.ptr<__nv_bfloat16>(),
         static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), stream, norm);
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchApplyRowScale(Tensor x, const unsigned long long* record, float eps,
                         cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(x, DType::kBF16);
  const int64_t K = x.dim(-1), M = x.numel() / std::max<int64_t>(K, 1);
  TP_CHECK(M <= kSkinnyFusedMaxM && record != nullptr)
      << "ApplyRowScale: x " << x.ShapeString() << " (at most " << kSkinnyFusedMaxM << " rows)";
  if (M == 0) return;
  LaunchPdl(ApplyRowScaleKernel, dim3(static_cast<unsigned>(M)), dim3(256), 0, stream,
            x.ptr<__nv_bfloat16>(), static_cast<int>(K), record, eps);
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchZeroNormSums(unsigned long long* sums, int64_t words, cudaStream_t stream) {
  TP_CHECK(words % 2 == 0 && IsAligned16(sums)) << "ZeroNormSums: " << words << " words";
  const int n = static_cast<int>(words / 2);
  if (n == 0) return;
  LaunchPdl(ZeroSumsKernel, dim3(static_cast<unsigned>(std::min(CeilDiv(n, 256), 16))), dim3(256),
            0, stream, reinterpret_cast<uint4*>(sums), n);
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
