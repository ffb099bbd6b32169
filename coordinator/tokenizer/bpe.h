// The BPE model of tokenizer.json: vocab, merge ranks, byte fallback, unk, and a word cache.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tpserve::tok {

// GPT-2 byte <-> unicode map used by ByteLevel pre-tokenizer and decoder.
const std::array<int32_t, 256>& ByteToCodePoint();
// Maps a byte-level code point back to its byte, or -1.
int ByteFromCodePoint(int32_t cp);

class BpeModel {
 public:
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromJson(const nlohmann::json& model);
  BpeModel();

  // Per-thread cache of word -> ids for one model (words up to kMaxCachedWord bytes).
  struct WordCache {
    absl::flat_hash_map<std::string, absl::InlinedVector<int32_t, 4>> map;
  };
  static constexpr size_t kMaxCachedWord = 256;
  static constexpr size_t kMaxCacheEntries = 1 << 16;
  // This thread's cache for this model. Valid until the thread next asks another model.
  WordCache* ThreadCache() const;

  // Appends the ids of one pre-token. In byte mode (see EnableByteMode) `word` holds raw bytes
  // and the GPT-2 byte map is applied implicitly; otherwise `word` is the mapped string.
  void Tokenize(std::string_view word, bool byte_mode, WordCache* cache,
                std::vector<int32_t>* out) const;

  // Prepares raw-byte tokenization: valid when the last pre-tokenizer is ByteLevel. Returns false
  // when this model cannot support it (prefix/suffix or byte fallback in use).
  bool EnableByteMode();

  std::optional<int32_t> TokenToId(std::string_view token) const;
  const std::string* IdToToken(int32_t id) const;
  int32_t max_id() const { return static_cast<int32_t>(id_to_token_.size()) - 1; }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  void MergeWord(std::string_view word, bool byte_mode, std::vector<int32_t>* out) const;
  void ApplyMerges(std::vector<int32_t>* symbols) const;
  const Merge* FindMerge(int32_t a, int32_t b) const {
    auto it = merges_.find((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) |
                           static_cast<uint32_t>(b));
    return it == merges_.end() ? nullptr : &it->second;
  }

  absl::flat_hash_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  // (last code point of a, first code point of b) over all merges (a, b). A boundary between two
  // characters that are both vocab tokens and not in this set can never be crossed by a merge, so
  // long words are cut there and their parts merged (and cached) separately: same result, faster.
  absl::flat_hash_set<uint64_t> crossing_pairs_;
  void TokenizeLongWord(std::string_view word, WordCache* cache, std::vector<int32_t>* out) const;
  std::optional<std::string> unk_token_;
  std::optional<int32_t> unk_id_;
  std::string prefix_;  // continuing_subword_prefix
  std::string suffix_;  // end_of_word_suffix
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_fallback_ids_{};  // <0xXX> ids or -1
  std::array<int32_t, 128> ascii_ids_{};          // id of each ASCII character token or -1

  // Byte mode: raw byte string -> id, and byte -> initial symbol id (-1 if absent).
  bool byte_mode_ready_ = false;
  absl::flat_hash_map<std::string, int32_t> byte_vocab_;
  std::array<int32_t, 256> byte_symbol_{};

  uint64_t instance_id_;  // keys the per-thread word caches
};

}  // namespace tpserve::tok
