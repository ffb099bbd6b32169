// tpserve-regchain-probe (built with the CUDA tools; kernels/cuda/NOTES.md, sessions 30-31):
// register-streamed chain GEMVs for M = 1 on the five DeepSeek-Coder-6.7B shapes, each checked bit
// for bit against a plain reference chain and timed against the copy bandwidth.
//   tpserve-regchain-probe [all|qkv|o|gate_up|down|lm_head] [nolt]   rolling loads (RegChain)
//   tpserve-regchain-probe burst                                     burst loads (BurstChain)
//   tpserve-regchain-probe latency      dependent mma.m16n8k16 chains, no memory (MmaChainLatency)
// Each warp runs the mma.m16n8k16 chain of one or two 16-row weight tiles (the A operand) over one
// K slice, loading its own fragments straight from global memory: LDG.64, or LDG.128 and one
// shuffle exchange per two steps. RegChain keeps kP steps in flight, one load issued per step
// consumed; BurstChain loads kP steps of its two rows at once into one of two register buffers
// while it consumes the other. The S slices of a tile are added in slice order in fp32. S = 1 is
// cuBLASLt's unsplit chain (the deterministic chain GEMV's bits). Without `nolt`, each shape also
// checks whether cuBLASLt's fixed algorithm with split-K forced to S equals the S in-order slice
// chains, at M = 1, 64 and 2048.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda/kv_read.cuh"
#include "kernels/cuda/mma_util.cuh"
#include "tools/cuda_bench/probes/probe_util.h"

// The tree's fragment MMA and streaming loads.
using tpserve::cuda::LoadStreaming;
using tpserve::cuda::LoadStreaming8;
using tpserve::cuda::Mma16816;

// Reference: one warp per (16-row tile, slice), the standard fragment layout (hw k = actual k),
// 4-byte loads, no prefetch; slices added in order by lane t == 0 through shared memory.
template <int kS, bool kTree = false>
__global__ void RefChain(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int N,
                         int K) {
  __shared__ float part[kS][16];
  const int lane = threadIdx.x & 31, s = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16, L = K / kS, kb = s * L;
  float d[4] = {0, 0, 0, 0};
  auto u32 = [](const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); };
  for (int k0 = kb; k0 < kb + L; k0 += 16) {
    const __nv_bfloat16* r0 = w + static_cast<int64_t>(n0 + g) * K + k0;
    const __nv_bfloat16* r1 = r0 + 8 * static_cast<int64_t>(K);
    uint32_t b0 = g == 0 ? u32(x + k0 + 2 * t) : 0u, b1 = g == 0 ? u32(x + k0 + 2 * t + 8) : 0u;
    Mma16816(d, u32(r0 + 2 * t), u32(r1 + 2 * t), u32(r0 + 2 * t + 8), u32(r1 + 2 * t + 8), b0, b1);
  }
  if (t == 0) {
    part[s][g] = d[0];
    part[s][g + 8] = d[2];
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float v = part[0][threadIdx.x];
    if (kTree && kS == 4) {
      v = __fadd_rn(__fadd_rn(part[0][threadIdx.x], part[1][threadIdx.x]),
                    __fadd_rn(part[2][threadIdx.x], part[3][threadIdx.x]));
    } else {
      for (int i = 1; i < kS; ++i) v = __fadd_rn(v, part[i][threadIdx.x]);
    }
    y[n0 + threadIdx.x] = __float2bfloat16(v);
  }
}

// kW warps a block; warp -> (tile group, slice) with the slices of a group in one block.
// kT tiles (16 rows) a warp; kP steps (LDG.64) or step pairs (LDG.128) in flight.
template <int kW, int kS, int kT, int kP, bool k128>
__global__ void __launch_bounds__(kW * 32)
    RegChain(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
             __nv_bfloat16* __restrict__ y, int N, int K) {
  static_assert(kW % kS == 0, "");
  __shared__ float part[kW][kT * 16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int gw = blockIdx.x * kW + warp;
  const int grp = gw / kS, s = gw % kS;
  const int n0 = grp * kT * 16;
  const bool live = n0 < N;
  const int L = K / kS, kb = s * L;
  float d[kT][4];
#pragma unroll
  for (int j = 0; j < kT; ++j) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
  if (live) {
    const int64_t K64 = K;
    if constexpr (!k128) {
      // Lane (g, t) holds actual k 4t..4t+3 of the group: hw 2t, 2t+1 <- 4t, 4t+1; hw 2t+8,
      // 2t+9 <- 4t+2, 4t+3 (a permutation within the k16 step, applied to x alike).
      const int steps = L / 16;
      const __nv_bfloat16* base = w + static_cast<int64_t>(n0 + g) * K64 + kb + 4 * t;
      const __nv_bfloat16* xb = x + kb + 4 * t;
      uint2 wa[kP][kT], wb[kP][kT];
#pragma unroll
      for (int p = 0; p < kP; ++p) {
#pragma unroll
        for (int j = 0; j < kT; ++j) {
          if (p < steps) {
            wa[p][j] = LoadStreaming8(base + (j * 16) * K64 + 16 * p);
            wb[p][j] = LoadStreaming8(base + (j * 16 + 8) * K64 + 16 * p);
          }
        }
      }
      for (int i = 0; i < steps; i += kP) {
#pragma unroll
        for (int p = 0; p < kP; ++p) {
          const int st = i + p;
          if (st < steps) {
            uint2 xv = *reinterpret_cast<const uint2*>(xb + 16 * st);
            if (g != 0) xv = make_uint2(0u, 0u);
#pragma unroll
            for (int j = 0; j < kT; ++j)
              Mma16816(d[j], wa[p][j].x, wb[p][j].x, wa[p][j].y, wb[p][j].y, xv.x, xv.y);
            if (st + kP < steps) {
#pragma unroll
              for (int j = 0; j < kT; ++j) {
                wa[p][j] = LoadStreaming8(base + (j * 16) * K64 + 16 * (st + kP));
                wb[p][j] = LoadStreaming8(base + (j * 16 + 8) * K64 + 16 * (st + kP));
              }
            }
          }
        }
      }
    } else {
      // Lane (g, t) loads 8 k of rows g and g + 8 at 32-element offset 8t (t < 2: step 2j,
      // t >= 2: step 2j + 1) and trades half with lane t ^ 2: afterwards it holds, for both
      // steps, the 4 k at offset o = (t & 1) * 8 + (t >> 1) * 4 of the step.
      const int pairs = L / 32;
      const __nv_bfloat16* base = w + static_cast<int64_t>(n0 + g) * K64 + kb + 8 * t;
      const int o = (t & 1) * 8 + (t >> 1) * 4;
      const __nv_bfloat16* xb = x + kb + o;
      const bool lo = t < 2;
      uint4 wa[kP][kT], wb[kP][kT];
#pragma unroll
      for (int p = 0; p < kP; ++p) {
#pragma unroll
        for (int j = 0; j < kT; ++j) {
          if (p < pairs) {
            wa[p][j] = LoadStreaming(base + (j * 16) * K64 + 32 * p);
            wb[p][j] = LoadStreaming(base + (j * 16 + 8) * K64 + 32 * p);
          }
        }
      }
      for (int i = 0; i < pairs; i += kP) {
#pragma unroll
        for (int p = 0; p < kP; ++p) {
          const int pr = i + p;
          if (pr < pairs) {
            uint2 x0 = *reinterpret_cast<const uint2*>(xb + 32 * pr);
            uint2 x1 = *reinterpret_cast<const uint2*>(xb + 32 * pr + 16);
            if (g != 0) x0 = x1 = make_uint2(0u, 0u);
#pragma unroll
            for (int j = 0; j < kT; ++j) {
              const uint4 ra = wa[p][j], rb = wb[p][j];
              const uint32_t ua0 = __shfl_xor_sync(0xffffffffu, lo ? ra.z : ra.x, 2);
              const uint32_t ua1 = __shfl_xor_sync(0xffffffffu, lo ? ra.w : ra.y, 2);
              const uint32_t ub0 = __shfl_xor_sync(0xffffffffu, lo ? rb.z : rb.x, 2);
              const uint32_t ub1 = __shfl_xor_sync(0xffffffffu, lo ? rb.w : rb.y, 2);
              // step 2j: lo ? own (x, y) : received; step 2j + 1: lo ? received : own (z, w)
              Mma16816(d[j], lo ? ra.x : ua0, lo ? rb.x : ub0, lo ? ra.y : ua1, lo ? rb.y : ub1,
                       x0.x, x0.y);
              Mma16816(d[j], lo ? ua0 : ra.z, lo ? ub0 : rb.z, lo ? ua1 : ra.w, lo ? ub1 : rb.w,
                       x1.x, x1.y);
            }
            if (pr + kP < pairs) {
#pragma unroll
              for (int j = 0; j < kT; ++j) {
                wa[p][j] = LoadStreaming(base + (j * 16) * K64 + 32 * (pr + kP));
                wb[p][j] = LoadStreaming(base + (j * 16 + 8) * K64 + 32 * (pr + kP));
              }
            }
          }
        }
      }
    }
  }
  if (t == 0) {
#pragma unroll
    for (int j = 0; j < kT; ++j) {
      part[warp][j * 16 + g] = d[j][0];
      part[warp][j * 16 + g + 8] = d[j][2];
    }
  }
  if constexpr (kS > 1)
    __syncthreads();
  else
    __syncwarp();
  // Warp w0 = the group's first warp in this block adds its slices in order.
  if (s == 0 && live && lane < 16) {
#pragma unroll
    for (int j = 0; j < kT; ++j) {
      float v = part[warp][j * 16 + lane];
#pragma unroll
      for (int i = 1; i < kS; ++i) v = __fadd_rn(v, part[warp + i][j * 16 + lane]);
      const int n = n0 + j * 16 + lane;
      if (n < N) y[n] = __float2bfloat16(v);
    }
  }
}

// Burst loads: a warp's 16-row tile streams kP steps of both its rows at once (32 * kP contiguous
// bytes a row, issued back to back) into one of two register buffers while it consumes the
// other. x (one token) sits in shared memory. Same fragments and chain as RegChain (S = 1, T = 1).
template <int kW, int kP>
__global__ void __launch_bounds__(kW * 32)
    BurstChain(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
               __nv_bfloat16* __restrict__ y, int N, int K) {
  extern __shared__ __align__(16) unsigned char xs_raw[];
  auto* xs = reinterpret_cast<__nv_bfloat16*>(xs_raw);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  for (int i = threadIdx.x * 8; i < K; i += kW * 32 * 8)
    *reinterpret_cast<uint4*>(xs + i) = *reinterpret_cast<const uint4*>(x + i);
  __syncthreads();
  const int n0 = (blockIdx.x * kW + warp) * 16;
  if (n0 >= N) return;
  const int64_t K64 = K;
  const __nv_bfloat16* ra = w + (n0 + g) * K64 + 4 * t;
  const __nv_bfloat16* rb = ra + 8 * K64;
  const __nv_bfloat16* xr = xs + 4 * t;
  const int steps = K / 16;
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  uint2 a0[kP], b0[kP], a1[kP], b1[kP];
  auto load = [&](uint2(&A)[kP], uint2(&B)[kP], int s0) {
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      A[p] = LoadStreaming8(ra + 16 * (s0 + p));
      B[p] = LoadStreaming8(rb + 16 * (s0 + p));
    }
  };
  auto consume = [&](uint2(&A)[kP], uint2(&B)[kP], int s0) {
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      uint2 xv = *reinterpret_cast<const uint2*>(xr + 16 * (s0 + p));
      if (g != 0) xv = make_uint2(0u, 0u);
      Mma16816(d, A[p].x, B[p].x, A[p].y, B[p].y, xv.x, xv.y);
    }
  };
  load(a0, b0, 0);
  for (int s = 0; s < steps; s += 2 * kP) {
    if (s + kP < steps) load(a1, b1, s + kP);
    consume(a0, b0, s);
    if (s + kP >= steps) break;
    if (s + 2 * kP < steps) load(a0, b0, s + 2 * kP);
    consume(a1, b1, s + kP);
  }
  if (t == 0) {
    if (n0 + g < N) y[n0 + g] = __float2bfloat16(d[0]);
    if (n0 + g + 8 < N) y[n0 + g + 8] = __float2bfloat16(d[2]);
  }
}

struct Shape {
  const char* name;
  int n, k;
};
const Shape kShapes[] = {{"qkv", 12288, 4096},
                         {"o", 4096, 4096},
                         {"gate_up", 22016, 4096},
                         {"down", 4096, 11008},
                         {"lm_head", 32256, 4096}};

#define LK(x)                                                                          \
  do {                                                                                 \
    cublasStatus_t st_ = (x);                                                          \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                \
      std::fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)st_); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

struct LtProb {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c;
};
LtProb MakeLt(int m, int n, int k) {
  LtProb p;
  LK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  LK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  LK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, k));
  LK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
  LK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, n, m, n));
  return p;
}
void FreeLt(LtProb& p) {
  cublasLtMatrixLayoutDestroy(p.a);
  cublasLtMatrixLayoutDestroy(p.b);
  cublasLtMatrixLayoutDestroy(p.c);
  cublasLtMatmulDescDestroy(p.desc);
}

// cuBLASLt's fixed algorithm (the heuristic's first unsplit candidate at M = 64) with split-K
// forced to S: are its bits the S-slice chains added in order? And what does S cost at M = 64
// and 2048 against S = 1?
void LtSplitCheck(const Shape& sh, const std::vector<__nv_bfloat16*>& ws, const __nv_bfloat16* x1,
                  const std::vector<uint16_t>* refs, const std::vector<uint16_t>& tree4) {
  static cublasLtHandle_t lt = nullptr;
  if (lt == nullptr) LK(cublasLtCreate(&lt));
  const size_t ws_bytes = size_t{256} << 20;
  static void* wsp = nullptr;
  static __nv_bfloat16 *xb = nullptr, *yb = nullptr;
  if (wsp == nullptr) {
    CK(cudaMalloc(&wsp, ws_bytes));
    CK(cudaMalloc(&xb, size_t{2} * 2048 * 11008));
    CK(cudaMalloc(&yb, size_t{2} * 2048 * 32256));
    CK(cudaMemset(xb, 0, size_t{2} * 2048 * 11008));
  }
  // Every row of x is the microbenchmark's x, so every row must equal the reference row.
  for (int r = 0; r < 2048; ++r)
    CK(cudaMemcpy(xb + size_t{1} * r * sh.k, x1, sh.k * 2, cudaMemcpyDeviceToDevice));
  LtProb ref = MakeLt(64, sh.n, sh.k);
  cublasLtMatmulPreference_t pref;
  LK(cublasLtMatmulPreferenceCreate(&pref));
  LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                          sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t res[16];
  int found = 0;
  LK(cublasLtMatmulAlgoGetHeuristic(lt, ref.desc, ref.a, ref.b, ref.c, ref.c, pref, 16, res,
                                    &found));
  cublasLtMatmulPreferenceDestroy(pref);
  FreeLt(ref);
  const cublasLtMatmulAlgo_t* base = nullptr;
  for (int i = 0; i < found && base == nullptr; ++i) {
    int32_t sp = 1;
    size_t wr = 0;
    LK(cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sp,
                                            sizeof(sp), &wr));
    if (res[i].state == CUBLAS_STATUS_SUCCESS && sp == 1) base = &res[i].algo;
  }
  if (base == nullptr) {
    std::printf("lt %s: no unsplit candidate\n", sh.name);
    return;
  }
  for (int split : {1, 2, 4}) {
    cublasLtMatmulAlgo_t algo = *base;
    const int32_t sp = split;
    const uint32_t scheme =
        split == 1 ? CUBLASLT_REDUCTION_SCHEME_NONE : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    LK(cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sp,
                                            sizeof(sp)));
    LK(cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                            sizeof(scheme)));
    for (int m : {1, 64, 2048}) {
      LtProb p = MakeLt(m, sh.n, sh.k);
      cublasLtMatmulHeuristicResult_t chk{};
      if (cublasLtMatmulAlgoCheck(lt, p.desc, p.a, p.b, p.c, p.c, &algo, &chk) !=
              CUBLAS_STATUS_SUCCESS ||
          chk.workspaceSize > ws_bytes) {
        std::printf("lt %-8s split %d M=%4d: refused\n", sh.name, split, m);
        FreeLt(p);
        continue;
      }
      const float alpha = 1.0f, beta = 0.0f;
      auto run = [&](int i) {
        LK(cublasLtMatmul(lt, p.desc, &alpha, ws[i % ws.size()], p.a, xb, p.b, &beta, yb, p.c, yb,
                          p.c, &algo, wsp, ws_bytes, 0));
      };
      run(0);
      CK(cudaDeviceSynchronize());
      std::vector<uint16_t> got(size_t{1} * m * sh.n);
      CK(cudaMemcpy(got.data(), yb, got.size() * 2, cudaMemcpyDeviceToHost));
      const auto& r = refs[split == 1 ? 0 : split == 2 ? 1 : 2];
      int64_t d_seq = 0, d_tree = 0, d_rows = 0;
      for (int row = 0; row < m; ++row) {
        for (int i = 0; i < sh.n; ++i) {
          const uint16_t v = got[size_t{1} * row * sh.n + i];
          d_seq += r.empty() ? 1 : v != r[i];
          d_tree += tree4.empty() ? 1 : v != tree4[i];
          d_rows += v != got[i];
        }
      }
      std::vector<double> ms;
      for (int rep = 0; rep < 3; ++rep) ms.push_back(MedianMs(m >= 1024 ? 20 : 50, run));
      std::sort(ms.begin(), ms.end());
      const double flops = 2.0 * m * sh.n * double(sh.k);
      std::printf(
          "lt %-8s split %d M=%4d  %8.4f ms  %6.0f GB/s  %6.1f TFLOP/s  outputs unlike "
          "the in-order slice chains %lld, unlike the 4-slice tree %lld, rows unlike row 0 %lld\n",
          sh.name, split, m, ms[1], 2.0 * sh.n * sh.k / ms[1] / 1e6, flops / ms[1] / 1e9,
          (long long)d_seq, (long long)d_tree, (long long)d_rows);
      std::fflush(stdout);
      FreeLt(p);
    }
  }
}

struct Ctx {
  const Shape* sh;
  std::vector<__nv_bfloat16*> ws;
  __nv_bfloat16 *x, *y, *yref;
  double copy_gbs;
  size_t wbytes;
  std::vector<uint16_t> ref_host[3];  // S = 1, 2, 4
};

template <int kS>
void RunRef(Ctx& c, std::vector<uint16_t>& out) {
  RefChain<kS><<<c.sh->n / 16, 32 * kS>>>(c.x, c.ws[0], c.yref, c.sh->n, c.sh->k);
  CK(cudaDeviceSynchronize());
  out.resize(c.sh->n);
  CK(cudaMemcpy(out.data(), c.yref, c.sh->n * 2, cudaMemcpyDeviceToHost));
}

// One variant: its first output checked bit for bit against `ref`, then its median time (the
// middle of 3 medians of 60 launches) printed as a share of the copy bandwidth after `label`.
void Measure(Ctx& c, const std::vector<uint16_t>& ref, const std::function<void(int)>& launch,
             const std::string& label) {
  const Shape& sh = *c.sh;
  CK(cudaMemset(c.y, 0, sh.n * 2));
  launch(0);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> got(sh.n);
  CK(cudaMemcpy(got.data(), c.y, sh.n * 2, cudaMemcpyDeviceToHost));
  int diff = 0;
  for (int i = 0; i < sh.n; ++i) diff += got[i] != ref[i];
  std::vector<double> ms;
  for (int r = 0; r < 3; ++r) ms.push_back(MedianMs(60, launch));
  std::sort(ms.begin(), ms.end());
  const double gbs = c.wbytes / ms[1] / 1e6;
  std::printf("%-8s %-24s %8.4f ms  %6.0f GB/s  %5.1f%% of copy  diff=%d\n", sh.name, label.c_str(),
              ms[1], gbs, 100.0 * gbs / c.copy_gbs, diff);
  std::fflush(stdout);
}

template <int kW, int kS, int kT, int kP, bool k128>
void RunVariant(Ctx& c) {
  const Shape& sh = *c.sh;
  if (sh.k % (kS * 32) != 0) return;
  const int groups = (sh.n + kT * 16 - 1) / (kT * 16);
  const int warps = groups * kS;
  const int blocks = (warps + kW - 1) / kW;
  char label[64];
  std::snprintf(label, sizeof(label), "S=%d W=%d T=%d P=%2d %s", kS, kW, kT, kP,
                k128 ? "ld128" : "ld64");
  Measure(
      c,
      c.ref_host[kS == 1   ? 0
                 : kS == 2 ? 1
                           : 2],
      [&](int i) {
        RegChain<kW, kS, kT, kP, k128>
            <<<blocks, kW * 32>>>(c.x, c.ws[i % c.ws.size()], c.y, sh.n, sh.k);
      },
      label);
}

template <int kW, int kS, int kT>
void RunPs(Ctx& c) {
  RunVariant<kW, kS, kT, 4, false>(c);
  RunVariant<kW, kS, kT, 8, false>(c);
  RunVariant<kW, kS, kT, 16, false>(c);
  RunVariant<kW, kS, kT, 2, true>(c);
  RunVariant<kW, kS, kT, 4, true>(c);
  RunVariant<kW, kS, kT, 8, true>(c);
}

template <int kW, int kP>
void RunBurst(Ctx& c) {
  const Shape& sh = *c.sh;
  if ((sh.k / 16) % kP != 0) return;
  const int blocks = (sh.n / 16 + kW - 1) / kW;
  const size_t smem = size_t{2} * sh.k;
  CK(cudaFuncSetAttribute(BurstChain<kW, kP>, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536));
  char label[64];
  std::snprintf(label, sizeof(label), "burst W=%d P=%2d", kW, kP);
  Measure(
      c, c.ref_host[0],
      [&](int i) {
        BurstChain<kW, kP><<<blocks, kW * 32, smem>>>(c.x, c.ws[i % c.ws.size()], c.y, sh.n, sh.k);
      },
      label);
}

// The chain GEMV's arithmetic alone (session 35): each warp runs kC independent chains of `steps`
// dependent mma.m16n8k16 (bf16, f32 accumulate) on register operands, interleaved, and lane 0
// of each warp records its clock64 cycles. One chain a warp gives the dependent-issue latency of
// an mma (what a 16-row tile's chain over K costs at least: K / 16 of them); more chains a warp
// and more warps an SM show how far the tensor pipe overlaps independent chains. The ring's
// consumer in the chain GEMV runs one chain a warp, 2 chain warps an SM for o and down.
template <int kC>
__global__ void MmaChainLatency(int steps, long long* cycles, float* sink) {
  const int lane = threadIdx.x & 31;
  float d[kC][4];
  uint32_t a[kC][4];
#pragma unroll
  for (int c = 0; c < kC; ++c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      d[c][i] = 0.0f;
      a[c][i] =
          0x3c003c00u ^ static_cast<uint32_t>(lane * 7 + c * 13 + i);  // small bf16 pairs (2^-7)
    }
  }
  const uint32_t b0 = 0x3c003c00u ^ lane, b1 = 0x3c003c00u ^ (lane * 3);
  __syncwarp();
  const long long t0 = clock64();
  // Empty volatile asm that "writes" the accumulators after the first clock read and "reads"
  // their sum before the second: the chains cannot be moved outside the timed span.
#pragma unroll
  for (int c = 0; c < kC; ++c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[c][i]));
  }
  for (int s = 0; s < steps; ++s) {
#pragma unroll
    for (int c = 0; c < kC; ++c) Mma16816(d[c], a[c], b0, b1);
  }
  float acc = 0.0f;
#pragma unroll
  for (int c = 0; c < kC; ++c) acc += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  asm volatile("" ::"f"(acc));
  __syncwarp();
  const long long t1 = clock64();
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;  // keeps the chains
  if (lane == 0) cycles[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = t1 - t0;
}

template <int kC>
void RunLatency(int sms, int warps_per_sm, int steps) {
  const int warps = sms * warps_per_sm;
  long long* cycles;
  float* sink;
  CK(cudaMalloc(&cycles, warps * sizeof(long long)));
  CK(cudaMalloc(&sink, warps * 32 * sizeof(float)));
  std::vector<double> per_step;
  for (int r = 0; r < 5; ++r) {
    MmaChainLatency<kC><<<sms, warps_per_sm * 32>>>(steps, cycles, sink);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<long long> h(warps);
    CK(cudaMemcpy(h.data(), cycles, warps * sizeof(long long), cudaMemcpyDeviceToHost));
    std::sort(h.begin(), h.end());
    per_step.push_back(static_cast<double>(h[warps / 2]) / steps);  // the median warp
  }
  std::sort(per_step.begin(), per_step.end());
  // Cycles a step, the median of 5 runs: a step is one mma of each of the warp's kC chains, so
  // this is also what one chain's dependent mma costs.
  const double cyc = per_step[2];
  // Bytes of weight a chain step stands for in the chain GEMV: a 16-row tile x 16 k of bf16.
  std::printf(
      "mma chains: %2d a warp, %2d warps an SM: %6.1f cycles a chain's mma, %5.1f per mma an SM, "
      "16x16 bf16 weight tiles an SM: %5.1f bytes/cycle\n",
      kC, warps_per_sm, cyc, cyc / (kC * warps_per_sm), 512.0 * kC * warps_per_sm / cyc);
  CK(cudaFree(cycles));
  CK(cudaFree(sink));
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "latency") == 0) {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device %s, %d SMs (cycles: the SM clock, clock64)\n", prop.name,
                prop.multiProcessorCount);
    const int sms = prop.multiProcessorCount, steps = 4096;
    for (int w : {1, 2, 4, 8, 16}) RunLatency<1>(sms, w, steps);
    for (int w : {1, 2, 4}) RunLatency<2>(sms, w, steps);
    for (int w : {1, 2, 4}) RunLatency<4>(sms, w, steps);
    RunLatency<8>(sms, 1, steps);
    RunLatency<8>(sms, 4, steps);
    return 0;
  }
  const bool burst = argc > 1 && std::strcmp(argv[1], "burst") == 0;
  const char* only = argc > 1 && !burst && std::strcmp(argv[1], "all") != 0 ? argv[1] : nullptr;
  const bool skip_lt = burst || (argc > 2 && std::strcmp(argv[2], "nolt") == 0);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  // Copy bandwidth (read + write), as tpserve-cuda-bench measures it.
  const size_t cb = size_t{1} << 30;
  void *src, *dst;
  CK(cudaMalloc(&src, cb));
  CK(cudaMalloc(&dst, cb));
  CK(cudaMemset(src, 1, cb));
  double copy_ms =
      MedianMs(10, [&](int) { CK(cudaMemcpyAsync(dst, src, cb, cudaMemcpyDeviceToDevice)); });
  CK(cudaFree(src));
  CK(cudaFree(dst));
  const double copy_gbs = 2.0 * cb / copy_ms / 1e6;
  std::printf("copy %.0f GB/s\n", copy_gbs);
  __nv_bfloat16 *x, *y, *yref;
  CK(cudaMalloc(&x, 11008 * 2));
  CK(cudaMalloc(&y, 32256 * 2));
  CK(cudaMalloc(&yref, 32256 * 2));
  {
    std::vector<uint16_t> h(11008);
    uint32_t st = 12345;
    for (auto& v : h) {
      st = st * 1664525u + 1013904223u;
      const float f = ((st >> 8) / 16777216.0f - 0.5f) * 2.0f;
      __nv_bfloat16 b = __float2bfloat16(f);
      std::memcpy(&v, &b, 2);
    }
    CK(cudaMemcpy(x, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  }
  for (const Shape& sh : kShapes) {
    if (only != nullptr && std::strcmp(only, sh.name) != 0) continue;
    Ctx c;
    c.sh = &sh;
    c.x = x;
    c.y = y;
    c.yref = yref;
    c.copy_gbs = copy_gbs;
    c.wbytes = size_t{2} * sh.n * sh.k;
    const int copies = static_cast<int>(std::max<size_t>(2, (size_t{1} << 30) / c.wbytes + 1));
    std::vector<uint16_t> h(size_t{1} * sh.n * sh.k);
    uint32_t st = 777 + sh.n;
    for (auto& v : h) {
      st = st * 1664525u + 1013904223u;
      // exponents over a wide range, signs mixed: cancellation and rounding show up
      const float f =
          ((st >> 8) / 16777216.0f - 0.5f) * std::ldexp(1.0f, static_cast<int>(st % 13) - 6);
      __nv_bfloat16 b = __float2bfloat16(f);
      std::memcpy(&v, &b, 2);
    }
    for (int i = 0; i < copies; ++i) {
      __nv_bfloat16* p;
      CK(cudaMalloc(&p, c.wbytes));
      CK(cudaMemcpy(p, h.data(), c.wbytes, cudaMemcpyHostToDevice));
      c.ws.push_back(p);
    }
    RunRef<1>(c, c.ref_host[0]);
    if (sh.k % 64 == 0) RunRef<2>(c, c.ref_host[1]);
    if (sh.k % 128 == 0) RunRef<4>(c, c.ref_host[2]);
    std::vector<uint16_t> tree4;
    if (sh.k % 128 == 0) {
      RefChain<4, true><<<sh.n / 16, 128>>>(c.x, c.ws[0], c.yref, sh.n, sh.k);
      CK(cudaDeviceSynchronize());
      tree4.resize(sh.n);
      CK(cudaMemcpy(tree4.data(), c.yref, sh.n * 2, cudaMemcpyDeviceToHost));
    }
    if (!skip_lt) LtSplitCheck(sh, c.ws, x, c.ref_host, tree4);
    {
      int d2 = 0;
      for (int i = 0; i < sh.n; ++i) d2 += c.ref_host[0][i] != c.ref_host[1][i];
      std::printf("%s: S=2 reference differs from S=1 in %d of %d outputs\n", sh.name, d2, sh.n);
    }
    if (burst) {
      RunVariant<4, 1, 1, 8, false>(c);
      RunBurst<4, 4>(c);
      RunBurst<4, 8>(c);
      RunBurst<4, 16>(c);
      RunBurst<2, 8>(c);
      RunBurst<2, 16>(c);
      RunBurst<8, 8>(c);
      RunBurst<1, 16>(c);
    } else {
      RunPs<4, 1, 1>(c);
      RunPs<4, 1, 2>(c);
      RunPs<8, 1, 1>(c);
      RunPs<4, 2, 1>(c);
      RunPs<8, 2, 1>(c);
      RunPs<4, 2, 2>(c);
      RunPs<4, 4, 1>(c);
      RunPs<8, 4, 1>(c);
    }
    for (auto* p : c.ws) CK(cudaFree(p));
  }
  return 0;
}
