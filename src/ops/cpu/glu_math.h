// Element math and row loops of the gated activations y = act(gate, up), shared by the swiglu and
// situ_glu ops and the MoE experts (which fuse them with the per-row gate):
//   SwiGLU    y = silu(g)·u
//   SiTU-GLU  y = β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)   (Kimi K3, ops/situ_glu.h)
// partials() gives ∂y/∂g and ∂y/∂u. Internal to ops/cpu.
#pragma once

#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"

namespace tessera::ops::cpu {

template <class T>
struct SwiGlu {
    T value(T g, T u) const { return g * vsigmoid(g) * u; }
    void partials(T g, T u, T& pg, T& pu) const {
        const T s = vsigmoid(g);
        pg = u * s * (T(1) + g * (T(1) - s));
        pu = g * s;
    }
};

template <class T>
struct SituGlu {
    T b, bl, ib, ibl;
    SituGlu(double beta, double linear_beta)
        : b(T(beta)), bl(T(linear_beta)), ib(T(1.0 / beta)), ibl(T(1.0 / linear_beta)) {}
    T value(T g, T u) const { return b * vtanh(g * ib) * vsigmoid(g) * (bl * vtanh(u * ibl)); }
    void partials(T g, T u, T& pg, T& pu) const {
        const T t = vtanh(g * ib), s = vsigmoid(g), tu = vtanh(u * ibl);
        pg = bl * tu * ((T(1) - t * t) * s + b * t * s * (T(1) - s));
        pu = b * t * s * (T(1) - tu * tu);
    }
};

template <class T>
void check_glu_shapes(const Rows<T>& g, const Rows<T>& other, std::string_view op, std::string_view what) {
    TESSERA_CHECK(g.rows == other.rows && g.cols == other.cols, "{}: {} is [{}, {}] but gate is [{}, {}]", op, what,
                  other.rows, other.cols, g.rows, g.cols);
}

// The CUDA path's shape checks (the CPU's row loops make the same ones): every tensor shaped like gate.
inline void check_like_gate(std::string_view op,
                            TensorView gate,
                            std::initializer_list<std::pair<const char*, TensorView>> others) {
    dispatch_float(gate.dtype, op, [&]<class T>(T) {
        const Rows<T> G = rows_of<T>(gate, op);
        for (const auto& [name, t] : others) check_glu_shapes(G, rows_of<T>(t, name), op, name);
    });
}

// y = act(gate, up) over [N, F] views (row-strided allowed)
template <class T, class Act>
void glu_forward(const Act& act, std::string_view op, TensorView gate, TensorView up, TensorView y) {
    Rows<T> G = rows_of<T>(gate, op), U = rows_of<T>(up, op), Y = rows_of<T>(y, op);
    check_glu_shapes(G, U, op, "up");
    check_glu_shapes(G, Y, op, "y");
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < G.rows; ++n) {
        const T* g = G.row(n);
        const T* u = U.row(n);
        T* yr = Y.row(n);
#pragma omp simd
        for (int64_t f = 0; f < G.cols; ++f) yr[f] = act.value(g[f], u[f]);
    }
}

// dgate += dy·∂y/∂g, dup += dy·∂y/∂u
template <class T, class Act>
void glu_backward(const Act& act,
                  std::string_view op,
                  TensorView dy,
                  TensorView gate,
                  TensorView up,
                  TensorView dgate,
                  TensorView dup) {
    Rows<T> G = rows_of<T>(gate, op), U = rows_of<T>(up, op), DY = rows_of<T>(dy, op), DG = rows_of<T>(dgate, op),
            DU = rows_of<T>(dup, op);
    check_glu_shapes(G, U, op, "up");
    check_glu_shapes(G, DY, op, "dy");
    check_glu_shapes(G, DG, op, "dgate");
    check_glu_shapes(G, DU, op, "dup");
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < G.rows; ++n) {
        const T* g = G.row(n);
        const T* u = U.row(n);
        const T* d = DY.row(n);
        T* dg = DG.row(n);
        T* du = DU.row(n);
#pragma omp simd
        for (int64_t f = 0; f < G.cols; ++f) {
            T pg, pu;
            act.partials(g[f], u[f], pg, pu);
            dg[f] += d[f] * pg;
            du[f] += d[f] * pu;
        }
    }
}

}  // namespace tessera::ops::cpu
