// The CUDA entry points of LoRA (ops/lora.h): the dense form: the CPU's thin GEMMs through cuBLAS, the dropout mask
// by a kernel (the same counter-based bits). The neutral entry points (ops/cpu/lora.cpp) have checked shapes,
// dtypes and scratch sizes already. The routed-expert form runs each of its products over all experts as one cuBLAS
// grouped-batched GEMM (GemmGroup), the expert offsets read on the host.
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/entry_util.h"

namespace tessera::ops::cuda {

namespace {
DropoutArg mask(const LoraParams& p) { return {p.seed, p.stream, p.dropout, 1.0 / (1.0 - p.dropout)}; }

// The input the adapter reads: x, or x̃ = x ⊙ m / (1 − p) written into xd
template <class T>
Rows<T> adapter_input(const LoraParams& p, TensorView x, TensorView xd) {
    const Rows<T> X = rows_of<T>(x, "lora: x");
    if (!p.drops()) return X;
    T* dst = xd.ptr<T>();
    check_launch(launch_dropout_rows<T>({X.data, X.rows, X.cols, X.ld}, dst, mask(p), stream()), "lora dropout");
    return Rows<T>{dst, X.rows, X.cols, X.cols};
}
}  // namespace

void lora_forward(
    const LoraParams& p, TensorView x, TensorView a, TensorView b, TensorView u, TensorView y, TensorView xd) {
    const int64_t N = x.size(0), in = a.size(1), out = b.size(0), r = a.size(0);
    dispatch_float(a.dtype, "lora", [&]<class T>(T) {
        const Rows<T> X = adapter_input<T>(p, x, xd), Y = rows_of<T>(y, "lora: y");
        T* U = u.ptr<T>();
        gemm_rows<T>(Trans::N, Trans::T, N, r, in, T(1), X.data, X.ld, a.ptr<T>(), in, T(0), U, r);
        gemm_rows<T>(Trans::N, Trans::T, N, out, r, T(p.scale), U, r, b.ptr<T>(), r, T(1), Y.data, Y.ld);
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
    const int64_t N = x.size(0), in = a.size(1), out = b.size(0), r = a.size(0);
    dispatch_float(a.dtype, "lora", [&]<class T>(T) {
        const Rows<T> X = adapter_input<T>(p, x, xd), DY = rows_of<T>(dy, "lora: dy");
        T *U = u.ptr<T>(), *DU = du.ptr<T>();
        const T s = T(p.scale);
        if (db.defined()) {  // u = x̃·Aᵀ again, dB += s·dyᵀ·u
            gemm_rows<T>(Trans::N, Trans::T, N, r, in, T(1), X.data, X.ld, a.ptr<T>(), in, T(0), U, r);
            gemm_rows<T>(Trans::T, Trans::N, out, r, N, s, DY.data, DY.ld, U, r, T(1), db.ptr<T>(), r);
        }
        gemm_rows<T>(Trans::N, Trans::N, N, r, out, s, DY.data, DY.ld, b.ptr<T>(), r, T(0), DU, r);  // du = s·dy·B
        if (da.defined()) gemm_rows<T>(Trans::T, Trans::N, r, in, N, T(1), DU, r, X.data, X.ld, T(1), da.ptr<T>(), in);
        if (!dx.defined()) return;
        const Rows<T> DX = rows_of<T>(dx, "lora: dx");
        if (!p.drops()) {
            gemm_rows<T>(Trans::N, Trans::N, N, in, r, T(1), DU, r, a.ptr<T>(), in, T(1), DX.data, DX.ld);
            return;
        }
        T* g = xd.ptr<T>();  // du·A into xd (x̃ is no longer needed), then dx += (du·A) ⊙ m / (1 − p)
        gemm_rows<T>(Trans::N, Trans::N, N, in, r, T(1), DU, r, a.ptr<T>(), in, T(0), g, in);
        check_launch(launch_masked_add<T>(g, arg(DX), mask(p), stream()), "lora dropout backward");
    });
}

void lora_grouped_forward(
    const LoraParams& p, const ExpertRows& g, TensorView x, TensorView a, TensorView b, TensorView u, TensorView y) {
    const int64_t in = a.size(2), out = b.size(1), r = a.size(1);
    dispatch_float(a.dtype, "lora (experts)", [&]<class T>(T) {
        const Rows<T> X = rows_of<T>(x, "lora: x"), Y = rows_of<T>(y, "lora: y");
        T* U = u.ptr<T>();
        // u = s·x·A_eᵀ, y += u·B_eᵀ (the CPU's order: u carries the scale)
        grouped_rows<T>(Trans::T, g, r, in, T(p.scale), X.data, X.ld, a.ptr<T>(), r * in, in, T(0), U, r);
        grouped_rows<T>(Trans::T, g, out, r, T(1), U, r, b.ptr<T>(), out * r, r, T(1), Y.data, Y.ld);
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
    const int64_t in = a.size(2), out = b.size(1), r = a.size(1);
    dispatch_float(a.dtype, "lora (experts)", [&]<class T>(T) {
        const Rows<T> X = rows_of<T>(x, "lora: x"), DY = rows_of<T>(dy, "lora: dy");
        T *U = u.ptr<T>(), *DU = du.ptr<T>();
        const T s = T(p.scale);
        if (db.defined()) {  // dB_e += dy_eᵀ·(s·u_e)
            grouped_rows<T>(Trans::T, g, r, in, s, X.data, X.ld, a.ptr<T>(), r * in, in, T(0), U, r);
            grouped_wgrad<T>(g, out, r, DY.data, DY.ld, U, r, db.ptr<T>(), out * r, r);
        }
        grouped_rows<T>(Trans::N, g, r, out, s, DY.data, DY.ld, b.ptr<T>(), out * r, r, T(0), DU, r);  // du = s·dy·B_e
        if (da.defined()) grouped_wgrad<T>(g, r, in, DU, r, X.data, X.ld, da.ptr<T>(), r * in, in);
        if (dx.defined()) {
            const Rows<T> DX = rows_of<T>(dx, "lora: dx");
            grouped_rows<T>(Trans::N, g, in, r, T(1), DU, r, a.ptr<T>(), r * in, in, T(1), DX.data, DX.ld);
        }
    });
}

void lora_merge(const LoraParams& p, TensorView w, TensorView a, TensorView b, TensorView out) {
    dispatch_float(w.dtype, "lora merge", [&]<class T>(T) {
        if (out.data != w.data)
            check_launch(cudaMemcpyAsync(out.data, w.data, w.nbytes(), cudaMemcpyDeviceToDevice, stream()),
                         "lora merge copy");
        gemm_rows<T>(Trans::N, Trans::N, w.size(0), w.size(1), a.size(0), T(p.scale), b.ptr<T>(), a.size(0), a.ptr<T>(),
                     w.size(1), T(1), out.ptr<T>(), w.size(1));
    });
}

void lora_weight_backward(
    const LoraParams& p, TensorView dw, TensorView a, TensorView b, TensorView da, TensorView db) {
    const int64_t out = dw.size(0), in = dw.size(1), r = a.size(0);
    dispatch_float(dw.dtype, "lora", [&]<class T>(T) {
        if (da.defined())
            gemm_rows<T>(Trans::T, Trans::N, r, in, out, T(p.scale), b.ptr<T>(), r, dw.ptr<T>(), in, T(1), da.ptr<T>(),
                         in);
        if (db.defined())
            gemm_rows<T>(Trans::N, Trans::T, out, r, in, T(p.scale), dw.ptr<T>(), in, a.ptr<T>(), in, T(1), db.ptr<T>(),
                         r);
    });
}

}  // namespace tessera::ops::cuda
