// RMSNorm forward/backward: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU kernels. Row
// statistics in double for f32 inputs (one extra cast per row, no measurable cost); dw is reduced over rows in row
// order (deterministic).
#include "ops/rmsnorm.h"

#include <cmath>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Rows;
using cpu::rows_of;

void rmsnorm_forward(const RmsNormParams& p, TensorView x, TensorView w, TensorView y, TensorView rstd) {
    note_op_use("rmsnorm");
    const Device device = op_device("rmsnorm", {x, w, y, rstd});
    dispatch_float(x.dtype, "rmsnorm", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "rmsnorm: x"), Y = rows_of<T>(y, "rmsnorm: y");
        TESSERA_CHECK(X.rows == Y.rows && X.cols == Y.cols, "rmsnorm: y {} must be shaped like x {}", y.shape.str(),
                      x.shape.str());
        check_shape(w, Shape{X.cols}, "rmsnorm: weight");
        check_shape(rstd, Shape{X.rows}, "rmsnorm: rstd");
        if (device == Device::cuda) return TESSERA_ON_CUDA(rmsnorm_forward(p, x, w, y, rstd));
        const T* W = w.ptr<T>();
        T* R = rstd.ptr<T>();
        const int64_t D = X.cols;
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < X.rows; ++n) {
            const T* xr = X.row(n);
            const double ss = cpu::lane_sum<double>(D, [&](int64_t d) { return double(xr[d]) * double(xr[d]); });
            const T r = T(1.0 / std::sqrt(ss / double(D) + p.eps));
            R[n] = r;
            T* yr = Y.row(n);
            for (int64_t d = 0; d < D; ++d) yr[d] = xr[d] * r * W[d];
        }
    });
}

void rmsnorm_backward(
    const RmsNormParams& p, TensorView dy, TensorView x, TensorView w, TensorView rstd, TensorView dx, TensorView dw) {
    const Device device = op_device("rmsnorm", {dy, x, w, rstd, dx, dw});
    dispatch_float(x.dtype, "rmsnorm", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "rmsnorm: x"), DY = rows_of<T>(dy, "rmsnorm: dy");
        TESSERA_CHECK(X.rows == DY.rows && X.cols == DY.cols, "rmsnorm: dy {} must be shaped like x {}", dy.shape.str(),
                      x.shape.str());
        check_shape(w, Shape{X.cols}, "rmsnorm: weight");
        check_shape(rstd, Shape{X.rows}, "rmsnorm: rstd");
        const int64_t D = X.cols;
        if (dx.defined()) {
            Rows<T> DX = rows_of<T>(dx, "rmsnorm: dx");
            TESSERA_CHECK(DX.rows == X.rows && DX.cols == D, "rmsnorm: dx must be shaped like x {}", x.shape.str());
        }
        if (dw.defined()) check_shape(dw, Shape{D}, "rmsnorm: dweight");
        if (device == Device::cuda) return TESSERA_ON_CUDA(rmsnorm_backward(p, dy, x, w, rstd, dx, dw));
        const T* W = w.ptr<T>();
        const T* R = rstd.ptr<T>();
        if (dx.defined()) {
            Rows<T> DX = rows_of<T>(dx, "rmsnorm: dx");
#pragma omp parallel for schedule(static)
            for (int64_t n = 0; n < X.rows; ++n) {
                const T* xr = X.row(n);
                const T* dyr = DY.row(n);
                const T r = R[n];
                const double dot = cpu::lane_sum<double>(  // Σ g∘x̂
                    D, [&](int64_t d) { return double(dyr[d] * W[d]) * double(xr[d] * r); });
                const T mean = T(dot / double(D));
                T* dxr = DX.row(n);
                for (int64_t d = 0; d < D; ++d) dxr[d] += r * (dyr[d] * W[d] - xr[d] * r * mean);
            }
        }
        if (!dw.defined()) return;  // a frozen weight
        T* DW = dw.ptr<T>();
        constexpr int64_t kCols = 64;
#pragma omp parallel for schedule(static)
        for (int64_t c0 = 0; c0 < D; c0 += kCols) {
            const int64_t c1 = std::min(D, c0 + kCols);
            for (int64_t n = 0; n < X.rows; ++n) {
                const T* xr = X.row(n);
                const T* dyr = DY.row(n);
                const T r = R[n];
                for (int64_t c = c0; c < c1; ++c) DW[c] += dyr[c] * xr[c] * r;
            }
        }
    });
}

}  // namespace tessera::ops
