// The KV block manager: the coordinator's view of the workers' KV cache pool. It hands out block
// ids (the workers own the contents); block tables live with the scheduler's sequences.
#pragma once

#include <cstdint>
#include <vector>

namespace tpserve {

class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size);

  int block_size() const { return block_size_; }
  int total_blocks() const { return total_; }
  int free_blocks() const { return static_cast<int>(free_.size()); }
  // Blocks needed to hold `tokens` tokens.
  int BlocksFor(int64_t tokens) const {
    return static_cast<int>((tokens + block_size_ - 1) / block_size_);
  }

  // Grows `table` to `count` blocks; false (and no change) when there are not enough free.
  bool GrowTo(std::vector<int32_t>& table, int count);
  // Returns every block of `table` to the pool and clears it.
  void Release(std::vector<int32_t>& table);

 private:
  int total_;
  int block_size_;
  std::vector<int32_t> free_;  // a stack: recently freed blocks are reused first
};

}  // namespace tpserve
