// AdamW update (Loshchilov & Hutter 2019, decoupled weight decay), in the operation order of
// PyTorch's torch.optim.AdamW (single-tensor path), so trajectories match it to rounding:
//   param *= 1 − lr·wd;  m = lerp(m, g, 1 − β1);  v = β2·v + (1 − β2)·g²;
//   param −= lr / (1 − β1^step) · m / (sqrt(v) / sqrt(1 − β2^step) + eps).
// Shapes: param, grad, m, v all alike (contiguous). step counts from 1.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace tessera::ops {

struct AdamWParams {
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.01;
    int64_t step = 1;
};

void adamw_update(const AdamWParams& p, TensorView param, TensorView grad, TensorView m, TensorView v);

}  // namespace tessera::ops
