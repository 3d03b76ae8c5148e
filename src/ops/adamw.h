// AdamW update (Loshchilov & Hutter 2019, decoupled weight decay), in the operation order of
// PyTorch's torch.optim.AdamW (single-tensor path), so trajectories match it to rounding:
//   param *= 1 − lr·wd;  m = lerp(m, g, 1 − β1);  v = β2·v + (1 − β2)·g²;
//   param −= lr / (1 − β1^step) · m / (sqrt(v) / sqrt(1 − β2^step) + eps).
// Shapes: param, grad, m, v all alike (contiguous). step counts from 1.
#pragma once

#include <cstdint>
#include <span>

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

// The optimizer's passes over flat f32 gradient ranges (train/optimizer.h, train/grad_sum.h), on either device:
// the gradient norm's partial sums, out[k] = Σ x_i² over elements [k·chunk, (k+1)·chunk) in double, each chunk in
// element order (the caller adds them in chunk order: the same sum on any thread count); clipping, x *= factor;
// and the micro-batches' sum, dst += src.
void sum_squares_by_chunk(TensorView x, int64_t chunk, std::span<double> out);
void scale_vector(TensorView x, float factor);
void add_vector(TensorView src, TensorView dst);

}  // namespace tessera::ops
