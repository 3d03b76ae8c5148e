// SwiGLU: y = silu(gate) · up, silu(a) = a·σ(a). Shapes: gate, up, y, and their gradients [N, F]
// (row-strided allowed, e.g. the two halves of a fused [N, 2F] buffer).
// Backward accumulates: dgate += dy·up·σ(a)·(1 + a·(1 − σ(a))), dup += dy·silu(gate).
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

void swiglu_forward(TensorView gate, TensorView up, TensorView y);
void swiglu_backward(TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup);

}  // namespace tessera::ops
