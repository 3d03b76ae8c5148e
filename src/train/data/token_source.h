// Token streams for training: a token shard written by `tessera data` (a safetensors file with a tensor
// "tokens", u16 or i32, memory-mapped, and optionally "loss_mask", u8, 1 where the token is a training
// target), or text files (a file or a directory of *.txt files, tokenized in memory, each file one document
// followed by <|endoftext|>).
//
// Shard metadata: vocab_size (required), num_documents, tokenizer ("byte" or the tokenizer file read), and for a
// checkpoint's tokenizer end_of_document (the id that ends each document; the byte tokenizer's <|endoftext|>
// when absent).
//
// Images (a model with an image tower, Kimi K3): "image_patches" f32 [Σ h·w, patch_dim] (each image's patches as
// Kimi's processor makes them), "image_grids" i32 [images, 2] (h, w in patches) and "image_tokens" i64 [images, 2]
// (each image's first token and its count: runs of metadata image_token, in order, apart; never training targets),
// with metadata image_token. An image is h·w / (merge_h·merge_w) tokens of the stream, which a training window may
// cut (train/data/loader.h).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <span>

#include "core/safetensors.h"
#include "ops/vision.h"

namespace tessera::train {

struct ShardInfo {
    int64_t num_tokens = 0;
    int64_t num_documents = 0;
    int64_t vocab_size = 0;
    int64_t num_targets = 0;  // tokens that are training targets (all of them unless prompts are masked)
    int64_t num_images = 0;
    int32_t end_of_document = 0;
    std::string tokenizer;  // "byte", or the tokenizer file read
};

struct ShardOptions {
    std::string tokenizer;  // a Hugging Face checkpoint directory (hf_tokenizer.h); empty: the byte tokenizer
    std::string eos;        // the token that ends each document; empty: tokenizer_config.json's eos_token
};

// Tokenizes the inputs into a token shard: each input a file or a directory of .txt and .jsonl files (sorted by
// name). A .txt file is one document; a .jsonl file holds one document or prompt/completion example per line
// (jsonl.h), with images when the tokenizer's checkpoint (its config.json) has an image tower: each image token in
// the text stands for the line's next image and becomes that image's image tokens. Each document is [bos] text eos: bos
// where tokenizer_config.json sets add_bos_token, eos the tokenizer's end-of-text token (the byte tokenizer's
// <|endoftext|>). Tokens are u16 when the vocabulary fits, else i32. When an example has a prompt, the shard carries
// "loss_mask": 0 for its bos and prompt tokens, 1 for every other token. The file appears only when complete; on any
// error nothing is written.
ShardInfo write_token_shard(const std::vector<std::string>& inputs,
                            const std::string& out_path,
                            const ShardOptions& options = {});

// One image of a shard: its grid, where its patches start (rows of image_patches) and its image tokens.
struct ShardImage {
    ops::PatchGrid grid;
    int64_t patch_row = 0;
    int64_t first = 0, count = 0;  // tokens [first, first + count)
};

class TokenSource {
  public:
    // path: a .safetensors shard, a text file, or a directory of .txt files
    explicit TokenSource(const std::string& path);

    int64_t size() const { return num_tokens_; }
    int32_t operator[](int64_t i) const { return u16_ ? int32_t(u16_[i]) : i32_[i]; }
    // whether token i is a training target (false where the shard's loss_mask is 0)
    bool is_target(int64_t i) const { return !mask_ || mask_[i] != 0; }
    bool has_loss_mask() const { return mask_ != nullptr; }
    int64_t vocab_size() const { return vocab_size_; }
    int32_t max_token() const { return max_token_; }  // the largest id in the stream (-1 when empty)
    int32_t end_of_document() const { return end_of_document_; }
    const std::string& description() const { return description_; }
    // images (none for text)
    std::span<const ShardImage> images() const { return images_; }
    const float* image_patches() const { return patches_; }  // [Σ h·w, patch_dim]
    int64_t patch_dim() const { return patch_dim_; }
    int32_t image_token() const { return image_token_; }

  private:
    void read_images(const std::string& path);

    std::optional<SafetensorsFile> shard_;
    std::optional<Tensor> copy_, patches_copy_;  // tokens or patches of a shard whose data is not aligned
    std::vector<int32_t> owned_;
    const uint16_t* u16_ = nullptr;
    const int32_t* i32_ = nullptr;
    const uint8_t* mask_ = nullptr;
    int64_t num_tokens_ = 0;
    int64_t vocab_size_ = 0;
    int32_t max_token_ = -1;
    int32_t end_of_document_ = 0;
    std::string description_;
    std::vector<ShardImage> images_;
    const float* patches_ = nullptr;
    int64_t patch_dim_ = 0;
    int32_t image_token_ = -1;
};

// The text files a path names: the file itself, or the sorted *.txt files of a directory.
std::vector<std::string> list_text_files(const std::string& path);
// The data files a path names for `tessera data`: the file itself, or the sorted *.txt and *.jsonl files of a
// directory.
std::vector<std::string> list_data_files(const std::string& path);

}  // namespace tessera::train
