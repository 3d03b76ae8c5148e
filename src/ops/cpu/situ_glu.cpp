// SiTU-GLU forward/backward on the CPU (elementwise, vectorized tanh and sigmoid).
#include "ops/situ_glu.h"

#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Rows;
using cpu::rows_of;

namespace {
template <class T>
void check_same(const Rows<T>& a, const Rows<T>& b, std::string_view what) {
    TESSERA_CHECK(a.rows == b.rows && a.cols == b.cols, "situ_glu: {} is [{}, {}] but gate is [{}, {}]", what, b.rows,
                  b.cols, a.rows, a.cols);
}
}  // namespace

void situ_glu_forward(const SituParams& p, TensorView gate, TensorView up, TensorView y) {
    dispatch_float(gate.dtype, "situ_glu", [&]<class T>(T) {
        Rows<T> G = rows_of<T>(gate, "situ_glu: gate"), U = rows_of<T>(up, "situ_glu: up"),
                Y = rows_of<T>(y, "situ_glu: y");
        check_same(G, U, "up");
        check_same(G, Y, "y");
        const T b = T(p.beta), bl = T(p.linear_beta), ib = T(1.0 / p.beta), ibl = T(1.0 / p.linear_beta);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < G.rows; ++n) {
            const T* g = G.row(n);
            const T* u = U.row(n);
            T* yr = Y.row(n);
#pragma omp simd
            for (int64_t f = 0; f < G.cols; ++f) {
                yr[f] = b * cpu::vtanh(g[f] * ib) * cpu::vsigmoid(g[f]) * (bl * cpu::vtanh(u[f] * ibl));
            }
        }
    });
}

void situ_glu_backward(
    const SituParams& p, TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup) {
    dispatch_float(gate.dtype, "situ_glu", [&]<class T>(T) {
        Rows<T> G = rows_of<T>(gate, "situ_glu: gate"), U = rows_of<T>(up, "situ_glu: up");
        Rows<T> DY = rows_of<T>(dy, "situ_glu: dy"), DG = rows_of<T>(dgate, "situ_glu: dgate"),
                DU = rows_of<T>(dup, "situ_glu: dup");
        check_same(G, U, "up");
        check_same(G, DY, "dy");
        check_same(G, DG, "dgate");
        check_same(G, DU, "dup");
        const T b = T(p.beta), bl = T(p.linear_beta), ib = T(1.0 / p.beta), ibl = T(1.0 / p.linear_beta);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < G.rows; ++n) {
            const T* g = G.row(n);
            const T* u = U.row(n);
            const T* d = DY.row(n);
            T* dg = DG.row(n);
            T* du = DU.row(n);
#pragma omp simd
            for (int64_t f = 0; f < G.cols; ++f) {
                const T t = cpu::vtanh(g[f] * ib), s = cpu::vsigmoid(g[f]), tu = cpu::vtanh(u[f] * ibl);
                const T Gv = b * t * s, Uv = bl * tu;
                dg[f] += d[f] * Uv * ((T(1) - t * t) * s + b * t * s * (T(1) - s));
                du[f] += d[f] * Gv * (T(1) - tu * tu);
            }
        }
    });
}

}  // namespace tessera::ops
