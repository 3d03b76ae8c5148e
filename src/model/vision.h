// Kimi K3's image tower, MoonViT-V2, and its projector into the language model (spec/kimi_k3.md §1.5, §5, §6; the
// released code's layout, Kimi-VL's MoonViT, for what the spec marks uncertain). Images arrive as patches: image i
// is an h_i × w_i grid of patch_size² pixels in `channels` colours, one row per patch ([channels, patch, patch]
// row-major, the conv weight's order), the grid in row-major order, images one after another. Then:
//   x = patches · W_patchᵀ + pos_embed(table resized to the grid)            (the 14×14 stride-14 conv as a GEMM)
//   per block: x += wo(attention(rope_2d(q), rope_2d(k), v))  with q, k, v = wqkv(RMSNorm₀(x)) [q; k; v] by heads,
//              attention bidirectional within each image;
//              x += fc1(gelu_tanh(fc0(RMSNorm₁(x))))
//   z = RMSNorm_final(x); m = patch_merge(z) (2×2 cells side by side: 4·width per image token)
//   out = RMSNorm_post(proj2(gelu_erf(proj0(m))))  [Σ h·w / 4, text width]: one row per image token of the LM.
// The tower runs forward only (frozen: a fine-tune trains the language model's adapters; its backward is not
// built yet). Parameter names are the checkpoint's (`vision_tower.*`, `mm_projector.*`). It runs on either backend:
// its ops (ops/vision.h) have CUDA kernels, compiled but not yet run on a GPU.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "core/buffer_spec.h"
#include "core/config_reader.h"
#include "model/config.h"
#include "model/image_input.h"
#include "model/layers/block.h"
#include "ops/vision.h"

namespace tessera::model {

// The tower's and projector's parameters (checkpoint names): frozen in every model that has them.
inline bool is_vision_param(const std::string& name) {
    return name.starts_with("vision_tower.") || name.starts_with("mm_projector.");
}

class VisionTower {
  public:
    explicit VisionTower(VisionConfig cfg);
    const VisionConfig& config() const { return cfg_; }

    void declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const;
    // Buffers of one forward over at most max_patches patches in at most max_images images.
    std::vector<BufferSpec> activation_specs(int64_t max_patches) const;
    size_t workspace_bytes(int64_t max_patches, int num_threads) const;
    void bind(const BufferGroup& params, const BufferGroup& acts, std::span<std::byte> workspace, int64_t max_images);

    // Image tokens the grids give (Σ h·w / (merge_h·merge_w)); checks every grid is whole cells within max_grid.
    int64_t tokens(std::span<const ops::PatchGrid> grids) const;
    int64_t max_images() const { return max_images_; }  // as bound
    // patches [Σ h·w, patch_dim] → out [tokens(grids), text_width]
    void forward(std::span<const ops::PatchGrid> grids, TensorView patches, TensorView out);
    double forward_flops(std::span<const ops::PatchGrid> grids) const;

  private:
    struct Layer {
        TensorView norm0, wqkv, wo, norm1, fc0, fc1;
    };
    VisionConfig cfg_;
    TensorView patch_w_, pos_table_, final_norm_, proj0_, proj2_, post_norm_;
    std::vector<Layer> layers_;
    TensorView x_, h_, qkv_, o_, tmp_, ffn_, lse_, rstd_, merged_, proj_hidden_, proj_out_;
    std::span<std::byte> ws_;
    int64_t max_images_ = 0;
    std::vector<int64_t> cu_;  // image boundaries of the packed patches (capacity set at bind)
};

}  // namespace tessera::model
