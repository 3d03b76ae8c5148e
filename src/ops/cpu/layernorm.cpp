// LayerNorm forward/backward: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU kernels. Row
// statistics in double; dw and db reduced over rows in row order per column block (deterministic, independent of
// the thread count).
#include "ops/layernorm.h"

#include <cmath>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Rows;
using cpu::rows_of;

void layernorm_forward(const LayerNormParams& p,
                       TensorView x,
                       TensorView w,
                       TensorView b,
                       TensorView y,
                       TensorView mean,
                       TensorView rstd) {
    note_op_use("layernorm");
    const Device device = op_device("layernorm", {x, w, b, y, mean, rstd});
    dispatch_float(x.dtype, "layernorm", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "layernorm: x"), Y = rows_of<T>(y, "layernorm: y");
        TESSERA_CHECK(X.rows == Y.rows && X.cols == Y.cols, "layernorm: y {} must be shaped like x {}", y.shape.str(),
                      x.shape.str());
        const int64_t D = X.cols;
        check_shape(w, Shape{D}, "layernorm: weight");
        check_shape(b, Shape{D}, "layernorm: bias");
        check_shape(mean, Shape{X.rows}, "layernorm: mean");
        check_shape(rstd, Shape{X.rows}, "layernorm: rstd");
        if (device == Device::cuda) return TESSERA_ON_CUDA(layernorm_forward(p, x, w, b, y, mean, rstd));
        const T *W = w.ptr<T>(), *Bias = b.ptr<T>();
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < X.rows; ++n) {
            const T* xr = X.row(n);
            double s = 0.0;
            for (int64_t d = 0; d < D; ++d) s += double(xr[d]);
            const double mu = s / double(D);
            double ss = 0.0;
            for (int64_t d = 0; d < D; ++d) ss += (double(xr[d]) - mu) * (double(xr[d]) - mu);
            const T m = T(mu), r = T(1.0 / std::sqrt(ss / double(D) + p.eps));
            mean.ptr<T>()[n] = m;
            rstd.ptr<T>()[n] = r;
            T* yr = Y.row(n);
            for (int64_t d = 0; d < D; ++d) yr[d] = (xr[d] - m) * r * W[d] + Bias[d];
        }
    });
}

void layernorm_backward(const LayerNormParams& p,
                        TensorView dy,
                        TensorView x,
                        TensorView w,
                        TensorView mean,
                        TensorView rstd,
                        TensorView dx,
                        TensorView dw,
                        TensorView db) {
    const Device device = op_device("layernorm", {dy, x, w, mean, rstd, dx, dw, db});
    dispatch_float(x.dtype, "layernorm", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "layernorm: x"), DY = rows_of<T>(dy, "layernorm: dy");
        TESSERA_CHECK(X.rows == DY.rows && X.cols == DY.cols, "layernorm: dy {} must be shaped like x {}",
                      dy.shape.str(), x.shape.str());
        const int64_t D = X.cols;
        check_shape(w, Shape{D}, "layernorm: weight");
        check_shape(mean, Shape{X.rows}, "layernorm: mean");
        check_shape(rstd, Shape{X.rows}, "layernorm: rstd");
        if (dx.defined()) {
            Rows<T> DX = rows_of<T>(dx, "layernorm: dx");
            TESSERA_CHECK(DX.rows == X.rows && DX.cols == D, "layernorm: dx must be shaped like x {}", x.shape.str());
        }
        TESSERA_CHECK(dw.defined() == db.defined(), "layernorm: dweight and dbias go together");
        if (dw.defined()) {
            check_shape(dw, Shape{D}, "layernorm: dweight");
            check_shape(db, Shape{D}, "layernorm: dbias");
        }
        if (device == Device::cuda) return TESSERA_ON_CUDA(layernorm_backward(p, dy, x, w, mean, rstd, dx, dw, db));
        const T *W = w.ptr<T>(), *M = mean.ptr<T>(), *R = rstd.ptr<T>();
        if (dx.defined()) {
            Rows<T> DX = rows_of<T>(dx, "layernorm: dx");
#pragma omp parallel for schedule(static)
            for (int64_t n = 0; n < X.rows; ++n) {
                const T* xr = X.row(n);
                const T* dyr = DY.row(n);
                double sg = 0.0, sgx = 0.0;  // Σ g, Σ g∘x̂
                for (int64_t d = 0; d < D; ++d) {
                    const double g = double(dyr[d]) * double(W[d]);
                    sg += g;
                    sgx += g * (double(xr[d]) - double(M[n])) * double(R[n]);
                }
                const T mg = T(sg / double(D)), mgx = T(sgx / double(D));
                T* dxr = DX.row(n);
                for (int64_t d = 0; d < D; ++d) dxr[d] += R[n] * (dyr[d] * W[d] - mg - (xr[d] - M[n]) * R[n] * mgx);
            }
        }
        if (!dw.defined()) return;  // a frozen weight and bias
        T *DW = dw.ptr<T>(), *DB = db.ptr<T>();
        constexpr int64_t kCols = 64;
#pragma omp parallel for schedule(static)
        for (int64_t c0 = 0; c0 < D; c0 += kCols) {
            const int64_t c1 = std::min(D, c0 + kCols);
            for (int64_t n = 0; n < X.rows; ++n) {
                const T* xr = X.row(n);
                const T* dyr = DY.row(n);
                for (int64_t c = c0; c < c1; ++c) {
                    DW[c] += dyr[c] * (xr[c] - M[n]) * R[n];
                    DB[c] += dyr[c];
                }
            }
        }
    });
}

}  // namespace tessera::ops
