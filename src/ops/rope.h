// Rotary position embedding, rotate-half (non-interleaved) layout (Su et al. 2021, "RoFormer"; the
// layout of Llama / GPT-NeoX). For pair i < D/2 at position t = offset + time index:
//   angle = t · theta^(−2i/D);  y[i] = x[i]·cos − x[i+D/2]·sin;  y[i+D/2] = x[i+D/2]·cos + x[i]·sin.
// Angles are computed in double, then rounded to the tensor dtype.
// Shapes: x, y, dx, dy [B, T, H, D], strided over B, T and H allowed (D contiguous, D even).
// y may alias x in forward. Backward (the inverse rotation) accumulates into dx; dx must not alias dy.
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

struct RopeParams {
    double theta = 10000.0;
    int64_t offset = 0;
};

void rope_forward(const RopeParams& p, TensorView x, TensorView y);
void rope_backward(const RopeParams& p, TensorView dy, TensorView dx);

}  // namespace tessera::ops
