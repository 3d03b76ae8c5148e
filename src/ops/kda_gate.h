// The KDA forget gate (../shared/spec/kda.md §1.2, §4.1), from the raw projection f:
//   lower_bound = 0 (softplus form): g = −exp(A_log[i]) · softplus(f + dt_bias)
//   lower_bound < 0 (safe form):      g = lower_bound · σ(exp(A_log[i]) · (f + dt_bias))
// softplus(z) = z for z > 20 (PyTorch's threshold). A scalar gate per head (GDN) is the case K = 1.
// Shapes: f, g, df, dg [N, HV, K] (any leading dims collapse to N tokens); A_log [HV]; dt_bias [HV, K]
// (or flat [HV·K]). Backward accumulates into df, dA_log, ddt_bias (the two parameter gradients
// summed over tokens in token order).
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

struct KdaGateParams {
    double lower_bound = 0.0;
};

void kda_gate_forward(const KdaGateParams& p, TensorView f, TensorView A_log, TensorView dt_bias, TensorView g);
void kda_gate_backward(const KdaGateParams& p,
                       TensorView dg,
                       TensorView f,
                       TensorView A_log,
                       TensorView dt_bias,
                       TensorView df,
                       TensorView dA_log,
                       TensorView ddt_bias);

}  // namespace tessera::ops
