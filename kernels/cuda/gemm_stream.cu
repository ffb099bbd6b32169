// Weight-streaming GEMM for decode batches on Hopper (issue 17): y[M, N] = x[M, K] w[N, K]^T
// (+ bias), bf16 in and out, fp32 accumulation, for M <= kStreamGemmMaxM.
//
// At M = 8-128 a decode step's GEMMs are bound by the weight bytes, and cuBLASLt streams them at
// 52-83% of the copy rate (kernels/cuda/NOTES.md, "cuBLASLt split-K at decode batch sizes"):
// its tiles are shaped for the tokens, its grids leave SMs idle on the narrow projections, and
// its ramp and tail are long at 8-90 MB. Here the weights are the wide operand:
// - The weight rows are wgmma's M dimension (64 rows a tile, kMT tiles a block) and the tokens
//   its N dimension (kN = 16, 32, 64 or 128, the batch rounded up): the product is y^T, with
//   both operands K-major in shared memory, exactly as they lie in global memory.
// - One producer warp feeds a ring of kStages stages through TMA (128-byte swizzle, 64 K a
//   stage; the tokens past M and the K past the end read as zeros), one consumer warpgroup runs
//   the wgmma and releases each stage through an mbarrier.
// - Stream-K: the (weight tile, 64-K block) pairs, in order, are cut into one contiguous range
//   per block of a grid that fills the GPU once, so every block streams the same number of
//   bytes whatever the shape. A tile split over blocks is added up by the last of them to
//   arrive (a counter per tile): each writes its fp32 partial sums to its own workspace slot,
//   and the last one adds the slots in block order, so a result does not depend on timing.
// - The first stages' weights are requested before the programmatic-launch wait (they do not
//   depend on the previous kernel), the tokens after it.
#include <cuda.h>

#include <algorithm>
#include <mutex>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gemm_stream.h"
#include "kernels/cuda/stream_k.h"
#include "kernels/cuda/wgmma_util.cuh"

namespace tpserve::cuda {
namespace {

constexpr int kBK = 64;          // K a stage: 128 bytes of bf16, one swizzle row
constexpr int kConsumers = 128;  // one warpgroup
// The producers: one warp issuing TMA boxes (kLoaders = 32), or a warpgroup copying the weight
// rows with cp.async (kLoaders = 128; the tokens still come through TMA).
template <int kLoaders>
inline constexpr int kThreadsOf = kConsumers + kLoaders;

struct StreamArgs {
  __nv_bfloat16* y;
  const __nv_bfloat16* bias;
  float* ws;      // [grid * 2] slots of kConsumers * (kMT * kN / 2) floats
  int* counters;  // [tiles], zero between launches
  int m, n, k;
  StreamKPlan plan;
};

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A 2-D TMA load of the box at (c0 = K, c1 = row) into shared memory, completing on `bar`.
__device__ __forceinline__ void TmaLoad(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                        int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// cp.async of 16 bytes (zeros where `bytes` is 0); CpAsyncArriveNoinc counts their completion on
// an mbarrier.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void ConsumerBarrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}

// Rounds and stores a tile's sums (+ bias): rows n0 + 64 mt + 16 warp + lane / 4 (+ 8), tokens
// 8 j + 2 (lane % 4) (+ 1).
template <int kN, int kMT>
__device__ __forceinline__ void StoreTile(const StreamArgs& a, const float (&acc)[kMT][kN / 2],
                                          int n0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = n0 + 64 * mt + 16 * warp + lane / 4 + 8 * h;
      if (row >= a.n) continue;
      const float b = a.bias != nullptr ? __bfloat162float(a.bias[row]) : 0.0f;
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = 8 * j + 2 * (lane % 4) + e;
          if (tok < a.m) {
            a.y[static_cast<size_t>(tok) * a.n + row] =
                __float2bfloat16_rn(acc[mt][4 * j + 2 * h + e] + b);
          }
        }
      }
    }
  }
}

// The end of a segment (a block's run of K blocks inside one tile): store the tile, or leave
// the partial sums in this block's slot and, if it is the last of the tile's blocks to arrive,
// add every slot in block order and store.
template <int kN, int kMT>
__device__ void FinishSegment(const StreamArgs& a, float (&acc)[kMT][kN / 2], int tile, bool whole,
                              int* s_last) {
  constexpr int kAcc = kMT * kN / 2;
  const int n0 = tile * 64 * kMT;
  if (whole) {
    StoreTile<kN, kMT>(a, acc, n0);
    return;
  }
  const int tid = threadIdx.x;
  float4* slot = reinterpret_cast<float4*>(
      a.ws + (static_cast<size_t>(blockIdx.x) * 2 + StreamKSlot(a.plan, blockIdx.x, tile)) *
                 kConsumers * kAcc);
  float* flat = &acc[0][0];
#pragma unroll
  for (int i = 0; i < kAcc / 4; ++i) {
    slot[i * kConsumers + tid] =
        make_float4(flat[4 * i], flat[4 * i + 1], flat[4 * i + 2], flat[4 * i + 3]);
  }
  __threadfence();
  ConsumerBarrier();
  const int kb = a.plan.kb;
  const int c0 = StreamKBlockOf(a.plan, tile * kb), c1 = StreamKBlockOf(a.plan, tile * kb + kb - 1);
  if (tid == 0) *s_last = atomicAdd(&a.counters[tile], 1) == c1 - c0;
  ConsumerBarrier();
  if (!*s_last) return;
  __threadfence();
#pragma unroll
  for (int i = 0; i < kAcc; ++i) flat[i] = 0.0f;
  for (int c = c0; c <= c1; ++c) {
    const int s = StreamKSlot(a.plan, c, tile);
    const float4* src = reinterpret_cast<const float4*>(a.ws + (static_cast<size_t>(c) * 2 + s) *
                                                                   kConsumers * kAcc);
#pragma unroll
    for (int i = 0; i < kAcc / 4; ++i) {
      const float4 v = __ldcg(src + i * kConsumers + tid);
      flat[4 * i] += v.x;
      flat[4 * i + 1] += v.y;
      flat[4 * i + 2] += v.z;
      flat[4 * i + 3] += v.w;
    }
  }
  StoreTile<kN, kMT>(a, acc, n0);
  if (tid == 0) a.counters[tile] = 0;
}

// kAtoms: 64-K swizzle atoms a stage (a stage reads kAtoms x 128 contiguous bytes of each weight
// row); kPipe: the consumer keeps one stage's wgmma group in flight and releases the stage before
// it (wait_group 1) instead of waiting for each stage's group (wait_group 0).
// kLoaders: see kThreadsOf.
template <int kN, int kMT, int kStages, int kAtoms, bool kPipe, int kLoaders>
__global__ void __launch_bounds__(kThreadsOf<kLoaders>)
    StreamGemmKernel(const __grid_constant__ CUtensorMap wmap,
                     const __grid_constant__ CUtensorMap xmap, StreamArgs a,
                     const __nv_bfloat16* __restrict__ w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kWAtomBytes = kMT * 64 * 128, kXAtomBytes = kN * 128;
  constexpr int kABytes = kWAtomBytes * kAtoms;
  constexpr int kStageBytes = kABytes + kXAtomBytes * kAtoms;
  constexpr int kStageK = kBK * kAtoms;
  extern __shared__ uint8_t smem_raw[];
  // The 128-byte swizzle repeats every 1024 bytes: stages start on 1024-byte boundaries.
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023));
  __shared__ __align__(8) uint64_t full[kStages];
  __shared__ __align__(8) uint64_t empty[kStages];
  __shared__ int s_last;
  const int tid = threadIdx.x;
  constexpr bool kCp = kLoaders == 128;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&full[s], kCp ? kLoaders + 1 : 1);
      MbarInit(&empty[s], kConsumers);
    }
    FenceMbarrierInit();
  }
  __syncthreads();
  PdlLaunchDependents();
  const StreamKPlan& plan = a.plan;
  const int begin = StreamKStart(plan, blockIdx.x);
  const int count = StreamKStart(plan, blockIdx.x + 1) - begin;
  // The TMA loads of the i-th pair of this block's range into its stage: the tokens' atoms, and
  // (TMA producer) the weights' atoms.
  auto load_x = [&](int i) {
    const int s = i % kStages, k0 = ((begin + i) % plan.kb) * kStageK;
#pragma unroll
    for (int at = 0; at < kAtoms; ++at) {
      TmaLoad(smem + s * kStageBytes + kABytes + at * kXAtomBytes, &xmap, &full[s], k0 + at * kBK,
              0);
    }
  };
  auto load_w = [&](int i) {
    const int s = i % kStages, it = begin + i, k0 = (it % plan.kb) * kStageK;
#pragma unroll
    for (int at = 0; at < kAtoms; ++at) {
      TmaLoad(smem + s * kStageBytes + at * kWAtomBytes, &wmap, &full[s], k0 + at * kBK,
              (it / plan.kb) * 64 * kMT);
    }
  };

  if (kCp && tid >= kConsumers) {
    // cp.async producers: consecutive threads copy consecutive 16-byte pieces of a stage's rows
    // (a warp instruction reads 512 contiguous bytes of a row when kAtoms >= 4), each written
    // where the 128-byte swizzle puts it (piece j of row r of an atom at r * 128 + (j ^ r % 8) *
    // 16). Thread kConsumers also feeds the tokens through TMA.
    constexpr int kPieces = 8 * kAtoms;  // 16-byte pieces of a row a stage
    constexpr int kRows = 64 * kMT;
    static_assert(kRows * kPieces % kLoaders == 0, "pieces a loader");
    const int ptid = tid - kConsumers;
    const bool x_thread = ptid == 0;
    auto issue_w = [&](int i) {
      const int s = i % kStages, it = begin + i;
      const int row0 = (it / plan.kb) * kRows;
      const int k0 = (it % plan.kb) * kStageK;
      const uint32_t base = SmemAddr(smem + s * kStageBytes);
#pragma unroll 4
      for (int idx = ptid; idx < kRows * kPieces; idx += kLoaders) {
        const int r = idx / kPieces, piece = idx % kPieces;
        const int at = piece / 8, j = piece % 8;
        const int row = row0 + r, k = k0 + 8 * piece;
        const bool in = row < a.n && k < a.k;
        const __nv_bfloat16* src = w + (in ? static_cast<int64_t>(row) * a.k + k : 0);
        CpAsync16(base + at * kWAtomBytes + r * 128 + ((j ^ (r % 8)) * 16), src, in ? 16 : 0);
      }
      CpAsyncArriveNoinc(&full[s]);
    };
    const int pre = min(kStages, count);
    for (int i = 0; i < pre; ++i) issue_w(i);
    PdlWait();
    for (int i = 0; i < pre; ++i) {
      if (x_thread) {
        MbarExpectTx(&full[i], kXAtomBytes * kAtoms);
        load_x(i);
      }
    }
    for (int i = pre; i < count; ++i) {
      const int s = i % kStages;
      MbarWait(&empty[s], ((i / kStages) & 1) ^ 1);
      issue_w(i);
      if (x_thread) {
        MbarExpectTx(&full[s], kXAtomBytes * kAtoms);
        load_x(i);
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }
  if (!kCp && tid >= kConsumers) {
    if (tid != kConsumers) return;
    // Producer. The first stages' weights go out before the previous kernel has finished.
    const int pre = min(kStages, count);
    for (int i = 0; i < pre; ++i) {
      MbarExpectTx(&full[i], kStageBytes);
      load_w(i);
    }
    PdlWait();
    for (int i = 0; i < pre; ++i) load_x(i);
    for (int i = pre; i < count; ++i) {
      const int s = i % kStages;
      MbarWait(&empty[s], ((i / kStages) & 1) ^ 1);
      MbarExpectTx(&full[s], kStageBytes);
      load_w(i);
      load_x(i);
    }
    return;
  }

  // Consumer warpgroup: one segment (a run of K blocks inside one tile) at a time. kPipe keeps
  // the previous stage's wgmma group in flight while the next one is issued; the accumulators
  // are touched only before a segment's first group and after its last wait.
  PdlWait();
  float acc[kMT][kN / 2];
  int i = 0;
  while (i < count) {
    const int it0 = begin + i;
    const int seg_len = min(plan.kb - it0 % plan.kb, count - i);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int j = 0; j < kN / 2; ++j) acc[mt][j] = 0.0f;
    }
    int prev = -1;
    for (int e = 0; e < seg_len; ++e, ++i) {
      const int s = i % kStages;
      MbarWait(&full[s], (i / kStages) & 1);
      // cp.async wrote the weights through the generic proxy; wgmma reads through the async one.
      if constexpr (kCp) FenceProxyAsync();
      const uint8_t* stage = smem + s * kStageBytes;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int j = 0; j < kN / 2; ++j) FenceReg(acc[mt][j]);
      }
      WgmmaFence();
#pragma unroll
      for (int at = 0; at < kAtoms; ++at) {
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const uint64_t b = SmemDesc(stage + kABytes + at * kXAtomBytes + kk * 32);
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            Wgmma<kN>::Run(acc[mt], SmemDesc(stage + at * kWAtomBytes + mt * 64 * 128 + kk * 32),
                           b);
          }
        }
      }
      WgmmaCommit();
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int j = 0; j < kN / 2; ++j) FenceReg(acc[mt][j]);
      }
      if constexpr (kPipe) {
        WgmmaWait<1>();  // the previous stage's group is done with its shared memory
        if (prev >= 0) MbarArrive(&empty[prev]);
        prev = s;
      } else {
        WgmmaWait<0>();
        MbarArrive(&empty[s]);
      }
    }
    if constexpr (kPipe) {
      WgmmaWait<0>();
      MbarArrive(&empty[prev]);
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int j = 0; j < kN / 2; ++j) FenceReg(acc[mt][j]);
    }
    const int last = begin + i - 1;
    const bool whole = it0 % plan.kb == 0 && last % plan.kb == plan.kb - 1;
    FinishSegment<kN, kMT>(a, acc, last / plan.kb, whole, &s_last);
  }
#else
  __trap();  // built for sm_90a only (StreamGemmFits checks the device)
#endif
}

// A row-major bf16 matrix [rows, cols] read in boxes of [box_rows, 64] with the 128-byte swizzle
// (rows past the end and columns past `cols` read as zeros).
CUtensorMap MakeMap(const void* data, int64_t rows, int64_t cols, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {kBK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r =
      EncodeTiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(data), dims,
                    strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TP_CHECK(r == CUDA_SUCCESS) << "cuTensorMapEncodeTiled failed (" << static_cast<int>(r)
                              << ") for a [" << rows << ", " << cols << "] bf16 matrix";
  return map;
}

struct Config {
  int n_tok, mt, stages, atoms = 1;
  bool pipe = false;
  int loaders = 32;
};
// The configurations tpserve-cuda-bench --stream compares; StreamGemmAutoConfig picks by M.
constexpr Config kConfigs[] = {
    // auto's choices
    {16, 2, 6},
    {32, 2, 5},
    {64, 2, 4},
    {128, 2, 6},
    // one 64-row tile a block
    {16, 1, 8},
    {32, 1, 8},
    {64, 1, 6},
    {128, 1, 4},
    // deeper rings (one block an SM)
    {64, 2, 8},
    {16, 2, 10},
    // Longer runs of each weight row a stage (256 / 512 bytes), and the wgmma groups pipelined.
    {16, 2, 3, 2},
    {16, 1, 5, 4},
    {64, 2, 2, 2},
    {64, 1, 3, 4},
    {16, 2, 6, 1, true},
    {64, 2, 4, 1, true},
    {16, 1, 5, 4, true},
    {64, 1, 3, 4, true},
    // Deep rings for one block an SM (the whole of a tile's K without splitting it).
    {16, 1, 20},
    {64, 1, 13},
    {128, 1, 9},
    // 768 B - 1 KB of each weight row a stage.
    {16, 1, 2, 8},
    {16, 2, 3, 4},
    {64, 2, 2, 4},
    {64, 1, 2, 6},
    {32, 1, 4, 4},
    {128, 1, 2, 4},
    // The weights through cp.async (a warp instruction: 512 contiguous bytes of a row).
    {16, 1, 5, 4, false, 128},
    {16, 2, 3, 4, false, 128},
    {64, 1, 3, 4, false, 128},
    {64, 2, 2, 4, false, 128},
    {16, 1, 2, 8, false, 128},
    {128, 1, 2, 4, false, 128},
    // More pipelined variants.
    {64, 1, 6, 1, true},
    {16, 2, 3, 4, true},
    {128, 2, 6, 1, true},
    {64, 2, 8, 1, true},
    {32, 2, 5, 1, true},
};

template <int kN, int kMT, int kStages, int kAtoms, bool kPipe, int kLoaders>
void LaunchConfig(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                  const StreamGemmWorkspace& ws, cudaStream_t stream, int max_grid,
                  bool exact_grid) {
  const int64_t n = w.dim(0), k = w.dim(1), m = x.numel() / k;
  constexpr int kStageBytes = (kMT * 64 * 128 + kN * 128) * kAtoms;
  constexpr size_t kSmem = size_t{kStages} * kStageBytes + 1024;
  auto kernel = StreamGemmKernel<kN, kMT, kStages, kAtoms, kPipe, kLoaders>;
  constexpr int kThreads = kThreadsOf<kLoaders>;
  static int per_sm = [&] {
    TP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kSmem)));
    int blocks = 0;
    TP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, kSmem));
    TP_CHECK(blocks > 0) << "stream GEMM config does not fit an SM";
    return blocks;
  }();
  StreamArgs a{};
  a.y = static_cast<__nv_bfloat16*>(y.data);
  a.bias = bias != nullptr ? static_cast<const __nv_bfloat16*>(bias->data) : nullptr;
  a.ws = ws.partials;
  a.counters = ws.counters;
  a.m = static_cast<int>(m);
  a.n = static_cast<int>(n);
  a.k = static_cast<int>(k);
  int grid = std::min(ws.num_sms * per_sm, ws.max_grid);
  if (max_grid > 0) grid = exact_grid ? std::min(max_grid, ws.max_grid) : std::min(grid, max_grid);
  a.plan = MakeStreamKPlan(CeilDiv(n, 64 * kMT), CeilDiv(k, kBK * kAtoms), grid);
  TP_CHECK(a.plan.tiles <= ws.max_tiles)
      << "stream GEMM: " << a.plan.tiles << " tiles, counters for " << ws.max_tiles;
  TP_CHECK(size_t{kConsumers} * kMT * kN / 2 <= ws.slot_floats) << "stream GEMM: slot too small";
  const CUtensorMap wmap = MakeMap(w.data, n, k, 64 * kMT);
  const CUtensorMap xmap = MakeMap(x.data, m, k, kN);
  LaunchPdl(kernel, dim3(a.plan.grid), dim3(kThreads), kSmem, stream, wmap, xmap, a,
            static_cast<const __nv_bfloat16*>(w.data));
}

template <int kI>
void LaunchIndexed(int index, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                   const StreamGemmWorkspace& ws, cudaStream_t stream, int max_grid,
                   bool exact_grid) {
  if constexpr (kI < static_cast<int>(std::size(kConfigs))) {
    if (index == kI) {
      constexpr Config c = kConfigs[kI];
      LaunchConfig<c.n_tok, c.mt, c.stages, c.atoms, c.pipe, c.loaders>(x, w, bias, y, ws, stream,
                                                                        max_grid, exact_grid);
    } else {
      LaunchIndexed<kI + 1>(index, x, w, bias, y, ws, stream, max_grid, exact_grid);
    }
  }
}

}  // namespace

int StreamGemmNumConfigs() { return static_cast<int>(std::size(kConfigs)); }

std::string StreamGemmConfigName(int config) {
  TP_CHECK(config >= 0 && config < StreamGemmNumConfigs()) << "stream GEMM config " << config;
  const Config& c = kConfigs[config];
  return "n" + std::to_string(c.n_tok) + " x" + std::to_string(64 * c.mt) + " rows, " +
         std::to_string(c.stages) + " stages" +
         (c.atoms > 1 ? " of " + std::to_string(128 * c.atoms) + " B a row" : "") +
         (c.pipe ? ", pipelined" : "") + (c.loaders == 128 ? ", cp.async" : "");
}

int StreamGemmConfigTokens(int config) {
  TP_CHECK(config >= 0 && config < StreamGemmNumConfigs()) << "stream GEMM config " << config;
  return kConfigs[config].n_tok;
}

int StreamGemmConfigRows(int config) {
  TP_CHECK(config >= 0 && config < StreamGemmNumConfigs()) << "stream GEMM config " << config;
  return 64 * kConfigs[config].mt;
}

int StreamGemmAutoConfig(int64_t m) {
  for (int i = 0; i < 4; ++i) {
    if (m <= kConfigs[i].n_tok) return i;
  }
  return -1;
}

bool StreamGemmSupported() { return Sm90aSupported(); }

bool StreamGemmFixedFits(const Tensor& x, const Tensor& w, const Tensor& y) {
  const int64_t k = w.dim(-1);
  if (w.dtype != DType::kBF16 || x.dtype != DType::kBF16 || y.dtype != DType::kBF16) return false;
  if (k <= 0 || k % 8 != 0 || x.dim(-1) != k) return false;
  const int64_t m = x.numel() / k;
  if (m < 1 || w.dim(0) > (int64_t{1} << 30)) return false;
  for (const void* p : {x.data, w.data, y.data}) {
    if ((reinterpret_cast<uintptr_t>(p) & 15) != 0) return false;
  }
  return StreamGemmSupported();
}

bool StreamGemmFits(const Tensor& x, const Tensor& w, const Tensor& y) {
  const int64_t k = w.dim(-1);
  return k > 0 && x.numel() / k <= kStreamGemmMaxM && StreamGemmFixedFits(x, w, y);
}

void LaunchStreamGemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                      const StreamGemmWorkspace& ws, cudaStream_t stream, int config, int max_grid,
                      bool exact_grid) {
  const int64_t k = w.dim(-1);
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  TP_CHECK(StreamGemmFits(x, w, y)) << "stream GEMM: x " << x.ShapeString() << " w "
                                    << w.ShapeString() << " y " << y.ShapeString();
  TP_CHECK(y.numel() == m * w.dim(0)) << "stream GEMM: y " << y.ShapeString();
  TP_CHECK(bias == nullptr || (bias->numel() == w.dim(0) && bias->dtype == DType::kBF16))
      << "stream GEMM: bias " << bias->ShapeString();
  if (config < 0) config = StreamGemmAutoConfig(m);
  TP_CHECK(config >= 0 && config < StreamGemmNumConfigs() && m <= kConfigs[config].n_tok)
      << "stream GEMM config " << config << " for M=" << m;
  LaunchIndexed<0>(config, x, w, bias, y, ws, stream, max_grid, exact_grid);
}

void LaunchStreamGemmFixed(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                           const StreamGemmWorkspace& ws, cudaStream_t stream) {
  TP_CHECK(StreamGemmFixedFits(x, w, y)) << "stream GEMM: x " << x.ShapeString() << " w "
                                         << w.ShapeString() << " y " << y.ShapeString();
  const int64_t k = w.dim(-1), n = w.dim(0), m = x.numel() / k;
  TP_CHECK(y.numel() == m * n) << "stream GEMM: y " << y.ShapeString();
  const int grid = ws.num_sms * kStreamGemmBlocksPerSm;
  TP_CHECK(grid <= ws.max_grid) << "stream GEMM: workspace for " << ws.max_grid << " blocks";
  for (int64_t r0 = 0; r0 < m; r0 += kStreamGemmMaxM) {
    const int64_t rows = std::min(kStreamGemmMaxM, m - r0);
    LaunchStreamGemm(x.reshape({m, k}).rows(r0, rows), w, bias, y.reshape({m, n}).rows(r0, rows),
                     ws, stream, /*config=*/-1, grid, /*exact_grid=*/true);
  }
}

}  // namespace tpserve::cuda
