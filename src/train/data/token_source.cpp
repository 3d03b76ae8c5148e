// Token shards and text sources.
#include "train/data/token_source.h"

#include <algorithm>
#include <charconv>
#include <filesystem>

#include "core/check.h"
#include "core/json.h"
#include "train/data/tokenizer.h"

namespace tessera::train {

namespace fs = std::filesystem;

std::vector<std::string> list_text_files(const std::string& path) {
    std::error_code ec;
    TESSERA_CHECK(fs::exists(path, ec), "{}: no such file or directory", path);
    // a device or pipe (/dev/zero) would be read forever
    TESSERA_CHECK(fs::is_directory(path, ec) || fs::is_regular_file(path, ec), "{}: not a regular file or a directory",
                  path);
    if (!fs::is_directory(path, ec)) return {path};
    std::vector<std::string> files;
    for (auto& e : fs::directory_iterator(path)) {
        if (e.is_regular_file() && e.path().extension() == ".txt") files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
    TESSERA_CHECK(!files.empty(), "{}: the directory holds no .txt files", path);
    return files;
}

namespace {
std::vector<int32_t> tokenize_files(const std::vector<std::string>& files, int64_t& num_docs) {
    std::vector<int32_t> tokens;
    num_docs = 0;
    for (const auto& f : files) {
        ByteTokenizer::encode(read_text(f), tokens);
        tokens.push_back(ByteTokenizer::kEndOfText);
        ++num_docs;
    }
    return tokens;
}
}  // namespace

ShardInfo write_token_shard(const std::vector<std::string>& inputs, const std::string& out_path) {
    std::vector<std::string> files;
    for (auto& in : inputs) {
        auto more = list_text_files(in);
        files.insert(files.end(), more.begin(), more.end());
    }
    ShardInfo info;
    std::vector<int32_t> tokens = tokenize_files(files, info.num_documents);
    info.num_tokens = int64_t(tokens.size());
    info.vocab_size = ByteTokenizer::kVocabSize;
    Tensor t(DType::u16, Shape{info.num_tokens});
    std::transform(tokens.begin(), tokens.end(), t.ptr<uint16_t>(), [](int32_t x) { return uint16_t(x); });
    write_safetensors(out_path, {{"tokens", t}},
                      {{"tokenizer", "byte"},
                       {"vocab_size", std::to_string(info.vocab_size)},
                       {"num_documents", std::to_string(info.num_documents)}});
    return info;
}

TokenSource::TokenSource(const std::string& path) {
    if (fs::path(path).extension() == ".safetensors") {
        shard_.emplace(path);
        TESSERA_CHECK(shard_->contains("tokens"), "{}: not a token shard (no \"tokens\" tensor)", path);
        const SafetensorsEntry& e = shard_->entry("tokens");
        TESSERA_CHECK(e.shape.ndim == 1 && (e.dtype == DType::u16 || e.dtype == DType::i32),
                      "{}: \"tokens\" must be a 1-D u16 or i32 tensor, not {} {}", path, dtype_name(e.dtype),
                      e.shape.str());
        // a file whose data section is not aligned for the dtype (written by another tool): read a copy
        const TensorView t =
            shard_->is_aligned("tokens") ? shard_->view("tokens") : copy_.emplace(shard_->load("tokens")).view();
        auto it = shard_->metadata().find("vocab_size");
        TESSERA_CHECK(it != shard_->metadata().end(), "{}: shard metadata lacks vocab_size", path);
        const char* end = it->second.data() + it->second.size();
        auto r = std::from_chars(it->second.data(), end, vocab_size_);  // the whole text: "258abc" is no number
        TESSERA_CHECK(r.ec == std::errc() && r.ptr == end && vocab_size_ > 0, "{}: bad vocab_size '{}' in metadata",
                      path, excerpt(it->second));
        num_tokens_ = t.numel();
        if (t.dtype == DType::u16) {
            u16_ = t.ptr<uint16_t>();
        } else {
            i32_ = t.ptr<int32_t>();
        }
        for (int64_t i = 0; i < num_tokens_; ++i) {
            const int32_t id = (*this)[i];
            TESSERA_CHECK(0 <= id && id < vocab_size_, "{}: token {} at position {} is outside [0, {})", path, id, i,
                          vocab_size_);
        }
        description_ = fmt::format("{} ({} tokens, shard)", path, num_tokens_);
        return;
    }
    int64_t docs = 0;
    owned_ = tokenize_files(list_text_files(path), docs);
    i32_ = owned_.data();
    num_tokens_ = int64_t(owned_.size());
    vocab_size_ = ByteTokenizer::kVocabSize;
    description_ = fmt::format("{} ({} tokens in {} documents, byte tokenizer)", path, num_tokens_, docs);
}

}  // namespace tessera::train
