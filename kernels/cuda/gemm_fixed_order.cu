// Fixed-order GEMM for deterministic serving: y[M, N] = x[M, K] w[N, K]^T (+ bias), bf16 in and
// out, fp32 accumulation, where every output y[m, n] is computed by the same instructions in the
// same order whatever M is, which rows lie beside row m, and which kernel variant runs. So a
// request's row has the same bits in a batch of 1, of 64, or in a prompt of 2048 tokens.
//
// The arithmetic of one output, fixed by (N, K) alone:
// - K is cut into chunks of 32 (zero-filled past K), the chunks into S = min(8, chunks) slices of
//   consecutive chunks (slice s = chunks [s C / S, (s + 1) C / S)).
// - A slice's partial sum starts at 0 and runs through its chunks in order, each chunk as two
//   mma.m16n8k16 (bf16 in, f32 accumulate) with the weights as the A operand (16 rows of w) and
//   the inputs as the B operand (8 tokens). Within a chunk, lane (g, t) holds elements
//   8t .. 8t + 7 of its rows: the first mma takes 8t .. 8t + 3, the second 8t + 4 .. 8t + 7 (a
//   fixed permutation of the k positions, so that every operand is one 16-byte load).
// - The output is ((P0 + P1) + P2) + ... + P(S-1), plus the bias, rounded once to bf16.
// A tensor-core instruction's result for one element depends only on that element's row of A,
// column of B and accumulator, so which other rows or tokens share an instruction does not
// matter.
//
// Three variants compute exactly that:
// - split (decode sizes, M <= 64): a block owns 16 rows of w and 8 * kT tokens; its 8 warps are
//   the slices (each streams its slice of the 16 rows once, 16-byte loads, kU chunks in flight),
//   and the slices' partial sums are added in order in shared memory. At M = 1 this reads w at
//   close to copy bandwidth, like the skinny kernel.
// - sliced (batches of 17-256 rows): a cluster of 8 blocks owns a kBN x kBM tile, block z
//   computes slice z through shared memory (as tiled, below), and the slices meet in the
//   cluster's distributed shared memory, added in order.
// - tiled (prefill sizes): a block owns a kBN x kBM tile, stages w and x through shared memory
//   with cp.async (3 stages of 2 chunks), each warp walks all slices in order keeping the running
//   total beside the current slice's partial sum.
#include <cooperative_groups.h>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/mma_util.cuh"

namespace tpserve::cuda {
namespace {

constexpr int kChunk = 32;  // K elements per chunk: two m16n8k16 steps
constexpr int kMaxSlices = 8;
constexpr int kThreads = 256;

__host__ __device__ __forceinline__ int NumChunks(int K) { return (K + kChunk - 1) / kChunk; }
__host__ __device__ __forceinline__ int NumSlices(int chunks) {
  return chunks < kMaxSlices ? chunks : kMaxSlices;
}
__host__ __device__ __forceinline__ int SliceBegin(int s, int chunks, int slices) {
  return static_cast<int>(static_cast<int64_t>(s) * chunks / slices);
}

// One chunk into d (rows g, g + 8 of a 16-row tile, tokens 2t, 2t + 1 of an 8-token tile): wr =
// elements 8t .. 8t + 7 of row g, wr8 of row g + 8, xv of token g. The A fragment of m16n8k16 is
// {(g, 2t..), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..)}, the B fragment {(2t.., g),
// (2t + 8.., g)}: k positions 2t, 2t + 1, 2t + 8, 2t + 9 take elements 8t .. 8t + 3 in the
// first step and 8t + 4 .. 8t + 7 in the second, in A and B alike.
__device__ __forceinline__ void MmaChunk(float (&d)[4], const uint4& wr, const uint4& wr8,
                                         const uint4& xv) {
  Mma16816(d, wr.x, wr8.x, wr.y, wr8.y, xv.x, xv.y);
  Mma16816(d, wr.z, wr8.z, wr.w, wr8.w, xv.z, xv.w);
}

__device__ __forceinline__ uint4 LoadOrZero(const __nv_bfloat16* p, bool valid) {
  return valid ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
}

// Stores the output of accumulator element i (0..3) of lane (g, t) in a 16 x 8 tile whose first
// row is n and first token m: rows g (i < 2) or g + 8, token 2t + (i & 1).
__device__ __forceinline__ void StoreOut(__nv_bfloat16* __restrict__ y,
                                         const __nv_bfloat16* __restrict__ bias, int M, int N,
                                         int n, int m, int g, int t, int i, float v) {
  const int row = n + g + (i >= 2 ? 8 : 0), token = m + 2 * t + (i & 1);
  if (row < N && token < M) {
    if (bias != nullptr) v += __bfloat162float(bias[row]);
    y[static_cast<int64_t>(token) * N + row] = __float2bfloat16(v);
  }
}

// ---- split variant -------------------------------------------------------------------------
// Grid (ceil(N / 16), ceil(M / (8 kT))), 8 warps: warp s computes slice s of 16 rows x 8 kT
// tokens; then the block adds the slices in order. kU chunks of loads are in flight per warp.
template <int kT, int kU>
__global__ void __launch_bounds__(kThreads)
    FixedOrderSplitKernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                          const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ y,
                          int M, int N, int K) {
  __shared__ float4 partial[kMaxSlices][kT][32];
  PdlLaunchDependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16, m0 = blockIdx.y * 8 * kT;
  const int chunks = NumChunks(K), slices = NumSlices(chunks);
  const bool active = warp < slices;
  const int c_begin = active ? SliceBegin(warp, chunks, slices) : 0;
  const int c_end = active ? SliceBegin(warp + 1, chunks, slices) : 0;
  const int row = n0 + g, row8 = n0 + g + 8;
  const __nv_bfloat16* w_row = w + static_cast<int64_t>(row < N ? row : 0) * K + 8 * t;
  const __nv_bfloat16* w_row8 = w + static_cast<int64_t>(row8 < N ? row8 : 0) * K + 8 * t;

  float acc[kT][4];
#pragma unroll
  for (int j = 0; j < kT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  uint4 wr[kU], wr8[kU];
  auto load_w = [&](int c) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int k = (c + u) * kChunk;
      const bool ok = c + u < c_end && k + 8 * t < K;
      wr[u] = ok && row < N ? LoadStreaming(w_row + k) : make_uint4(0, 0, 0, 0);
      wr8[u] = ok && row8 < N ? LoadStreaming(w_row8 + k) : make_uint4(0, 0, 0, 0);
    }
  };
  // The weights do not depend on the previous kernel: the first loads go out before the wait.
  if (active) load_w(c_begin);
  PdlWait();
  if (active) {
    for (int c = c_begin; c < c_end; c += kU) {
      if (c != c_begin) load_w(c);
      uint4 xv[kU][kT];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int k = (c + u) * kChunk + 8 * t;
#pragma unroll
        for (int j = 0; j < kT; ++j) {
          const int token = m0 + j * 8 + g;
          xv[u][j] = LoadOrZero(x + static_cast<int64_t>(token) * K + k,
                                c + u < c_end && k < K && token < M);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (c + u < c_end) {  // a chunk past the slice adds nothing, not even +0
#pragma unroll
          for (int j = 0; j < kT; ++j) MmaChunk(acc[j], wr[u], wr8[u], xv[u][j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kT; ++j) {
      partial[warp][j][lane] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kT * 32 * 4; idx += kThreads) {
    const int i = idx & 3, l = (idx >> 2) & 31, j = idx >> 7;
    const float* p0 = reinterpret_cast<const float*>(&partial[0][j][l]);
    float s = p0[i];
    for (int sl = 1; sl < slices; ++sl) {
      s += reinterpret_cast<const float*>(&partial[sl][j][l])[i];
    }
    StoreOut(y, bias, M, N, n0, m0 + j * 8, l >> 2, l & 3, i, s);
  }
}

// ---- tiled variant -------------------------------------------------------------------------
constexpr int kStages = 3;
constexpr int kStageChunks = 2;

// kStageChunks chunks from chunk0 of rows [row0, row0 + kRows) of src ([rows, K]) into dst as
// [chunk][kRows][32] (64 bytes a row), zero past c_end, K and `rows`.
template <int kRows>
__device__ __forceinline__ void LoadTileChunks(uint4* dst, const __nv_bfloat16* __restrict__ src,
                                               int row0, int rows, int K, int chunk0, int c_end) {
#pragma unroll 2
  for (int p = threadIdx.x; p < kStageChunks * kRows * 4; p += kThreads) {
    const int c = p / (kRows * 4), r = (p >> 2) % kRows, piece = p & 3;
    const int chunk = chunk0 + c, k = chunk * kChunk + piece * 8, row = row0 + r;
    const bool ok = chunk < c_end && k < K && row < rows;
    CpAsync16(SmemAddr(dst + p), ok ? src + static_cast<int64_t>(row) * K + k : src, ok);
  }
}

template <int kBN, int kBM>
constexpr size_t TiledSmemBytes() {
  return size_t{kStages} * kStageChunks * (kBN + kBM) * kChunk * 2;
}

// Grid (ceil(N / kBN), ceil(M / kBM), 1 or kMaxSlices), 8 warps of kWN m16 x kWM n8 tiles each.
// Shared memory per stage: w as [chunk][kBN rows][32] and x as [chunk][kBM tokens][32], 64 bytes
// a row, so the 16-byte reads of a quarter warp (rows g, g + 1; t = 0..3) cover 128 consecutive
// bytes.
// Tiled (kSliced false): the block walks every slice in order, keeping the running total beside
// the current slice's partial sum.
// Sliced (kSliced true): block z of a cluster of kMaxSlices blocks computes slice z of the tile;
// the partial sums meet in the cluster's shared memory (distributed shared memory), where each
// block adds all slices of 1/kMaxSlices of the tile in order. No global workspace.
template <int kBN, int kBM, int kWN, int kWM, bool kSliced>
__global__ void __launch_bounds__(kThreads, 1)
    FixedOrderTiledKernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                          const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ y,
                          int M, int N, int K) {
  constexpr int kWarpsN = kBN / (16 * kWN), kWarpsM = kBM / (8 * kWM);
  static_assert(kWarpsN * kWarpsM == kThreads / 32, "8 warps tile the block");
  constexpr int kAPieces = kStageChunks * kBN * 4, kBPieces = kStageChunks * kBM * 4;
  static_assert(!kSliced || TiledSmemBytes<kBN, kBM>() >= size_t{4} * kBN * kBM,
                "the partial sums of a tile fit the stage buffers");
  extern __shared__ uint4 smem[];
  PdlLaunchDependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int n_block = blockIdx.x * kBN, m_block = blockIdx.y * kBM;
  const int warp_n = warp % kWarpsN, warp_m = warp / kWarpsN;
  const int chunks = NumChunks(K), slices = NumSlices(chunks);
  const int my_slice = kSliced ? static_cast<int>(blockIdx.z) : 0;
  const bool active = !kSliced || my_slice < slices;
  const int c_begin = kSliced && active ? SliceBegin(my_slice, chunks, slices) : 0;
  const int c_end = !kSliced ? chunks : active ? SliceBegin(my_slice + 1, chunks, slices) : 0;
  const int stages = (c_end - c_begin + kStageChunks - 1) / kStageChunks;

  auto load_stage = [&](int st, int buf) {
    uint4* a = smem + buf * (kAPieces + kBPieces);
    const int chunk0 = c_begin + st * kStageChunks;
    LoadTileChunks<kBN>(a, w, n_block, N, K, chunk0, c_end);
    LoadTileChunks<kBM>(a + kAPieces, x, m_block, M, K, chunk0, c_end);
  };

  float acc[kWN][kWM][4], total[kWN][kWM][4];
#pragma unroll
  for (int i = 0; i < kWN; ++i) {
#pragma unroll
    for (int j = 0; j < kWM; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = total[i][j][e] = 0.0f;
    }
  }
  int slice = 0, next_slice_begin = SliceBegin(1, chunks, slices);
  // total = P0, then total += P(s) in slice order: the split variant's sum.
  auto flush = [&]() {
#pragma unroll
    for (int i = 0; i < kWN; ++i) {
#pragma unroll
      for (int j = 0; j < kWM; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          total[i][j][e] = slice == 0 ? acc[i][j][e] : total[i][j][e] + acc[i][j][e];
          acc[i][j][e] = 0.0f;
        }
      }
    }
    ++slice;
    next_slice_begin = SliceBegin(slice + 1, chunks, slices);
  };

  PdlWait();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < stages) load_stage(s, s);
    CpAsyncCommit();
  }
  for (int st = 0; st < stages; ++st) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // stage st landed for every thread; buffer (st - 1) % kStages is free
    if (st + kStages - 1 < stages) load_stage(st + kStages - 1, (st + kStages - 1) % kStages);
    CpAsyncCommit();
    const uint4* a = smem + (st % kStages) * (kAPieces + kBPieces);
    const uint4* b = a + kAPieces;
#pragma unroll
    for (int c = 0; c < kStageChunks; ++c) {
      const int chunk = c_begin + st * kStageChunks + c;
      if (chunk >= c_end) break;
      if (!kSliced && chunk == next_slice_begin) flush();
      uint4 wr[kWN], wr8[kWN], xv[kWM];
#pragma unroll
      for (int i = 0; i < kWN; ++i) {
        const int r = warp_n * kWN * 16 + i * 16 + g;
        wr[i] = a[c * kBN * 4 + r * 4 + t];
        wr8[i] = a[c * kBN * 4 + (r + 8) * 4 + t];
      }
#pragma unroll
      for (int j = 0; j < kWM; ++j) {
        xv[j] = b[c * kBM * 4 + (warp_m * kWM * 8 + j * 8 + g) * 4 + t];
      }
#pragma unroll
      for (int i = 0; i < kWN; ++i) {
#pragma unroll
        for (int j = 0; j < kWM; ++j) MmaChunk(acc[i][j], wr[i], wr8[i], xv[j]);
      }
    }
  }
  CpAsyncWait<0>();
  if constexpr (!kSliced) {
    flush();  // the last slice
#pragma unroll
    for (int i = 0; i < kWN; ++i) {
#pragma unroll
      for (int j = 0; j < kWM; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          StoreOut(y, bias, M, N, n_block + warp_n * kWN * 16 + i * 16,
                   m_block + warp_m * kWM * 8 + j * 8, g, t, e, total[i][j][e]);
        }
      }
    }
  } else {
    // This slice's partial sums as [token][row] floats over the stage buffers.
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    float* partial = reinterpret_cast<float*>(smem);
    __syncthreads();  // every warp is done with the stage buffers
#pragma unroll
    for (int i = 0; i < kWN; ++i) {
#pragma unroll
      for (int j = 0; j < kWM; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = warp_n * kWN * 16 + i * 16 + g + (e >= 2 ? 8 : 0);
          const int token = warp_m * kWM * 8 + j * 8 + 2 * t + (e & 1);
          partial[token * kBN + row] = acc[i][j][e];
        }
      }
    }
    cluster.sync();  // every slice's partial sums are in its block's shared memory
    const int rank = static_cast<int>(cluster.block_rank());
    constexpr int kPart = kBN * kBM / kMaxSlices;
    for (int idx = rank * kPart + tid; idx < (rank + 1) * kPart; idx += kThreads) {
      float v = cluster.map_shared_rank(partial, 0)[idx];
      for (int sl = 1; sl < slices; ++sl) v += cluster.map_shared_rank(partial, sl)[idx];
      const int row = n_block + idx % kBN, token = m_block + idx / kBN;
      if (row < N && token < M) {
        if (bias != nullptr) v += __bfloat162float(bias[row]);
        y[static_cast<int64_t>(token) * N + row] = __float2bfloat16(v);
      }
    }
    cluster.sync();  // the peers have read this block's partial sums
  }
}

template <int kT, int kU>
void LaunchSplit(const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* bias,
                 __nv_bfloat16* y, int M, int N, int K, cudaStream_t stream) {
  LaunchPdl(FixedOrderSplitKernel<kT, kU>, dim3(CeilDiv(N, 16), CeilDiv(M, 8 * kT)), dim3(kThreads),
            0, stream, x, w, bias, y, M, N, K);
}

template <int kBN, int kBM, int kWN, int kWM, bool kSliced>
void LaunchTiled(const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* bias,
                 __nv_bfloat16* y, int M, int N, int K, cudaStream_t stream) {
  auto kernel = FixedOrderTiledKernel<kBN, kBM, kWN, kWM, kSliced>;
  constexpr size_t smem = TiledSmemBytes<kBN, kBM>();
  static bool attributes_set = [&] {
    TP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    return true;
  }();
  (void)attributes_set;
  if constexpr (!kSliced) {
    LaunchPdl(kernel, dim3(CeilDiv(N, kBN), CeilDiv(M, kBM)), dim3(kThreads), smem, stream, x, w,
              bias, y, M, N, K);
  } else {
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = kMaxSlices;
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(CeilDiv(N, kBN), CeilDiv(M, kBM), kMaxSlices);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = PdlEnabled() ? 2 : 1;
    TP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, x, w, bias, y, M, N, K));
  }
}

}  // namespace

void LaunchFixedOrderGemm(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor y,
                          cudaStream_t stream, FixedOrderGemmVariant variant) {
  TP_CHECK_CUDA_TENSOR(x, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(w, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(y, DType::kBF16);
  const int64_t K = x.dim(-1), M = x.numel() / std::max<int64_t>(K, 1), N = w.dim(0);
  TP_CHECK(FixedOrderGemmFits(x, w, y))
      << "FixedOrderGemm: x " << x.ShapeString() << ", w " << w.ShapeString() << ", y "
      << y.ShapeString() << " (needs K % 8 == 0, 16-byte aligned x and w, M, N, K < 2^31)";
  CheckGemmBias("FixedOrderGemm", bias, N);
  if (M == 0 || N == 0) return;
  const auto* xp = x.ptr<const __nv_bfloat16>();
  const auto* wp = w.ptr<const __nv_bfloat16>();
  const auto* bp = bias != nullptr ? bias->ptr<const __nv_bfloat16>() : nullptr;
  auto* yp = y.ptr<__nv_bfloat16>();
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  if (variant == FixedOrderGemmVariant::kAuto) {
    variant = M <= kFixedOrderSplitMaxM    ? FixedOrderGemmVariant::kSplit
              : M <= kFixedOrderSlicedMaxM ? FixedOrderGemmVariant::kSliced
                                           : FixedOrderGemmVariant::kTiled;
  }
  if (variant == FixedOrderGemmVariant::kSplit) {
    if (M <= 8) {
      LaunchSplit<1, 8>(xp, wp, bp, yp, m, n, k, stream);
    } else if (M <= 16) {
      LaunchSplit<2, 4>(xp, wp, bp, yp, m, n, k, stream);
    } else {
      LaunchSplit<4, 4>(xp, wp, bp, yp, m, n, k, stream);
    }
  } else if (variant == FixedOrderGemmVariant::kSliced) {
    if (M <= 32) {
      LaunchTiled<64, 32, 2, 1, true>(xp, wp, bp, yp, m, n, k, stream);
    } else {
      LaunchTiled<64, 64, 2, 2, true>(xp, wp, bp, yp, m, n, k, stream);
    }
  } else if (M <= 64) {
    LaunchTiled<64, 64, 2, 2, false>(xp, wp, bp, yp, m, n, k, stream);
  } else {
    LaunchTiled<128, 128, 4, 4, false>(xp, wp, bp, yp, m, n, k, stream);
  }
  TP_CUDA_CHECK_LAUNCH();
}

bool FixedOrderGemmFits(const Tensor& x, const Tensor& w, const Tensor& y) {
  const int64_t K = x.dim(-1), M = x.numel() / std::max<int64_t>(K, 1), N = w.dim(0);
  return w.ndim == 2 && w.dim(1) == K && y.numel() == M * N && y.dim(-1) == N && K % 8 == 0 &&
         IsAligned16(x.data) && IsAligned16(w.data) && M < (int64_t{1} << 31) &&
         N < (int64_t{1} << 31) && K < (int64_t{1} << 31);
}

}  // namespace tpserve::cuda
