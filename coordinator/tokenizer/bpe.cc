// BPE model: loading vocab/merges and merging words exactly like HF tokenizers' Word::merge_all.
#include "coordinator/tokenizer/bpe.h"

#include <algorithm>
#include <atomic>
#include <queue>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/tokenizer/text_util.h"

namespace tpserve::tok {

const std::array<int32_t, 256>& ByteToCodePoint() {
  static const std::array<int32_t, 256> table = [] {
    std::array<int32_t, 256> t{};
    std::array<bool, 256> direct{};
    for (int b = '!'; b <= '~'; ++b) direct[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b) t[b] = direct[b] ? b : 256 + n++;
    return t;
  }();
  return table;
}

int ByteFromCodePoint(int32_t cp) {
  static const std::vector<int16_t> inverse = [] {
    std::vector<int16_t> inv(512, -1);
    const auto& t = ByteToCodePoint();
    for (int b = 0; b < 256; ++b) inv[t[b]] = static_cast<int16_t>(b);
    return inv;
  }();
  return cp >= 0 && cp < 512 ? inverse[cp] : -1;
}

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromJson(const nlohmann::json& model) {
  auto m = std::unique_ptr<BpeModel>(new BpeModel());
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    return absl::InvalidArgumentError("model.vocab: missing or not an object");
  }
  int32_t max_id = -1;
  m->vocab_.reserve(model["vocab"].size());
  for (const auto& [token, id] : model["vocab"].items()) {
    if (!id.is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.vocab[\"", token, "\"]: not an integer"));
    }
    int32_t v = id.get<int32_t>();
    m->vocab_[token] = v;
    max_id = std::max(max_id, v);
  }
  m->id_to_token_.assign(max_id + 1, std::string());
  for (const auto& [token, id] : m->vocab_) m->id_to_token_[id] = token;

  auto str_or_empty = [&](const char* key) -> std::string {
    if (model.contains(key) && model[key].is_string()) return model[key].get<std::string>();
    return "";
  };
  m->prefix_ = str_or_empty("continuing_subword_prefix");
  m->suffix_ = str_or_empty("end_of_word_suffix");
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    m->unk_token_ = model["unk_token"].get<std::string>();
    auto it = m->vocab_.find(*m->unk_token_);
    if (it != m->vocab_.end()) m->unk_id_ = it->second;
  }
  m->fuse_unk_ = model.value("fuse_unk", false);
  m->byte_fallback_ = model.value("byte_fallback", false);
  m->ignore_merges_ = model.value("ignore_merges", false);
  for (int b = 0; b < 256; ++b) {
    auto it = m->vocab_.find(absl::StrFormat("<0x%02X>", b));
    m->byte_fallback_ids_[b] = it == m->vocab_.end() ? -1 : it->second;
  }

  for (int c = 0; c < 128; ++c) {
    auto it = m->vocab_.find(std::string(1, static_cast<char>(c)));
    m->ascii_ids_[c] = it == m->vocab_.end() ? -1 : it->second;
  }
  if (model.contains("merges") && model["merges"].is_array()) {
    const auto& merges = model["merges"];
    m->merges_.reserve(merges.size());
    int32_t rank = 0;
    for (const auto& entry : merges) {
      std::string a, b;
      if (entry.is_string()) {
        const std::string& s = entry.get_ref<const std::string&>();
        size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
          return absl::InvalidArgumentError(
              absl::StrCat("model.merges[", rank, "]: expected \"a b\", got \"", s, "\""));
        }
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() &&
                 entry[1].is_string()) {
        a = entry[0].get<std::string>();
        b = entry[1].get<std::string>();
      } else {
        return absl::InvalidArgumentError(absl::StrCat("model.merges[", rank, "]: bad entry"));
      }
      auto ia = m->vocab_.find(a);
      auto ib = m->vocab_.find(b);
      std::string merged =
          a +
          (m->prefix_.empty()
               ? b
               : b.substr(std::min(b.size(), b.rfind(m->prefix_, 0) == 0 ? m->prefix_.size() : 0)));
      auto in = m->vocab_.find(merged);
      if (ia == m->vocab_.end() || ib == m->vocab_.end() || in == m->vocab_.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model.merges[", rank, "]: token out of vocabulary (\"", a, "\" \"", b, "\")"));
      }
      uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32) |
                     static_cast<uint32_t>(ib->second);
      m->merges_.try_emplace(key, Merge{rank, in->second});
      if (!a.empty() && !b.empty()) {
        size_t p = a.size() - 1;
        while (p > 0 && (a[p] & 0xC0) == 0x80) --p;
        int len;
        uint64_t x = static_cast<uint32_t>(DecodeCodePoint(a, p, &len));
        uint64_t c = static_cast<uint32_t>(DecodeCodePoint(b, 0, &len));
        m->crossing_pairs_.insert((x << 32) | c);
      }
      ++rank;
    }
  }
  return m;
}

bool BpeModel::EnableByteMode() {
  if (!prefix_.empty() || !suffix_.empty() || byte_fallback_) return false;
  const auto& table = ByteToCodePoint();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    AppendCodePoint(&s, table[b]);
    auto it = vocab_.find(s);
    byte_symbol_[b] = it == vocab_.end() ? -1 : it->second;
  }
  if (ignore_merges_) {
    byte_vocab_.reserve(vocab_.size());
    for (const auto& [token, id] : vocab_) {
      std::string raw;
      bool ok = true;
      for (size_t i = 0; i < token.size() && ok;) {
        int len;
        int b = ByteFromCodePoint(DecodeCodePoint(token, i, &len));
        if (b < 0) ok = false;
        raw.push_back(static_cast<char>(b));
        i += len;
      }
      if (ok) byte_vocab_.try_emplace(raw, id);
    }
  }
  byte_mode_ready_ = true;
  return true;
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = vocab_.find(AbslView(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || id >= static_cast<int32_t>(id_to_token_.size())) return nullptr;
  // Holes in the id space (ids not in vocab) are empty and unknown.
  const std::string& s = id_to_token_[id];
  if (s.empty()) return nullptr;
  return &s;
}

BpeModel::BpeModel() {
  static std::atomic<uint64_t> next_id{1};
  instance_id_ = next_id.fetch_add(1);
}

BpeModel::WordCache* BpeModel::ThreadCache() const {
  // One cache per (thread, model). Models are few; if many come and go, start over.
  thread_local absl::flat_hash_map<uint64_t, std::unique_ptr<WordCache>> caches;
  auto it = caches.find(instance_id_);
  if (it != caches.end()) return it->second.get();
  if (caches.size() >= 8) caches.clear();
  auto& slot = caches[instance_id_];
  slot = std::make_unique<WordCache>();
  return slot.get();
}

void BpeModel::Tokenize(std::string_view word, bool byte_mode, WordCache* cache,
                        std::vector<int32_t>* out) const {
  if (word.empty()) return;
  const bool cacheable = word.size() <= kMaxCachedWord;
  if (cacheable) {
    auto it = cache->map.find(AbslView(word));
    if (it != cache->map.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t before = out->size();
  bool done = false;
  if (ignore_merges_) {
    const auto& v = byte_mode ? byte_vocab_ : vocab_;
    auto it = v.find(AbslView(word));
    if (it != v.end()) {
      out->push_back(it->second);
      done = true;
    }
  }
  if (!done) {
    if (!cacheable && !byte_mode && prefix_.empty() && suffix_.empty() && !ignore_merges_) {
      TokenizeLongWord(word, cache, out);
    } else {
      MergeWord(word, byte_mode, out);
    }
  }
  if (cacheable) {
    if (cache->map.size() >= kMaxCacheEntries) cache->map.clear();
    cache->map.try_emplace(std::string(word), out->begin() + before, out->end());
  }
}

void BpeModel::TokenizeLongWord(std::string_view w, WordCache* cache,
                                std::vector<int32_t>* out) const {
  size_t seg_start = 0;
  int32_t prev_cp = -1;
  bool prev_in_vocab = false;
  for (size_t i = 0; i < w.size();) {
    int len;
    int32_t cp = DecodeCodePoint(w, i, &len);
    bool in_vocab = cp < 128 ? ascii_ids_[cp] >= 0 : vocab_.contains(AbslView(w.substr(i, len)));
    if (i > seg_start && prev_in_vocab && in_vocab &&
        !crossing_pairs_.contains((static_cast<uint64_t>(static_cast<uint32_t>(prev_cp)) << 32) |
                                  static_cast<uint32_t>(cp))) {
      std::string_view seg = w.substr(seg_start, i - seg_start);
      if (seg.size() <= kMaxCachedWord) {
        Tokenize(seg, false, cache, out);
      } else {
        MergeWord(seg, false, out);
      }
      seg_start = i;
    }
    prev_cp = cp;
    prev_in_vocab = in_vocab;
    i += len;
  }
  std::string_view seg = w.substr(seg_start);
  if (seg.size() <= kMaxCachedWord) {
    Tokenize(seg, false, cache, out);
  } else {
    MergeWord(seg, false, out);
  }
}

void BpeModel::MergeWord(std::string_view w, bool byte_mode, std::vector<int32_t>* out) const {
  thread_local std::vector<int32_t> symbols;
  symbols.clear();
  if (byte_mode) {
    for (unsigned char c : w) {
      int32_t id = byte_symbol_[c];
      if (id >= 0) {
        symbols.push_back(id);
      } else if (unk_id_) {
        // Same unk handling as the character path (each byte is one "character" here).
        if (fuse_unk_ && !symbols.empty() && symbols.back() == *unk_id_) continue;
        symbols.push_back(*unk_id_);
      }
    }
  } else {
    int32_t unk = -1;  // pending unk id (fused), -1 if none
    std::string s;
    for (size_t i = 0; i < w.size();) {
      size_t len = Utf8SeqLen(static_cast<unsigned char>(w[i]));
      size_t end = std::min(w.size(), i + len);
      bool is_first = i == 0, is_last = end == w.size();
      std::string_view ch = w.substr(i, end - i);
      const std::string_view* key = &ch;
      std::string_view composed;
      if ((!is_first && !prefix_.empty()) || (is_last && !suffix_.empty())) {
        s.clear();
        if (!is_first) s.append(prefix_);
        s.append(ch);
        if (is_last) s.append(suffix_);
        composed = s;
        key = &composed;
      }
      int32_t found = -1;
      if (key == &ch && len == 1 && static_cast<unsigned char>(ch[0]) < 128) {
        found = ascii_ids_[static_cast<unsigned char>(ch[0])];
      } else {
        auto it = vocab_.find(AbslView(*key));
        if (it != vocab_.end()) found = it->second;
      }
      if (found >= 0) {
        if (unk >= 0) {
          symbols.push_back(unk);
          unk = -1;
        }
        symbols.push_back(found);
      } else {
        bool done = false;
        if (byte_fallback_) {
          bool all = true;
          for (unsigned char b : *key) all = all && byte_fallback_ids_[b] >= 0;
          if (all) {
            for (unsigned char b : *key) symbols.push_back(byte_fallback_ids_[b]);
            done = true;
          }
        }
        if (!done && unk_token_) {
          // HF looks up vocab[unk_token]; a missing unk is a load-time inconsistency: skip.
          if (unk_id_) {
            if (unk >= 0 && !fuse_unk_) symbols.push_back(unk);
            unk = *unk_id_;
          }
        }
      }
      i = end;
    }
    if (unk >= 0) symbols.push_back(unk);
  }
  ApplyMerges(&symbols);
  out->insert(out->end(), symbols.begin(), symbols.end());
}

void BpeModel::ApplyMerges(std::vector<int32_t>* symbols) const {
  const size_t n = symbols->size();
  if (n < 2) return;
  struct Sym {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  struct Entry {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator<(const Entry& o) const {  // max-heap on (lowest rank, lowest pos)
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  thread_local std::vector<Sym> syms;
  thread_local std::vector<Entry> heap;
  syms.resize(n);
  heap.clear();
  for (size_t i = 0; i < n; ++i) {
    syms[i] = Sym{(*symbols)[i], static_cast<int32_t>(i) - 1,
                  i + 1 < n ? static_cast<int32_t>(i + 1) : -1, true};
  }
  for (size_t i = 0; i + 1 < n; ++i) {
    if (const Merge* m = FindMerge(syms[i].id, syms[i + 1].id)) {
      heap.push_back(Entry{m->rank, static_cast<int32_t>(i), m->new_id});
    }
  }
  std::make_heap(heap.begin(), heap.end());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    Entry top = heap.back();
    heap.pop_back();
    Sym& cur = syms[top.pos];
    if (!cur.alive || cur.next < 0) continue;
    Sym right = syms[cur.next];
    const Merge* m = FindMerge(cur.id, right.id);
    if (m == nullptr || m->new_id != top.new_id) continue;
    int32_t right_pos = cur.next;
    cur.id = top.new_id;
    cur.next = right.next;
    syms[right_pos].alive = false;
    if (right.next >= 0) syms[right.next].prev = top.pos;
    if (cur.prev >= 0) {
      if (const Merge* pm = FindMerge(syms[cur.prev].id, cur.id)) {
        heap.push_back(Entry{pm->rank, cur.prev, pm->new_id});
        std::push_heap(heap.begin(), heap.end());
      }
    }
    if (cur.next >= 0) {
      if (const Merge* nm = FindMerge(cur.id, syms[cur.next].id)) {
        heap.push_back(Entry{nm->rank, top.pos, nm->new_id});
        std::push_heap(heap.begin(), heap.end());
      }
    }
  }
  symbols->clear();
  for (int32_t i = 0; i >= 0; i = syms[i].next) symbols->push_back(syms[i].id);
}

}  // namespace tpserve::tok
