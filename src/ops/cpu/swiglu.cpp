// SwiGLU forward/backward on the CPU (elementwise).
#include "ops/swiglu.h"

#include <cmath>

#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Rows;
using cpu::rows_of;

namespace {
template <class T>
void check_same(const Rows<T>& a, const Rows<T>& b, std::string_view what) {
    TESSERA_CHECK(a.rows == b.rows && a.cols == b.cols, "swiglu: {} is [{}, {}] but gate is [{}, {}]", what, b.rows,
                  b.cols, a.rows, a.cols);
}
}  // namespace

void swiglu_forward(TensorView gate, TensorView up, TensorView y) {
    dispatch_float(gate.dtype, "swiglu", [&]<class T>(T) {
        Rows<T> G = rows_of<T>(gate, "swiglu: gate"), U = rows_of<T>(up, "swiglu: up"), Y = rows_of<T>(y, "swiglu: y");
        check_same(G, U, "up");
        check_same(G, Y, "y");
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < G.rows; ++n) {
            const T* g = G.row(n);
            const T* u = U.row(n);
            T* yr = Y.row(n);
#pragma omp simd
            for (int64_t f = 0; f < G.cols; ++f) yr[f] = g[f] * cpu::vsigmoid(g[f]) * u[f];
        }
    });
}

void swiglu_backward(TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup) {
    dispatch_float(gate.dtype, "swiglu", [&]<class T>(T) {
        Rows<T> G = rows_of<T>(gate, "swiglu: gate"), U = rows_of<T>(up, "swiglu: up");
        Rows<T> DY = rows_of<T>(dy, "swiglu: dy"), DG = rows_of<T>(dgate, "swiglu: dgate"),
                DU = rows_of<T>(dup, "swiglu: dup");
        check_same(G, U, "up");
        check_same(G, DY, "dy");
        check_same(G, DG, "dgate");
        check_same(G, DU, "dup");
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < G.rows; ++n) {
            const T* g = G.row(n);
            const T* u = U.row(n);
            const T* d = DY.row(n);
            T* dg = DG.row(n);
            T* du = DU.row(n);
#pragma omp simd
            for (int64_t f = 0; f < G.cols; ++f) {
                const T s = cpu::vsigmoid(g[f]);
                dg[f] += d[f] * u[f] * s * (T(1) + g[f] * (T(1) - s));
                du[f] += d[f] * g[f] * s;
            }
        }
    });
}

}  // namespace tessera::ops
