// Batches of (input, target) windows from a token stream, deterministic by seed.
// The stream is split once: the first (1 − val_fraction) of the tokens train, the rest evaluate.
// Training windows are the non-overlapping seq_len-token windows of the train split (each with its
// next token as the last target; a target the shard's loss_mask marks as no target, a prompt token, is
// model::Model::kIgnoreIndex, which the loss skips), visited in a fresh Philox permutation every epoch; the whole
// state is (epoch, cursor), saved in checkpoints. Evaluation reads the first windows of the
// validation split in order, the same every time.
//
// Data parallelism: one optimizer step reads world × accumulation micro-batches of `batch` windows from
// the one window sequence, micro-batch-major (rank r's micro-batch m is the step's (m·world + r)-th, so
// the ranks' gradients of one round add up in the order one rank would add them; train/grad_sum.h), so W
// ranks together read exactly what one rank accumulating W·accumulation micro-batches reads, and the
// position (kept between steps) does not depend on the number of ranks.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ops/vision.h"
#include "train/data/token_source.h"

namespace tessera::train {

// The images of a micro-batch's windows (a shard with images), in token order: each one's grid, the rows of it the
// windows hold (a window may cut an image at either end; the tower still sees the whole image) and the patches,
// f32 [Σ h·w, patch_dim]: what model::Model::set_images takes. The vectors keep their capacity between batches.
struct ImageBatch {
    std::vector<ops::PatchGrid> grids;
    std::vector<ops::ImageRows> rows;
    std::vector<float> patches;
};

struct LoaderPosition {
    int64_t epoch = 0;
    int64_t cursor = 0;  // windows consumed in this epoch
};

// This rank's share of each step's windows.
struct DataShard {
    int rank = 0, world = 1;
    int64_t accumulation = 1;  // micro-batches per rank per optimizer step
};

class DataLoader {
  public:
    DataLoader(const TokenSource& tokens,
               int64_t seq_len,
               int64_t batch,
               double val_fraction,
               uint64_t seed,
               DataShard shard = {});

    // This rank's next micro-batch. ids, targets: [batch · seq_len]; images: the windows' images (none without)
    void next_batch(std::span<int32_t> ids, std::span<int32_t> targets, ImageBatch* images = nullptr);
    // The i-th evaluation batch (i < num_eval_batches()).
    void eval_batch(int64_t i, std::span<int32_t> ids, std::span<int32_t> targets, ImageBatch* images = nullptr) const;
    int64_t num_eval_batches() const { return num_val_windows_ / batch_; }
    int64_t num_train_windows() const { return int64_t(order_.size()); }
    // Between steps: the targets that count (not prompt tokens) in the windows the next step reads on every rank,
    // from the data alone (no communication); 0 when the data has no loss mask (every target counts).
    int64_t step_targets() const;
    // Between steps: the grids of the images the next step's windows take on every rank, from the data alone (an
    // image that two windows cut is in both: the tower runs on it in each). Empty without images.
    void step_images(std::vector<ops::PatchGrid>& grids) const;

    // between optimizer steps (after every micro-batch of a step was read)
    LoaderPosition position() const;
    void set_position(LoaderPosition p);

  private:
    void shuffle_epoch();
    // f(start) for the first token of each window the next step reads on every rank, in order
    template <class F>
    void for_each_step_window(F&& f) const;
    int64_t next_window();  // the next window of the sequence (a new epoch after the last)
    void skip(int64_t windows);
    // the first image whose tokens end after position start
    std::span<const ShardImage>::iterator first_image_after(int64_t start) const;
    void read_window(int64_t start, std::span<int32_t> ids, std::span<int32_t> targets, ImageBatch* images) const;

    const TokenSource& tokens_;
    int64_t seq_len_, batch_;
    uint64_t seed_;
    int64_t train_tokens_ = 0;
    int64_t num_val_windows_ = 0;
    std::vector<int64_t> order_;               // window index permutation of the current epoch
    mutable std::vector<int64_t> next_order_;  // step_targets: the next epoch's, when a step reaches into it
    LoaderPosition pos_;
    DataShard shard_;
    int64_t micro_ = 0;  // micro-batches of the current step read by this rank
};

// Document boundaries of a batch of `batch` rows of `seq` tokens: the start of every row and the
// position after every end-of-document token, as cu_seqlens over the flattened batch (ending with
// batch·seq). cu needs batch·seq + 1 entries; returns how many it filled.
int64_t document_starts(
    std::span<const int32_t> ids, int64_t batch, int64_t seq, int32_t end_of_document, std::span<int64_t> cu);

}  // namespace tessera::train
