// Byte-level tokenizer: ids 0..255 are bytes, then the special tokens. Lossless for any input.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::train {

struct ByteTokenizer {
    static constexpr int32_t kEndOfText = 256;  // "<|endoftext|>": separates documents
    static constexpr int32_t kPad = 257;        // "<|pad|>"
    static constexpr int32_t kVocabSize = 258;

    static void encode(std::string_view text, std::vector<int32_t>& out);
    // Special tokens render as their names; ids outside the vocabulary as "<?>".
    static std::string decode(std::span<const int32_t> ids);
};

}  // namespace tessera::train
