// Kimi K3's image tower and projector (model/vision.h): configuration, buffers and the forward pass.
#include "model/vision.h"

#include <cmath>

#include "ops/attention.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rows.h"

namespace tessera::model {

VisionTower::VisionTower(VisionConfig cfg) : cfg_(std::move(cfg)) {
    cfg_.validate("vision tower");
    TESSERA_CHECK(cfg_.enabled(), "vision tower: no layers");
}

void VisionTower::declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const {
    const VisionConfig& c = cfg_;
    const ParamInit w = ParamInit::normal(0.02), one = ParamInit::constant(1.0);
    const std::string t = "vision_tower.";
    add_param(specs, inits, t + "patch_embed.proj.weight", Shape{c.width, c.channels, c.patch_size, c.patch_size}, w,
              true);
    add_param(specs, inits, t + "patch_embed.pos_emb.weight", Shape{c.pos_height, c.pos_width, c.width}, w, false);
    for (int64_t l = 0; l < c.layers; ++l) {
        const std::string b = t + "encoder.blocks." + std::to_string(l) + ".";
        add_param(specs, inits, b + "norm0.weight", Shape{c.width}, one, false);
        add_param(specs, inits, b + "wqkv.weight", Shape{3 * c.qkv_width(), c.width}, w, true);
        add_param(specs, inits, b + "wo.weight", Shape{c.width, c.qkv_width()}, w, true);
        add_param(specs, inits, b + "norm1.weight", Shape{c.width}, one, false);
        add_param(specs, inits, b + "mlp.fc0.weight", Shape{c.ffn_dim, c.width}, w, true);
        add_param(specs, inits, b + "mlp.fc1.weight", Shape{c.width, c.ffn_dim}, w, true);
    }
    add_param(specs, inits, t + "encoder.final_layernorm.weight", Shape{c.width}, one, false);
    add_param(specs, inits, "mm_projector.proj.0.weight", Shape{c.merged_width(), c.merged_width()}, w, true);
    add_param(specs, inits, "mm_projector.proj.2.weight", Shape{c.text_width, c.merged_width()}, w, true);
    add_param(specs, inits, "mm_projector.post_norm.weight", Shape{c.text_width}, one, false);
}

std::vector<BufferSpec> VisionTower::activation_specs(int64_t max_patches) const {
    const VisionConfig& c = cfg_;
    const int64_t N = max_patches, M = max_patches / (c.merge_h * c.merge_w);
    TESSERA_CHECK(N > 0, "vision tower: at most {} patches per forward must be positive", N);
    auto act = [](std::string name, Shape s) { return BufferSpec{"vision." + std::move(name), DType::f32, s}; };
    return {act("x", Shape{N, c.width}),
            act("normed", Shape{N, c.width}),
            act("qkv", Shape{N, 3 * c.qkv_width()}),
            act("attn", Shape{N, c.qkv_width()}),
            act("out", Shape{N, c.width}),
            act("ffn", Shape{N, c.ffn_dim}),
            act("lse", Shape{c.heads, N}),
            act("rstd", Shape{N}),
            act("merged", Shape{std::max<int64_t>(M, 1), c.merged_width()}),
            act("proj_hidden", Shape{std::max<int64_t>(M, 1), c.merged_width()}),
            act("proj_out", Shape{std::max<int64_t>(M, 1), c.text_width})};
}

size_t VisionTower::workspace_bytes(int64_t max_patches, int num_threads) const {
    return ops::attention_workspace_bytes(DType::f32, max_patches, cfg_.head_dim, num_threads);
}

void VisionTower::bind(const BufferGroup& params,
                       const BufferGroup& acts,
                       std::span<std::byte> workspace,
                       int64_t max_images) {
    const VisionConfig& c = cfg_;
    const std::string t = "vision_tower.";
    patch_w_ = params.view(t + "patch_embed.proj.weight").reshape(Shape{c.width, c.patch_dim()});
    pos_table_ = params.view(t + "patch_embed.pos_emb.weight");
    layers_.clear();
    for (int64_t l = 0; l < c.layers; ++l) {
        const std::string b = t + "encoder.blocks." + std::to_string(l) + ".";
        layers_.push_back({params.view(b + "norm0.weight"), params.view(b + "wqkv.weight"),
                           params.view(b + "wo.weight"), params.view(b + "norm1.weight"),
                           params.view(b + "mlp.fc0.weight"), params.view(b + "mlp.fc1.weight")});
    }
    final_norm_ = params.view(t + "encoder.final_layernorm.weight");
    proj0_ = params.view("mm_projector.proj.0.weight");
    proj2_ = params.view("mm_projector.proj.2.weight");
    post_norm_ = params.view("mm_projector.post_norm.weight");
    x_ = acts.view("vision.x");
    h_ = acts.view("vision.normed");
    qkv_ = acts.view("vision.qkv");
    o_ = acts.view("vision.attn");
    tmp_ = acts.view("vision.out");
    ffn_ = acts.view("vision.ffn");
    lse_ = acts.view("vision.lse");
    rstd_ = acts.view("vision.rstd");
    merged_ = acts.view("vision.merged");
    proj_hidden_ = acts.view("vision.proj_hidden");
    proj_out_ = acts.view("vision.proj_out");
    ws_ = workspace;
    max_images_ = max_images;
    cu_.clear();
    cu_.reserve(size_t(max_images) + 1);
}

int64_t VisionTower::tokens(std::span<const ops::PatchGrid> grids) const {
    int64_t n = 0;
    for (const ops::PatchGrid& g : grids) n += image_tokens(cfg_, g);
    return n;
}

void VisionTower::forward(std::span<const ops::PatchGrid> grids, TensorView patches, TensorView out) {
    const VisionConfig& c = cfg_;
    const int64_t M = tokens(grids), N = ops::grid_patches(grids), D = c.head_dim, H = c.heads;
    TESSERA_CHECK(N <= x_.size(0), "vision tower: {} patches, but the buffers hold {}", N, x_.size(0));
    TESSERA_CHECK(int64_t(grids.size()) <= max_images_, "vision tower: {} images, but at most {} were bound",
                  grids.size(), max_images_);
    TESSERA_CHECK(patches.ndim() == 2 && patches.size(0) == N && patches.size(1) == c.patch_dim(),
                  "vision tower: patches {} must be [{}, {}]", patches.shape.str(), N, c.patch_dim());
    TESSERA_CHECK(out.ndim() == 2 && out.size(0) == M && out.size(1) == c.text_width,
                  "vision tower: output {} must be [{}, {}]", out.shape.str(), M, c.text_width);
    cu_.assign(1, 0);
    for (const ops::PatchGrid& g : grids) cu_.push_back(cu_.back() + g.patches());

    const TensorView x = x_.prefix(Shape{N, c.width}), h = h_.prefix(Shape{N, c.width}),
                     qkv = qkv_.prefix(Shape{N, 3 * c.qkv_width()}), o = o_.prefix(Shape{N, c.qkv_width()}),
                     tmp = tmp_.prefix(Shape{N, c.width}), ffn = ffn_.prefix(Shape{N, c.ffn_dim}),
                     lse = lse_.prefix(Shape{1, H, N}), rstd = rstd_.prefix(Shape{N});
    const ops::RmsNormParams norm{c.norm_eps};
    const TensorView none;

    ops::linear_forward({}, patches, patch_w_, none, x);
    ops::pos_embed_forward(grids, pos_table_, x);
    // q, k, v as [1, N, H, D] head views of the fused projection's rows, q and k also as [N, H, D] for the rope
    auto heads = [&](int64_t part) {
        TensorView v = qkv.columns(part * c.qkv_width(), c.qkv_width());
        v.shape = Shape{1, N, H, D};
        v.strides = {N * qkv.strides[0], qkv.strides[0], D, 1};
        return v;
    };
    auto rope_rows = [&](TensorView v) {
        v.shape = Shape{N, H, D};
        v.strides = {v.strides[1], D, 1};
        return v;
    };
    const TensorView q = heads(0), k = heads(1), v = heads(2), o4 = o.reshape(Shape{1, N, H, D});
    const ops::AttentionParams attn{0.0, false};
    for (const Layer& l : layers_) {
        ops::rmsnorm_forward(norm, x, l.norm0, h, rstd);
        ops::linear_forward({}, h, l.wqkv, none, qkv);
        ops::rope_2d_forward(c.rope_theta, grids, rope_rows(q), rope_rows(q));
        ops::rope_2d_forward(c.rope_theta, grids, rope_rows(k), rope_rows(k));
        ops::attention_forward(attn, q, k, v, o4, lse, ws_, cu_);
        ops::linear_forward({}, o, l.wo, none, tmp);
        ops::add_rows(tmp, x);
        ops::rmsnorm_forward(norm, x, l.norm1, h, rstd);
        ops::linear_forward({}, h, l.fc0, none, ffn);
        ops::gelu_forward(ops::Gelu::tanh, ffn, ffn);
        ops::linear_forward({}, ffn, l.fc1, none, tmp);
        ops::add_rows(tmp, x);
    }
    ops::rmsnorm_forward(norm, x, final_norm_, h, rstd);
    const TensorView merged = merged_.prefix(Shape{M, c.merged_width()}),
                     hidden = proj_hidden_.prefix(Shape{M, c.merged_width()}),
                     projected = proj_out_.prefix(Shape{M, c.text_width});
    ops::patch_merge_forward(grids, c.merge_h, c.merge_w, h, merged);
    ops::linear_forward({}, merged, proj0_, none, hidden);
    ops::gelu_forward(ops::Gelu::erf, hidden, hidden);
    ops::linear_forward({}, hidden, proj2_, none, projected);
    ops::rmsnorm_forward({c.projector_eps}, projected, post_norm_, out, rstd.prefix(Shape{M}));
}

double VisionTower::forward_flops(std::span<const ops::PatchGrid> grids) const {
    const VisionConfig& c = cfg_;
    double flops = 0;
    for (const ops::PatchGrid& g : grids) {
        const double n = double(g.patches()), m = n / double(c.merge_h * c.merge_w);
        const double block = 2 * n * double(c.width) * double(4 * c.qkv_width() + 2 * c.ffn_dim) +
                             ops::attention_forward_flops(1, g.patches(), c.heads, c.head_dim, false);
        flops += 2 * n * double(c.width * c.patch_dim()) + double(c.layers) * block +
                 2 * m * double(c.merged_width()) * double(c.merged_width() + c.text_width);
    }
    return flops;
}

}  // namespace tessera::model
