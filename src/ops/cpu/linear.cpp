// Linear forward/backward: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU's GEMMs plus a
// bias pass. Math: y = x·wᵀ + b;
// dx += dy·w, dw += dyᵀ·x, db += Σ_rows dy (summed in row order for determinism).
#include "ops/linear.h"

#include <algorithm>
#include <chrono>

#include "core/device.h"
#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/gemm.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Rows;
using cpu::rows_of;

void linear_forward(const LinearParams& p, TensorView x, TensorView w, TensorView b, TensorView y) {
    note_op_use("linear");
    const Device device = op_device("linear", {x, w, b, y});
    dispatch_float(x.dtype, "linear", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "linear: x");
        Rows<T> Y = rows_of<T>(y, "linear: y");
        check_contiguous(w, "linear: w");
        TESSERA_CHECK(w.ndim() == 2 && w.size(1) == X.cols && w.size(0) == Y.cols && X.rows == Y.rows,
                      "linear: x {} and w {} do not give y {}", x.shape.str(), w.shape.str(), y.shape.str());
        if (b.defined()) check_shape(b, Shape{Y.cols}, "linear: b");
        if (device == Device::cuda) return TESSERA_ON_CUDA(linear_forward(p, x, w, b, y));
        cpu::with_weight<T>(w, "linear", [&](auto W) {
            gemm(Trans::N, Trans::T, X.rows, Y.cols, X.cols, T(1), X.data, X.ld, W, X.cols, p.accumulate ? T(1) : T(0),
                 Y.data, Y.ld);
        });
        if (b.defined()) {
            const T* B = b.ptr<T>();
#pragma omp parallel for schedule(static)
            for (int64_t r = 0; r < Y.rows; ++r) {
                T* yr = Y.row(r);
                for (int64_t c = 0; c < Y.cols; ++c) yr[c] += B[c];
            }
        }
    });
}

void linear_backward(TensorView dy, TensorView x, TensorView w, TensorView dx, TensorView dw, TensorView db) {
    const Device device = op_device("linear", {dy, x, w, dx, dw, db});
    dispatch_float(x.dtype, "linear", [&]<class T>(T) {
        Rows<T> DY = rows_of<T>(dy, "linear: dy");
        Rows<T> X = rows_of<T>(x, "linear: x");
        check_shape(w, Shape{DY.cols, X.cols}, "linear: w");
        check_contiguous(w, "linear: w");
        TESSERA_CHECK(DY.rows == X.rows, "linear: dy has {} rows but x has {}", DY.rows, X.rows);
        if (dx.defined()) {
            Rows<T> DX = rows_of<T>(dx, "linear: dx");
            TESSERA_CHECK(DX.rows == X.rows && DX.cols == X.cols, "linear: dx must be shaped like x {}", x.shape.str());
        }
        if (dw.defined()) {
            check_shape(dw, w.shape, "linear: dw");
            check_contiguous(dw, "linear: dw");
        }
        if (db.defined()) check_shape(db, Shape{DY.cols}, "linear: db");
        if (device == Device::cuda) return TESSERA_ON_CUDA(linear_backward(dy, x, w, dx, dw, db));
        if (dx.defined()) {
            Rows<T> DX = rows_of<T>(dx, "linear: dx");
            cpu::with_weight<T>(w, "linear", [&](auto W) {
                gemm(Trans::N, Trans::N, X.rows, X.cols, DY.cols, T(1), DY.data, DY.ld, W, X.cols, T(1), DX.data,
                     DX.ld);
            });
        }
        if (dw.defined()) {  // absent for a frozen weight (w is not read: a trained one may be its bf16 copy)
            gemm(Trans::T, Trans::N, DY.cols, X.cols, X.rows, T(1), DY.data, DY.ld, X.data, X.ld, T(1), dw.ptr<T>(),
                 X.cols);
        }
        if (db.defined()) {
            T* DB = db.ptr<T>();
            // NOTES: parallel over columns, rows summed in order: the same bits on any thread count.
#pragma omp parallel for schedule(static)
            for (int64_t c0 = 0; c0 < DY.cols; c0 += 16) {
                const int64_t c1 = std::min<int64_t>(DY.cols, c0 + 16);
                for (int64_t r = 0; r < DY.rows; ++r) {
                    const T* dyr = DY.row(r);
                    for (int64_t c = c0; c < c1; ++c) DB[c] += dyr[c];
                }
            }
        }
    });
}

double measure_linear_gflops(Device device, int64_t max_n) {
    for (int64_t n = std::min<int64_t>(512, max_n);; n = std::min(2 * n, max_n)) {
        Tensor x(DType::f32, Shape{n, n}, device), w(DType::f32, Shape{n, n}, device),
            y(DType::f32, Shape{n, n}, device);
        linear_forward({}, x, w, {}, y);  // warm up
        synchronize(device);
        double best = 0, fastest = 1e30;
        for (int r = 0; r < 5; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            linear_forward({}, x, w, {}, y);
            synchronize(device);
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            best = std::max(best, linear_forward_flops(n, n, n) / s / 1e9);
            fastest = std::min(fastest, s);
        }
        if (n >= max_n || fastest >= 0.02) return best;
    }
}

}  // namespace tessera::ops
