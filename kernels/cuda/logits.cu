// Logit plumbing: gather the sampled rows of the batch, and interleave all-gathered vocab
// shards [S, B, Vs] into full rows [B, S * Vs].
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {
namespace {

template <typename T>
__global__ void GatherRowsKernel(const T* __restrict__ in, const int32_t* __restrict__ rows,
                                 int64_t row_elems, T* __restrict__ out) {
  int r = blockIdx.y;
  const T* src = in + static_cast<int64_t>(rows[r]) * row_elems;
  T* dst = out + static_cast<int64_t>(r) * row_elems;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < row_elems;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = src[i];
  }
}

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}

template <typename In, typename Out>
__global__ void InterleaveKernel(const In* __restrict__ in, int shards, int batch,
                                 int64_t shard_vocab, Out* __restrict__ out) {
  int b = blockIdx.y;
  int64_t row = shards * shard_vocab;
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < row;
       j += int64_t{gridDim.x} * blockDim.x) {
    int64_t s = j / shard_vocab, v = j % shard_vocab;
    out[b * row + j] = FromFloat<Out>(ToFloat(in[(s * batch + b) * shard_vocab + v]));
  }
}

}  // namespace

void LaunchGatherRows(const Tensor& in, const DeviceBatch& b, Tensor out, cudaStream_t stream) {
  TP_CHECK(in.device == Device::kCuda && out.device == Device::kCuda && in.dtype == out.dtype &&
           in.ndim == 2 && out.ndim == 2 && out.dim(0) == b.num_logits_rows &&
           out.dim(1) == in.dim(1))
      << "GatherLogitRows: in " << in.ShapeString() << ", out " << out.ShapeString() << ", "
      << b.num_logits_rows << " rows";
  if (b.num_logits_rows == 0) return;
  int64_t row_bytes = in.dim(1) * DTypeSize(in.dtype);
  dim3 grid(1, b.num_logits_rows);
  int threads = 256;
  if (row_bytes % 16 == 0 && IsAligned16(in.data) && IsAligned16(out.data)) {
    grid.x = CeilDiv(row_bytes / 16, threads);
    GatherRowsKernel<<<grid, threads, 0, stream>>>(in.ptr<const uint4>(), b.logits_rows,
                                                   row_bytes / 16, out.ptr<uint4>());
  } else if (row_bytes % 4 == 0) {
    grid.x = CeilDiv(row_bytes / 4, threads);
    GatherRowsKernel<<<grid, threads, 0, stream>>>(in.ptr<const uint32_t>(), b.logits_rows,
                                                   row_bytes / 4, out.ptr<uint32_t>());
  } else {
    grid.x = CeilDiv(row_bytes / 2, threads);
    GatherRowsKernel<<<grid, threads, 0, stream>>>(in.ptr<const uint16_t>(), b.logits_rows,
                                                   row_bytes / 2, out.ptr<uint16_t>());
  }
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchInterleaveShards(const Tensor& in, Tensor out, cudaStream_t stream) {
  TP_CHECK(in.device == Device::kCuda && out.device == Device::kCuda && in.ndim == 3 &&
           out.ndim == 2 && out.dim(0) == in.dim(1) && out.dim(1) == in.dim(0) * in.dim(2) &&
           (in.dtype == DType::kF32 || in.dtype == DType::kBF16) &&
           (out.dtype == DType::kF32 || out.dtype == DType::kBF16))
      << "InterleaveShards: in " << in.ShapeString() << " [S, B, Vs], out " << out.ShapeString()
      << " [B, S * Vs]";
  int shards = static_cast<int>(in.dim(0)), batch = static_cast<int>(in.dim(1));
  int64_t vs = in.dim(2);
  if (batch == 0 || shards == 0 || vs == 0) return;
  int threads = 256;
  dim3 grid(std::min(CeilDiv(shards * vs, threads), 1024), batch);
  if (in.dtype == DType::kF32 && out.dtype == DType::kF32) {
    InterleaveKernel<<<grid, threads, 0, stream>>>(in.ptr<const float>(), shards, batch, vs,
                                                   out.ptr<float>());
  } else if (in.dtype == DType::kBF16 && out.dtype == DType::kF32) {
    InterleaveKernel<<<grid, threads, 0, stream>>>(in.ptr<const __nv_bfloat16>(), shards, batch, vs,
                                                   out.ptr<float>());
  } else if (in.dtype == DType::kF32 && out.dtype == DType::kBF16) {
    InterleaveKernel<<<grid, threads, 0, stream>>>(in.ptr<const float>(), shards, batch, vs,
                                                   out.ptr<__nv_bfloat16>());
  } else {
    InterleaveKernel<<<grid, threads, 0, stream>>>(in.ptr<const __nv_bfloat16>(), shards, batch, vs,
                                                   out.ptr<__nv_bfloat16>());
  }
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
