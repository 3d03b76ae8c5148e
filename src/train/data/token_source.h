// Token streams for training: a token shard written by `tessera data` (a safetensors file with one
// tensor "tokens", u16 or i32, memory-mapped), or text files (a file or a directory of *.txt files,
// tokenized in memory, each file one document followed by <|endoftext|>).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/safetensors.h"

namespace tessera::train {

struct ShardInfo {
    int64_t num_tokens = 0;
    int64_t num_documents = 0;
    int64_t vocab_size = 0;
};

// Tokenizes text files (each input a file or a directory of .txt files) into a u16 token shard.
ShardInfo write_token_shard(const std::vector<std::string>& inputs, const std::string& out_path);

class TokenSource {
  public:
    // path: a .safetensors shard, a text file, or a directory of .txt files
    explicit TokenSource(const std::string& path);

    int64_t size() const { return num_tokens_; }
    int32_t operator[](int64_t i) const { return u16_ ? int32_t(u16_[i]) : i32_[i]; }
    int64_t vocab_size() const { return vocab_size_; }
    const std::string& description() const { return description_; }

  private:
    std::optional<SafetensorsFile> shard_;
    std::optional<Tensor> copy_;  // the tokens of a shard whose data is not aligned for their dtype
    std::vector<int32_t> owned_;
    const uint16_t* u16_ = nullptr;
    const int32_t* i32_ = nullptr;
    int64_t num_tokens_ = 0;
    int64_t vocab_size_ = 0;
    std::string description_;
};

// The text files a path names: the file itself, or the sorted *.txt files of a directory.
std::vector<std::string> list_text_files(const std::string& path);

}  // namespace tessera::train
