// tpserve-stream-probe (built with the CUDA tools; kernels/cuda/NOTES.md, session 36): what
// bandwidth the weight streams of the deterministic chain GEMV can reach, without its arithmetic
// and with it, on the DeepSeek-Coder-6.7B shapes at M = 1.
//   tpserve-stream-probe [all|qkv|o|gate_up|down]
// Session 35's question: the chain GEMV's ring (gemm_lt_chain.cu: a block owns 32 weight rows, a
// 4-stage cp.async ring of 256 k, two warps running the mma chains) pulls ~73% of copy on down and
// ~64% on o, where the skinny kernel pulls 89% and 70%; `tpserve-regchain-probe latency` put a
// dependent mma at ~24 cycles, so the chains' arithmetic (16 mma a stage) is not what caps it.
// Each row below streams the same bytes in another way:
// - read: every thread of a full grid loads 16-byte pieces, 4 in flight (the read ceiling);
// - ldg T/R/U: the skinny kernel's pattern: a block of T threads owns R rows, its warps split K
//   in 512-byte pieces, U pieces a row in flight a lane;
// - ldg-rows T/R/U: the ring's block shape (R = 32 rows a block) with plain loads: each warp owns
//   R / warps rows over all of K, U pieces a row in flight a lane;
// - ring T/R/KT/S (+chain): the chain GEMV's cp.async ring (R rows, stages of KT k, S stages, a
//   block barrier a stage); "+chain": R / 16 warps run ldmatrix and 16 dependent mma a stage
//   (the real consumer, x a constant register), the other warps issue the copies, and the first
//   chain warp's clock splits its stage time into waiting (copy wait + barrier) and computing;
// - bulk R/KT/S (+chain): a TMA ring: one warp issues one cp.async.bulk a row and stage
//   completing on the stage's mbarrier, R / 16 consumer warps wait on it (and run the chain),
//   then free the stage on a second mbarrier; no block barrier.
// - tile-bulk T/KT/S (+chain), tile-ldg W/P: the weights in a tile-contiguous layout (session
//   37's question): a 16-row tile's k16 steps stored one after another, each step as the 32
//   lanes' A fragments (16 bytes a lane), so a tile over all of K is one contiguous run. tile-bulk:
//   a block of T tiles, one bulk copy a tile and stage (16 x KT x 2 bytes), its chain warps read
//   their fragments with one conflict-free 16-byte shared load a step (no ldmatrix); tile-ldg: a
//   warp a tile, W warps a block, loading its fragments straight from global (512 contiguous
//   bytes a warp-wide load), P steps in flight in registers, no shared memory. Only the address
//   pattern is measured (the bytes are not transformed).
// Weights are rotated over enough copies (>= 1 GiB) that L2 holds none of the next launch's.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/mma_util.cuh"
#include "kernels/cuda/wgmma_util.cuh"
#include "tools/cuda_bench/probes/probe_util.h"

using namespace tpserve::cuda;  // the tree's copy, ldmatrix, mma and mbarrier helpers

namespace {

// Keeps a value alive without storing it (a store only when it equals an impossible pattern).
__device__ __forceinline__ void Keep(float v, float* sink) {
  if (__float_as_uint(v) == 0x7fbadbadu) sink[0] = v;
}

// Marks v as used here. Volatile asm keeps its order with the loads (themselves volatile asm), so
// a load's registers stay live until this point: every load of a batch is issued before the first
// of its values is used (without it, ptxas interleaved loads and uses: 32 registers, few in
// flight).
__device__ __forceinline__ void Touch(uint4& v) {
  asm volatile("" : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w));
}

// A streaming 16-byte load of w[at..at+8) without a branch (a branch around each load kept ptxas
// from having them in flight together): an invalid piece loads w[0..8) and yields zeros.
__device__ __forceinline__ uint4 LoadIf(const __nv_bfloat16* w, int64_t at, bool valid) {
  uint4 v = LoadStreaming(w + (valid ? at : 0));
  const uint32_t m = valid ? 0xffffffffu : 0u;
  return make_uint4(v.x & m, v.y & m, v.z & m, v.w & m);
}

// Every thread loads 16-byte pieces of the whole matrix, 4 in flight.
__global__ void __launch_bounds__(512) ReadKernel(const uint4* w, size_t n16, float* sink) {
  uint32_t acc = 0;
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = LoadStreaming(w + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) Touch(v[u]);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) {
    uint4 v = LoadStreaming(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  Keep(__uint_as_float(acc), sink);
}

// The skinny kernel's loads: block b owns rows [b R, b R + R); warp w takes the 256-k pieces w,
// w + warps, ...; each lane loads U pieces of each row before using them.
// Loads kU 16-byte pieces of each of kRows rows (row n0 + r, piece u at column k_of(u) of this
// lane) before using any, then folds them into acc. Shared by the plain-load kernels below.
template <int kU, int kRows, class KOf>
__device__ __forceinline__ void LoadAndFold(const __nv_bfloat16* w, int N, int K, int n0, KOf k_of,
                                            uint32_t& acc) {
  uint4 v[kU][kRows];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int k = k_of(u);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      v[u][r] = LoadIf(w, static_cast<int64_t>(n0 + r) * K + k, k < K && n0 + r < N);
    }
  }
#pragma unroll
  for (int u = 0; u < kU; ++u) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) Touch(v[u][r]);
  }
#pragma unroll
  for (int u = 0; u < kU; ++u) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc ^= v[u][r].x ^ v[u][r].y ^ v[u][r].z ^ v[u][r].w;
  }
}

template <int kT, int kR, int kU>
__global__ void __launch_bounds__(kT) LdgKernel(const __nv_bfloat16* w, int N, int K, float* sink) {
  constexpr int kWarps = kT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int pieces = (K + 255) / 256, n0 = blockIdx.x * kR;
  uint32_t acc = 0;
  for (int c0 = warp; c0 < pieces; c0 += kWarps * kU) {
    LoadAndFold<kU, kR>(
        w, N, K, n0, [&](int u) { return (c0 + u * kWarps) * 256 + lane * 8; }, acc);
  }
  Keep(__uint_as_float(acc), sink);
}

// The ring's block shape with plain loads: block b owns rows [b R, b R + R), warp w rows
// w R / warps ..., each over all of K, U 512-byte pieces a row in flight a lane.
template <int kT, int kR, int kU>
__global__ void __launch_bounds__(kT, 1)
    LdgRowsKernel(const __nv_bfloat16* w, int N, int K, float* sink) {
  constexpr int kRW = kR / (kT / 32);
  static_assert(kRW >= 1 && kRW * (kT / 32) == kR, "rows split evenly over the warps");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int pieces = (K + 255) / 256, n0 = blockIdx.x * kR + warp * kRW;
  uint32_t acc = 0;
  for (int c0 = 0; c0 < pieces; c0 += kU) {
    LoadAndFold<kU, kRW>(
        w, N, K, n0, [&](int u) { return (c0 + u) * 256 + lane * 8; }, acc);
  }
  Keep(__uint_as_float(acc), sink);
}

// The chain's consumer for one 16-row tile and one stage of kKT k: kKT / 16 ldmatrix, then the
// kKT / 16 dependent mma (B a constant register pair: the memory side is what is measured).
template <int kKT>
__device__ __forceinline__ void ChainStage(float (&d)[4], uint32_t a_base, int groups) {
  constexpr int kGroups = kKT / 16;
  const uint32_t b0 = 0x3c003c00u, b1 = 0x3c003c00u;
  if (groups == kGroups) {
#pragma unroll
    for (int q0 = 0; q0 < kGroups; q0 += 16) {
      uint32_t af[16][4];
#pragma unroll
      for (int q = 0; q < 16; ++q) LdMatrixX4(af[q], a_base + (q0 + q) * 32);
#pragma unroll
      for (int q = 0; q < 16; ++q) Mma16816(d, af[q], b0, b1);
    }
  } else {
    for (int q = 0; q < groups; ++q) {
      uint32_t af[4];
      LdMatrixX4(af, a_base + q * 32);
      Mma16816(d, af, b0, b1);
    }
  }
}

// The chain GEMV's cp.async ring (gemm_lt_chain.cu), optionally with its chain warps.
template <int kT, int kR, int kKT, int kS, bool kChain>
__global__ void __launch_bounds__(kT)
    RingKernel(const __nv_bfloat16* w, int N, int K, float* sink, long long* cyc) {
  constexpr int kStride = kKT + 8, kElems = kR * kStride, kVecs = kKT / 8;
  constexpr int kChainThreads = kChain ? kR / 16 * 32 : 0;
  constexpr int kIssuers = kT - kChainThreads;
  static_assert(kIssuers > 0, "a warp must issue the copies");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* stages = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int issuer = tid - kChainThreads, n0 = blockIdx.x * kR;
  const int num_kt = (K + kKT - 1) / kKT;
  auto issue = [&](int kt) {
    if (kt < num_kt && issuer >= 0) {
      __nv_bfloat16* dst = stages + (kt % kS) * kElems;
      const int k0 = kt * kKT;
      for (int i = issuer; i < kR * kVecs; i += kIssuers) {
        const int r = i / kVecs, c = i % kVecs, row = n0 + r, k = k0 + c * 8;
        const bool valid = row < N && k < K;
        CpAsync16(SmemAddr(dst + r * kStride + c * 8),
                  valid ? w + static_cast<int64_t>(row) * K + k : w, valid);
      }
    }
    CpAsyncCommit();
  };
#pragma unroll
  for (int s = 0; s < kS - 1; ++s) issue(s);
  const bool chain_warp = kChain && warp < kR / 16;
  const int lm_row = (lane & 7) + ((lane >> 3) & 1) * 8, lm_col = (lane >> 4) * 8;
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  long long waited = 0, computed = 0;
  for (int kt = 0; kt < num_kt; ++kt) {
    const long long t0 = clock64();
    CpAsyncWait<kS - 2>();
    __syncthreads();
    const long long t1 = clock64();
    issue(kt + kS - 1);
    if (chain_warp) {
      const __nv_bfloat16* stage = stages + (kt % kS) * kElems;
      ChainStage<kKT>(d, SmemAddr(stage + (warp * 16 + lm_row) * kStride + lm_col),
                      min(kKT, K - kt * kKT) / 16);
      asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]));
    }
    const long long t2 = clock64();
    waited += t1 - t0;
    computed += t2 - t1;
  }
  CpAsyncWait<0>();
  Keep(d[0] + d[1] + d[2] + d[3], sink);
  if (tid == 0) {
    cyc[2 * blockIdx.x] = waited;
    cyc[2 * blockIdx.x + 1] = computed;
  }
}

// A wait on an mbarrier phase without the tree's deadline (its trap or fault path capped these
// kernels at 32 registers, with spills).
__device__ __forceinline__ void SpinWait(uint64_t* bar, uint32_t parity) {
  while (!MbarTryWait(bar, parity)) {
  }
}

// A TMA ring: warp 0 issues (lane r: row r's piece of the stage), warps 1..R/16 consume.
template <int kR, int kKT, int kS, bool kChain>
__global__ void __launch_bounds__(32 * (1 + kR / 16), 1)
    BulkKernel(const __nv_bfloat16* w, int N, int K, float* sink, long long* cyc) {
  constexpr int kStride = kKT + 8, kElems = kR * kStride, kConsumers = kR / 16;
  static_assert(kR <= 32, "a lane a row");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* stages = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  auto* full = reinterpret_cast<uint64_t*>(smem_raw + size_t{kS} * kElems * 2);
  uint64_t* empty = full + kS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n0 = blockIdx.x * kR;
  const int num_kt = (K + kKT - 1) / kKT;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kS; ++s) {
      MbarInit(&full[s], 1);
      MbarInit(&empty[s], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  long long waited = 0, computed = 0;
  if (warp == 0) {
    for (int kt = 0; kt < num_kt; ++kt) {
      const int s = kt % kS;
      if (kt >= kS) SpinWait(&empty[s], ((kt / kS) - 1) & 1);
      const int k0 = kt * kKT, len = min(kKT, K - k0);
      const int rows = min(kR, N - n0);
      if (lane == 0) MbarExpectTx(&full[s], static_cast<uint32_t>(rows * len * 2));
      __syncwarp();
      if (lane < rows) {
        BulkCopyToShared(stages + s * kElems + lane * kStride,
                         w + static_cast<int64_t>(n0 + lane) * K + k0,
                         static_cast<uint32_t>(len * 2), &full[s]);
      }
    }
  } else {
    const int c = warp - 1;
    const int lm_row = (lane & 7) + ((lane >> 3) & 1) * 8, lm_col = (lane >> 4) * 8;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int kt = 0; kt < num_kt; ++kt) {
      const int s = kt % kS;
      const long long t0 = clock64();
      SpinWait(&full[s], (kt / kS) & 1);
      const long long t1 = clock64();
      if constexpr (kChain) {
        const __nv_bfloat16* stage = stages + s * kElems;
        ChainStage<kKT>(d, SmemAddr(stage + (c * 16 + lm_row) * kStride + lm_col),
                        min(kKT, K - kt * kKT) / 16);
        asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]));
      }
      __syncwarp();
      if (lane == 0) MbarArrive(&empty[s]);
      const long long t2 = clock64();
      waited += t1 - t0;
      computed += t2 - t1;
    }
    Keep(d[0] + d[1] + d[2] + d[3], sink);
    if (c == 0 && lane == 0) {
      cyc[2 * blockIdx.x] = waited;
      cyc[2 * blockIdx.x + 1] = computed;
    }
  }
}

// Tile-contiguous layout, TMA ring: warp 0 lane 0 issues one bulk copy a tile and stage; warps
// 1..kTiles each run one tile's chain, a step's A fragment one 16-byte shared load.
template <int kTiles, int kKT, int kS, bool kChain>
__global__ void __launch_bounds__(32 * (1 + kTiles), 1)
    TileBulkKernel(const __nv_bfloat16* w, int N, int K, float* sink, long long* cyc) {
  constexpr int kTileElems = 16 * kKT;  // one tile's stage
  constexpr int kElems = kTiles * kTileElems;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto* stages = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  auto* full = reinterpret_cast<uint64_t*>(smem_raw + size_t{kS} * kElems * 2);
  uint64_t* empty = full + kS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t0 = blockIdx.x * kTiles, tiles = min(kTiles, N / 16 - t0);
  const int num_kt = (K + kKT - 1) / kKT;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kS; ++s) {
      MbarInit(&full[s], 1);
      MbarInit(&empty[s], kTiles);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  long long waited = 0, computed = 0;
  if (warp == 0) {
    if (lane == 0) {
      for (int kt = 0; kt < num_kt; ++kt) {
        const int s = kt % kS;
        if (kt >= kS) SpinWait(&empty[s], ((kt / kS) - 1) & 1);
        const int k0 = kt * kKT, len = min(kKT, K - k0);
        MbarExpectTx(&full[s], static_cast<uint32_t>(tiles * 16 * len * 2));
        for (int t = 0; t < tiles; ++t) {
          BulkCopyToShared(stages + s * kElems + t * kTileElems,
                           w + (static_cast<int64_t>(t0 + t) * K + k0) * 16,
                           static_cast<uint32_t>(16 * len * 2), &full[s]);
        }
      }
    }
  } else {
    const int c = warp - 1;
    const uint32_t b0 = 0x3c003c00u, b1 = 0x3c003c00u;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int kt = 0; kt < num_kt; ++kt) {
      const int s = kt % kS;
      const long long c0 = clock64();
      SpinWait(&full[s], (kt / kS) & 1);
      const long long c1 = clock64();
      if constexpr (kChain) {
        const uint4* frag =
            reinterpret_cast<const uint4*>(stages + s * kElems + c * kTileElems) + lane;
        const int groups = min(kKT, K - kt * kKT) / 16;
        if (groups == kKT / 16) {
#pragma unroll
          for (int q0 = 0; q0 < kKT / 16; q0 += 16) {
            uint4 af[16];
#pragma unroll
            for (int q = 0; q < 16; ++q) af[q] = frag[(q0 + q) * 32];
#pragma unroll
            for (int q = 0; q < 16; ++q) Mma16816(d, af[q].x, af[q].y, af[q].z, af[q].w, b0, b1);
          }
        } else {
          for (int q = 0; q < groups; ++q) {
            const uint4 a = frag[q * 32];
            Mma16816(d, a.x, a.y, a.z, a.w, b0, b1);
          }
        }
        asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]));
      }
      __syncwarp();
      if (lane == 0) MbarArrive(&empty[s]);
      const long long c2 = clock64();
      waited += c1 - c0;
      computed += c2 - c1;
    }
    Keep(d[0] + d[1] + d[2] + d[3], sink);
    if (c == 0 && lane == 0) {
      cyc[2 * blockIdx.x] = waited;
      cyc[2 * blockIdx.x + 1] = computed;
    }
  }
}

// Tile-contiguous layout, no shared memory: warp w of block b runs tile b kW + w, loading kP steps'
// fragments ahead (a rolling window: the load of step j + kP is issued after step j's mma).
template <int kW, int kP>
__global__ void __launch_bounds__(32 * kW)
    TileLdgKernel(const __nv_bfloat16* w, int N, int K, float* sink) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile = blockIdx.x * kW + warp;
  if (tile >= N / 16) return;
  const int steps = K / 16;
  const uint4* frag =
      reinterpret_cast<const uint4*>(w + static_cast<int64_t>(tile) * K * 16) + lane;
  const uint32_t b0 = 0x3c003c00u, b1 = 0x3c003c00u;
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  uint4 buf[kP];
#pragma unroll
  for (int j = 0; j < kP; ++j) buf[j] = LoadStreaming(frag + min(j, steps - 1) * 32);
  for (int j0 = 0; j0 < steps; j0 += kP) {
#pragma unroll
    for (int j = 0; j < kP; ++j) {
      if (j0 + j < steps) Mma16816(d, buf[j].x, buf[j].y, buf[j].z, buf[j].w, b0, b1);
      buf[j] = LoadStreaming(frag + min(j0 + kP + j, steps - 1) * 32);
    }
  }
  Keep(d[0] + d[1] + d[2] + d[3], sink);
}

struct Shape {
  const char* name;
  int n, k;
};
const Shape kShapes[] = {
    {"qkv", 12288, 4096}, {"o", 4096, 4096}, {"gate_up", 22016, 4096}, {"down", 4096, 11008}};

struct Ctx {
  const Shape* sh;
  std::vector<__nv_bfloat16*> ws;
  size_t wbytes;
  double copy_gbs;
  float* sink;
  long long* cyc;
  int sms;
};

void Report(const Ctx& c, const std::string& label, double ms, int blocks, int per_sm, bool timed,
            int stages) {
  const double gbs = c.wbytes / ms / 1e6;
  std::printf("%-8s %-34s %4d blocks (%d an SM) %8.4f ms %6.0f GB/s = %5.1f%% of copy", c.sh->name,
              label.c_str(), blocks, per_sm, ms, gbs, 100.0 * gbs / c.copy_gbs);
  if (timed) {
    // The last launch's first-chain-warp clocks, per stage, the median block.
    std::vector<long long> h(2 * blocks);
    CK(cudaMemcpy(h.data(), c.cyc, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    std::vector<double> wv, cv;
    for (int b = 0; b < blocks; ++b) {
      wv.push_back(static_cast<double>(h[2 * b]) / stages);
      cv.push_back(static_cast<double>(h[2 * b + 1]) / stages);
    }
    std::sort(wv.begin(), wv.end());
    std::sort(cv.begin(), cv.end());
    std::printf("; a stage: wait %.0f + compute %.0f cycles", wv[blocks / 2], cv[blocks / 2]);
  }
  std::printf("\n");
}

template <class Kernel>
int PerSm(Kernel k, int threads, size_t smem) {
  int n = 0;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, threads, smem));
  return n;
}

void RunRead(Ctx& c) {
  const size_t n16 = c.wbytes / 16;
  const int blocks = c.sms * 4;
  const double ms = MedianMs(20, [&](int i) {
    ReadKernel<<<blocks, 512>>>(reinterpret_cast<const uint4*>(c.ws[i % c.ws.size()]), n16, c.sink);
  });
  Report(c, "read (full grid, 4 in flight)", ms, blocks, 4, false, 1);
}

template <int kT, int kR, int kU>
void RunLdg(Ctx& c) {
  const int blocks = (c.sh->n + kR - 1) / kR;
  const int per_sm = PerSm(LdgKernel<kT, kR, kU>, kT, 0);
  const double ms = MedianMs(20, [&](int i) {
    LdgKernel<kT, kR, kU><<<blocks, kT>>>(c.ws[i % c.ws.size()], c.sh->n, c.sh->k, c.sink);
  });
  Report(c, "ldg T" + std::to_string(kT) + " R" + std::to_string(kR) + " U" + std::to_string(kU),
         ms, blocks, per_sm, false, 1);
}

template <int kT, int kR, int kU>
void RunLdgRows(Ctx& c) {
  const int blocks = (c.sh->n + kR - 1) / kR;
  const int per_sm = PerSm(LdgRowsKernel<kT, kR, kU>, kT, 0);
  const double ms = MedianMs(20, [&](int i) {
    LdgRowsKernel<kT, kR, kU><<<blocks, kT>>>(c.ws[i % c.ws.size()], c.sh->n, c.sh->k, c.sink);
  });
  Report(c,
         "ldg-rows T" + std::to_string(kT) + " R" + std::to_string(kR) + " U" + std::to_string(kU),
         ms, blocks, per_sm, false, 1);
}

template <int kT, int kR, int kKT, int kS, bool kChain>
void RunRing(Ctx& c) {
  const int blocks = (c.sh->n + kR - 1) / kR;
  const size_t smem = size_t{kS} * kR * (kKT + 8) * 2;
  auto* k = RingKernel<kT, kR, kKT, kS, kChain>;
  const int per_sm = PerSm(k, kT, smem);
  const double ms = MedianMs(20, [&](int i) {
    k<<<blocks, kT, smem>>>(c.ws[i % c.ws.size()], c.sh->n, c.sh->k, c.sink, c.cyc);
  });
  Report(c,
         "ring T" + std::to_string(kT) + " R" + std::to_string(kR) + " KT" + std::to_string(kKT) +
             " S" + std::to_string(kS) + (kChain ? " +chain" : ""),
         ms, blocks, per_sm, true, (c.sh->k + kKT - 1) / kKT);
}

template <int kR, int kKT, int kS, bool kChain>
void RunBulk(Ctx& c) {
  const int blocks = (c.sh->n + kR - 1) / kR, threads = 32 * (1 + kR / 16);
  const size_t smem = size_t{kS} * kR * (kKT + 8) * 2 + 2 * kS * sizeof(uint64_t);
  auto* k = BulkKernel<kR, kKT, kS, kChain>;
  const int per_sm = PerSm(k, threads, smem);
  const double ms = MedianMs(20, [&](int i) {
    k<<<blocks, threads, smem>>>(c.ws[i % c.ws.size()], c.sh->n, c.sh->k, c.sink, c.cyc);
  });
  Report(c,
         "bulk R" + std::to_string(kR) + " KT" + std::to_string(kKT) + " S" + std::to_string(kS) +
             (kChain ? " +chain" : ""),
         ms, blocks, per_sm, true, (c.sh->k + kKT - 1) / kKT);
}

template <int kTiles, int kKT, int kS, bool kChain>
void RunTileBulk(Ctx& c) {
  const int blocks = (c.sh->n / 16 + kTiles - 1) / kTiles, threads = 32 * (1 + kTiles);
  const size_t smem = size_t{kS} * kTiles * 16 * kKT * 2 + 2 * kS * sizeof(uint64_t);
  auto* k = TileBulkKernel<kTiles, kKT, kS, kChain>;
  const int per_sm = PerSm(k, threads, smem);
  const double ms = MedianMs(20, [&](int i) {
    k<<<blocks, threads, smem>>>(c.ws[i % c.ws.size()], c.sh->n, c.sh->k, c.sink, c.cyc);
  });
  Report(c,
         "tile-bulk T" + std::to_string(kTiles) + " KT" + std::to_string(kKT) + " S" +
             std::to_string(kS) + (kChain ? " +chain" : ""),
         ms, blocks, per_sm, true, (c.sh->k + kKT - 1) / kKT);
}

template <int kW, int kP>
void RunTileLdg(Ctx& c) {
  const int blocks = (c.sh->n / 16 + kW - 1) / kW;
  const int per_sm = PerSm(TileLdgKernel<kW, kP>, 32 * kW, 0);
  const double ms = MedianMs(20, [&](int i) {
    TileLdgKernel<kW, kP><<<blocks, 32 * kW>>>(c.ws[i % c.ws.size()], c.sh->n, c.sh->k, c.sink);
  });
  Report(c, "tile-ldg W" + std::to_string(kW) + " P" + std::to_string(kP) + " +chain", ms, blocks,
         per_sm, false, 1);
}

}  // namespace

int main(int argc, char** argv) {
  const char* only = argc > 1 && std::strcmp(argv[1], "all") != 0 ? argv[1] : nullptr;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  const size_t cb = size_t{1} << 30;
  void *src, *dst;
  CK(cudaMalloc(&src, cb));
  CK(cudaMalloc(&dst, cb));
  CK(cudaMemset(src, 1, cb));
  const double copy_ms =
      MedianMs(10, [&](int) { CK(cudaMemcpyAsync(dst, src, cb, cudaMemcpyDeviceToDevice)); });
  CK(cudaFree(src));
  CK(cudaFree(dst));
  Ctx c;
  c.copy_gbs = 2.0 * cb / copy_ms / 1e6;
  c.sms = prop.multiProcessorCount;
  std::printf("copy %.0f GB/s (read + write); %% below: weight bytes read / time / copy\n",
              c.copy_gbs);
  CK(cudaMalloc(&c.sink, 64));
  CK(cudaMalloc(&c.cyc, 2 * 4096 * sizeof(long long)));
  for (const Shape& sh : kShapes) {
    if (only != nullptr && std::strcmp(only, sh.name) != 0) continue;
    c.sh = &sh;
    c.wbytes = size_t{2} * sh.n * sh.k;
    const int copies = static_cast<int>(std::max<size_t>(2, cb / c.wbytes + 1));
    c.ws.clear();
    for (int i = 0; i < copies; ++i) {
      __nv_bfloat16* p;
      CK(cudaMalloc(&p, c.wbytes));
      CK(cudaMemset(p, (i * 37 + 11) & 0x7f, c.wbytes));  // small finite bf16 values
      c.ws.push_back(p);
    }
    RunRead(c);
    // The skinny kernel's pattern at its own shape (8 warps, 2 rows, 4 pieces) and at the ring's
    // block shape (32 rows a block of 16 or 32 warps).
    RunLdg<256, 2, 4>(c);
    RunLdg<256, 4, 2>(c);
    RunLdgRows<512, 32, 4>(c);
    RunLdgRows<512, 32, 8>(c);
    RunLdgRows<1024, 32, 8>(c);
    // The chain GEMV's ring (ChainNarrow: 512 threads, 32 rows, 256 k, 4 stages), without and
    // with the chains, and deeper / longer / 16-row forms of it.
    RunRing<512, 32, 256, 4, false>(c);
    RunRing<512, 32, 256, 4, true>(c);
    RunRing<512, 32, 256, 2, false>(c);
    RunRing<512, 32, 256, 8, false>(c);
    RunRing<512, 32, 256, 8, true>(c);
    RunRing<512, 32, 512, 4, false>(c);
    RunRing<512, 32, 512, 4, true>(c);
    RunRing<256, 16, 256, 4, false>(c);
    RunRing<256, 16, 256, 4, true>(c);
    RunRing<256, 16, 512, 6, true>(c);
    // The TMA ring, 32 and 16 rows a block.
    RunBulk<32, 256, 4, false>(c);
    RunBulk<32, 256, 4, true>(c);
    RunBulk<32, 256, 8, true>(c);
    RunBulk<32, 512, 4, true>(c);
    RunBulk<32, 1024, 3, true>(c);
    RunBulk<16, 256, 8, true>(c);
    RunBulk<16, 512, 6, true>(c);
    RunBulk<16, 1024, 4, true>(c);
    // The tile-contiguous layout (session 37): TMA ring of one bulk copy a tile and stage, and
    // fragments straight from global.
    RunTileBulk<2, 1024, 3, false>(c);
    RunTileBulk<2, 1024, 3, true>(c);
    RunTileBulk<2, 512, 4, true>(c);
    RunTileBulk<1, 1024, 3, true>(c);
    RunTileBulk<1, 512, 4, true>(c);
    RunTileBulk<1, 256, 8, true>(c);
    RunTileBulk<4, 512, 3, true>(c);
    RunTileLdg<2, 8>(c);
    RunTileLdg<2, 16>(c);
    RunTileLdg<4, 16>(c);
    RunTileLdg<1, 24>(c);
    for (auto* p : c.ws) CK(cudaFree(p));
  }
  return 0;
}
