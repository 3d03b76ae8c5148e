// The ops of a ViT image tower (Kimi K3's MoonViT, spec/kimi_k3.md §6; model/vision.h), over images packed one
// after another: image i is a grid of h_i × w_i patches, its rows (one per patch, the grid in row-major order)
// following image i − 1's.
//   - gelu: y = x·Φ(x) (exact, erf) or PyTorch's tanh approximation
//     0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), elementwise over rows.
//   - rope_2d: MoonViT's 2-D rotary embedding. Head dim D (a multiple of 4) holds D/2 pairs (x[2i], x[2i+1]); pair
//     i turns by the angle c·f_{⌊i/2⌋} with c the patch's column for even i and its row for odd i, and
//     f_j = theta^(−4j/D). (The column-first order is the released code's, Kimi-VL's `Rope2DPosEmb`, whose docstring
//     says the opposite.)
//   - pos_embed: adds a learned [Ht, Wt, C] table resized to each image's grid: the table itself when the grid is
//     Ht × Wt, else bilinear interpolation with PyTorch's `align_corners=False` (source coordinate
//     (d + 0.5)·in/out − 0.5, clamped below at 0; the upper neighbour clamped to the last row or column).
//   - patch_merge: each kh × kw cell of an image's grid becomes one row, its patches side by side in row-major
//     order within the cell: [Σ h·w, C] → [Σ (h/kh)·(w/kw), kh·kw·C], cells in row-major order.
// Rows: 2-D views [rows, cols] with the last dim contiguous (row strides allowed); rope_2d's x, y [N, H, D] with D
// contiguous. Backward accumulates (+=) into what it writes, as every op's backward does. f32 and f64 on both
// backends; the index arithmetic both share is below (host code: the CUDA entry points upload its tables).
#pragma once

#include <algorithm>
#include <span>

#include "core/tensor.h"

namespace tessera::ops {

struct PatchGrid {
    int64_t h = 0, w = 0;  // patches per column and per row
    int64_t patches() const { return h * w; }
};

// The merged rows [begin, end) of an image that a pass's ids hold: all of them, or, where a training window cuts the
// image (train/data/loader.h), the part inside the window.
struct ImageRows {
    int64_t begin = 0, end = 0;
};

// Σ h·w over the grids (checked: positive sizes)
int64_t grid_patches(std::span<const PatchGrid> grids);

// The position table's two source indices along one axis and their weights for output index d of `out` when
// resizing `in` (PyTorch's bilinear, align_corners = False); the identity when in == out.
struct BilinearTaps {
    int64_t i0 = 0, i1 = 0;
    double w0 = 1.0, w1 = 0.0;
};
inline BilinearTaps bilinear_taps(int64_t d, int64_t in, int64_t out) {
    if (in == out) return {d, d, 1.0, 0.0};
    const double src = std::max((double(d) + 0.5) * double(in) / double(out) - 0.5, 0.0);
    const auto i0 = std::min(int64_t(src), in - 1);
    const int64_t i1 = std::min(i0 + 1, in - 1);
    const double l1 = src - double(i0);
    return {i0, i1, 1.0 - l1, l1};
}
// f(merged row, slot, patch row) for every merged row's kh·kw slots (slot u·kw + v of its cell), images in order.
template <class F>
void for_each_merge_slot(std::span<const PatchGrid> grids, int64_t kh, int64_t kw, F&& f) {
    int64_t base = 0, out = 0;
    for (const PatchGrid& g : grids) {
        const int64_t cells_w = g.w / kw, cells = g.patches() / (kh * kw);
        for (int64_t m = 0; m < cells; ++m) {
            const int64_t a = m / cells_w, b = m % cells_w;
            for (int64_t u = 0; u < kh; ++u)
                for (int64_t v = 0; v < kw; ++v) f(out + m, u * kw + v, base + (a * kh + u) * g.w + b * kw + v);
        }
        base += g.patches();
        out += cells;
    }
}

enum class Gelu : uint8_t { erf, tanh };

void gelu_forward(Gelu kind, TensorView x, TensorView y);  // y may alias x
void gelu_backward(Gelu kind, TensorView dy, TensorView x, TensorView dx);

void rope_2d_forward(double theta, std::span<const PatchGrid> grids, TensorView x, TensorView y);  // y may alias x
void rope_2d_backward(double theta, std::span<const PatchGrid> grids, TensorView dy, TensorView dx);

void pos_embed_forward(std::span<const PatchGrid> grids, TensorView table, TensorView x);  // x += table at grid
void pos_embed_backward(std::span<const PatchGrid> grids, TensorView dx, TensorView dtable);

void patch_merge_forward(std::span<const PatchGrid> grids, int64_t kh, int64_t kw, TensorView x, TensorView y);
void patch_merge_backward(std::span<const PatchGrid> grids, int64_t kh, int64_t kw, TensorView dy, TensorView dx);

}  // namespace tessera::ops
