// LayerNorm with weight and bias (Ba et al. 2016): y = (x − mean(x)) · rstd · w + b, rstd = 1/sqrt(var(x) + eps)
// with the biased variance. The DSA indexer's key norm (spec/dsa.md §1.1). Shapes: x, y, dx, dy [N, D]
// (row-strided allowed), w, b, dw, db [D], mean and rstd [N] (written by forward, read by backward).
// Backward: with x̂ = (x − mean)·rstd and g = dy∘w, dx += rstd·(g − mean(g) − x̂·mean(g∘x̂)) (skipped when
// dx is absent), dw += Σ_n dy∘x̂, db += Σ_n dy, reduced over rows in row order (dw
// and db undefined together: frozen, skipped).
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

struct LayerNormParams {
    double eps = 1e-6;
};

void layernorm_forward(
    const LayerNormParams& p, TensorView x, TensorView w, TensorView b, TensorView y, TensorView mean, TensorView rstd);
void layernorm_backward(const LayerNormParams& p,
                        TensorView dy,
                        TensorView x,
                        TensorView w,
                        TensorView mean,
                        TensorView rstd,
                        TensorView dx,
                        TensorView dw,
                        TensorView db);

}  // namespace tessera::ops
