// Byte-level BPE, the tokenizer of Qwen2/Qwen3, DeepSeek-V3 and Kimi checkpoints; read from a Hugging Face
// tokenizer.json or a tiktoken rank file by hf_tokenizer.h.
//
// encode(text):
//   1. special (added) tokens are cut out of the text where they occur literally, leftmost first and the longest
//      at one position (Hugging Face tokenizers' AddedVocabulary; tiktoken's allowed_special="all");
//   2. each stretch between them is normalized (NFC where the tokenizer asks for it) and pre-tokenized: every
//      split pattern in turn cuts each piece into its matches and the text between them (tokenizers' Split with
//      behavior Isolated; Digits and ByteLevel's GPT-2 regex are such patterns);
//   3. each piece's UTF-8 bytes are merged by BPE: starting from one symbol per byte, the adjacent pair of lowest
//      rank merges, the leftmost of equal ranks first, until no pair has a rank. The rank of a pair is its merge's
//      line in tokenizer.json's merges, or in a tiktoken file the rank of the pair's concatenated bytes. With
//      whole_words (tokenizers' ignore_merges; always in tiktoken) a piece that is itself a token is that token.
// Tokens are held as raw bytes: tokenizer.json's byte-level alphabet (GPT-2's bytes_to_unicode) is undone at load.
// decode(ids) is the concatenation of the tokens' bytes (special tokens as their text).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "train/data/text_unicode.h"

namespace tessera::train {

// GPT-2's byte-level alphabet: the character standing for each byte in tokenizer.json's vocab and merges.
char32_t byte_level_char(uint8_t byte);
// The byte a character stands for, or -1 when it is not in the alphabet.
int byte_level_byte(char32_t c);

// GPT-2's pre-tokenization regex (ByteLevel with use_regex true), in the tokenizers library's spelling.
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct BpeSpec {
    std::string name;                 // for messages: "qwen/tokenizer.json"
    std::vector<std::string> tokens;  // each id's bytes; ids missing from the file hold an empty string
    std::vector<bool> mergeable;      // the ids BPE may produce (the vocabulary, not the added tokens)
    std::vector<std::pair<std::string, int32_t>> specials;  // literal text -> id
    std::vector<std::string> splits;                        // PCRE2 patterns, applied in order
    bool nfc = false;
    bool whole_words = false;
    // tokenizer.json: merges as (left id, right id) in rank order. tiktoken: none; a pair's rank is the id of its
    // concatenated bytes (ids are ranks)
    bool ranks_are_ids = false;
    std::vector<std::pair<int32_t, int32_t>> merges;
};

class BpeTokenizer {
  public:
    explicit BpeTokenizer(BpeSpec spec);

    // Appends the ids of text (valid UTF-8, else an Error naming the byte offset). Not thread-safe (a cache).
    void encode(std::string_view text, std::vector<int32_t>& out);
    // The bytes of ids (special tokens as their text); an id outside the vocabulary is an Error.
    std::string decode(std::span<const int32_t> ids) const;

    int64_t vocab_size() const { return int64_t(tokens_.size()); }
    // The id of a special token or of a vocabulary entry with exactly these bytes.
    std::optional<int32_t> token_id(std::string_view text) const;
    const std::string& name() const { return name_; }

  private:
    struct Merge {
        int32_t rank, id;
    };
    std::optional<Merge> pair_merge(int32_t left, int32_t right) const;
    void encode_ordinary(std::string_view text, std::vector<int32_t>& out);
    void encode_piece(std::string_view piece, std::vector<int32_t>& out);

    std::string name_;
    std::vector<std::string> tokens_;
    std::unordered_map<std::string, int32_t> by_bytes_;  // mergeable tokens
    std::unordered_map<std::string, int32_t> specials_;
    std::optional<Regex> special_regex_;
    std::vector<Regex> splits_;
    bool nfc_, whole_words_;
    bool ranks_are_ids_;
    std::unordered_map<uint64_t, Merge> merges_;  // tokenizer.json: (left << 32 | right) -> merge
    int32_t byte_ids_[256];
    std::unordered_map<std::string, std::vector<int32_t>> cache_;  // piece -> ids
    mutable std::string scratch_;
};

}  // namespace tessera::train
