// The model's image input (model.h, set_images): the images of the next passes, the image tower run once per pass
// (or once per decoded set of images), and its rows spliced at the image tokens of the embedding's output.
#include <algorithm>

#include "core/device.h"
#include "core/trace.h"
#include "model/model.h"
#include "model/vision.h"
#include "ops/rows.h"

namespace tessera::model {

void Model::set_images(std::span<const ops::PatchGrid> grids,
                       TensorView patches,
                       std::span<const ops::ImageRows> rows) {
    TESSERA_CHECK(vision_ || grids.empty(), "model: images given, but the model has no image tower (model.vision)");
    TESSERA_CHECK(!vision_ || int64_t(grids.size()) <= vision_->max_images(),
                  "model: {} images in one pass; at most {} fit (model.vision.max_patches)", grids.size(),
                  vision_ ? vision_->max_images() : 0);
    TESSERA_CHECK(rows.empty() || rows.size() == grids.size(), "model: rows of {} images for {} images", rows.size(),
                  grids.size());
    image_grids_.assign(grids.begin(), grids.end());
    image_keep_.clear();
    image_kept_ = image_rows_total_ = 0;
    for (size_t i = 0; i < grids.size(); ++i) {
        const int64_t all = vision_->tokens(grids.subspan(i, 1));
        const ops::ImageRows keep = rows.empty() ? ops::ImageRows{0, all} : rows[i];
        TESSERA_CHECK(0 <= keep.begin && keep.begin < keep.end && keep.end <= all,
                      "model: rows [{}, {}) of image {}, which has {}", keep.begin, keep.end, i, all);
        image_keep_.push_back({image_rows_total_ + keep.begin, image_rows_total_ + keep.end});
        image_kept_ += keep.end - keep.begin;
        image_rows_total_ += all;
    }
    image_patches_ = patches;
    image_next_ = 0;
    image_rows_ready_ = false;
    if (grids.empty()) return;
    const int64_t n = ops::grid_patches(grids);
    TESSERA_CHECK(patches.device == Device::cpu && patches.dtype == DType::f32 && patches.is_contiguous() &&
                      patches.shape == (Shape{n, cfg_.vision.patch_dim()}),
                  "model: the images' patches must be f32 [{}, {}] on the host, not {} {}", n, cfg_.vision.patch_dim(),
                  dtype_name(patches.dtype), patches.shape.str());
    TESSERA_CHECK(n <= cfg_.vision.max_patches, "model: {} patches in one pass; model.vision.max_patches is {}", n,
                  cfg_.vision.max_patches);
}

int64_t Model::find_image_tokens(std::span<const int32_t> ids) {
    image_pos_.clear();
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] == cfg_.vision.image_token) image_pos_.push_back(int64_t(i));
    }
    return int64_t(image_pos_.size());
}

TensorView Model::run_tower() {
    const TensorView rows = image_rows_.slice0(0, image_rows_total_),
                     patches = image_buf_.slice0(0, image_patches_.size(0));
    copy_bytes(patches.data, patches.device, image_patches_.data, Device::cpu, image_patches_.nbytes());
    trace::Span span("vision tower", "forward", -1);
    vision_->forward(image_grids_, patches, rows);
    image_rows_ready_ = true;
    return rows;
}

void Model::splice_images(std::span<const int32_t> ids) {
    if (!vision_) return;
    const int64_t n = find_image_tokens(ids);
    TESSERA_CHECK(n == image_kept_,
                  "model: the ids hold {} image tokens (model.vision.image_token {}), the images give {}", n,
                  cfg_.vision.image_token, image_kept_);
    if (n == 0) return;
    const TensorView rows = run_tower();
    // each image's kept rows to its tokens' positions, in order; in a tensor group only the tokens of this rank's rows
    // [t·m, (t+1)·m) of the micro-batch, at their local positions (every rank runs the frozen tower whole)
    const int64_t m = local_rows(int64_t(ids.size())), lo = t_ * m, hi = lo + m;
    const auto first = std::lower_bound(image_pos_.begin(), image_pos_.end(), lo),
               last = std::lower_bound(image_pos_.begin(), image_pos_.end(), hi);
    const int64_t a = first - image_pos_.begin(), b = last - image_pos_.begin();  // this rank's image tokens
    for (int64_t& p : image_pos_) p -= lo;
    int64_t placed = 0;
    for (const ops::ImageRows& k : image_keep_) {
        const int64_t from = std::max(placed, a), to = std::min(placed + k.end - k.begin, b);
        if (from < to) {
            const std::span<const int64_t> at(image_pos_.data() + from, size_t(to - from));
            ops::scatter_rows(rows.slice0(k.begin + from - placed, k.begin + to - placed), at, x_[0]);
        }
        placed += k.end - k.begin;
    }
    image_pos_.erase(image_pos_.begin() + b, image_pos_.end());  // backward keeps these rows out of the embedding
    image_pos_.erase(image_pos_.begin(), image_pos_.begin() + a);
}

void Model::splice_decoded_images(int64_t pos, std::span<const int32_t> ids) {
    if (!vision_) return;
    if (pos == 0) image_next_ = 0;  // new sequences: their images from the first
    const int64_t n = find_image_tokens(ids);
    if (n == 0) return;
    TESSERA_CHECK(image_next_ + n <= image_rows_total_, "model: image token {} decoded, but the images give {}",
                  image_next_ + n, image_rows_total_);
    // the tower runs once for the images set; decoding places their rows in order
    const TensorView rows = image_rows_ready_ ? image_rows_.slice0(0, image_rows_total_) : run_tower();
    ops::scatter_rows(rows.slice0(image_next_, image_next_ + n), image_pos_, x_[0]);
    image_next_ += n;
}

}  // namespace tessera::model
