// KDA forget gate forward/backward: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU kernels
// (formulas: ops/kda_gate.h, spec/kda.md §3.3).
#include "ops/kda_gate.h"

#include <algorithm>
#include <cmath>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;

namespace {
constexpr int64_t kChunk = 64;  // channels of a head the backward sums together

struct GateDims {
    int64_t N, HV, K;
};

GateDims check(const TensorView& f, const TensorView& A_log, const TensorView& dt_bias) {
    TESSERA_CHECK(f.ndim() >= 2 && f.size(-1) > 0 && f.size(-2) > 0, "kda_gate: f must be [..., HV, K], not {}",
                  f.shape.str());
    GateDims d{f.numel() / (f.size(-1) * f.size(-2)), f.size(-2), f.size(-1)};
    check_shape(A_log, Shape{d.HV}, "kda_gate: A_log");
    TESSERA_CHECK(dt_bias.numel() == d.HV * d.K, "kda_gate: dt_bias must hold HV·K = {} values, not {}", d.HV * d.K,
                  dt_bias.shape.str());
    for (const TensorView* t : {&f, &A_log, &dt_bias}) {
        check_contiguous(*t, "kda_gate: inputs");
        TESSERA_CHECK(t->dtype == f.dtype, "kda_gate: inputs must share one dtype");
    }
    return d;
}

template <class T>
inline T softplus(T z) {
    return z > T(20) ? z : T(std::log1p(std::exp(double(z))));
}
}  // namespace

void kda_gate_forward(const KdaGateParams& p, TensorView f, TensorView A_log, TensorView dt_bias, TensorView g) {
    note_op_use("kda_gate");
    const Device device = op_device("kda_gate", {f, A_log, dt_bias, g});
    const GateDims d = check(f, A_log, dt_bias);
    check_shape(g, f.shape, "kda_gate: g");
    TESSERA_CHECK(p.lower_bound <= 0, "kda_gate: lower_bound must be <= 0 (0 = softplus form), not {}", p.lower_bound);
    check_contiguous(g, "kda_gate: g");
    if (device == Device::cuda) return TESSERA_ON_CUDA(kda_gate_forward(p, f, A_log, dt_bias, g));
    dispatch_float(f.dtype, "kda_gate", [&]<class T>(T) {
        const T* F = f.ptr<T>();
        const T* A = A_log.ptr<T>();
        const T* bias = dt_bias.ptr<T>();
        T* G = g.ptr<T>();
        const T lb = T(p.lower_bound);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < d.N; ++n) {
            for (int64_t i = 0; i < d.HV; ++i) {
                const T a = T(std::exp(double(A[i])));
                const T* fz = F + (n * d.HV + i) * d.K;
                const T* b = bias + i * d.K;
                T* gr = G + (n * d.HV + i) * d.K;
                if (lb == T(0)) {
                    for (int64_t c = 0; c < d.K; ++c) gr[c] = -a * softplus(fz[c] + b[c]);
                } else {
#pragma omp simd
                    for (int64_t c = 0; c < d.K; ++c) gr[c] = lb * cpu::vsigmoid(a * (fz[c] + b[c]));
                }
            }
        }
    });
}

void kda_gate_backward(const KdaGateParams& p,
                       TensorView dg,
                       TensorView f,
                       TensorView A_log,
                       TensorView dt_bias,
                       TensorView df,
                       TensorView dA_log,
                       TensorView ddt_bias) {
    const Device device = op_device("kda_gate", {dg, f, A_log, dt_bias, df, dA_log, ddt_bias});
    const GateDims d = check(f, A_log, dt_bias);
    check_shape(dg, f.shape, "kda_gate: dg");
    check_contiguous(dg, "kda_gate: dg");
    if (df.defined()) check_shape(df, f.shape, "kda_gate: df");
    if (dA_log.defined()) check_shape(dA_log, A_log.shape, "kda_gate: dA_log");
    if (ddt_bias.defined()) check_shape(ddt_bias, dt_bias.shape, "kda_gate: ddt_bias");
    for (const TensorView* t : {&df, &dA_log, &ddt_bias})
        if (t->defined()) check_contiguous(*t, "kda_gate: gradients");
    if (device == Device::cuda)
        return TESSERA_ON_CUDA(kda_gate_backward(p, dg, f, A_log, dt_bias, df, dA_log, ddt_bias));
    dispatch_float(f.dtype, "kda_gate", [&]<class T>(T) {
        const T* F = f.ptr<T>();
        const T* A = A_log.ptr<T>();
        const T* bias = dt_bias.ptr<T>();
        const T* DG = dg.ptr<T>();
        T* DF = df.defined() ? df.ptr<T>() : nullptr;
        T* DA = dA_log.defined() ? dA_log.ptr<T>() : nullptr;
        T* DB = ddt_bias.defined() ? ddt_bias.ptr<T>() : nullptr;
        const T lb = T(p.lower_bound);
        // NOTES: one task per head walks every token in order: the parameter sums have a fixed order. ddt_bias adds
        // each token's term in place, in token order; dA_log sums per channel c (the same lanes on every ISA), then
        // over c. Channels go in chunks of kChunk (a head of any width; each chunk walks the tokens again).
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < d.HV; ++i) {
            const T a = T(std::exp(double(A[i])));
            T da_sum = 0;
            for (int64_t c0 = 0; c0 < d.K; c0 += kChunk) {
                const int64_t m = std::min(kChunk, d.K - c0);
                T db[kChunk], da[kChunk], dz[kChunk];
                const T* b = bias + i * d.K + c0;
                for (int64_t c = 0; c < m; ++c) {
                    db[c] = DB ? DB[i * d.K + c0 + c] : T(0);
                    da[c] = 0;
                }
                for (int64_t n = 0; n < d.N; ++n) {
                    const int64_t e0 = (n * d.HV + i) * d.K + c0;
                    const T* fz = F + e0;
                    const T* g = DG + e0;
                    if (lb == T(0)) {  // g = −a·softplus(z): dz = −a·σ(z)·dg, dA = dg·g
                        for (int64_t c = 0; c < m; ++c) {
                            const T z = fz[c] + b[c];
                            dz[c] = -a * cpu::vsigmoid(z) * g[c];
                            da[c] += g[c] * (-a * softplus(z));
                        }
                    } else {  // g = lb·σ(u), u = a·z: du = dg·lb·σ(u)(1 − σ(u)), dz = a·du, dA = du·u
#pragma omp simd
                        for (int64_t c = 0; c < m; ++c) {
                            const T u = a * (fz[c] + b[c]), s = cpu::vsigmoid(u);
                            const T du = g[c] * lb * s * (T(1) - s);
                            dz[c] = a * du;
                            da[c] += du * u;
                        }
                    }
                    if (DF) {
                        T* df_row = DF + e0;
#pragma omp simd
                        for (int64_t c = 0; c < m; ++c) df_row[c] += dz[c];
                    }
#pragma omp simd
                    for (int64_t c = 0; c < m; ++c) db[c] += dz[c];
                }
                if (DB)
                    for (int64_t c = 0; c < m; ++c) DB[i * d.K + c0 + c] = db[c];
                for (int64_t c = 0; c < m; ++c) da_sum += da[c];
            }
            if (DA) DA[i] += da_sum;
        }
    });
}

}  // namespace tessera::ops
