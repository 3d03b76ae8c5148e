// Cross-entropy forward/backward: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU kernels. Per
// row: online max/sum over the vocabulary (one pass), then the loss is summed over rows in row order (deterministic).
#include "ops/cross_entropy.h"

#include <cmath>
#include <limits>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::load_index;
using cpu::Rows;
using cpu::rows_of;

namespace {
int64_t checked_target(const CrossEntropyParams& p, TensorView targets, int64_t n, int64_t V) {
    int64_t t = load_index(targets, n);
    TESSERA_CHECK(t == p.ignore_index || (0 <= t && t < V),
                  "cross_entropy: targets[{}] = {} is outside [0, {}) and is not the ignore index {}", n, t, V,
                  p.ignore_index);
    return t;
}

// Online log-sum-exp of one row, in blocks so the inner loop vectorizes.
template <class T>
double row_lse(const T* x, int64_t V) {
    constexpr int64_t kBlock = 512;
    double m = -std::numeric_limits<double>::infinity(), s = 0.0;
    for (int64_t v0 = 0; v0 < V; v0 += kBlock) {
        const int64_t v1 = std::min(V, v0 + kBlock);
        T bm = -std::numeric_limits<T>::infinity();
        for (int64_t v = v0; v < v1; ++v) bm = std::max(bm, x[v]);
        if (double(bm) > m) {
            s *= std::exp(m - double(bm));
            m = double(bm);
        }
        if (m == -std::numeric_limits<double>::infinity()) continue;
        const T mt = T(m);
        T bs = 0;
#pragma omp simd reduction(+ : bs)
        for (int64_t v = v0; v < v1; ++v) bs += cpu::vexp(x[v] - mt);
        s += double(bs);
    }
    return m + std::log(s);
}
// The shared checks of forward and backward (dlogits optional); returns the vocabulary size.
int64_t check_shapes(TensorView logits, TensorView targets, TensorView lse, TensorView dlogits) {
    int64_t V = 0;
    dispatch_float(logits.dtype, "cross_entropy", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(logits, "cross_entropy: logits");
        cpu::check_index_dtype(targets, "cross_entropy: targets");
        check_shape(targets, Shape{X.rows}, "cross_entropy: targets");
        check_shape(lse, Shape{X.rows}, "cross_entropy: lse");
        check_dtype(lse, logits.dtype, "cross_entropy: lse");
        if (dlogits.defined()) {
            Rows<T> DX = rows_of<T>(dlogits, "cross_entropy: dlogits");
            TESSERA_CHECK(DX.rows == X.rows && DX.cols == X.cols,
                          "cross_entropy: dlogits must be shaped like logits {}", logits.shape.str());
        }
        V = X.cols;
    });
    return V;
}
}  // namespace

CrossEntropyResult cross_entropy_forward(const CrossEntropyParams& p,
                                         TensorView logits,
                                         TensorView targets,
                                         TensorView lse) {
    note_op_use("cross_entropy");
    check_shapes(logits, targets, lse, {});
    if (op_device("cross_entropy", {logits, targets, lse}) == Device::cuda)
        return TESSERA_ON_CUDA(cross_entropy_forward(p, logits, targets, lse));
    CrossEntropyResult res;
    dispatch_float(logits.dtype, "cross_entropy", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(logits, "cross_entropy: logits");
        T* L = lse.ptr<T>();
        for (int64_t n = 0; n < X.rows; ++n) checked_target(p, targets, n, X.cols);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < X.rows; ++n) L[n] = T(row_lse(X.row(n), X.cols));
        for (int64_t n = 0; n < X.rows; ++n) {
            int64_t t = load_index(targets, n);
            if (t == p.ignore_index) continue;
            res.sum += double(L[n]) - double(X.row(n)[t]);
            res.count++;
        }
    });
    res.loss = res.count ? res.sum / double(res.count) : 0.0;
    return res;
}

void cross_entropy_backward(const CrossEntropyParams& p,
                            double dloss,
                            TensorView logits,
                            TensorView targets,
                            TensorView lse,
                            TensorView dlogits) {
    TESSERA_CHECK(dlogits.defined(), "cross_entropy: backward needs dlogits");
    check_shapes(logits, targets, lse, dlogits);
    if (op_device("cross_entropy", {logits, targets, lse, dlogits}) == Device::cuda)
        return TESSERA_ON_CUDA(cross_entropy_backward(p, dloss, logits, targets, lse, dlogits));
    dispatch_float(logits.dtype, "cross_entropy", [&]<class T>(T) {
        Rows<T> X = rows_of<T>(logits, "cross_entropy: logits");
        Rows<T> DX = rows_of<T>(dlogits, "cross_entropy: dlogits");
        const T* L = lse.ptr<T>();
        int64_t count = 0;
        for (int64_t n = 0; n < X.rows; ++n) count += checked_target(p, targets, n, X.cols) != p.ignore_index;
        if (count == 0) return;
        const T scale = T(dloss / double(count));
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < X.rows; ++n) {
            const int64_t t = load_index(targets, n);
            if (t == p.ignore_index) continue;
            const T* x = X.row(n);
            T* dx = DX.row(n);
            const T l = L[n];
#pragma omp simd
            for (int64_t v = 0; v < X.cols; ++v) dx[v] += scale * cpu::vexp(x[v] - l);
            dx[t] -= scale;
        }
    });
}

}  // namespace tessera::ops
