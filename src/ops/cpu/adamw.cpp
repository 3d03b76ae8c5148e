// AdamW: the entry point (checks, then CUDA tensors to ops/cuda) and the CPU's one elementwise pass.
#include "ops/adamw.h"

#include <cmath>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/op_use.h"

namespace tessera::ops {

void adamw_update(const AdamWParams& p, TensorView param, TensorView grad, TensorView m, TensorView v) {
    note_op_use("adamw");
    TESSERA_CHECK(p.step >= 1, "adamw: step must be >= 1, not {}", p.step);
    for (const TensorView* t : {&grad, &m, &v}) {
        TESSERA_CHECK(t->shape == param.shape && t->dtype == param.dtype,
                      "adamw: grad, m and v must be shaped like param {} {}", dtype_name(param.dtype),
                      param.shape.str());
    }
    for (const TensorView* t : {&param, &grad, &m, &v}) check_contiguous(*t, "adamw: tensors");
    if (op_device("adamw", {param, grad, m, v}) == Device::cuda)
        return TESSERA_ON_CUDA(adamw_update(p, param, grad, m, v));
    cpu::dispatch_float(param.dtype, "adamw", [&]<class T>(T) {
        const int64_t n = param.numel();
        T* P = param.ptr<T>();
        const T* G = grad.ptr<T>();
        T* M = m.ptr<T>();
        T* V = v.ptr<T>();
        const T decay = T(1.0 - p.lr * p.weight_decay);
        const T b2 = T(p.beta2), one_minus_b1 = T(1.0 - p.beta1), one_minus_b2 = T(1.0 - p.beta2);
        const T step_size = T(p.lr / (1.0 - std::pow(p.beta1, double(p.step))));
        const T bc2_sqrt = T(std::sqrt(1.0 - std::pow(p.beta2, double(p.step))));
        const T eps = T(p.eps);
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            const T g = G[i];
            P[i] *= decay;
            M[i] += one_minus_b1 * (g - M[i]);
            V[i] = V[i] * b2 + one_minus_b2 * g * g;
            P[i] -= step_size * M[i] / (std::sqrt(V[i]) / bc2_sqrt + eps);
        }
    });
}

}  // namespace tessera::ops
