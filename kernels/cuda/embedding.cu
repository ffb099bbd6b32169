// Embedding lookup with a vocab-parallel row offset: out[t] = table[token - offset] or zeros.
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace tpserve::cuda {
namespace {

__global__ void EmbeddingKernel(const uint4* __restrict__ table, int64_t rows, int64_t row_offset,
                                const int32_t* __restrict__ token_ids, int vecs_per_row,
                                uint4* __restrict__ out) {
  int t = blockIdx.x;
  int64_t row = static_cast<int64_t>(token_ids[t]) - row_offset;
  bool valid = row >= 0 && row < rows;
  uint4* dst = out + static_cast<int64_t>(t) * vecs_per_row;
  const uint4* src = table + (valid ? row : 0) * vecs_per_row;
  for (int i = threadIdx.x; i < vecs_per_row; i += blockDim.x) {
    dst[i] = valid ? src[i] : make_uint4(0, 0, 0, 0);
  }
}

// token_ids[pairs[i].x] = ids[pairs[i].y]: the input tokens of a step launched before the host
// saw the previous step's sampled ids.
__global__ void FeedTokensKernel(int32_t* __restrict__ token_ids, const int2* __restrict__ pairs,
                                 int n, const int32_t* __restrict__ ids) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) token_ids[pairs[i].x] = ids[pairs[i].y];
}

}  // namespace

void LaunchFeedTokens(int32_t* token_ids, const int2* pairs, int n, const int32_t* ids,
                      cudaStream_t stream) {
  if (n == 0) return;
  FeedTokensKernel<<<(n + 255) / 256, 256, 0, stream>>>(token_ids, pairs, n, ids);
  TP_CUDA_CHECK_LAUNCH();
}

void LaunchEmbedding(const Tensor& table, int64_t row_offset, const DeviceBatch& b, Tensor out,
                     cudaStream_t stream) {
  TP_CHECK_CUDA_TENSOR(table, DType::kBF16);
  TP_CHECK_CUDA_TENSOR(out, DType::kBF16);
  TP_CHECK(table.ndim == 2 && out.ndim == 2 && out.dim(0) == b.num_tokens &&
           out.dim(1) == table.dim(1))
      << "Embedding: table " << table.ShapeString() << ", out " << out.ShapeString() << ", tokens "
      << b.num_tokens;
  int64_t hidden = table.dim(1);
  TP_CHECK(hidden % 8 == 0) << "Embedding: hidden " << hidden << " must be a multiple of 8";
  if (b.num_tokens == 0) return;
  int vecs = static_cast<int>(hidden / 8);
  int threads = vecs < 256 ? ((vecs + 31) / 32) * 32 : 256;
  EmbeddingKernel<<<b.num_tokens, threads, 0, stream>>>(
      table.ptr<const uint4>(), table.dim(0), row_offset, b.token_ids, vecs, out.ptr<uint4>());
  TP_CUDA_CHECK_LAUNCH();
}

}  // namespace tpserve::cuda
