// Deterministic batch loader.
#include "train/data/loader.h"

#include <algorithm>
#include <numeric>

#include "core/check.h"
#include "core/rng.h"
#include "model/model.h"

namespace tessera::train {

DataLoader::DataLoader(
    const TokenSource& tokens, int64_t seq_len, int64_t batch, double val_fraction, uint64_t seed, DataShard shard)
    : tokens_(tokens), seq_len_(seq_len), batch_(batch), seed_(seed), shard_(shard) {
    TESSERA_CHECK(seq_len > 0 && batch > 0, "data: seq_len and batch_size must be positive");
    TESSERA_CHECK(shard.world >= 1 && shard.rank >= 0 && shard.rank < shard.world && shard.accumulation >= 1,
                  "data: rank {} of {} with {} micro-batches per step", shard.rank, shard.world, shard.accumulation);
    TESSERA_CHECK(val_fraction >= 0 && val_fraction < 1, "data: val_fraction must be in [0, 1), not {}", val_fraction);
    const int64_t n = tokens.size();
    train_tokens_ = int64_t(double(n) * (1.0 - val_fraction));
    const int64_t windows = (train_tokens_ - 1) / seq_len;
    TESSERA_CHECK(windows >= batch,
                  "data: {} has {} training tokens, fewer than one batch of {} x {} (+1); use more data or a smaller "
                  "batch",
                  tokens.description(), train_tokens_, batch, seq_len);
    num_val_windows_ = std::max<int64_t>(0, (n - train_tokens_ - 1) / seq_len);
    order_.resize(size_t(windows));
    shuffle_epoch();
}

namespace {
// epoch e's window order: Fisher-Yates with the epoch's own stream
void permutation(std::vector<int64_t>& order, uint64_t seed, int64_t epoch) {
    std::iota(order.begin(), order.end(), int64_t(0));
    Rng rng(seed, 0x10ad0000ull + uint64_t(epoch));
    for (int64_t i = int64_t(order.size()) - 1; i > 0; --i)
        std::swap(order[size_t(i)], order[rng.below(uint64_t(i + 1))]);
}
}  // namespace

void DataLoader::shuffle_epoch() { permutation(order_, seed_, pos_.epoch); }

void DataLoader::set_position(LoaderPosition p) {
    TESSERA_CHECK(p.epoch >= 0 && p.cursor >= 0 && p.cursor <= int64_t(order_.size()),
                  "data: position (epoch {}, cursor {}) is out of range", p.epoch, p.cursor);
    pos_ = p;
    micro_ = 0;
    shuffle_epoch();
}

LoaderPosition DataLoader::position() const {
    TESSERA_CHECK(micro_ == 0, "data: the position is taken between steps ({} of {} micro-batches read)", micro_,
                  shard_.accumulation);
    return pos_;
}

int64_t DataLoader::next_window() {
    if (pos_.cursor == int64_t(order_.size())) {
        pos_ = {pos_.epoch + 1, 0};
        shuffle_epoch();
    }
    return order_[size_t(pos_.cursor++)];
}

void DataLoader::skip(int64_t windows) {
    for (int64_t i = 0; i < windows; ++i) next_window();
}

std::span<const ShardImage>::iterator DataLoader::first_image_after(int64_t start) const {
    const std::span<const ShardImage> all = tokens_.images();
    return std::partition_point(all.begin(), all.end(),
                                [&](const ShardImage& im) { return im.first + im.count <= start; });
}

void DataLoader::read_window(int64_t start,
                             std::span<int32_t> ids,
                             std::span<int32_t> targets,
                             ImageBatch* images) const {
    for (int64_t t = 0; t < seq_len_; ++t) {
        ids[size_t(t)] = tokens_[start + t];
        // a prompt token (loss_mask 0) is no target: the loss ignores it
        targets[size_t(t)] = tokens_.is_target(start + t + 1) ? tokens_[start + t + 1] : model::Model::kIgnoreIndex;
    }
    if (!images) return;
    // the images whose tokens meet [start, start + seq_len)
    const int64_t dim = tokens_.patch_dim();
    for (auto it = first_image_after(start); it != tokens_.images().end() && it->first < start + seq_len_; ++it) {
        images->grids.push_back(it->grid);
        images->rows.push_back(
            {std::max(start, it->first) - it->first, std::min(start + seq_len_, it->first + it->count) - it->first});
        const float* p = tokens_.image_patches() + it->patch_row * dim;
        images->patches.insert(images->patches.end(), p, p + it->grid.patches() * dim);
    }
}

namespace {
void clear(ImageBatch* images) {
    if (!images) return;
    images->grids.clear();
    images->rows.clear();
    images->patches.clear();
}
}  // namespace

void DataLoader::next_batch(std::span<int32_t> ids, std::span<int32_t> targets, ImageBatch* images) {
    TESSERA_CHECK(int64_t(ids.size()) == batch_ * seq_len_ && ids.size() == targets.size(),
                  "data: batch buffers must hold {} tokens", batch_ * seq_len_);
    clear(images);
    skip(shard_.rank * batch_);  // the lower ranks' share of this round of micro-batches
    for (int64_t b = 0; b < batch_; ++b) {
        read_window(next_window() * seq_len_, ids.subspan(size_t(b * seq_len_), size_t(seq_len_)),
                    targets.subspan(size_t(b * seq_len_), size_t(seq_len_)), images);
    }
    skip((shard_.world - 1 - shard_.rank) * batch_);  // the higher ranks' share
    if (++micro_ == shard_.accumulation) micro_ = 0;
}

template <class F>
void DataLoader::for_each_step_window(F&& f) const {
    TESSERA_CHECK(micro_ == 0, "data: the next step's windows are taken between steps");
    const int64_t windows = shard_.world * shard_.accumulation * batch_, n = int64_t(order_.size());
    int64_t cursor = pos_.cursor;
    const std::vector<int64_t>* order = &order_;
    for (int64_t w = 0, epoch = pos_.epoch; w < windows; ++w, ++cursor) {
        if (cursor == n) {  // the step reaches into the next epoch: its permutation, as next_window will draw it
            next_order_.resize(size_t(n));
            permutation(next_order_, seed_, ++epoch);
            order = &next_order_;
            cursor = 0;
        }
        f((*order)[size_t(cursor)] * seq_len_);
    }
}

int64_t DataLoader::step_targets() const {
    if (!tokens_.has_loss_mask()) return 0;
    int64_t count = 0;
    for_each_step_window([&](int64_t start) {
        for (int64_t t = 0; t < seq_len_; ++t) count += tokens_.is_target(start + t + 1) ? 1 : 0;
    });
    return count;
}

void DataLoader::step_images(std::vector<ops::PatchGrid>& grids) const {
    grids.clear();
    if (tokens_.images().empty()) return;
    for_each_step_window([&](int64_t start) {
        for (auto it = first_image_after(start); it != tokens_.images().end() && it->first < start + seq_len_; ++it)
            grids.push_back(it->grid);
    });
}

void DataLoader::eval_batch(int64_t i, std::span<int32_t> ids, std::span<int32_t> targets, ImageBatch* images) const {
    TESSERA_CHECK(i >= 0 && i < num_eval_batches(), "data: eval batch {} of {}", i, num_eval_batches());
    clear(images);
    for (int64_t b = 0; b < batch_; ++b) {
        const int64_t start = train_tokens_ + (i * batch_ + b) * seq_len_;
        read_window(start, ids.subspan(size_t(b * seq_len_), size_t(seq_len_)),
                    targets.subspan(size_t(b * seq_len_), size_t(seq_len_)), images);
    }
}

int64_t document_starts(
    std::span<const int32_t> ids, int64_t batch, int64_t seq, int32_t end_of_document, std::span<int64_t> cu) {
    TESSERA_CHECK(int64_t(ids.size()) == batch * seq && int64_t(cu.size()) >= batch * seq + 1,
                  "document_starts: buffers too small");
    int64_t n = 0;
    for (int64_t b = 0; b < batch; ++b) {
        cu[size_t(n++)] = b * seq;
        for (int64_t t = 0; t + 1 < seq; ++t) {
            if (ids[size_t(b * seq + t)] == end_of_document) cu[size_t(n++)] = b * seq + t + 1;
        }
    }
    cu[size_t(n++)] = batch * seq;
    return n;
}

}  // namespace tessera::train
