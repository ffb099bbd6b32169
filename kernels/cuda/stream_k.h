// Stream-K partition of a GEMM's (tile, K block) pairs over a grid (gemm_stream.cu), as host and
// device code alike, so that the CPU tests check the kernel's own index arithmetic
// (tests/kernels/stream_k_test.cc).
//
// The pairs, tile-major, are cut into `grid` contiguous ranges: block c owns
// [Start(c), Start(c + 1)). A block's run of pairs inside one tile is a segment. A segment that
// is not the whole tile leaves partial sums in a workspace slot of its block: slot 0 when it is
// the block's first segment (the block's range starts in that tile), slot 1 otherwise (it can
// only be the block's last one, since segments between the first and the last are whole tiles).
// The tile's blocks are BlockOf(first pair) .. BlockOf(last pair); the last of them to finish
// adds their slots in that order.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TP_STREAM_K_FN __host__ __device__ __forceinline__
#else
#define TP_STREAM_K_FN inline
#endif

namespace tpserve::cuda {

struct StreamKPlan {
  int tiles = 0;  // output tiles
  int kb = 0;     // K blocks a tile
  int total = 0;  // tiles * kb
  int grid = 0;   // blocks, 1 .. total
};

TP_STREAM_K_FN StreamKPlan MakeStreamKPlan(int tiles, int kb, int max_grid) {
  StreamKPlan p;
  p.tiles = tiles;
  p.kb = kb;
  p.total = tiles * kb;
  p.grid = max_grid < p.total ? max_grid : p.total;
  return p;
}

// The first pair of block c (c = grid: total).
TP_STREAM_K_FN int StreamKStart(const StreamKPlan& p, int c) {
  return static_cast<int>(static_cast<int64_t>(c) * p.total / p.grid);
}

// The block whose range holds pair i.
TP_STREAM_K_FN int StreamKBlockOf(const StreamKPlan& p, int i) {
  int c = static_cast<int>(static_cast<int64_t>(i) * p.grid / p.total);
  while (c + 1 < p.grid && StreamKStart(p, c + 1) <= i) ++c;
  while (c > 0 && StreamKStart(p, c) > i) --c;
  return c;
}

// The workspace slot of block c's (partial) segment of `tile`.
TP_STREAM_K_FN int StreamKSlot(const StreamKPlan& p, int c, int tile) {
  return StreamKStart(p, c) / p.kb == tile ? 0 : 1;
}

}  // namespace tpserve::cuda

#undef TP_STREAM_K_FN
