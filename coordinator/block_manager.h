// The KV block manager: the coordinator's view of the workers' KV cache pool, with the prefix
// cache. It hands out block ids (the workers own the contents); block tables live with the
// scheduler's sequences. Full blocks of computed tokens can be registered under a hash chained
// over their tokens (and a per-request salt); sequences with the same prefix then share them
// (reference counts), and blocks nobody uses stay cached until memory is needed (LRU eviction).
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace tpserve {

class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size, bool enable_prefix_caching = false);

  int block_size() const { return block_size_; }
  int total_blocks() const { return total_; }
  bool prefix_caching() const { return caching_; }
  // Blocks a sequence can get: truly free ones plus cached ones nobody uses (evictable).
  int free_blocks() const { return static_cast<int>(free_.size() + lru_.size()); }
  // Blocks registered in the prefix cache (in use or evictable).
  int cached_blocks() const { return static_cast<int>(cached_.size()); }
  int evictable_blocks() const { return static_cast<int>(lru_.size()); }
  int64_t evictions() const { return evictions_; }
  // Blocks needed to hold `tokens` tokens.
  int BlocksFor(int64_t tokens) const {
    return static_cast<int>((tokens + block_size_ - 1) / block_size_);
  }

  // Grows `table` to `count` blocks with fresh (private) blocks, evicting the least recently
  // used cached blocks when no block is truly free; false (and no change) when there are not
  // enough.
  bool GrowTo(std::vector<int32_t>& table, int count);
  // Drops the reference of `table` to each of its blocks and clears it. A cached block nobody
  // uses any more becomes evictable (the table's last blocks are evicted first); a private block
  // is free at once.
  void Release(std::vector<int32_t>& table);

  // The chain hash of a sequence's first block is ChainHash(RootHash(salt), its tokens); of the
  // next one ChainHash(that hash, its tokens), and so on.
  static uint64_t RootHash(std::string_view salt);
  static uint64_t ChainHash(uint64_t parent, std::span<const int32_t> block_tokens);

  // The longest run of cached blocks for a sequence whose full blocks have the chain hashes
  // `hashes` (at most `max_blocks` of them), its tokens `tokens` and salt `salt`. Each hit is
  // checked against the stored tokens and parent block, so a hash collision is a miss, never a
  // wrong block. Takes no references.
  std::vector<int32_t> Match(std::span<const uint64_t> hashes, std::span<const int32_t> tokens,
                             std::string_view salt, int max_blocks) const;
  // Appends `blocks` (a Match result) to the empty `table`, taking a reference to each.
  void Acquire(std::vector<int32_t>& table, std::span<const int32_t> blocks);
  // Registers table[i], full of computed tokens `block_tokens` whose chain hash is `hash`, in
  // the cache; table[0..i) must be registered already (its parent is table[i - 1]). When the
  // same block is cached already, table[i] is replaced by the cached block (same contents) and
  // its own block is freed. False when it cannot be cached (another block holds the hash, or
  // caching is off): later blocks of the table cannot be cached either.
  bool Register(std::vector<int32_t>& table, int i, uint64_t hash,
                std::span<const int32_t> block_tokens, std::string_view salt);
  // True when Register(table, i, hash, ...) would replace table[i] with another block already
  // cached under `hash` (or find a collision there): the caller's copy would be freed.
  bool WouldReplace(std::span<const int32_t> table, int i, uint64_t hash) const;
  // True when `block` is registered in the cache (shared or shareable: never written again).
  bool IsCached(int32_t block) const { return meta_[block].cached; }
  // Forgets every cached block of requests with salt `salt` (all salts when `all`): evictable
  // ones are freed, ones in use stay with their sequences as private blocks (freed when they
  // end). Returns the number of blocks forgotten.
  int DropCached(std::string_view salt, bool all);

 private:
  struct Meta {
    int refs = 0;
    bool cached = false;
    uint64_t hash = 0;
    int32_t parent = -1;  // the cached block before this one in its chain; -1: first block
    std::string salt;     // first blocks only (the rest inherit it through their parent)
    std::vector<int32_t> tokens;
    std::vector<int32_t> children;     // cached blocks whose parent this is
    std::list<int32_t>::iterator lru;  // valid when cached and refs == 0
  };
  int32_t TakeBlock();          // a truly free block, else the LRU cached one (evicted)
  void Uncache(int32_t block);  // unregisters the block and its descendants
  bool Verify(int32_t block, int32_t parent, std::span<const int32_t> tokens,
              std::string_view salt) const;

  int total_;
  int block_size_;
  bool caching_;
  std::vector<int32_t> free_;  // a stack: recently freed blocks are reused first
  std::vector<Meta> meta_;
  absl::flat_hash_map<uint64_t, int32_t> cached_;  // chain hash -> block
  std::list<int32_t> lru_;  // cached blocks with no reference, least recently used first
  int64_t evictions_ = 0;
};

}  // namespace tpserve
