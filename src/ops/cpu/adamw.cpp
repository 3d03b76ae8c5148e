// AdamW and the optimizer's vector passes: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU's
// elementwise loops.
#include "ops/adamw.h"

#include <algorithm>
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

namespace {
void check_flat(const TensorView& t, const char* op) {
    TESSERA_CHECK(t.dtype == DType::f32, "{}: f32 values, not {}", op, dtype_name(t.dtype));
    check_contiguous(t, op);
}
}  // namespace

void sum_squares_by_chunk(TensorView x, int64_t chunk, std::span<double> out) {
    check_flat(x, "sum_squares_by_chunk");
    const int64_t n = x.numel();
    TESSERA_CHECK(chunk > 0 && int64_t(out.size()) >= (n + chunk - 1) / chunk,
                  "sum_squares_by_chunk: {} sums for {} elements in chunks of {}", out.size(), n, chunk);
    if (op_device("sum_squares_by_chunk", {x}) == Device::cuda)
        return TESSERA_ON_CUDA(sum_squares_by_chunk(x, chunk, out));
    const float* g = x.ptr<float>();
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < (n + chunk - 1) / chunk; ++k) {
        const int64_t e0 = k * chunk, e1 = std::min(n, e0 + chunk);
        double s = 0;
        for (int64_t e = e0; e < e1; ++e) s += double(g[e]) * double(g[e]);
        out[size_t(k)] = s;
    }
}

void scale_vector(TensorView x, float factor) {
    check_flat(x, "scale_vector");
    if (op_device("scale_vector", {x}) == Device::cuda) return TESSERA_ON_CUDA(scale_vector(x, factor));
    float* p = x.ptr<float>();
    const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static)
    for (int64_t e = 0; e < n; ++e) p[e] *= factor;
}

void add_vector(TensorView src, TensorView dst) {
    check_flat(src, "add_vector");
    check_flat(dst, "add_vector");
    TESSERA_CHECK(src.numel() == dst.numel(), "add_vector: {} values into {}", src.numel(), dst.numel());
    if (op_device("add_vector", {src, dst}) == Device::cuda) return TESSERA_ON_CUDA(add_vector(src, dst));
    const float* s = src.ptr<float>();
    float* d = dst.ptr<float>();
    const int64_t n = src.numel();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) d[i] += s[i];
}

}  // namespace tessera::ops
