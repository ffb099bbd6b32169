// Decode-sized GEMMs with the bits of cuBLASLt's fixed algorithm (deterministic mode).
//
// The fixed algorithm (LtGemm::set_fixed_algorithm: unsplit, one per weight shape) computes every
// output as one chain of tensor-core k16 steps over K in order from zero, then the bias, then one
// rounding to bf16: deterministic_ops_test ChainGemmAgainstTheFixedCublasLtAlgorithm finds the
// plain chain of mma.m16n8k16 below (LaunchChainGemmReference) equal to it bit for bit on the
// 6.7B and tiny-coder shapes at M = 1, 8, 64 and 300. So a decode batch may run this file's
// kernels and a prefill chunk cuBLASLt, and a token's row has the same bits in both.
//
// The chain GEMV (M <= 16): a block owns ChainCfg::kRT (2 in the launchers' own configurations)
// tiles of 16 weight rows (the A operand, through ldmatrix) and all tokens (the B operand, 8 per
// mma), both staged through shared memory by cp.async in a ring of K tiles (ChainDefault: 8 warps,
// 4 stages of 256, the copies issued by the warps without a chain); warp (token tile, row tile)
// runs that tile's chain. The first stages' weights go out before the programmatic-launch wait
// (they do not depend on the previous kernel); the epilogues' other operands (gamma, the
// residual, the RoPE/KV store's positions and slots) are read right after it, so the stores at
// the end wait on nothing. With the weight's tile-contiguous copy registered (MakeChainTiles;
// TPSERVE_DETERMINISTIC_TILES, on by default), the M <= 2 forms read it instead: one thread issues
// each stage as one bulk copy (TMA) a tile into an mbarrier ring, and a chain warp loads a k16
// step's A fragment with one 16-byte shared load (no ldmatrix, no cp.async in the LSU pipe), in
// the positions ldmatrix gives, so the bits are the same (H100, session 37: o / q/k/v / gate_up /
// down / lm_head at 66 / 87 / 94 / 81 / 98% of copy at M = 1, against 64 / 84 / 90 / 74 / 94 from
// the row-major ring). Fused forms for decode steps of at most
// kSkinnyFusedMaxM tokens (deterministic mode's versions of the skinny kernel's fusions, each
// giving the bits of the unfused ops):
// - input SwiGLU: B = bf16(SiluMulValue(gate, up)), as SiluMul stores it;
// - input row scale (a deferred norm's consumer): B = bf16(x * scale), as ApplyRowScale;
// - RoPE/KV epilogue: the block's two tiles are rows (i, i + D/2) of one head, rotated and stored
//   as RopeKvWrite does;
// - add-norm epilogue (a deferred norm's producer): y, residual += y, normed = bf16(h * gamma)
//   and each element's NormSquareFixed added into the record, as AddRmsNorm in deterministic
//   mode.
#include <algorithm>
#include <atomic>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gemm_epilogue.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/mma_util.cuh"
#include "kernels/cuda/wgmma_util.cuh"

namespace tpserve::cuda {
namespace {

// A pipeline configuration: threads per block, K elements per stage, stages in the ring,
// whether only the warps that run no chain issue the copies, the 16-row weight tiles a block
// owns (kRT; the RoPE/KV epilogue needs 2: a head's rows i and i + D/2), and whether the copies
// ask L2 to fetch 256 bytes at a time (cp.async's prefetch size). The launchers use ChainNarrow /
// ChainWide (M <= 2, by the waves of their grids: ChainWideWins) and ChainDefault (larger M);
// kChainConfigs lists the others that tpserve-cuda-bench --chain compares.
template <int kThreadsT, int kKTT, int kStagesT, bool kProducersOnlyT, int kRTT = 2,
          bool kL2PrefetchT = false, bool kTiledT = false>
struct ChainCfg {
  static constexpr int kThreads = kThreadsT;
  static constexpr int kKT = kKTT;
  static constexpr int kStages = kStagesT;
  static constexpr bool kProducersOnly = kProducersOnlyT;
  static constexpr int kRT = kRTT;
  static constexpr bool kL2Prefetch = kL2PrefetchT;
  // The weights from their tile-contiguous copy (MakeChainTiles) by one bulk copy (TMA) a tile and
  // stage, freed by the chain warps on mbarriers; the kTok <= 2 forms only.
  static constexpr bool kTiled = kTiledT;
  static constexpr int kRowStride = kKT + 8;  // +16 bytes: 8 rows hit 8 different bank groups
};
// 8 warps, copies by the 4-6 warps without a chain (M = 9-16: 4 chain warps).
using ChainDefault = ChainCfg<256, 256, 4, true>;

enum Input { kInPlain = 0, kInSwiGlu = 1, kInScaled = 2 };
enum Output { kOutStore = 0, kOutRopeKv = 1, kOutAddNorm = 2 };

// A stage: kRT * 16 weight rows, then (kTok > 2) the input rows of its K tile (gate rows then up
// rows for the SwiGLU input). With kTok = 2 (the fused decode forms) the whole input is instead
// read once, transformed, and kept after the ring: kTok rows of XStride(K).
// Tiled (C::kTiled): a stage is kRT tiles of 16 x kKT in fragment order (no padding), and the
// ring's 2 kStages mbarriers (full, empty) follow the input rows.
template <int kTok, int kIn, class C>
struct Stage {
  static constexpr bool kUpfront = kTok <= 2;
  static_assert(!C::kTiled || kUpfront, "tiled weights: the kTok <= 2 forms only");
  static constexpr int kXRows = kUpfront ? 0 : kIn == kInSwiGlu ? 2 * kTok : kTok;
  static constexpr int kElems =
      C::kTiled ? C::kRT * 16 * C::kKT : (C::kRT * 16 + kXRows) * C::kRowStride;
  static constexpr size_t kRingBytes = size_t{C::kStages} * kElems * 2;
  __host__ __device__ static constexpr int XStride(int K) {
    return (K + C::kKT - 1) / C::kKT * C::kKT + 8;
  }
  __host__ __device__ static constexpr size_t BarrierOffset(int K) {
    return kRingBytes + (kUpfront ? size_t{2} * kTok * XStride(K) : 0);
  }
  static size_t SmemBytes(int K) {
    return BarrierOffset(K) + (C::kTiled ? 2 * C::kStages * sizeof(uint64_t) : 0);
  }
};
constexpr size_t kMaxSmem = 227 * 1024;

struct ChainArgs {
  const __nv_bfloat16* x = nullptr;   // [M, K], or gate_up [M, 2K] for kInSwiGlu
  const __nv_bfloat16* w = nullptr;   // [N, K]
  const __nv_bfloat16* wt = nullptr;  // its tile-contiguous copy (FindChainTiles), or null
  const __nv_bfloat16* bias = nullptr;
  __nv_bfloat16* y = nullptr;  // [M, N] (kOutStore, kOutAddNorm)
  int M = 0, N = 0, K = 0;
  const unsigned long long* in_sums = nullptr;  // kInScaled: the producer's record
  float eps = 0.0f;
  __nv_bfloat16* residual = nullptr;  // kOutAddNorm
  const __nv_bfloat16* gamma = nullptr;
  __nv_bfloat16* normed = nullptr;
  unsigned long long* out_sums = nullptr;
  RopeKvArgs rope;  // kOutRopeKv
};

// First weight row of tile j of this block.
template <int kOut, int kRT>
__device__ __forceinline__ int TileRow(const ChainArgs& a, int j) {
  if constexpr (kOut == kOutRopeKv) {
    const int half = a.rope.head_dim / 2, blocks_per_head = half / 16;
    const int head = blockIdx.x / blocks_per_head, i0 = (blockIdx.x % blocks_per_head) * 16;
    return head * a.rope.head_dim + j * half + i0;
  } else {
    return (blockIdx.x * kRT + j) * 16;
  }
}

// cp.async of 16 bytes (zero-filled when !valid), with L2 asked for 256-byte pieces when kL2.
template <bool kL2>
__device__ __forceinline__ void ChainCopy16(uint32_t dst, const void* src, bool valid) {
  if constexpr (kL2) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
  } else {
    CpAsync16(dst, src, valid);
  }
}

template <int kTok, int kIn, int kOut, class C>
__global__ void __launch_bounds__(C::kThreads) ChainGemvKernel(const ChainArgs a) {
  constexpr int kThreads = C::kThreads, kKT = C::kKT, kStages = C::kStages, kRT = C::kRT;
  static_assert(kOut != kOutRopeKv || kRT == 2, "the RoPE/KV epilogue pairs two tiles");
  constexpr int kRowStride = C::kRowStride;
  constexpr int kMT = (kTok + 7) / 8;  // 8-token tiles
  static_assert(kRT * kMT <= kThreads / 32, "a warp per (row tile, token tile)");
  static_assert(!C::kProducersOnly || kRT * kMT < kThreads / 32,
                "producers-only needs a spare warp");
  using St = Stage<kTok, kIn, C>;
  // The threads that issue the copies: all, or those of the warps without a chain.
  constexpr int kChainThreads = kRT * kMT * 32;
  constexpr int kIssuers = C::kProducersOnly ? kThreads - kChainThreads : kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* stages = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  PdlLaunchDependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int K = a.K, N = a.N, M = a.M;
  const int issuer = C::kProducersOnly ? tid - kChainThreads : tid;  // < 0: issues nothing
  const int num_kt = (K + kKT - 1) / kKT;
  constexpr int kVecs = kKT / 8;

  auto issue_w = [&](int kt) {
    if (kt >= num_kt) return;
    __nv_bfloat16* dst = stages + (kt % kStages) * St::kElems;
    const int k0 = kt * kKT;
    for (int i = issuer < 0 ? kRT * 16 * kVecs : issuer; i < kRT * 16 * kVecs; i += kIssuers) {
      const int r = i / kVecs, c = i % kVecs;
      const int row = TileRow<kOut, kRT>(a, r / 16) + r % 16, k = k0 + c * 8;
      const bool valid = row < N && k < K;
      ChainCopy16<C::kL2Prefetch>(SmemAddr(dst + r * kRowStride + c * 8),
                                  valid ? a.w + static_cast<int64_t>(row) * K + k : a.w, valid);
    }
  };
  auto issue_x = [&](int kt) {
    if (kt < num_kt) {
      __nv_bfloat16* dst = stages + (kt % kStages) * St::kElems + kRT * 16 * kRowStride;
      const int k0 = kt * kKT;
      for (int i = issuer < 0 ? St::kXRows * kVecs : issuer; i < St::kXRows * kVecs;
           i += kIssuers) {
        const int r = i / kVecs, c = i % kVecs, k = k0 + c * 8;
        const int token = r % kTok;
        const bool valid = token < M && k < K;
        const __nv_bfloat16* src =
            kIn == kInSwiGlu ? a.x + static_cast<int64_t>(token) * 2 * K + (r >= kTok ? K : 0) + k
                             : a.x + static_cast<int64_t>(token) * K + k;
        CpAsync16(SmemAddr(dst + r * kRowStride + c * 8), valid ? src : a.x, valid);
      }
    }
    CpAsyncCommit();  // an empty group past the end keeps the wait counts uniform
  };
  // Tiled: one thread (lane 0 of the first warp without a chain) owns the ring's mbarriers and
  // issues every stage as kRT bulk copies, one a tile: tile T's k16 steps k0 / 16 .. are the
  // contiguous 16 x len elements at (T K + k0) 16 of the tile-contiguous copy.
  [[maybe_unused]] uint64_t* full = nullptr;
  [[maybe_unused]] uint64_t* empty = nullptr;
  constexpr int kProducer = kRT * kMT * 32;
  auto issue_tiles = [&](int kt) {
    const int s = kt % kStages, k0 = kt * kKT, len = min(kKT, K - k0);
    MbarExpectTx(&full[s], static_cast<uint32_t>(kRT * 16 * len * 2));
#pragma unroll
    for (int jt = 0; jt < kRT; ++jt) {
      const int64_t tile = TileRow<kOut, kRT>(a, jt) / 16;
      BulkCopyToShared(stages + s * St::kElems + jt * 16 * kKT, a.wt + (tile * K + k0) * 16,
                       static_cast<uint32_t>(16 * len * 2), &full[s]);
    }
  };
  // The weights do not depend on the previous kernel: the first stages' go out before the wait
  // (they join stage 0's group); the inputs after it.
  if constexpr (C::kTiled) {
    full = reinterpret_cast<uint64_t*>(smem_raw + St::BarrierOffset(K));
    empty = full + kStages;
    if (tid == kProducer) {
      for (int s = 0; s < kStages; ++s) {
        MbarInit(&full[s], 1);
        MbarInit(&empty[s], kRT * kMT);
      }
      FenceMbarrierInit();
      FenceProxyAsync();
      for (int s = 0; s < min(kStages, num_kt); ++s) issue_tiles(s);
    }
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      issue_w(s);
      if constexpr (St::kUpfront) CpAsyncCommit();  // stage s: group s
    }
  }
  const int j = warp % kRT, mt = warp / kRT;
  const bool chain_warp = warp < kRT * kMT;
  // The add-norm epilogue's operands, read early so that its stores wait on nothing: gamma (a
  // weight) before the wait, the residual (an earlier kernel writes it) after it. Lane element
  // i: weight row TileRow(j) + g (+ 8 for i >= 2), token 2t + (i & 1) (kMT = 1).
  __nv_bfloat16 gamma_pre[4], residual_pre[4];
  if constexpr (kOut == kOutAddNorm) {
    const int row0 = TileRow<kOut, kRT>(a, j);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + g + (i >= 2 ? 8 : 0), token = 2 * t + (i & 1);
      gamma_pre[i] = chain_warp && row < N && token < M ? a.gamma[row] : __nv_bfloat16{};
    }
  }
  PdlWait();  // x, the record and the residual come from earlier kernels
  if constexpr (!St::kUpfront) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue_x(s);  // stage 0's weights join its group
  }
  if constexpr (kOut == kOutAddNorm) {
    const int row0 = TileRow<kOut, kRT>(a, j);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + g + (i >= 2 ? 8 : 0), token = 2 * t + (i & 1);
      residual_pre[i] = chain_warp && row < N && token < M
                            ? a.residual[static_cast<int64_t>(token) * N + row]
                            : __nv_bfloat16{};
    }
  }
  // The RoPE/KV epilogue's step inputs (thread tid < 16 M stores row pair tid % 16 of token
  // tid / 16).
  RopePairOperands rope_pre;
  if constexpr (kOut == kOutRopeKv) {
    if (tid < 16 * M) {
      const int half = a.rope.head_dim / 2, blocks_per_head = half / 16;
      rope_pre = LoadRopePairOperands(a.rope, tid / 16, blockIdx.x / blocks_per_head,
                                      (blockIdx.x % blocks_per_head) * 16 + tid % 16);
    }
  }

  // kTok = 2: the input rows, transformed once (SiluMul's or ApplyRowScale's output), after the
  // ring; the first barrier of the loop publishes them. With a row scale, each thread's first
  // kPre pieces are loaded before the record's sums are reduced, so both reads are in flight
  // together.
  __nv_bfloat16* const xsm = stages + kStages * St::kElems;
  const int x_stride = St::XStride(K);
  float scale[kSkinnyFusedMaxM];  // kInScaled: tokens 0, 1 (every lane of every warp)
  auto row_scales = [&] {
#pragma unroll
    for (int r = 0; r < kSkinnyFusedMaxM; ++r) {
      scale[r] =
          RowScaleOfSums(r < M ? __ldcg(a.in_sums + r * kNormSumSlots + lane) : 0ull, K, a.eps);
    }
  };
  if constexpr (St::kUpfront) {
    const int vecs = K / 8;
    auto transform_store = [&](int i, uint4 xr, uint4 ur) {
      const int token = i / vecs, c = (i % vecs) * 8;
      float f[8];
      Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&xr), f);
      if constexpr (kIn == kInSwiGlu) {
        float u[8];
        Bf16x8ToFloat(*reinterpret_cast<const Bf16x8*>(&ur), u);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = SiluMulValue(f[e], u[e]);
      } else if constexpr (kIn == kInScaled) {
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = __fmul_rn(f[e], scale[token]);
      }
      *reinterpret_cast<Bf16x8*>(xsm + token * x_stride + c) = FloatToBf16x8(f);
    };
    auto x_at = [&](int i) {
      return a.x + static_cast<int64_t>(i / vecs) * (kIn == kInSwiGlu ? 2 : 1) * K + (i % vecs) * 8;
    };
    int i0 = tid;
    if constexpr (kIn == kInScaled) {
      constexpr int kPre = 4;
      uint4 pre[kPre];
#pragma unroll
      for (int p = 0; p < kPre; ++p) {
        if (tid + p * kThreads < M * vecs) {
          pre[p] = *reinterpret_cast<const uint4*>(x_at(tid + p * kThreads));
        }
      }
      row_scales();
#pragma unroll
      for (int p = 0; p < kPre; ++p) {
        if (tid + p * kThreads < M * vecs) transform_store(tid + p * kThreads, pre[p], pre[p]);
      }
      i0 = tid + kPre * kThreads;
    }
    for (int i = i0; i < M * vecs; i += kThreads) {
      const __nv_bfloat16* xp = x_at(i);
      const uint4 xr = *reinterpret_cast<const uint4*>(xp);
      const uint4 ur = kIn == kInSwiGlu ? *reinterpret_cast<const uint4*>(xp + K) : xr;
      transform_store(i, xr, ur);
    }
  } else if constexpr (kIn == kInScaled) {
    row_scales();
  }
  const int m = mt * 8 + g;  // this lane's token in the B operand
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // ldmatrix.x4 row addresses: lanes 0-7 rows 0-7 (k 0-7), 8-15 rows 8-15 (k 0-7), 16-23 rows
  // 0-7 (k 8-15), 24-31 rows 8-15 (k 8-15): registers 0-3 are the A fragment.
  const int lm_row = (lane & 7) + ((lane >> 3) & 1) * 8, lm_col = (lane >> 4) * 8;
  if constexpr (C::kTiled) {
    __syncthreads();  // the transformed input rows and the ring's mbarriers, for every warp
    if (tid == kProducer) {
      for (int kt = kStages; kt < num_kt; ++kt) {
        MbarWait(&empty[kt % kStages], ((kt / kStages) - 1) & 1);
        issue_tiles(kt);
      }
    } else if (chain_warp) {
      for (int kt = 0; kt < num_kt; ++kt) {
        const int s = kt % kStages, k0 = kt * kKT;
        MbarWait(&full[s], (kt / kStages) & 1);
        // Step q's A fragment: lane's 16 bytes at q 256 + lane 8 of the tile's stage.
        const uint4* frag =
            reinterpret_cast<const uint4*>(stages + s * St::kElems + j * 16 * kKT) + lane;
        const __nv_bfloat16* b_row = xsm + min(m, kTok - 1) * x_stride + k0 + 2 * t;
        const int groups = min(kKT, K - k0) / 16;
        constexpr int kGroups = kKT / 16;
        if (groups == kGroups) {
#pragma unroll
          for (int q0 = 0; q0 < kGroups; q0 += 16) {
            constexpr int kQ = kGroups < 16 ? kGroups : 16;
            uint4 af[kQ];
            uint32_t bf[kQ][2];
#pragma unroll
            for (int q = 0; q < kQ; ++q) {
              af[q] = frag[(q0 + q) * 32];
              bf[q][0] = m < M ? *reinterpret_cast<const uint32_t*>(b_row + (q0 + q) * 16) : 0u;
              bf[q][1] = m < M ? *reinterpret_cast<const uint32_t*>(b_row + (q0 + q) * 16 + 8) : 0u;
            }
#pragma unroll
            for (int q = 0; q < kQ; ++q) {
              Mma16816(d, af[q].x, af[q].y, af[q].z, af[q].w, bf[q][0], bf[q][1]);
            }
          }
        } else {
          for (int q = 0; q < groups; ++q) {
            const uint4 af = frag[q * 32];
            uint32_t b0 = 0u, b1 = 0u;
            if (m < M) {
              b0 = *reinterpret_cast<const uint32_t*>(b_row + q * 16);
              b1 = *reinterpret_cast<const uint32_t*>(b_row + q * 16 + 8);
            }
            Mma16816(d, af.x, af.y, af.z, af.w, b0, b1);
          }
        }
        __syncwarp();
        if (lane == 0) MbarArrive(&empty[s]);
      }
    }
  }
  for (int kt = 0; kt < (C::kTiled ? 0 : num_kt); ++kt) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // stage kt landed for everyone; stage kt - 1's slot is free
    issue_w(kt + kStages - 1);
    if constexpr (St::kUpfront) {
      CpAsyncCommit();
    } else {
      issue_x(kt + kStages - 1);
    }
    __nv_bfloat16* stage = stages + (kt % kStages) * St::kElems;
    __nv_bfloat16* xs = stage + kRT * 16 * kRowStride;
    const int k0 = kt * kKT;
    if constexpr (kIn != kInPlain && !St::kUpfront) {
      // The input's transform, in place, by all threads: row `token` becomes SiluMul's output
      // (from its gate row and up row) or ApplyRowScale's.
      for (int i = tid; i < M * kKT; i += kThreads) {
        const int token = i / kKT, c = i % kKT;
        __nv_bfloat16* e = xs + token * kRowStride + c;
        if constexpr (kIn == kInSwiGlu) {
          const float gv = __bfloat162float(*e);
          const float uv = __bfloat162float(xs[(kTok + token) * kRowStride + c]);
          *e = __float2bfloat16(SiluMulValue(gv, uv));
        } else {
          *e = __float2bfloat16(__fmul_rn(__bfloat162float(*e), scale[token]));
        }
      }
      __syncthreads();
    }
    if (chain_warp) {
      const uint32_t a_base = SmemAddr(stage + (j * 16 + lm_row) * kRowStride + lm_col);
      const __nv_bfloat16* b_row = St::kUpfront ? xsm + min(m, kTok - 1) * x_stride + k0 + 2 * t
                                                : xs + min(m, kTok - 1) * kRowStride + 2 * t;
      const int groups = min(kKT, K - k0) / 16;
      constexpr int kGroups = kKT / 16;
      if (groups == kGroups) {
        // A full stage: every fragment first, then the kGroups dependent mma back to back (the
        // chain's latency is the mma's alone).
        uint32_t af[kGroups][4], bf[kGroups][2];
#pragma unroll
        for (int q = 0; q < kGroups; ++q) {
          LdMatrixX4(af[q], a_base + q * 32);
          bf[q][0] = m < M ? *reinterpret_cast<const uint32_t*>(b_row + q * 16) : 0u;
          bf[q][1] = m < M ? *reinterpret_cast<const uint32_t*>(b_row + q * 16 + 8) : 0u;
        }
#pragma unroll
        for (int q = 0; q < kGroups; ++q) Mma16816(d, af[q], bf[q][0], bf[q][1]);
      } else {
        for (int q = 0; q < groups; ++q) {
          uint32_t af[4];
          LdMatrixX4(af, a_base + q * 32);
          uint32_t b0 = 0u, b1 = 0u;
          if (m < M) {
            b0 = *reinterpret_cast<const uint32_t*>(b_row + q * 16);
            b1 = *reinterpret_cast<const uint32_t*>(b_row + q * 16 + 8);
          }
          Mma16816(d, af, b0, b1);
        }
      }
    }
  }
  CpAsyncWait<0>();

  // d[i]: weight row TileRow(j) + g (+ 8 for i >= 2), token mt * 8 + 2t + (i & 1).
  const int row0 = TileRow<kOut, kRT>(a, j);
  if constexpr (kOut == kOutStore) {
    if (!chain_warp) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + g + (i >= 2 ? 8 : 0), token = mt * 8 + 2 * t + (i & 1);
      if (row < N && token < M) {
        float v = d[i];
        if (a.bias != nullptr) v = __fadd_rn(v, __bfloat162float(a.bias[row]));
        a.y[static_cast<int64_t>(token) * N + row] = __float2bfloat16(v);
      }
    }
  } else if constexpr (kOut == kOutAddNorm) {
    if (!chain_warp) return;
    unsigned long long sq[2] = {0ull, 0ull};  // tokens 2t, 2t + 1 (kMT = 1: only t = 0 is real)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + g + (i >= 2 ? 8 : 0), token = 2 * t + (i & 1);
      if (row < N && token < M) {
        float v = d[i];
        if (a.bias != nullptr) v = __fadd_rn(v, __bfloat162float(a.bias[row]));
        const int64_t at = static_cast<int64_t>(token) * N + row;
        const __nv_bfloat16 yb = __float2bfloat16(v);
        a.y[at] = yb;
        const __nv_bfloat16 hb =
            __float2bfloat16(__fadd_rn(__bfloat162float(residual_pre[i]), __bfloat162float(yb)));
        a.residual[at] = hb;
        const float h = __bfloat162float(hb);
        a.normed[at] = __float2bfloat16(__fmul_rn(h, __bfloat162float(gamma_pre[i])));
        sq[i & 1] += NormSquareFixed(h);
      }
    }
    // Sum over the lanes of each token (the same t), then one atomic per token and tile.
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      sq[0] += __shfl_xor_sync(0xffffffffu, sq[0], o);
      sq[1] += __shfl_xor_sync(0xffffffffu, sq[1], o);
    }
    if (g == 0) {
      const int slot = (blockIdx.x * kRT + j) % kNormSumSlots;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int token = 2 * t + e;
        if (token < M) atomicAdd(a.out_sums + token * kNormSumSlots + slot, sq[e]);
      }
    }
  } else {  // kOutRopeKv: the two tiles meet in shared memory (the ring is idle now)
    __syncthreads();
    auto* pair = reinterpret_cast<float*>(smem_raw);  // [kRT][16 rows][kSkinnyFusedMaxM]
    if (chain_warp) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = g + (i >= 2 ? 8 : 0), token = 2 * t + (i & 1);
        if (token < kSkinnyFusedMaxM) {
          float v = d[i];
          if (a.bias != nullptr) v = __fadd_rn(v, __bfloat162float(a.bias[row0 + r]));
          pair[(j * 16 + r) * kSkinnyFusedMaxM + token] =
              __bfloat162float(__float2bfloat16(v));  // as the GEMM would store it
        }
      }
    }
    __syncthreads();
    if (tid < 16 * M) {
      const int r = tid % 16, token = tid / 16;
      const int half = a.rope.head_dim / 2, blocks_per_head = half / 16;
      StoreRopeKvPair(a.rope, token, blockIdx.x / blocks_per_head,
                      (blockIdx.x % blocks_per_head) * 16 + r, pair[r * kSkinnyFusedMaxM + token],
                      pair[(16 + r) * kSkinnyFusedMaxM + token], rope_pre);
    }
  }
}

// One block per kRT tiles of 16 weight rows (the RoPE/KV form: per head, (D / 2) / 16 blocks of
// rows i and i + D / 2).
template <int kOut, class C>
int ChainBlocks(const ChainArgs& a) {
  return kOut == kOutRopeKv ? a.N / 32 : CeilDiv(a.N, C::kRT * 16);
}

// The ring is above the default 48 KB of shared memory: allowed once per instantiation, before
// its first launch or occupancy query.
template <int kTok, int kIn, int kOut, class C>
void AllowChainSmem() {
  static const bool done = [] {
    TP_CUDA_CHECK(cudaFuncSetAttribute(ChainGemvKernel<kTok, kIn, kOut, C>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kMaxSmem)));
    return true;
  }();
  (void)done;
}

template <int kTok, int kIn, int kOut, class C = ChainDefault>
void Launch(const ChainArgs& a, cudaStream_t stream) {
  TP_CHECK(!C::kTiled || a.wt != nullptr)
      << "ChainGemv: a tiled pipeline needs the weight's tile-contiguous copy (RegisterChainTiles)";
  const int blocks = ChainBlocks<kOut, C>(a);
  const size_t smem = Stage<kTok, kIn, C>::SmemBytes(a.K);
  TP_CHECK(smem <= kMaxSmem) << "ChainGemv: K " << a.K << " needs " << smem
                             << " bytes of shared memory (ChainGemvFits)";
  AllowChainSmem<kTok, kIn, kOut, C>();
  LaunchPdl(ChainGemvKernel<kTok, kIn, kOut, C>, dim3(static_cast<unsigned>(blocks)),
            dim3(C::kThreads), smem, stream, a);
}

// Blocks of this instantiation an SM holds at this K (the input rows kept after the ring make
// its shared memory depend on K).
template <int kTok, int kIn, int kOut, class C>
int ChainBlocksPerSm(int K) {
  AllowChainSmem<kTok, kIn, kOut, C>();
  int n = 0;
  TP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &n, ChainGemvKernel<kTok, kIn, kOut, C>, C::kThreads, Stage<kTok, kIn, C>::SmemBytes(K)));
  return n;
}

// The pipelines of the kTok = 2 forms: 16 warps (14 issuing copies, a 4-stage ring; 2 blocks an
// SM at K = 4096) and 8 warps (a 3-stage ring; 3 blocks an SM). The 16-warp one is at least as
// fast a block (H200: o and down 54.7% / 73.2% of copy at M = 1 against 54.3% / 73.2% with 8
// warps and 42.8% / 48.1% with 4; H100: o 64.8 against 61.3), so it runs every shape but one
// whose 8-warp grid fits the GPU in one wave and whose 16-warp grid does not: q/k/v's 384 blocks
// (H200: 65.0% of copy with 16 warps, 1.45 waves). gate_up (688 blocks) and lm_head (1,008) take
// several waves either way, and the 16-warp pipeline gains there (H100, tpserve-cuda-bench --chain,
// two runs, % of copy at M = 1: gate_up 89.2 / 88.8 against 86.5 / 86.4, lm_head 93.8 / 93.5
// against 90.3 / 90.6; q/k/v 81.1 / 81.0 against 84.1 / 83.6). Until session 35 the 8-warp pipeline
// ran every N above 8192.
using ChainNarrow = ChainCfg<512, 256, 4, true>;
using ChainWide = ChainCfg<256, 256, 3, true>;

// A pipeline decision per weight shape (N, K), made once from the GPU's SM count: the occupancy
// queries are not free, and eager decode steps launch ~160 chain GEMMs. One cache per `decide`
// (each caller's lambda, per instantiation, is a type of its own).
template <class Decide>
bool ShapeChoice(const ChainArgs& a, Decide decide) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, bool> choice;
  std::lock_guard<std::mutex> lock(mu);
  auto [it, inserted] = choice.try_emplace({a.N, a.K}, false);
  if (inserted) it->second = decide(int64_t{CurrentDeviceSms()});
  return it->second;
}

// Whether the 8-warp pipeline runs a kTok = 2 form of this shape.
template <int kTok, int kIn, int kOut>
bool ChainWideWins(const ChainArgs& a) {
  return ShapeChoice(a, [&](int64_t sms) {
    return ChainBlocks<kOut, ChainWide>(a) <=
               sms * ChainBlocksPerSm<kTok, kIn, kOut, ChainWide>(a.K) &&
           ChainBlocks<kOut, ChainNarrow>(a) >
               sms * ChainBlocksPerSm<kTok, kIn, kOut, ChainNarrow>(a.K);
  });
}

// The tiled pipelines (weights from their tile-contiguous copy): 4 stages of 512 k (one block an
// SM) where that grid fits the GPU in one wave (o and down) and its shared memory fits (K up to
// ~20k), else 4 stages of 256 k (two blocks an SM; shared memory as ChainNarrow's at any K).
using ChainTiledDeep = ChainCfg<256, 512, 4, true, 2, false, true>;
using ChainTiledShallow = ChainCfg<256, 256, 4, true, 2, false, true>;

template <int kTok, int kIn, int kOut>
bool ChainTiledDeepFits(const ChainArgs& a) {
  return ShapeChoice(a, [&](int64_t sms) {
    return Stage<kTok, kIn, ChainTiledDeep>::SmemBytes(a.K) <= kMaxSmem &&
           ChainBlocks<kOut, ChainTiledDeep>(a) <=
               sms * ChainBlocksPerSm<kTok, kIn, kOut, ChainTiledDeep>(a.K);
  });
}

template <int kTok, int kIn, int kOut>
void LaunchAuto(const ChainArgs& a, cudaStream_t stream) {
  if (a.wt != nullptr) {
    if (ChainTiledDeepFits<kTok, kIn, kOut>(a)) {
      Launch<kTok, kIn, kOut, ChainTiledDeep>(a, stream);
    } else {
      Launch<kTok, kIn, kOut, ChainTiledShallow>(a, stream);
    }
  } else if (ChainWideWins<kTok, kIn, kOut>(a)) {
    Launch<kTok, kIn, kOut, ChainWide>(a, stream);
  } else {
    Launch<kTok, kIn, kOut, ChainNarrow>(a, stream);
  }
}

// Plain and SwiGLU inputs at any M up to kChainGemvMaxM.
template <int kIn>
void LaunchForM(const ChainArgs& a, cudaStream_t stream) {
  if (a.M <= 2) {
    LaunchAuto<2, kIn, kOutStore>(a, stream);
  } else if (a.M <= 8) {
    Launch<8, kIn, kOutStore>(a, stream);
  } else {
    Launch<16, kIn, kOutStore>(a, stream);
  }
}

// Tile-contiguous copies of weights (RegisterChainTiles), by the weight's address.
struct Tiles {
  const void* tiles;
  int64_t n, k;
};
std::mutex tiles_mu;
std::unordered_map<const void*, Tiles> tiles_of;
std::atomic<int> tiles_count{0};

__global__ void MakeChainTilesKernel(const __nv_bfloat16* __restrict__ w,
                                     __nv_bfloat16* __restrict__ out, int N, int K,
                                     int64_t pieces) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= pieces) return;
  // Piece i: lane l of k16 step `step` of tile `tile` (K / 16 steps a tile, 32 lanes a step).
  const int l = static_cast<int>(i % 32), g = l >> 2, t = l & 3;
  const int64_t step = (i / 32) % (K / 16), tile = i / 32 / (K / 16);
  __nv_bfloat16 v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    // Element e: register e / 2 of the m16n8k16 A fragment, its half e % 2.
    const int reg = e >> 1, row = static_cast<int>(tile * 16) + g + 8 * (reg & 1);
    const int64_t k = step * 16 + 2 * t + (e & 1) + 8 * (reg >> 1);
    v[e] = row < N ? w[int64_t{row} * K + k] : __float2bfloat16(0.0f);
  }
  *reinterpret_cast<uint4*>(out + i * 8) = *reinterpret_cast<const uint4*>(v);
}

// The GEMM arguments every entry point checks: bf16, [M, K] x [N, K], K % 16 == 0, aligned.
ChainArgs GemmArgs(const char* op, const Tensor& x, int64_t x_width, const Tensor& w,
                   const Tensor* bias, int64_t max_m) {
  TP_CHECK_CUDA_TENSOR(x, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(w, DType::kBF16);
  const int64_t K = w.dim(-1), N = w.dim(0);
  const int64_t M = x.numel() / std::max<int64_t>(x_width, 1);
  TP_CHECK(w.ndim == 2 && x.dim(-1) == x_width && M >= 0 && M <= max_m && K % 16 == 0 &&
           IsAligned16(x.data) && IsAligned16(w.data) && N < (int64_t{1} << 31))
      << op << ": x " << x.ShapeString() << ", w " << w.ShapeString() << " (needs M <= " << max_m
      << ", K % 16 == 0, 16-byte aligned)";
  CheckGemmBias(op, bias, N);
  ChainArgs a;
  a.x = x.ptr<const __nv_bfloat16>();
  a.w = w.ptr<const __nv_bfloat16>();
  a.wt = static_cast<const __nv_bfloat16*>(FindChainTiles(w));
  a.bias = bias != nullptr ? bias->ptr<const __nv_bfloat16>() : nullptr;
  a.M = static_cast<int>(M);
  a.N = static_cast<int>(N);
  a.K = static_cast<int>(K);
  return a;
}

}  // namespace

size_t ChainTileBytes(int64_t n, int64_t k) {
  return static_cast<size_t>((n + 31) / 32 * 32) * static_cast<size_t>(k) * 2;
}

void MakeChainTiles(const Tensor& w, void* tiles, cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(w, DType::kBF16);
  const int64_t N = w.dim(0), K = w.dim(-1);
  TP_CHECK(w.ndim == 2 && K % 16 == 0 && N < (int64_t{1} << 31) && IsAligned16(tiles))
      << "MakeChainTiles: w " << w.ShapeString() << " (needs K % 16 == 0, aligned tiles)";
  const int64_t pieces = static_cast<int64_t>(ChainTileBytes(N, K) / 16);
  if (pieces == 0) return;
  MakeChainTilesKernel<<<static_cast<unsigned>((pieces + 255) / 256), 256, 0, stream>>>(
      w.ptr<const __nv_bfloat16>(), static_cast<__nv_bfloat16*>(tiles), static_cast<int>(N),
      static_cast<int>(K), pieces);
  TP_CUDA_CHECK_LAUNCH();
}

void RegisterChainTiles(const Tensor& w, const void* tiles) {
  std::lock_guard<std::mutex> lock(tiles_mu);
  tiles_of[w.data] = Tiles{tiles, w.dim(0), w.dim(-1)};
  tiles_count.store(static_cast<int>(tiles_of.size()));
}

void UnregisterChainTiles(const void* w) {
  std::lock_guard<std::mutex> lock(tiles_mu);
  tiles_of.erase(w);
  tiles_count.store(static_cast<int>(tiles_of.size()));
}

const void* FindChainTiles(const Tensor& w) {
  if (tiles_count.load(std::memory_order_relaxed) == 0) return nullptr;
  std::lock_guard<std::mutex> lock(tiles_mu);
  auto it = tiles_of.find(w.data);
  // A view of the first rows of a registered weight reads the first tiles of its copy.
  if (it == tiles_of.end() || w.ndim != 2 || w.dim(-1) != it->second.k || w.dim(0) > it->second.n) {
    return nullptr;
  }
  return it->second.tiles;
}

bool ChainGemvFits(int64_t m, int64_t k, const void* x, const void* w) {
  // K up to 32768: the kTok = 2 forms keep their transformed input rows in shared memory.
  return m >= 1 && m <= kChainGemvMaxM && k > 0 && k % 16 == 0 && k <= 32768 && IsAligned16(x) &&
         IsAligned16(w);
}

// The benchmark's pipeline configurations of the plain M <= 2 form (index 0: the launchers' own
// choice, LaunchForM).
using ChainLaunch = void (*)(const ChainArgs&, cudaStream_t);
constexpr ChainLaunch kChainConfigs[] = {
    nullptr,
    Launch<2, kInPlain, kOutStore, ChainCfg<128, 256, 4, false>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<128, 128, 8, false>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<128, 512, 3, false>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<128, 256, 4, true>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<256, 256, 4, false>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<256, 256, 6, true>>,
    Launch<2, kInPlain, kOutStore, ChainNarrow>,
    Launch<2, kInPlain, kOutStore, ChainWide>,
    // Session 33: one 16-row tile a block (twice the blocks: o and down have only 128 of two
    // tiles for 132 SMs), L2 prefetches of 256 bytes, a deeper ring, longer row runs.
    Launch<2, kInPlain, kOutStore, ChainCfg<512, 256, 4, true, 1>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<256, 256, 4, true, 1>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<256, 256, 3, true, 1>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<128, 256, 4, true, 1>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<512, 256, 4, true, 2, true>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<256, 256, 3, true, 2, true>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<256, 256, 4, true, 1, true>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<512, 256, 6, true, 2>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<512, 512, 3, true, 2>>,
    // Session 37: the weights from their tile-contiguous copy (these need RegisterChainTiles).
    Launch<2, kInPlain, kOutStore, ChainTiledDeep>,
    Launch<2, kInPlain, kOutStore, ChainTiledShallow>,
    Launch<2, kInPlain, kOutStore, ChainCfg<256, 768, 3, true, 2, false, true>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<128, 512, 4, true, 1, false, true>>,
    Launch<2, kInPlain, kOutStore, ChainCfg<128, 256, 8, true, 1, false, true>>,
};
constexpr int kChainTiledConfigs = 5;  // the last ones

int ChainGemvNumConfigs(int64_t m, bool tiled) {
  const int all = static_cast<int>(std::size(kChainConfigs));
  return m > kChainGemvMaxM ? 0 : m > 2 ? 1 : tiled ? all : all - kChainTiledConfigs;
}

void LaunchChainGemv(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                     cudaStream_t stream, int config) {
  ChainArgs a = GemmArgs("ChainGemv", x, w.dim(-1), w, bias, kChainGemvMaxM);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  TP_CHECK(y.numel() == int64_t{a.M} * a.N) << "ChainGemv: y " << y.ShapeString();
  TP_CHECK(config >= 0 && config < ChainGemvNumConfigs(a.M, a.wt != nullptr))
      << "ChainGemv: config " << config << " (1-" << ChainGemvNumConfigs(1, true) - 1
      << " exist for M <= 2, the last " << kChainTiledConfigs
      << " with the weight's tiles registered)";
  if (a.M == 0 || a.N == 0) return;
  a.y = y.ptr<__nv_bfloat16>();
  if (config == 0) {
    LaunchForM<kInPlain>(a, stream);
  } else {
    kChainConfigs[config](a, stream);
  }
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchChainSwiGluGemv(const Tensor& gate_up, const Tensor& w, Tensor y, cudaStream_t stream) {
  ChainArgs a = GemmArgs("ChainSwiGluGemv", gate_up, 2 * w.dim(-1), w, nullptr, kChainGemvMaxM);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  TP_CHECK(y.numel() == int64_t{a.M} * a.N) << "ChainSwiGluGemv: y " << y.ShapeString();
  if (a.M == 0 || a.N == 0) return;
  a.y = y.ptr<__nv_bfloat16>();
  LaunchForM<kInSwiGlu>(a, stream);
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchChainGemvScaledRows(const Tensor& x, const unsigned long long* record, float eps,
                               const Tensor& w, const Tensor* bias, Tensor y, cudaStream_t stream) {
  ChainArgs a = GemmArgs("ChainGemvScaledRows", x, w.dim(-1), w, bias, kSkinnyFusedMaxM);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  TP_CHECK(y.numel() == int64_t{a.M} * a.N && record != nullptr)
      << "ChainGemvScaledRows: y " << y.ShapeString();
  if (a.M == 0 || a.N == 0) return;
  a.y = y.ptr<__nv_bfloat16>();
  a.in_sums = record;
  a.eps = eps;
  LaunchAuto<2, kInScaled, kOutStore>(a, stream);
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchChainGemvAddNorm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                            Tensor residual, const Tensor& gamma, Tensor normed, bool swiglu,
                            unsigned long long* record, cudaStream_t stream) {
  const int64_t K = w.dim(-1);
  ChainArgs a = GemmArgs("ChainGemvAddNorm", x, swiglu ? 2 * K : K, w, bias, kSkinnyFusedMaxM);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(residual, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(gamma, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(normed, DType::kBF16);
  const int64_t mn = int64_t{a.M} * a.N;
  TP_CHECK(y.numel() == mn && residual.numel() == mn && normed.numel() == mn &&
           gamma.numel() == a.N && record != nullptr)
      << "ChainGemvAddNorm: y " << y.ShapeString() << ", residual " << residual.ShapeString()
      << ", gamma " << gamma.ShapeString();
  if (a.M == 0 || a.N == 0) return;
  a.y = y.ptr<__nv_bfloat16>();
  a.residual = residual.ptr<__nv_bfloat16>();
  a.gamma = gamma.ptr<const __nv_bfloat16>();
  a.normed = normed.ptr<__nv_bfloat16>();
  a.out_sums = record;
  if (swiglu) {
    LaunchAuto<2, kInSwiGlu, kOutAddNorm>(a, stream);
  } else {
    LaunchAuto<2, kInPlain, kOutAddNorm>(a, stream);
  }
  TP_CUDA_CHECK_LAUNCH();
}

bool ChainQkvRopeKvFits(int head_dim) { return head_dim % 32 == 0; }

void LaunchChainQkvRopeKvWrite(const Tensor& x, const Tensor& w_qkv, const Tensor* bias,
                               const Tensor& inv_freq, int num_q_heads, int num_kv_heads,
                               int head_dim, const DeviceBatch& b, Tensor q_out, Tensor k_cache,
                               Tensor v_cache, cudaStream_t stream,
                               const unsigned long long* x_sums, float eps) {
  ChainArgs a = GemmArgs("ChainQkvRopeKvWrite", x, w_qkv.dim(-1), w_qkv, bias, kSkinnyFusedMaxM);
  TP_CHECK_CUDA_TENSOR(inv_freq, DType::kF32);
  TP_CHECK_CUDA_TENSOR(q_out, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(k_cache, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(v_cache, DType::kBF16);
  TP_CHECK(ChainQkvRopeKvFits(head_dim) && a.N == (num_q_heads + 2 * num_kv_heads) * head_dim &&
           a.M == b.num_tokens && inv_freq.numel() == head_dim / 2 &&
           q_out.numel() == int64_t{a.M} * num_q_heads * head_dim && k_cache.ndim == 4 &&
           k_cache.dim(1) == b.block_size && k_cache.dim(2) == num_kv_heads &&
           k_cache.dim(3) == head_dim && v_cache.numel() == k_cache.numel())
      << "ChainQkvRopeKvWrite: w_qkv " << w_qkv.ShapeString() << ", q_out " << q_out.ShapeString()
      << ", k_cache " << k_cache.ShapeString() << ", heads " << num_q_heads << "/" << num_kv_heads
      << ", head_dim " << head_dim << ", tokens " << b.num_tokens << " (needs head_dim % 32 == 0)";
  if (a.M == 0) return;
  a.rope.inv_freq = inv_freq.ptr<const float>();
  a.rope.positions = b.positions;
  a.rope.slots = b.slot_mapping;
  a.rope.num_q_heads = num_q_heads;
  a.rope.num_kv_heads = num_kv_heads;
  a.rope.head_dim = head_dim;
  a.rope.num_slots = k_cache.dim(0) * k_cache.dim(1);
  a.rope.q_out = q_out.ptr<__nv_bfloat16>();
  a.rope.k_cache = k_cache.ptr<__nv_bfloat16>();
  a.rope.v_cache = v_cache.ptr<__nv_bfloat16>();
  a.in_sums = x_sums;
  a.eps = eps;
  if (x_sums != nullptr) {
    LaunchAuto<2, kInScaled, kOutRopeKv>(a, stream);
  } else {
    LaunchAuto<2, kInPlain, kOutRopeKv>(a, stream);
  }
  TP_CUDA_CHECK_LAUNCH();
}

// ---- the reference chain ----------------------------------------------------------------------

namespace {

__device__ __forceinline__ uint32_t Pair(const __nv_bfloat16* base, int row, int rows, int K,
                                         int k) {
  if (row >= rows) return 0u;
  return *reinterpret_cast<const uint32_t*>(base + static_cast<int64_t>(row) * K + k);
}

// One warp per output tile, 4-byte fragment loads: w in the A operand (16 rows) and x in B
// (8 tokens), or x in A and w in B.
template <bool kWeightsA>
__global__ void ChainGemmReferenceKernel(const __nv_bfloat16* __restrict__ x,
                                         const __nv_bfloat16* __restrict__ w,
                                         const __nv_bfloat16* __restrict__ bias,
                                         __nv_bfloat16* __restrict__ y, int M, int N, int K) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int a_rows = kWeightsA ? N : M, b_rows = kWeightsA ? M : N;
  const int a_tiles = (a_rows + 15) / 16, b_tiles = (b_rows + 7) / 8;
  if (warp >= a_tiles * b_tiles) return;
  const int a0 = (warp % a_tiles) * 16, b0 = (warp / a_tiles) * 8;
  const __nv_bfloat16* A = kWeightsA ? w : x;
  const __nv_bfloat16* B = kWeightsA ? x : w;
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k = 0; k < K; k += 16) {
    Mma16816(d, Pair(A, a0 + g, a_rows, K, k + 2 * t), Pair(A, a0 + g + 8, a_rows, K, k + 2 * t),
             Pair(A, a0 + g, a_rows, K, k + 2 * t + 8),
             Pair(A, a0 + g + 8, a_rows, K, k + 2 * t + 8), Pair(B, b0 + g, b_rows, K, k + 2 * t),
             Pair(B, b0 + g, b_rows, K, k + 2 * t + 8));
  }
  for (int i = 0; i < 4; ++i) {
    const int ar = a0 + g + (i >= 2 ? 8 : 0), br = b0 + 2 * t + (i & 1);
    const int row = kWeightsA ? ar : br, token = kWeightsA ? br : ar;
    if (row < N && token < M) {
      float v = d[i];
      if (bias != nullptr) v += __bfloat162float(bias[row]);
      y[static_cast<int64_t>(token) * N + row] = __float2bfloat16_rn(v);
    }
  }
}

}  // namespace

void LaunchChainGemmReference(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                              bool weights_a, cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(x, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(w, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  const int64_t K = x.dim(-1), M = x.numel() / std::max<int64_t>(K, 1), N = w.dim(0);
  TP_CHECK(K % 16 == 0 && w.dim(1) == K && y.numel() == M * N)
      << "ChainGemmReference: x " << x.ShapeString() << ", w " << w.ShapeString();
  CheckGemmBias("ChainGemmReference", bias, N);
  if (M == 0 || N == 0) return;
  const int64_t tiles =
      weights_a ? ((N + 15) / 16) * ((M + 7) / 8) : ((M + 15) / 16) * ((N + 7) / 8);
  const int blocks = static_cast<int>((tiles + 7) / 8);
  const auto* bp = bias != nullptr ? bias->ptr<const __nv_bfloat16>() : nullptr;
  auto kernel = weights_a ? ChainGemmReferenceKernel<true> : ChainGemmReferenceKernel<false>;
  kernel<<<blocks, 256, 0, stream>>>(x.ptr<const __nv_bfloat16>(), w.ptr<const __nv_bfloat16>(), bp,
                                     y.ptr<__nv_bfloat16>(), static_cast<int>(M),
                                     static_cast<int>(N), static_cast<int>(K));
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
