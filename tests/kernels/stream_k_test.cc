// The stream-K partition of gemm_stream.cu (kernels/cuda/stream_k.h), checked on the CPU by
// walking every block's range as the kernel does: every (tile, K block) pair is computed by
// exactly one block; a tile is written whole by one block or in partial segments, one per block
// of BlockOf(first pair) .. BlockOf(last pair), each into a slot no other segment uses, the slot
// the adding block reads for it; and the counter reaches the number of those blocks.
#include "kernels/cuda/stream_k.h"

#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace tpserve::cuda {
namespace {

void CheckPlan(int tiles, int kb, int max_grid) {
  SCOPED_TRACE(testing::Message() << tiles << " tiles x " << kb
                                  << " K blocks, grid <= " << max_grid);
  const StreamKPlan p = MakeStreamKPlan(tiles, kb, max_grid);
  ASSERT_EQ(p.total, tiles * kb);
  ASSERT_GE(p.grid, 1);
  ASSERT_LE(p.grid, p.total);
  ASSERT_EQ(StreamKStart(p, 0), 0);
  ASSERT_EQ(StreamKStart(p, p.grid), p.total);
  std::vector<int> covered(p.total, 0);
  std::set<std::pair<int, int>> slots_written;     // (block, slot)
  std::map<int, std::vector<int>> partial_blocks;  // tile -> blocks, in walk order
  std::map<std::pair<int, int>, int> slot_of;      // (block, tile) -> slot written
  std::map<int, int> covered_by_partials;          // tile -> K blocks in partial segments
  std::set<int> whole_tiles;
  for (int c = 0; c < p.grid; ++c) {
    const int begin = StreamKStart(p, c), end = StreamKStart(p, c + 1);
    ASSERT_LT(begin, end) << "block " << c << " has no pairs";
    int seg_begin = begin;
    for (int it = begin; it < end; ++it) {
      ++covered[it];
      EXPECT_EQ(StreamKBlockOf(p, it), c) << "pair " << it;
      const int kblk = it % kb;
      if (kblk != kb - 1 && it != end - 1) continue;
      const int tile = it / kb;
      const bool whole = seg_begin % kb == 0 && kblk == kb - 1;
      if (whole) {
        EXPECT_TRUE(whole_tiles.insert(tile).second) << "tile " << tile << " written twice";
      } else {
        const int slot = StreamKSlot(p, c, tile);
        // The kernel's rule: slot 0 for the block's first segment, 1 for any later one.
        EXPECT_EQ(slot, seg_begin == begin ? 0 : 1) << "block " << c << " tile " << tile;
        EXPECT_TRUE(slots_written.insert({c, slot}).second)
            << "block " << c << " writes slot " << slot << " twice";
        partial_blocks[tile].push_back(c);
        slot_of[{c, tile}] = slot;
        covered_by_partials[tile] += it - seg_begin + 1;
      }
      seg_begin = it + 1;
    }
  }
  for (int i = 0; i < p.total; ++i) ASSERT_EQ(covered[i], 1) << "pair " << i;
  for (int t = 0; t < tiles; ++t) {
    const int c0 = StreamKBlockOf(p, t * kb), c1 = StreamKBlockOf(p, t * kb + kb - 1);
    if (whole_tiles.count(t) > 0) {
      EXPECT_EQ(c0, c1) << "tile " << t;
      EXPECT_EQ(partial_blocks.count(t), 0u) << "tile " << t;
      continue;
    }
    const std::vector<int>& blocks = partial_blocks[t];
    ASSERT_EQ(static_cast<int>(blocks.size()), c1 - c0 + 1) << "tile " << t << ": arrivals";
    EXPECT_GE(blocks.size(), 2u) << "tile " << t << " split over one block";
    EXPECT_EQ(covered_by_partials[t], kb) << "tile " << t;
    for (int c = c0; c <= c1; ++c) {
      EXPECT_EQ(blocks[c - c0], c) << "tile " << t;
      // The slot the adding block reads is the one the block wrote.
      EXPECT_EQ(StreamKSlot(p, c, t), slot_of[std::make_pair(c, t)]) << "tile " << t << " block " << c;
    }
  }
}

TEST(StreamKTest, EveryPairOnceAndEverySplitTileAddedFromItsOwnSlots) {
  // The 6.7B shapes at 128-row tiles and 64-K blocks on 132 SMs x 2, and others.
  for (auto [tiles, kb] : {std::pair{96, 64},
                           {32, 64},
                           {172, 64},
                           {32, 172},
                           {252, 64},
                           {2, 16},
                           {4, 17},
                           {1, 1},
                           {1, 100},
                           {300, 1}}) {
    for (int grid : {1, 2, 3, 7, 37, 132, 264, 100000}) CheckPlan(tiles, kb, grid);
  }
  std::mt19937 rng(3);
  for (int i = 0; i < 300; ++i) {
    CheckPlan(1 + static_cast<int>(rng() % 600), 1 + static_cast<int>(rng() % 200),
              1 + static_cast<int>(rng() % 600));
  }
}

}  // namespace
}  // namespace tpserve::cuda
