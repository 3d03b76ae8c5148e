// L2 normalisation forward/backward: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU kernels.
#include "ops/l2norm.h"

#include <cmath>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::Rows;
using cpu::rows_of;

void l2norm_forward(const L2NormParams& p, TensorView x, TensorView y) {
    note_op_use("l2norm");
    const Device device = op_device("l2norm", {x, y});
    cpu::dispatch_float(x.dtype, "l2norm", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "l2norm: x"), Y = rows_of<T>(y, "l2norm: y");
        TESSERA_CHECK(X.rows == Y.rows && X.cols == Y.cols, "l2norm: y must be shaped like x {}", x.shape.str());
        if (device == Device::cuda) return TESSERA_ON_CUDA(l2norm_forward(p, x, y));
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < X.rows; ++n) {
            const T* xr = X.row(n);
            const double ss = cpu::lane_sum<double>(X.cols, [&](int64_t c) { return double(xr[c]) * double(xr[c]); });
            const T rho = T(1.0 / std::sqrt(ss + p.eps));
            T* yr = Y.row(n);
#pragma omp simd
            for (int64_t c = 0; c < X.cols; ++c) yr[c] = xr[c] * rho;
        }
    });
}

void l2norm_backward(const L2NormParams& p, TensorView dy, TensorView x, TensorView dx) {
    const Device device = op_device("l2norm", {dy, x, dx});
    cpu::dispatch_float(x.dtype, "l2norm", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "l2norm: x"), DY = rows_of<T>(dy, "l2norm: dy"), DX = rows_of<T>(dx, "l2norm: dx");
        TESSERA_CHECK(X.rows == DY.rows && X.cols == DY.cols && X.rows == DX.rows && X.cols == DX.cols,
                      "l2norm: dy and dx must be shaped like x {}", x.shape.str());
        if (device == Device::cuda) return TESSERA_ON_CUDA(l2norm_backward(p, dy, x, dx));
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < X.rows; ++n) {
            const T* xr = X.row(n);
            const T* g = DY.row(n);
            const double ss = cpu::lane_sum<double>(X.cols, [&](int64_t c) { return double(xr[c]) * double(xr[c]); });
            const T rho = T(1.0 / std::sqrt(ss + p.eps));
            const T ydy = cpu::lane_sum<T>(X.cols, [&](int64_t c) { return xr[c] * rho * g[c]; });
            T* d = DX.row(n);
#pragma omp simd
            for (int64_t c = 0; c < X.cols; ++c) d[c] += rho * (g[c] - xr[c] * rho * ydy);
        }
    });
}

}  // namespace tessera::ops
