// The KV block manager (see block_manager.h).
#include "coordinator/block_manager.h"

#include "common/logging.h"

namespace tpserve {

BlockManager::BlockManager(int num_blocks, int block_size)
    : total_(num_blocks), block_size_(block_size) {
  TP_CHECK(num_blocks >= 0 && block_size > 0);
  free_.reserve(num_blocks);
  for (int i = num_blocks - 1; i >= 0; --i) free_.push_back(i);
}

bool BlockManager::GrowTo(std::vector<int32_t>& table, int count) {
  const int need = count - static_cast<int>(table.size());
  if (need <= 0) return true;
  if (need > free_blocks()) return false;
  for (int i = 0; i < need; ++i) {
    table.push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void BlockManager::Release(std::vector<int32_t>& table) {
  for (int32_t b : table) free_.push_back(b);
  TP_CHECK(static_cast<int>(free_.size()) <= total_) << "a KV block was released twice";
  table.clear();
}

}  // namespace tpserve
