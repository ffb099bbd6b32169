// Hugging Face tokenizer.json in C++: encode text to ids, decode ids to text, stream decoding.
// Follows the Rust `tokenizers` library (HF) rule for rule; HF is the reference for conformance.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tpserve {

namespace tok {
class TokenizerImpl;
}

// A loaded tokenizer. Thread-safe: Encode/Decode may be called concurrently (BPE word caches are
// per thread).
//
// Supported tokenizer.json parts:
//   model: BPE (byte-level and SentencePiece style with byte_fallback, unk_token, fuse_unk,
//          ignore_merges, continuing_subword_prefix, end_of_word_suffix; dropout is ignored).
//   normalizer: NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip, StripAccents, Sequence.
//   pre_tokenizer: Split (String or Regex pattern, all five behaviours, invert), ByteLevel,
//          Digits, Metaspace, Whitespace, WhitespaceSplit, Punctuation, BertPreTokenizer,
//          Sequence. Regexes run through PCRE2 (UTF + UCP, JIT).
//   added_tokens with lstrip / rstrip / normalized / single_word / special.
//   post_processor: TemplateProcessing (single sequences), ByteLevel, RobertaProcessing,
//          BertProcessing, Sequence.
//   decoder: ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace, Sequence.
// Anything else is a load error naming the JSON field and type.
//
// Invalid UTF-8 input: Encode first replaces every maximal ill-formed subsequence with U+FFFD
// (the Unicode "substitution of maximal subparts" practice, identical to Rust's
// String::from_utf8_lossy, Python's bytes.decode("utf-8", "replace") and the WHATWG
// TextDecoder), then encodes the repaired text. HF's bindings cannot receive such input at all,
// so this is the documented tpserve behaviour.
//
// Decode output is always valid UTF-8: byte sequences that do not form characters become U+FFFD,
// exactly like HF's decoders. No clean_up_tokenization_spaces post-pass is applied (matches
// `tokenizers.Tokenizer.decode`).
class Tokenizer {
 public:
  // `path_or_dir` is a tokenizer.json file or a directory holding one. A tokenizer_config.json
  // beside it, if present, supplies bos_token / eos_token / add_bos_token / add_eos_token.
  // Errors name the file and the JSON field.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path_or_dir);
  // Same from in-memory JSON texts (config may be empty).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view tokenizer_json,
                                                             std::string_view config_json,
                                                             std::string_view source_name);
  ~Tokenizer();

  // Like HF `tokenizers.Tokenizer.encode(text, add_special_tokens=...).ids`: with
  // add_special_tokens the tokenizer.json post_processor adds its tokens (e.g. bos). The
  // add_bos_token / add_eos_token flags of tokenizer_config.json are NOT applied here: HF
  // tokenizers ignores them and transformers 5.17 did not apply them either on the conformance
  // tokenizers (checked on DeepSeek-V3's, whose config says add_bos_token=true but whose
  // post_processor adds nothing). They are exposed below for callers that want them.
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const;
  // The same, but it stops soon after the ids outnumber `max_tokens`, so that a text too long
  // for the caller costs about max_tokens tokens of work, not the whole text's. Returns the
  // exact ids when there are at most `max_tokens`; more than `max_tokens` ids (a prefix of the
  // full encoding's, with the post_processor's suffix missing) otherwise. Normalization and
  // pre-tokenization still read the whole text (they are linear and cheap beside the BPE).
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens,
                              size_t max_tokens) const;
  // Like HF `decode(ids, skip_special_tokens=...)`. Unknown ids are skipped, as in HF.
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::optional<std::string> IdToToken(int32_t id) const;
  bool IsSpecial(int32_t id) const;
  // bos_token / eos_token of tokenizer_config.json (when present and known to the vocabulary).
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  // add_bos_token / add_eos_token of tokenizer_config.json (false when absent).
  bool config_add_bos_token() const;
  bool config_add_eos_token() const;
  // One past the largest id of the model vocabulary and the added tokens.
  int32_t vocab_size() const;

  const tok::TokenizerImpl& impl() const { return *impl_; }

 private:
  explicit Tokenizer(std::unique_ptr<tok::TokenizerImpl> impl);
  std::unique_ptr<tok::TokenizerImpl> impl_;
};

// Streaming detokenization: feed ids one at a time, get text as soon as it is complete.
// Never returns part of a UTF-8 character; the concatenation of every Add() and Finish() equals
// tokenizer.Decode(all ids, skip_special_tokens). Works on a sliding window of ids (the previous
// emitted step is kept as context so decoders that strip a leading space, like Metaspace and
// Strip, behave as in a full decode), so the cost per token does not grow with the sequence.
// Text ending in U+FFFD is held back until more tokens complete it, for at most 16 tokens; only
// a stream of more than 16 tokens that never completes a character could then differ from Decode
// (a ByteFallback run later turned invalid), which real models do not produce.
class IncrementalDecoder {
 public:
  IncrementalDecoder(const Tokenizer* tokenizer, bool skip_special_tokens);
  // Returns the new text made complete by `id` (often empty).
  std::string Add(int32_t id);
  // Returns whatever is still held back (an incomplete character decodes as U+FFFD, as Decode
  // does). Call once at the end of the stream.
  std::string Finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;
  size_t read_offset_ = 0;
};

}  // namespace tpserve
