// Gated RMSNorm forward/backward: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU kernels.
#include "ops/gated_rmsnorm.h"

#include <cmath>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::Rows;
using cpu::rows_of;

namespace {
template <class T>
inline T act(GateActivation a, T z) {
    const T s = cpu::vsigmoid(z);
    return a == GateActivation::sigmoid ? s : z * s;
}
template <class T>
inline T act_grad(GateActivation a, T z) {
    const T s = cpu::vsigmoid(z);
    return a == GateActivation::sigmoid ? s * (T(1) - s) : s * (T(1) + z * (T(1) - s));
}
}  // namespace

void gated_rmsnorm_forward(
    const GatedRmsNormParams& p, TensorView x, TensorView gate, TensorView weight, TensorView y) {
    note_op_use("gated_rmsnorm");
    const Device device = op_device("gated_rmsnorm", {x, gate, weight, y});
    cpu::dispatch_float(x.dtype, "gated_rmsnorm", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "gated_rmsnorm: x"), Z = rows_of<T>(gate, "gated_rmsnorm: gate"),
                Y = rows_of<T>(y, "gated_rmsnorm: y");
        TESSERA_CHECK(Z.rows == X.rows && Z.cols == X.cols && Y.rows == X.rows && Y.cols == X.cols,
                      "gated_rmsnorm: gate and y must be shaped like x {}", x.shape.str());
        check_shape(weight, Shape{X.cols}, "gated_rmsnorm: weight");
        if (device == Device::cuda) return TESSERA_ON_CUDA(gated_rmsnorm_forward(p, x, gate, weight, y));
        const T* W = weight.ptr<T>();
        const int64_t D = X.cols;
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < X.rows; ++n) {
            const T* xr = X.row(n);
            const T* z = Z.row(n);
            const double ss = cpu::lane_sum<double>(D, [&](int64_t c) { return double(xr[c]) * double(xr[c]); });
            const T r = T(1.0 / std::sqrt(ss / double(D) + p.eps));
            T* yr = Y.row(n);
#pragma omp simd
            for (int64_t c = 0; c < D; ++c) yr[c] = xr[c] * r * W[c] * act(p.activation, z[c]);
        }
    });
}

void gated_rmsnorm_backward(const GatedRmsNormParams& p,
                            TensorView dy,
                            TensorView x,
                            TensorView gate,
                            TensorView weight,
                            TensorView dx,
                            TensorView dgate,
                            TensorView dweight) {
    const Device device = op_device("gated_rmsnorm", {dy, x, gate, weight, dx, dgate, dweight});
    cpu::dispatch_float(x.dtype, "gated_rmsnorm", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "gated_rmsnorm: x"), Z = rows_of<T>(gate, "gated_rmsnorm: gate"),
                DY = rows_of<T>(dy, "gated_rmsnorm: dy");
        TESSERA_CHECK(Z.rows == X.rows && Z.cols == X.cols && DY.rows == X.rows && DY.cols == X.cols,
                      "gated_rmsnorm: gate and dy must be shaped like x {}", x.shape.str());
        check_shape(weight, Shape{X.cols}, "gated_rmsnorm: weight");
        const int64_t D = X.cols, N = X.rows;
        for (const auto& [t, name] : {std::pair{dx, "gated_rmsnorm: dx"}, {dgate, "gated_rmsnorm: dgate"}}) {
            if (!t.defined()) continue;
            const Rows<T> R = rows_of<T>(t, name);
            TESSERA_CHECK(R.rows == N && R.cols == D, "{} must be shaped like x {}", name, x.shape.str());
        }
        if (dweight.defined()) check_shape(dweight, Shape{D}, "gated_rmsnorm: dweight");
        if (device == Device::cuda)
            return TESSERA_ON_CUDA(gated_rmsnorm_backward(p, dy, x, gate, weight, dx, dgate, dweight));
        const T* W = weight.ptr<T>();
        auto rstd = [&](const T* xr) {
            const double ss = cpu::lane_sum<double>(D, [&](int64_t c) { return double(xr[c]) * double(xr[c]); });
            return T(1.0 / std::sqrt(ss / double(D) + p.eps));
        };
        if (dx.defined() || dgate.defined()) {
            Rows<T> DX{}, DZ{};
            if (dx.defined()) DX = rows_of<T>(dx, "gated_rmsnorm: dx");
            if (dgate.defined()) DZ = rows_of<T>(dgate, "gated_rmsnorm: dgate");
#pragma omp parallel for schedule(static)
            for (int64_t n = 0; n < N; ++n) {
                const T* xr = X.row(n);
                const T* z = Z.row(n);
                const T* g = DY.row(n);
                const T r = rstd(xr);
                const T dot = cpu::lane_sum<T>(  // Σ dn·n with dn = dy·w·act(z), n = x·r
                    D, [&](int64_t c) { return g[c] * W[c] * act(p.activation, z[c]) * xr[c] * r; });
                const T mean = dot / T(D);
                if (DX.data) {
                    T* dxr = DX.row(n);
#pragma omp simd
                    for (int64_t c = 0; c < D; ++c)
                        dxr[c] += r * (g[c] * W[c] * act(p.activation, z[c]) - xr[c] * r * mean);
                }
                if (DZ.data) {
                    T* dzr = DZ.row(n);
#pragma omp simd
                    for (int64_t c = 0; c < D; ++c) dzr[c] += g[c] * (xr[c] * r) * W[c] * act_grad(p.activation, z[c]);
                }
            }
        }
        if (!dweight.defined()) return;
        T* DW = dweight.ptr<T>();
        // NOTES: rows summed in order per column block (deterministic): a task per 16 columns (one cache line of f32)
        // walks every row in order: fixed sums, and a head's 64 channels still make 4 tasks; each task recomputes its
        // rows' rstd (a vectorized row sum).
        constexpr int64_t kCols = 16;
#pragma omp parallel for schedule(static)
        for (int64_t c0 = 0; c0 < D; c0 += kCols) {
            const int64_t c1 = std::min(D, c0 + kCols);
            for (int64_t n = 0; n < N; ++n) {
                const T* xr = X.row(n);
                const T* g = DY.row(n);
                const T* z = Z.row(n);
                const T r = rstd(xr);
#pragma omp simd
                for (int64_t c = c0; c < c1; ++c) DW[c] += g[c] * xr[c] * r * act(p.activation, z[c]);
            }
        }
    });
}

}  // namespace tessera::ops
