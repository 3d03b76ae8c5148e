// Gated RMSNorm (the KDA/GDN output norm): y = x / sqrt(mean(x²) + eps) · weight · act(gate), with
// act = sigmoid (KDA) or silu (GDN). Rows are heads: x, gate, y [N, D] with D = the head dim and one
// weight [D] shared by all heads. Backward accumulates into dx, dgate and dweight (dweight summed
// over rows in row order).
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

enum class GateActivation : uint8_t { sigmoid, silu };

struct GatedRmsNormParams {
    double eps = 1e-5;
    GateActivation activation = GateActivation::sigmoid;
};

void gated_rmsnorm_forward(const GatedRmsNormParams& p, TensorView x, TensorView gate, TensorView weight, TensorView y);
void gated_rmsnorm_backward(const GatedRmsNormParams& p,
                            TensorView dy,
                            TensorView x,
                            TensorView gate,
                            TensorView weight,
                            TensorView dx,
                            TensorView dgate,
                            TensorView dweight);

}  // namespace tessera::ops
