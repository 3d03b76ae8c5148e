// L2 normalisation of rows: y = x / sqrt(Σ x² + eps) (eps inside the sqrt, fla's kernel form).
// Shapes: x, y, dx, dy [N, D] (leading dims collapse; row-strided allowed). Backward accumulates
// dx += ρ·(dy − y·(y·dy)), ρ = (Σ x² + eps)^-1/2.
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

struct L2NormParams {
    double eps = 1e-6;
};

void l2norm_forward(const L2NormParams& p, TensorView x, TensorView y);
void l2norm_backward(const L2NormParams& p, TensorView dy, TensorView x, TensorView dx);

}  // namespace tessera::ops
