// RMSNorm: y = x / sqrt(mean(x²) + eps) · w. Shapes: x, y, dx, dy [N, D] (row-strided allowed),
// w, dw [D], rstd [N] (written by forward, read by backward; f32 or f64 like x).
// Backward: with x̂ = x·rstd and g = dy∘w, dx += rstd·(g − x̂·mean(g∘x̂)), dw += Σ_n dy∘x̂ (skipped when dw
// is undefined: a frozen weight).
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

struct RmsNormParams {
    double eps = 1e-6;
};

void rmsnorm_forward(const RmsNormParams& p, TensorView x, TensorView w, TensorView y, TensorView rstd);
void rmsnorm_backward(
    const RmsNormParams& p, TensorView dy, TensorView x, TensorView w, TensorView rstd, TensorView dx, TensorView dw);

}  // namespace tessera::ops
