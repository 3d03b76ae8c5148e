// Batched matrix products over heads, for the blocks' per-head projections (MLA's absorbed W_UK / W_UV):
// for h < H, C_h = alpha · op(A_h) · op(B_h) + beta · C_h, where X_h is the matrix [rows, cols] of a 3-D view
// X [H, rows, cols] whose last dim is contiguous; the first two dims take any strides, so heads side by side in the
// columns of a row-major buffer [N, H·D] are the view {H, N, D} with strides {D, H·D, 1}. op(X) = X (Trans::N) or
// Xᵀ: op(A_h) is [M, K], op(B_h) [K, N], C_h [M, N]. f32 or f64. The CPU runs ops::gemm per head (deterministic,
// ops/gemm.h); CUDA one strided-batched cuBLAS call.
#pragma once

#include "core/tensor.h"
#include "ops/gemm.h"

namespace tessera::ops {

void matmul_heads(Trans ta, Trans tb, double alpha, TensorView a, TensorView b, double beta, TensorView c);

// The view {H, rows, cols} of heads side by side in the columns of a row-major buffer: head h's matrix starts at
// column col + h·head_stride of rows [rows, cols) wide `cols`.
TensorView head_matrices(TensorView rows, int64_t col, int64_t heads, int64_t head_stride, int64_t cols);

}  // namespace tessera::ops
