// SiTU-GLU, Kimi K3's gated activation (spec/kimi_k3.md §2.1):
//   y = G(gate)·U(up),  G(g) = β·tanh(g/β)·σ(g),  U(u) = β_lin·tanh(u/β_lin)   (β = 4, β_lin = 25)
// Near 0 G ≈ silu; both factors saturate, so |y| < β·β_lin. Shapes like swiglu: gate, up, y and their
// gradients [N, F] (row-strided allowed). Backward accumulates:
//   dgate += dy·U·[(1 − t²)·σ(g) + β·t·σ(g)·(1 − σ(g))], t = tanh(g/β);  dup += dy·G·(1 − tanh²(u/β_lin))
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

struct SituParams {
    double beta = 4.0;
    double linear_beta = 25.0;
};

void situ_glu_forward(const SituParams& p, TensorView gate, TensorView up, TensorView y);
void situ_glu_backward(
    const SituParams& p, TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup);

}  // namespace tessera::ops
