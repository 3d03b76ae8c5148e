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
// contiguous. Backward accumulates (+=) into what it writes, as every op's backward does. f32 and f64, CPU only
// (CUDA tensors get a one-line error).
#pragma once

#include <span>

#include "core/tensor.h"

namespace tessera::ops {

struct PatchGrid {
    int64_t h = 0, w = 0;  // patches per column and per row
    int64_t patches() const { return h * w; }
};

// Σ h·w over the grids (checked: positive sizes)
int64_t grid_patches(std::span<const PatchGrid> grids);

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
