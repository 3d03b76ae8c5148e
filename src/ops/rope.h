// Rotary position embedding (Su et al. 2021, "RoFormer"). For pair i < D/2 at position t = offset +
// time index, angle = t · theta^(−2i/D), the pair (a, b) = (x[i], x[i+D/2]) in the rotate-half layout
// of Llama / GPT-NeoX (default), or (x[2i], x[2i+1]) in the interleaved layout of MLA (DeepSeek-V2/V3),
// is rotated: a' = a·cos − b·sin, b' = b·cos + a·sin.
// Angles are computed in double, then rounded to the tensor dtype.
// Shapes: x, y, dx, dy [B, T, H, D], strided over B, T and H allowed (D contiguous, D even).
// y may alias x in forward. Backward (the inverse rotation) accumulates into dx; dx must not alias dy.
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

struct RopeParams {
    double theta = 10000.0;
    int64_t offset = 0;
    bool interleaved = false;  // pairs (2i, 2i+1) instead of (i, i + D/2)
};

void rope_forward(const RopeParams& p, TensorView x, TensorView y);
void rope_backward(const RopeParams& p, TensorView dy, TensorView dx);

}  // namespace tessera::ops
