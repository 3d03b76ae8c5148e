// Token shards and text sources.
#include "train/data/token_source.h"

#include <algorithm>
#include <charconv>
#include <filesystem>

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"
#include "model/hf_config.h"
#include "model/image_input.h"
#include "train/data/hf_tokenizer.h"
#include "train/data/jsonl.h"
#include "train/data/tokenizer.h"

namespace tessera::train {

namespace fs = std::filesystem;

namespace {
std::vector<std::string> list_files(const std::string& path,
                                    std::initializer_list<std::string_view> extensions,
                                    const char* what) {
    std::error_code ec;
    TESSERA_CHECK(fs::exists(path, ec), "{}: no such file or directory", path);
    // a device or pipe (/dev/zero) would be read forever
    TESSERA_CHECK(fs::is_directory(path, ec) || fs::is_regular_file(path, ec), "{}: not a regular file or a directory",
                  path);
    if (!fs::is_directory(path, ec)) return {path};
    std::vector<std::string> files;
    for (auto& e : fs::directory_iterator(path)) {
        if (!e.is_regular_file()) continue;
        const std::string ext = e.path().extension().string();
        if (std::find(extensions.begin(), extensions.end(), ext) != extensions.end())
            files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
    TESSERA_CHECK(!files.empty(), "{}: the directory holds no {}", path, what);
    return files;
}

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

int64_t metadata_integer(const SafetensorsFile& f, const std::string& key, const std::string& path) {
    const std::string& v = f.metadata().at(key);
    int64_t x = 0;
    auto r = std::from_chars(v.data(), v.data() + v.size(), x);  // the whole text: "258abc" is no number
    TESSERA_CHECK(r.ec == std::errc() && r.ptr == v.data() + v.size(), "{}: bad {} '{}' in metadata", path, key,
                  excerpt(v));
    return x;
}

// The documents of a shard being written, tokenized by the byte tokenizer or a checkpoint's.
class DocumentWriter {
  public:
    explicit DocumentWriter(const ShardOptions& o) {
        if (o.tokenizer.empty()) {
            TESSERA_CHECK(o.eos.empty(),
                          "--eos {}: the byte tokenizer ends documents with <|endoftext|>; --eos goes with --tokenizer",
                          excerpt(o.eos));
            return;
        }
        hf_.emplace(load_hf_tokenizer(o.tokenizer));
        tokenizer = hf_->source;
        vocab_size = hf_->bpe.vocab_size();
        if (!o.eos.empty()) {
            const std::optional<int32_t> id = hf_->bpe.token_id(o.eos);
            TESSERA_CHECK(id.has_value(), "--eos {}: not a token of {}", excerpt(o.eos), tokenizer);
            eos = *id;
        } else {
            TESSERA_CHECK(hf_->eos.has_value(),
                          "{}: tokenizer_config.json names no eos_token; name the token that ends documents with "
                          "--eos TOKEN",
                          o.tokenizer);
            eos = *hf_->eos;
        }
        if (hf_->add_bos) bos = *hf_->bos;
        // a checkpoint with an image tower (config.json with a vision_config: Kimi K3): its image token in a text
        // stands for the next image of the example. Any other config.json is not read (a tokenizer of any model)
        const fs::path config = fs::path(o.tokenizer) / "config.json";
        if (fs::exists(config)) {
            const Json doc = parse_json(read_text(config.string()), config.string());
            if (doc.is_object() && doc.contains("vision_config")) {
                const model::VisionConfig v = model::import_hf_config(doc, config.string()).model.vision;
                if (v.enabled()) vision_ = v;
            }
        }
    }

    // [bos] prompt completion eos; the bos and prompt of a supervised example are not targets
    void add(const Example& e, const std::string& where) {
        pending_.clear();
        if (!e.images.empty()) {
            TESSERA_CHECK(vision_.has_value(),
                          "{}: images, but {} has no image tower to read them (--tokenizer: a checkpoint directory "
                          "whose config.json has one, e.g. Kimi K3's)",
                          where, hf_ ? tokenizer : std::string("the byte tokenizer"));
            for (const std::string& file : e.images) {
                TESSERA_CHECK(fs::is_regular_file(file), "{}: image file {} does not exist", where, file);
                std::vector<ops::PatchGrid> grids;
                Tensor p = model::read_processor_images(SafetensorsFile(file), file, *vision_, grids);
                int64_t row = 0;
                for (const ops::PatchGrid& g : grids) {
                    pending_.push_back({g, p.view().slice0(row, row + g.patches())});
                    row += g.patches();
                }
                owned_.push_back(std::move(p));  // (its views stay valid: the storage does not move)
            }
        }
        next_ = 0;
        if (bos >= 0) push(bos, e.supervised ? 0 : 1);
        encode(e.prompt, where, 0);
        encode(e.completion, where, 1);
        push(eos, 1);
        TESSERA_CHECK(next_ == pending_.size(), "{}: {} image(s) but {} image token(s) (id {}) in the text", where,
                      pending_.size(), next_, vision_ ? vision_->image_token : -1);
        owned_.clear();
        ++documents;
    }
    bool byte() const { return !hf_; }

    std::vector<int32_t> tokens;
    std::vector<uint8_t> mask;  // 1: a training target
    int64_t documents = 0;
    int64_t vocab_size = ByteTokenizer::kVocabSize;
    int32_t eos = ByteTokenizer::kEndOfText, bos = -1;
    std::string tokenizer = "byte";
    // the images, in token order: patches f32 [Σ h·w, patch_dim], their grids, and each one's image tokens
    // (first position, count); none without an image tower
    std::vector<float> image_patches;
    std::vector<int32_t> image_grids;   // h, w per image
    std::vector<int64_t> image_tokens;  // first, count per image
    std::optional<model::VisionConfig> vision() const { return vision_; }

  private:
    void push(int32_t id, uint8_t target) {
        tokens.push_back(id);
        mask.push_back(target);
    }
    void encode(const std::string& text, const std::string& where, uint8_t target) {
        piece_.clear();
        if (hf_) {
            const size_t bad = invalid_utf8_at(text);
            TESSERA_CHECK(bad == std::string::npos, "{}: not valid UTF-8 at byte {} ({} reads UTF-8 text)", where, bad,
                          tokenizer);
            hf_->bpe.encode(text, piece_);
        } else {
            ByteTokenizer::encode(text, piece_);
        }
        for (const int32_t id : piece_) {
            if (!vision_ || id != vision_->image_token) {
                push(id, target);
                continue;
            }
            // the next image: its image tokens (never targets) in place of this one
            TESSERA_CHECK(next_ < pending_.size(), "{}: more image tokens (id {}) in the text than the {} image(s)",
                          where, id, pending_.size());
            const auto& [grid, patches] = pending_[next_++];
            const int64_t n = model::image_tokens(*vision_, grid);
            image_tokens.push_back(int64_t(tokens.size()));
            image_tokens.push_back(n);
            image_grids.push_back(int32_t(grid.h));
            image_grids.push_back(int32_t(grid.w));
            const float* p = patches.ptr<float>();
            image_patches.insert(image_patches.end(), p, p + patches.numel());
            for (int64_t k = 0; k < n; ++k) push(id, 0);
        }
    }
    std::optional<HfTokenizer> hf_;
    std::optional<model::VisionConfig> vision_;
    std::vector<std::pair<ops::PatchGrid, TensorView>> pending_;  // the example's images
    std::vector<Tensor> owned_;                                   // (their patches)
    size_t next_ = 0;                                             // the next of them to place
    std::vector<int32_t> piece_;
};
}  // namespace

std::vector<std::string> list_text_files(const std::string& path) { return list_files(path, {".txt"}, ".txt files"); }

std::vector<std::string> list_data_files(const std::string& path) {
    return list_files(path, {".txt", ".jsonl"}, ".txt or .jsonl files");
}

ShardInfo write_token_shard(const std::vector<std::string>& inputs,
                            const std::string& out_path,
                            const ShardOptions& options) {
    DocumentWriter w(options);
    std::vector<std::string> files;
    for (auto& in : inputs) {
        auto more = list_data_files(in);
        files.insert(files.end(), more.begin(), more.end());
    }
    for (const auto& f : files) {
        if (fs::path(f).extension() == ".jsonl") {
            const std::vector<Example> examples = read_jsonl(f);
            for (size_t i = 0; i < examples.size(); ++i) w.add(examples[i], fmt::format("{}:{}", f, i + 1));
        } else {
            w.add(Example{.completion = read_text(f)}, f);
        }
    }
    ShardInfo info;
    info.num_tokens = int64_t(w.tokens.size());
    info.num_documents = w.documents;
    info.vocab_size = w.vocab_size;
    info.num_targets = int64_t(std::count(w.mask.begin(), w.mask.end(), uint8_t(1)));
    info.end_of_document = w.eos;
    info.tokenizer = w.tokenizer;
    const bool u16 = info.vocab_size <= 65535;
    Tensor t(u16 ? DType::u16 : DType::i32, Shape{info.num_tokens});
    if (u16) {
        std::transform(w.tokens.begin(), w.tokens.end(), t.ptr<uint16_t>(), [](int32_t x) { return uint16_t(x); });
    } else {
        std::copy(w.tokens.begin(), w.tokens.end(), t.ptr<int32_t>());
    }
    std::vector<NamedTensor> tensors{{"tokens", t}};
    std::optional<Tensor> mask;
    if (info.num_targets < info.num_tokens) {  // only a shard with prompts carries a mask
        mask.emplace(DType::u8, Shape{info.num_tokens});
        std::copy(w.mask.begin(), w.mask.end(), mask->ptr<uint8_t>());
        tensors.push_back({"loss_mask", *mask});
    }
    std::map<std::string, std::string> metadata{{"tokenizer", info.tokenizer},
                                                {"vocab_size", std::to_string(info.vocab_size)},
                                                {"num_documents", std::to_string(info.num_documents)}};
    if (!w.byte()) metadata.emplace("end_of_document", std::to_string(info.end_of_document));
    const int64_t images = int64_t(w.image_grids.size() / 2);
    info.num_images = images;
    if (images > 0) {  // the patches, grids and image tokens, as TokenSource reads them
        const int64_t dim = w.vision()->patch_dim();
        tensors.push_back({"image_patches", TensorView(w.image_patches.data(), DType::f32,
                                                       Shape{int64_t(w.image_patches.size()) / dim, dim})});
        tensors.push_back({"image_grids", TensorView(w.image_grids.data(), DType::i32, Shape{images, 2})});
        tensors.push_back({"image_tokens", TensorView(w.image_tokens.data(), DType::i64, Shape{images, 2})});
        metadata.emplace("image_token", std::to_string(w.vision()->image_token));
    }
    write_safetensors(out_path, tensors, metadata);
    return info;
}

TokenSource::TokenSource(const std::string& path) {
    end_of_document_ = ByteTokenizer::kEndOfText;
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
        TESSERA_CHECK(shard_->metadata().contains("vocab_size"), "{}: shard metadata lacks vocab_size", path);
        vocab_size_ = metadata_integer(*shard_, "vocab_size", path);
        TESSERA_CHECK(vocab_size_ > 0 && vocab_size_ <= (int64_t(1) << 31), "{}: bad vocab_size '{}' in metadata", path,
                      vocab_size_);
        if (shard_->metadata().contains("end_of_document")) {
            const int64_t eod = metadata_integer(*shard_, "end_of_document", path);
            TESSERA_CHECK(0 <= eod && eod < vocab_size_, "{}: end_of_document {} is outside [0, {})", path, eod,
                          vocab_size_);
            end_of_document_ = int32_t(eod);
        }
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
            max_token_ = std::max(max_token_, id);
        }
        if (shard_->contains("loss_mask")) {
            const SafetensorsEntry& m = shard_->entry("loss_mask");
            TESSERA_CHECK(m.shape.ndim == 1 && m.dtype == DType::u8 && m.shape[0] == num_tokens_,
                          "{}: \"loss_mask\" must be a 1-D u8 tensor of the {} tokens, not {} {}", path, num_tokens_,
                          dtype_name(m.dtype), m.shape.str());
            mask_ = shard_->view("loss_mask").ptr<uint8_t>();
            for (int64_t i = 0; i < num_tokens_; ++i) {
                TESSERA_CHECK(mask_[i] <= 1, "{}: loss_mask[{}] is {}, not 0 or 1", path, i, int(mask_[i]));
            }
        }
        read_images(path);
        description_ =
            fmt::format("{} ({} tokens, shard{}{})", path, num_tokens_, mask_ ? ", prompts masked from the loss" : "",
                        images_.empty() ? "" : fmt::format(", {} images", images_.size()));
        return;
    }
    int64_t docs = 0;
    owned_ = tokenize_files(list_text_files(path), docs);
    i32_ = owned_.data();
    num_tokens_ = int64_t(owned_.size());
    vocab_size_ = ByteTokenizer::kVocabSize;
    for (int32_t id : owned_) max_token_ = std::max(max_token_, id);
    description_ = fmt::format("{} ({} tokens in {} documents, byte tokenizer)", path, num_tokens_, docs);
}

void TokenSource::read_images(const std::string& path) {
    const bool any =
        shard_->contains("image_patches") || shard_->contains("image_grids") || shard_->contains("image_tokens");
    if (!any) return;
    TESSERA_CHECK(shard_->contains("image_patches") && shard_->contains("image_grids") &&
                      shard_->contains("image_tokens") && shard_->metadata().contains("image_token"),
                  "{}: images need image_patches, image_grids, image_tokens and the metadata image_token", path);
    const int64_t token = metadata_integer(*shard_, "image_token", path);
    TESSERA_CHECK(0 <= token && token < vocab_size_, "{}: image_token {} is outside [0, {})", path, token, vocab_size_);
    image_token_ = int32_t(token);
    const SafetensorsEntry &p = shard_->entry("image_patches"), &g = shard_->entry("image_grids"),
                           &t = shard_->entry("image_tokens");
    const int64_t n = g.shape.ndim == 2 ? g.shape[0] : -1;
    TESSERA_CHECK(n > 0 && g.dtype == DType::i32 && g.shape[1] == 2 && t.dtype == DType::i64 &&
                      t.shape == (Shape{n, 2}) && p.dtype == DType::f32 && p.shape.ndim == 2 && p.shape[1] > 0,
                  "{}: images need image_grids i32 [images, 2], image_tokens i64 [images, 2] and image_patches f32 "
                  "[patches, patch_dim], not {} {}, {} {}, {} {}",
                  path, dtype_name(g.dtype), g.shape.str(), dtype_name(t.dtype), t.shape.str(), dtype_name(p.dtype),
                  p.shape.str());
    const Tensor grids = shard_->load("image_grids"), spans = shard_->load("image_tokens");
    patches_ = (shard_->is_aligned("image_patches") ? shard_->view("image_patches")
                                                    : patches_copy_.emplace(shard_->load("image_patches")).view())
                   .ptr<float>();
    patch_dim_ = p.shape[1];
    int64_t row = 0, end = 0;
    for (int64_t i = 0; i < n; ++i) {
        ShardImage im{{grids.ptr<int32_t>()[2 * i], grids.ptr<int32_t>()[2 * i + 1]},
                      row,
                      spans.ptr<int64_t>()[2 * i],
                      spans.ptr<int64_t>()[2 * i + 1]};
        TESSERA_CHECK(im.grid.h > 0 && im.grid.w > 0, "{}: image {} has a {}x{} grid", path, i, im.grid.h, im.grid.w);
        TESSERA_CHECK(im.count > 0 && im.first >= end && im.first <= num_tokens_ && im.count <= num_tokens_ - im.first,
                      "{}: image {}'s {} tokens from {} are not after the image before it within the {} tokens", path,
                      i, im.count, im.first, num_tokens_);
        for (int64_t k = im.first; k < im.first + im.count; ++k)
            TESSERA_CHECK((*this)[k] == image_token_, "{}: image {}'s token {} is {}, not the image token {}", path, i,
                          k, (*this)[k], image_token_);
        row += im.grid.patches();
        TESSERA_CHECK(row <= p.shape[0], "{}: image {} needs patches up to row {}; image_patches holds {}", path, i,
                      row, p.shape[0]);
        end = im.first + im.count;
        images_.push_back(im);
    }
    TESSERA_CHECK(row == p.shape[0], "{}: the images' grids give {} patches; image_patches holds {}", path, row,
                  p.shape[0]);
}

}  // namespace tessera::train
