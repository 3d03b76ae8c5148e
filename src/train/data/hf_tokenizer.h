// The tokenizer of a Hugging Face checkpoint directory, read into a BpeTokenizer (bpe_tokenizer.h):
//
//  - tokenizer.json (the `tokenizers` library's format; Qwen2/Qwen3, DeepSeek-V3): model BPE with vocab and merges
//    ("a b" strings or [a, b] pairs); normalizer null, NFC, or a Sequence of those; pre_tokenizer a Sequence of
//    Split (a Regex or String pattern, behavior Isolated, invert false), Digits and ByteLevel (add_prefix_space
//    false, last; use_regex true adds GPT-2's regex); added_tokens as special tokens (lstrip, rstrip and
//    single_word unsupported). Anything else is refused in one line naming it, never tokenized differently. The
//    post_processor is not applied: the data pipeline adds BOS / EOS itself (tokenizer_config.json).
//    https://huggingface.co/docs/tokenizers/api/pre-tokenizers, .../api/models, .../api/added-tokens
//  - tiktoken.model (Kimi): lines "base64(token bytes) rank", BPE over byte pairs by the rank of their concatenation
//    (https://github.com/openai/tiktoken), pre-tokenized by the pattern of Kimi's tokenization_kimi.py (pat_str),
//    with the special tokens that file builds: ids len(ranks) .. len(ranks) + 257, named by tokenizer_config.json's
//    added_tokens_decoder or "<|reserved_token_{id}|>".
//
// tokenizer_config.json (optional beside tokenizer.json, required beside tiktoken.model) gives eos_token, bos_token
// and add_bos_token.
#pragma once

#include <optional>
#include <string>

#include "train/data/bpe_tokenizer.h"

namespace tessera::train {

// Kimi's pat_str (tokenization_kimi.py) in PCRE2 syntax: its class intersections [X&&[^\p{Han}]] are spelled
// (?:(?!\p{Han})[X]).
extern const std::string_view kKimiPattern;

BpeSpec read_tokenizer_json(const std::string& path);
BpeSpec read_tiktoken(const std::string& model_path, const std::string& config_path);

struct HfTokenizer {
    BpeTokenizer bpe;
    std::string source;               // the file read: DIR/tokenizer.json or DIR/tiktoken.model
    std::optional<int32_t> bos, eos;  // tokenizer_config.json's bos_token / eos_token
    bool add_bos = false;             // tokenizer_config.json's add_bos_token: every document starts with bos
};

// dir: a checkpoint directory with tokenizer.json (preferred) or tiktoken.model + tokenizer_config.json.
HfTokenizer load_hf_tokenizer(const std::string& dir);

}  // namespace tessera::train
