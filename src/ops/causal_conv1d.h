// Depthwise causal 1-D convolution (the short convolution of Mamba / GDN / KDA blocks):
//   z[b,t,c] = Σ_{k<W} w[c,k] · x[b, t−(W−1)+k, c]   (x = 0 before t = 0: left padding),
//   y = silu(z) or z.
// Shapes: x, y, dx, dy [B, T, C] (contiguous), w, dw [C, W]. With cu_seqlens (B = 1) the row holds
// packed sequences and the convolution restarts at every sequence start (never reads across one).
// Backward recomputes z and accumulates into dx and dw (dw summed over (b, t) in order; either may be
// undefined: not wanted).
#pragma once

#include <span>

#include "core/tensor.h"

namespace tessera::ops {

enum class Activation : uint8_t { none, silu };

inline constexpr int64_t kCausalConvMaxWidth = 16;  // the widest kernel W (KDA, GDN and Mamba use 4)

struct CausalConv1dParams {
    Activation activation = Activation::none;
};

void causal_conv1d_forward(
    const CausalConv1dParams& p, TensorView x, TensorView w, TensorView y, std::span<const int64_t> cu_seqlens = {});
void causal_conv1d_backward(const CausalConv1dParams& p,
                            TensorView dy,
                            TensorView x,
                            TensorView w,
                            TensorView dx,
                            TensorView dw,
                            std::span<const int64_t> cu_seqlens = {});

// One decoding step: x [B, C] is token t of each row, window [B, W−1, C] the row's previous W−1 inputs (oldest
// first; zeros before the sequence start). y [B, C] is the forward's output at t, summed in the forward's order;
// then the window moves on by one (drops its oldest input, appends x). f32.
void causal_conv1d_step(const CausalConv1dParams& p, TensorView x, TensorView w, TensorView window, TensorView y);

}  // namespace tessera::ops
