// LoRA's low-rank update (see ops/lora.h): the entry points (checks, then CUDA tensors to ops/cuda; the grouped
// form is CPU-only for now) and the CPU's two thin GEMMs each way, every one of them deterministic.
#include "ops/lora.h"

#include "core/check.h"
#include "core/mix64.h"
#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/gemm.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Rows;
using cpu::rows_of;

namespace {

struct Dims {
    int64_t N = 0, in = 0, out = 0, r = 0;
};

// a [(E,) r, IN], b [(E,) OUT, r], x [N, IN], y [N, OUT], u (and du) [N, r]; grads like their values
Dims check(TensorView x, TensorView y, TensorView a, TensorView b, TensorView u, bool grouped, const char* what) {
    const int nd = grouped ? 3 : 2;
    TESSERA_CHECK(a.ndim() == nd && b.ndim() == nd, "{}: A and B must be {}-D, not {} and {}", what, nd, a.shape.str(),
                  b.shape.str());
    TESSERA_CHECK(!grouped || a.size(0) == b.size(0), "{}: A {} and B {} hold different numbers of experts", what,
                  a.shape.str(), b.shape.str());
    check_contiguous(a, what);
    check_contiguous(b, what);
    check_contiguous(u, what);
    Dims d{x.size(0), a.size(-1), b.size(-2), a.size(-2)};
    TESSERA_CHECK(b.size(-1) == d.r, "{}: B {} must have A's rank {} columns", what, b.shape.str(), d.r);
    TESSERA_CHECK(x.ndim() == 2 && x.size(1) == d.in, "{}: x {} must be [N, {}]", what, x.shape.str(), d.in);
    TESSERA_CHECK(y.ndim() == 2 && y.size(0) == d.N && y.size(1) == d.out, "{}: {} must be [{}, {}]", what,
                  y.shape.str(), d.N, d.out);
    TESSERA_CHECK(u.numel() >= d.N * d.r, "{}: scratch u holds {} values, {} needed", what, u.numel(), d.N * d.r);
    TESSERA_CHECK(x.dtype == a.dtype && y.dtype == a.dtype && b.dtype == a.dtype && u.dtype == a.dtype,
                  "{}: every tensor must share one dtype", what);
    return d;
}

void check_grad(TensorView g, TensorView v, const char* what) {
    if (!g.defined()) return;
    check_shape(g, v.shape, what);
    check_contiguous(g, what);
}

template <class T>
void scale_rows(T* p, int64_t n, T s) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) p[i] *= s;
}

// With dropout, the scratch xd holds x̃ [N, IN] (contiguous)
void check_dropout_scratch(const LoraParams& p, const TensorView& xd, const Dims& d) {
    if (!p.drops()) return;
    TESSERA_CHECK(xd.defined() && xd.numel() >= d.N * d.in, "lora: dropout needs scratch xd of [{}, {}]", d.N, d.in);
    check_contiguous(xd, "lora: xd");
}

// x̃ = x ⊙ m / (1 − p) into xd [N, IN] (contiguous), and out pointing at it
template <class T>
void drop_input(const LoraParams& p, const Rows<T>& X, TensorView xd, int64_t N, int64_t in, Rows<T>& out) {
    T* dst = xd.ptr<T>();
    const T s = T(1.0 / (1.0 - p.dropout));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const T* xr = X.row(n);
        for (int64_t i = 0; i < in; ++i) dst[n * in + i] = lora_keep(p, uint64_t(n * in + i)) ? xr[i] * s : T(0);
    }
    out = Rows<T>{dst, N, in, in};
}
}  // namespace

bool lora_keep(const LoraParams& p, uint64_t index) { return dropout_keep(p.seed, p.stream, index, p.dropout); }

void lora_forward(
    const LoraParams& p, TensorView x, TensorView a, TensorView b, TensorView u, TensorView y, TensorView xd) {
    note_op_use("lora");
    const Device device = op_device("lora", {x, a, b, u, y, xd});
    const Dims d = check(x, y, a, b, u, false, "lora");
    check_dropout_scratch(p, xd, d);
    if (device == Device::cuda) return TESSERA_ON_CUDA(lora_forward(p, x, a, b, u, y, xd));
    dispatch_float(a.dtype, "lora", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "lora: x");
        const Rows<T> Y = rows_of<T>(y, "lora: y");
        if (p.drops()) drop_input(p, X, xd, d.N, d.in, X);
        T* U = u.ptr<T>();
        gemm(Trans::N, Trans::T, d.N, d.r, d.in, T(1), X.data, X.ld, a.ptr<T>(), d.in, T(0), U, d.r);
        gemm(Trans::N, Trans::T, d.N, d.out, d.r, T(p.scale), U, d.r, b.ptr<T>(), d.r, T(1), Y.data, Y.ld);
    });
}

void lora_backward(const LoraParams& p,
                   TensorView x,
                   TensorView dy,
                   TensorView a,
                   TensorView b,
                   TensorView u,
                   TensorView du,
                   TensorView dx,
                   TensorView da,
                   TensorView db,
                   TensorView xd) {
    const Device device = op_device("lora", {x, dy, a, b, u, du, dx, da, db, xd});
    const Dims d = check(x, dy, a, b, u, false, "lora");
    TESSERA_CHECK(du.numel() >= d.N * d.r && du.dtype == a.dtype, "lora: scratch du must hold [{}, {}]", d.N, d.r);
    check_contiguous(du, "lora: du");
    check_grad(da, a, "lora: dA");
    check_grad(db, b, "lora: dB");
    if (dx.defined()) check_shape(dx, x.shape, "lora: dx");
    check_dropout_scratch(p, xd, d);
    if (device == Device::cuda) return TESSERA_ON_CUDA(lora_backward(p, x, dy, a, b, u, du, dx, da, db, xd));
    dispatch_float(a.dtype, "lora", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(x, "lora: x");
        const Rows<T> DY = rows_of<T>(dy, "lora: dy");
        if (p.drops()) drop_input(p, X, xd, d.N, d.in, X);  // the x̃ forward read
        T *U = u.ptr<T>(), *DU = du.ptr<T>();
        const T s = T(p.scale);
        if (db.defined()) {
            gemm(Trans::N, Trans::T, d.N, d.r, d.in, T(1), X.data, X.ld, a.ptr<T>(), d.in, T(0), U, d.r);
            gemm(Trans::T, Trans::N, d.out, d.r, d.N, s, DY.data, DY.ld, U, d.r, T(1), db.ptr<T>(), d.r);
        }
        gemm(Trans::N, Trans::N, d.N, d.r, d.out, s, DY.data, DY.ld, b.ptr<T>(), d.r, T(0), DU, d.r);
        if (da.defined())
            gemm(Trans::T, Trans::N, d.r, d.in, d.N, T(1), DU, d.r, X.data, X.ld, T(1), da.ptr<T>(), d.in);
        if (!dx.defined()) return;
        const Rows<T> DX = rows_of<T>(dx, "lora: dx");
        if (!p.drops()) {
            gemm(Trans::N, Trans::N, d.N, d.in, d.r, T(1), DU, d.r, a.ptr<T>(), d.in, T(1), DX.data, DX.ld);
            return;
        }
        // dx += (du·A) ⊙ m / (1 − p), du·A into xd (free again)
        T* g = xd.ptr<T>();
        gemm(Trans::N, Trans::N, d.N, d.in, d.r, T(1), DU, d.r, a.ptr<T>(), d.in, T(0), g, d.in);
        const T k = T(1.0 / (1.0 - p.dropout));
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < d.N; ++n) {
            T* dxr = DX.row(n);
            for (int64_t i = 0; i < d.in; ++i)
                if (lora_keep(p, uint64_t(n * d.in + i))) dxr[i] += g[n * d.in + i] * k;
        }
    });
}

void lora_grouped_forward(
    const LoraParams& p, const ExpertRows& g, TensorView x, TensorView a, TensorView b, TensorView u, TensorView y) {
    note_op_use("lora_experts");
    const Device device = op_device("lora_experts", {x, a, b, u, y});
    const Dims d = check(x, y, a, b, u, true, "lora (experts)");
    TESSERA_CHECK(a.size(0) == g.experts, "lora (experts): A holds {} experts, the rows {}", a.size(0), g.experts);
    if (device == Device::cuda) return TESSERA_ON_CUDA(lora_grouped_forward(p, g, x, a, b, u, y));
    dispatch_float(a.dtype, "lora (experts)", [&]<class T>(T) {
        const Rows<T> X = rows_of<T>(x, "lora: x"), Y = rows_of<T>(y, "lora: y");
        T* U = u.ptr<T>();
        // u = s·x·A_eᵀ (the grouped GEMM has no alpha: the r-wide u is scaled instead), y += u·B_eᵀ
        grouped_gemm(Trans::T, g, d.r, d.in, X.data, X.ld, a.ptr<T>(), d.r * d.in, d.in, T(0), U, d.r);
        scale_rows(U, d.N * d.r, T(p.scale));
        grouped_gemm(Trans::T, g, d.out, d.r, U, d.r, b.ptr<T>(), d.out * d.r, d.r, T(1), Y.data, Y.ld);
    });
}

void lora_grouped_backward(const LoraParams& p,
                           const ExpertRows& g,
                           TensorView x,
                           TensorView dy,
                           TensorView a,
                           TensorView b,
                           TensorView u,
                           TensorView du,
                           TensorView dx,
                           TensorView da,
                           TensorView db) {
    const Device device = op_device("lora_experts", {x, dy, a, b, u, du, dx, da, db});
    const Dims d = check(x, dy, a, b, u, true, "lora (experts)");
    TESSERA_CHECK(a.size(0) == g.experts, "lora (experts): A holds {} experts, the rows {}", a.size(0), g.experts);
    TESSERA_CHECK(du.numel() >= d.N * d.r && du.dtype == a.dtype, "lora (experts): scratch du must hold [{}, {}]", d.N,
                  d.r);
    check_grad(da, a, "lora (experts): dA");
    check_grad(db, b, "lora (experts): dB");
    if (dx.defined()) check_shape(dx, x.shape, "lora (experts): dx");
    if (device == Device::cuda) return TESSERA_ON_CUDA(lora_grouped_backward(p, g, x, dy, a, b, u, du, dx, da, db));
    dispatch_float(a.dtype, "lora (experts)", [&]<class T>(T) {
        const Rows<T> X = rows_of<T>(x, "lora: x"), DY = rows_of<T>(dy, "lora: dy");
        T *U = u.ptr<T>(), *DU = du.ptr<T>();
        const T s = T(p.scale);
        if (db.defined()) {  // dB_e += dy_eᵀ·(s·u_e)
            grouped_gemm(Trans::T, g, d.r, d.in, X.data, X.ld, a.ptr<T>(), d.r * d.in, d.in, T(0), U, d.r);
            scale_rows(U, d.N * d.r, s);
            grouped_gemm_wgrad(g, d.out, d.r, DY.data, DY.ld, U, d.r, db.ptr<T>(), d.out * d.r, d.r);
        }
        // du = s·dy·B_e
        grouped_gemm(Trans::N, g, d.r, d.out, DY.data, DY.ld, b.ptr<T>(), d.out * d.r, d.r, T(0), DU, d.r);
        scale_rows(DU, d.N * d.r, s);
        if (da.defined()) grouped_gemm_wgrad(g, d.r, d.in, DU, d.r, X.data, X.ld, da.ptr<T>(), d.r * d.in, d.in);
        if (dx.defined()) {
            const Rows<T> DX = rows_of<T>(dx, "lora: dx");
            grouped_gemm(Trans::N, g, d.in, d.r, DU, d.r, a.ptr<T>(), d.r * d.in, d.in, T(1), DX.data, DX.ld);
        }
    });
}

void lora_merge(const LoraParams& p, TensorView w, TensorView a, TensorView b, TensorView out) {
    const Device device = op_device("lora", {w, a, b, out});
    TESSERA_CHECK(w.ndim() == 2 && a.ndim() == 2 && b.ndim() == 2 && a.size(1) == w.size(1) && b.size(0) == w.size(0) &&
                      b.size(1) == a.size(0),
                  "lora merge: w {} needs A [r, {}] and B [{}, r], not {} and {}", w.shape.str(), w.size(-1), w.size(0),
                  a.shape.str(), b.shape.str());
    check_shape(out, w.shape, "lora merge: out");
    for (const TensorView* t : {&w, &a, &b, &out}) {
        check_contiguous(*t, "lora merge");
        TESSERA_CHECK(t->dtype == w.dtype, "lora merge: every tensor must share one dtype");
    }
    if (device == Device::cuda) return TESSERA_ON_CUDA(lora_merge(p, w, a, b, out));
    dispatch_float(w.dtype, "lora merge", [&]<class T>(T) {
        const int64_t n = w.numel();
        if (out.data != w.data) std::copy_n(w.ptr<T>(), n, out.ptr<T>());
        gemm(Trans::N, Trans::N, w.size(0), w.size(1), a.size(0), T(p.scale), b.ptr<T>(), a.size(0), a.ptr<T>(),
             w.size(1), T(1), out.ptr<T>(), w.size(1));
    });
}

void lora_weight_backward(
    const LoraParams& p, TensorView dw, TensorView a, TensorView b, TensorView da, TensorView db) {
    const Device device = op_device("lora", {dw, a, b, da, db});
    TESSERA_CHECK(dw.ndim() == 2 && a.ndim() == 2 && b.ndim() == 2 && a.size(1) == dw.size(1) &&
                      b.size(0) == dw.size(0) && b.size(1) == a.size(0),
                  "lora: dW {} needs A [r, {}] and B [{}, r], not {} and {}", dw.shape.str(), dw.size(-1), dw.size(0),
                  a.shape.str(), b.shape.str());
    const int64_t out = dw.size(0), in = dw.size(1), r = a.size(0);
    check_grad(da, a, "lora: dA");
    check_grad(db, b, "lora: dB");
    check_contiguous(dw, "lora: dW");
    check_contiguous(a, "lora: A");
    check_contiguous(b, "lora: B");
    if (device == Device::cuda) return TESSERA_ON_CUDA(lora_weight_backward(p, dw, a, b, da, db));
    dispatch_float(dw.dtype, "lora", [&]<class T>(T) {
        if (da.defined())
            gemm(Trans::T, Trans::N, r, in, out, T(p.scale), b.ptr<T>(), r, dw.ptr<T>(), in, T(1), da.ptr<T>(), in);
        if (db.defined())
            gemm(Trans::N, Trans::T, out, r, in, T(p.scale), dw.ptr<T>(), in, a.ptr<T>(), in, T(1), db.ptr<T>(), r);
    });
}

double lora_forward_flops(int64_t tokens, int64_t in, int64_t out, int64_t rank) {
    return 2.0 * double(tokens) * double(rank) * double(in + out);
}

}  // namespace tessera::ops
