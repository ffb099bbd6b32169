// The KV block manager and its prefix cache (see block_manager.h).
#include "coordinator/block_manager.h"

#include <algorithm>

#include "absl/hash/hash.h"
#include "common/logging.h"

namespace tpserve {

BlockManager::BlockManager(int num_blocks, int block_size, bool enable_prefix_caching)
    : total_(num_blocks), block_size_(block_size), caching_(enable_prefix_caching) {
  TP_CHECK(num_blocks >= 0 && block_size > 0);
  free_.reserve(num_blocks);
  for (int i = num_blocks - 1; i >= 0; --i) free_.push_back(i);
  meta_.resize(num_blocks);
}

uint64_t BlockManager::RootHash(std::string_view salt) {
  return absl::HashOf(std::string_view("tpserve prefix cache root"), salt);
}

uint64_t BlockManager::ChainHash(uint64_t parent, std::span<const int32_t> block_tokens) {
  return absl::HashOf(parent, absl::MakeConstSpan(block_tokens.data(), block_tokens.size()));
}

int32_t BlockManager::TakeBlock() {
  if (!free_.empty()) {
    const int32_t b = free_.back();
    free_.pop_back();
    return b;
  }
  TP_CHECK(!lru_.empty()) << "no KV block to take";
  const int32_t victim = lru_.front();
  // Its descendants are unused too (a sequence holding a block holds its whole chain): they go
  // to the free list with it.
  const size_t before = free_.size();
  Uncache(victim);
  evictions_ += static_cast<int64_t>(free_.size() - before);
  TP_CHECK(!free_.empty() && free_.back() == victim) << "the evicted block was not freed";
  free_.pop_back();
  return victim;
}

bool BlockManager::GrowTo(std::vector<int32_t>& table, int count) {
  const int need = count - static_cast<int>(table.size());
  if (need <= 0) return true;
  if (need > free_blocks()) return false;
  for (int i = 0; i < need; ++i) {
    const int32_t b = TakeBlock();
    meta_[b].refs = 1;
    table.push_back(b);
  }
  return true;
}

void BlockManager::Release(std::vector<int32_t>& table) {
  // Last blocks first: they land nearer the LRU's cold end than the prefix they extend.
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    Meta& m = meta_[*it];
    TP_CHECK(m.refs > 0) << "KV block " << *it << " was released twice";
    if (--m.refs > 0) continue;
    if (m.cached) {
      m.lru = lru_.insert(lru_.end(), *it);
    } else {
      free_.push_back(*it);
    }
  }
  table.clear();
}

bool BlockManager::Verify(int32_t block, int32_t parent, std::span<const int32_t> tokens,
                          std::string_view salt) const {
  const Meta& m = meta_[block];
  if (!m.cached || m.parent != parent) return false;
  if (parent < 0 && m.salt != salt) return false;
  return std::equal(m.tokens.begin(), m.tokens.end(), tokens.begin(), tokens.end());
}

std::vector<int32_t> BlockManager::Match(std::span<const uint64_t> hashes,
                                         std::span<const int32_t> tokens, std::string_view salt,
                                         int max_blocks) const {
  std::vector<int32_t> out;
  if (!caching_) return out;
  const size_t n = std::min(hashes.size(), static_cast<size_t>(std::max(max_blocks, 0)));
  int32_t parent = -1;
  for (size_t i = 0; i < n; ++i) {
    if ((i + 1) * block_size_ > tokens.size()) break;
    auto it = cached_.find(hashes[i]);
    if (it == cached_.end()) break;
    if (!Verify(it->second, parent, tokens.subspan(i * block_size_, block_size_), salt)) break;
    parent = it->second;
    out.push_back(parent);
  }
  return out;
}

void BlockManager::Acquire(std::vector<int32_t>& table, std::span<const int32_t> blocks) {
  TP_CHECK(table.empty());
  for (int32_t b : blocks) {
    Meta& m = meta_[b];
    TP_CHECK(m.cached) << "KV block " << b << " is not cached";
    if (m.refs++ == 0) lru_.erase(m.lru);
    table.push_back(b);
  }
}

bool BlockManager::Register(std::vector<int32_t>& table, int i, uint64_t hash,
                            std::span<const int32_t> block_tokens, std::string_view salt) {
  if (!caching_) return false;
  TP_CHECK(i >= 0 && i < static_cast<int>(table.size()) &&
           static_cast<int>(block_tokens.size()) == block_size_);
  const int32_t b = table[i];
  const int32_t parent = i > 0 ? table[i - 1] : -1;
  if (parent >= 0 && !meta_[parent].cached) return false;
  if (meta_[b].cached) return Verify(b, parent, block_tokens, salt);
  auto it = cached_.find(hash);
  if (it != cached_.end()) {
    const int32_t c = it->second;
    if (!Verify(c, parent, block_tokens, salt)) return false;  // a collision: keep it private
    // The same block computed twice (e.g. the last block of a fully cached prompt): use the
    // cached one, free this one.
    TP_CHECK(meta_[b].refs == 1) << "private KV block " << b << " is shared";
    Meta& cm = meta_[c];
    if (cm.refs++ == 0) lru_.erase(cm.lru);
    meta_[b].refs = 0;
    free_.push_back(b);
    table[i] = c;
    return true;
  }
  Meta& m = meta_[b];
  m.cached = true;
  m.hash = hash;
  m.parent = parent;
  m.tokens.assign(block_tokens.begin(), block_tokens.end());
  m.salt = parent < 0 ? std::string(salt) : std::string();
  if (parent >= 0) meta_[parent].children.push_back(b);
  cached_.emplace(hash, b);
  return true;
}

bool BlockManager::WouldReplace(std::span<const int32_t> table, int i, uint64_t hash) const {
  if (!caching_ || meta_[table[i]].cached) return false;
  auto it = cached_.find(hash);
  return it != cached_.end() && it->second != table[i];
}

void BlockManager::Uncache(int32_t block) {
  Meta& m = meta_[block];
  if (!m.cached) return;
  for (int32_t c : std::vector<int32_t>(m.children)) Uncache(c);
  m.children.clear();
  if (m.parent >= 0) std::erase(meta_[m.parent].children, block);
  cached_.erase(m.hash);
  m.cached = false;
  m.parent = -1;
  m.salt.clear();
  m.tokens.clear();
  if (m.refs == 0) {
    lru_.erase(m.lru);
    free_.push_back(block);
  }
}

int BlockManager::DropCached(std::string_view salt, bool all) {
  const int before = cached_blocks();
  for (int32_t b = 0; b < total_; ++b) {
    const Meta& m = meta_[b];
    if (m.cached && m.parent < 0 && (all || m.salt == salt)) Uncache(b);
  }
  return before - cached_blocks();
}

}  // namespace tpserve
