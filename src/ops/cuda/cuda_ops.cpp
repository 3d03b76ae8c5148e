// The CUDA backend's op entry points: operand layouts for the launchers and cuBLAS, device-side checks of
// integer inputs, error messages. The neutral entry points have checked shapes and dtypes already.
#include "ops/cuda/cuda_ops.h"

#include <cublas_v2.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/device.h"
#include "ops/cuda/entry_util.h"
#include "ops/cuda/launchers.h"
#include "ops/views.h"

namespace tessera::ops::cuda {

namespace {
// The first position of `ids` outside [0, limit) (skipping `except`), or -1; synchronises.
int64_t first_bad_id(const TensorView& ids, int64_t limit, int64_t except, int64_t* bad_value) {
    auto* bad = static_cast<int64_t*>(scratch(sizeof(int64_t)));
    const int64_t none = INT64_MAX;
    copy_bytes(bad, Device::cuda, &none, Device::cpu, sizeof none);
    check_launch(launch_check_ids(ids.data, ids.dtype == DType::i32, ids.numel(), limit, except, bad, stream()),
                 "id check");
    int64_t pos = 0;
    copy_bytes(&pos, Device::cpu, bad, Device::cuda, sizeof pos);
    if (pos == none) return -1;
    const size_t width = dtype_size(ids.dtype);
    int64_t value = 0;
    if (ids.dtype == DType::i32) {
        int32_t v32 = 0;
        copy_bytes(&v32, Device::cpu, static_cast<const std::byte*>(ids.data) + pos * width, Device::cuda, width);
        value = v32;
    } else {
        copy_bytes(&value, Device::cpu, static_cast<const std::byte*>(ids.data) + pos * width, Device::cuda, width);
    }
    *bad_value = value;
    return pos;
}

// The CPU's one-line errors for a bad id (ops/cpu/embedding.cpp, ops/cpu/cross_entropy.cpp), found on the device.
void check_embedding_ids(const TensorView& ids, int64_t vocab) {
    int64_t value = 0;
    const int64_t bad = first_bad_id(ids, vocab, INT64_MIN, &value);
    TESSERA_CHECK(bad < 0, "embedding: ids[{}] = {} is outside the vocabulary [0, {})", bad, value, vocab);
}
void check_targets(const CrossEntropyParams& p, const TensorView& targets, int64_t V) {
    int64_t value = 0;
    const int64_t bad = first_bad_id(targets, V, p.ignore_index, &value);
    TESSERA_CHECK(bad < 0, "cross_entropy: targets[{}] = {} is outside [0, {}) and is not the ignore index {}", bad,
                  value, V, p.ignore_index);
}

}  // namespace

void adamw_update(const AdamWParams& p, TensorView param, TensorView grad, TensorView m, TensorView v) {
    dispatch_float(param.dtype, "adamw", [&]<class T>(T) {
        const AdamWScalars<T> s{.decay = T(1.0 - p.lr * p.weight_decay),
                                .one_minus_beta1 = T(1.0 - p.beta1),
                                .beta2 = T(p.beta2),
                                .one_minus_beta2 = T(1.0 - p.beta2),
                                .step_size = T(p.lr / (1.0 - std::pow(p.beta1, double(p.step)))),
                                .bias_correction2_sqrt = T(std::sqrt(1.0 - std::pow(p.beta2, double(p.step)))),
                                .eps = T(p.eps)};
        check_launch(launch_adamw<T>(param.ptr<T>(), grad.ptr<T>(), m.ptr<T>(), v.ptr<T>(), param.numel(), s, stream()),
                     "adamw");
    });
}

void sum_squares_by_chunk(TensorView x, int64_t chunk, std::span<double> out) {
    const int64_t n = x.numel(), chunks = (n + chunk - 1) / chunk;
    auto* sums = static_cast<double*>(scratch(8 * size_t(chunks)));
    check_launch(launch_sum_squares(x.ptr<float>(), n, chunk, sums, stream()), "sum_squares_by_chunk");
    copy_bytes(out.data(), Device::cpu, sums, Device::cuda, 8 * size_t(chunks));
}

void scale_vector(TensorView x, float factor) {
    check_launch(launch_scale_vector(x.ptr<float>(), x.numel(), factor, stream()), "scale_vector");
}

void add_vector(TensorView src, TensorView dst) {
    check_launch(launch_add_vector(src.ptr<float>(), dst.ptr<float>(), src.numel(), stream()), "add_vector");
}

void sum_blocks(DType dtype, const void* parts, int blocks, int64_t count, void* out, bool accumulate) {
    const auto run = [&]<class T>(T*) {
        check_launch(
            launch_sum_blocks(static_cast<const T*>(parts), blocks, count, static_cast<T*>(out), accumulate, stream()),
            "sum_blocks");
    };
    switch (dtype) {
        case DType::f32:
            return run(static_cast<float*>(nullptr));
        case DType::f64:
            return run(static_cast<double*>(nullptr));
        case DType::i32:
            return run(static_cast<int32_t*>(nullptr));
        case DType::i64:
            return run(static_cast<int64_t*>(nullptr));
        default:
            TESSERA_FAIL("sum_blocks: dtype {} is not summed (f32, f64, i32, i64)", dtype_name(dtype));
    }
}

namespace {
// A frozen weight [OUT, IN] held narrow (bf16: model.lora.base_dtype; MXFP4) with f32 inputs, as the CPU's linear
// takes it: fn(o0, rows, w, dtype) for consecutive row blocks of at most kWidenBytes widened to f32 in the thread's
// scratch (the CPU widens per GEMM block instead; both products equal those on the widened f32 weight up to the order
// of the sum over OUT in dx). At GemmPrecision::bf16, where each GEMM takes bf16 operands, a bf16 weight is one block
// read in place and an MXFP4 one is dequantized to bf16 in the same row blocks: the same products without widening
// and rounding back (per call 2 bytes read per weight instead of 2 read, 4 written, 4 read and 2 written before the
// GEMM reads 2). f64 inputs run on f32 weights only, as on the CPU.
void check_narrow_weight(const TensorView& x, const TensorView& w) {
    TESSERA_CHECK((w.dtype == DType::bf16 || w.dtype == DType::mxfp4) && x.dtype == DType::f32,
                  "linear: a {} weight {} in a {} product ({} runs on {} weights)", dtype_name(w.dtype), w.shape.str(),
                  dtype_name(x.dtype), dtype_name(x.dtype), dtype_name(x.dtype));
}
template <class F>
void with_narrow_weight(const TensorView& w, F&& fn) {
    const int64_t OUT = w.size(0), IN = w.numel() / std::max<int64_t>(1, OUT);
    const bool bf16 = gemm_precision() == GemmPrecision::bf16;
    if (bf16 && w.dtype == DType::bf16) return fn(int64_t(0), OUT, held_weight(w, "linear"), DType::bf16);
    const DType to = bf16 ? DType::bf16 : DType::f32;
    const int64_t rows =
        std::clamp<int64_t>(kWidenBytes / (4 * std::max<int64_t>(1, IN)), 1, std::max<int64_t>(1, OUT));
    void* wide = scratch(dtype_bytes(to, rows * IN));
    for (int64_t o0 = 0; o0 < OUT; o0 += rows) {
        const int64_t n = std::min(rows, OUT - o0);
        widen(w, o0 * IN, n * IN, to, wide, "linear: widen the weight");
        fn(o0, n, static_cast<const void*>(wide), to);
    }
}
// gemm<float> on f32 operands; gemm_bf16 where an operand (a weight, rows rounded already) is bf16.
void operand_gemm(bool ta,
                  bool tb,
                  int64_t m,
                  int64_t n,
                  int64_t k,
                  GroupOperand a,
                  int64_t lda,
                  GroupOperand b,
                  int64_t ldb,
                  float beta,
                  float* c,
                  int64_t ldc) {
    if (a.type == DType::bf16 || b.type == DType::bf16)
        return gemm_bf16(ta, tb, m, n, k, 1.f, a.data, a.type, lda, b.data, b.type, ldb, beta, c, ldc);
    gemm<float>(ta, tb, m, n, k, 1.f, static_cast<const float*>(a.data), lda, static_cast<const float*>(b.data), ldb,
                beta, c, ldc);
}
// A linear's dy as its backward's GEMMs read it: at GemmPrecision::bf16, when both products read it (dx and dw) and its
// rows are one block, rounded to bf16 once into the thread's buffer for both (each would round a copy of its own);
// else as it is. With where its rows start apart.
std::pair<GroupOperand, int64_t> dy_operand(const Rows<float>& DY, bool both) {
    if (!both || gemm_precision() != GemmPrecision::bf16 || DY.ld != DY.cols || DY.rows == 0) return {DY.data, DY.ld};
    thread_local GrowBuffer buffer;
    const int64_t n = DY.rows * DY.cols;
    auto* dst = static_cast<uint16_t*>(buffer.reserve(2 * size_t(n)));
    check_launch(launch_narrow_bf16(DY.data, n, dst, stream()), "linear: dy to bf16");
    return {GroupOperand(dst, DType::bf16), DY.cols};
}
}  // namespace

void linear_forward(const LinearParams& p, TensorView x, TensorView w, TensorView b, TensorView y) {
    if (w.dtype != x.dtype) {  // y[:, o0:o0+n] = x·w[o0:o0+n]ᵀ per widened row block
        check_narrow_weight(x, w);
        const Rows<float> X = rows_of<float>(x, "linear: x"), Y = rows_of<float>(y, "linear: y");
        with_narrow_weight(w, [&](int64_t o0, int64_t n, const void* W, DType wt) {
            operand_gemm(true, false, n, X.rows, X.cols, {W, wt}, X.cols, X.data, X.ld, p.accumulate ? 1.f : 0.f,
                         Y.data + o0, Y.ld);
        });
        if (b.defined()) check_launch(launch_add_bias<float>(arg(Y), b.ptr<float>(), stream()), "linear bias");
        return;
    }
    dispatch_float(x.dtype, "linear", [&]<class T>(T) {
        const Rows<T> X = rows_of<T>(x, "linear: x"), Y = rows_of<T>(y, "linear: y");
        const T* W = w.ptr<T>();
        gemm<T>(true, false, Y.cols, X.rows, X.cols, T(1), W, X.cols, X.data, X.ld, p.accumulate ? T(1) : T(0), Y.data,
                Y.ld);
        if (b.defined()) check_launch(launch_add_bias<T>(arg(Y), b.ptr<T>(), stream()), "linear bias");
    });
}

void linear_backward(TensorView dy, TensorView x, TensorView w, TensorView dx, TensorView dw, TensorView db) {
    // f32 rows: dx += dy·w (a narrow weight, a frozen base's or a trained one's bf16 copy, train/weight_copies.h:
    // dx += dy[:, o0:o0+n]·w[o0:o0+n] per widened row block), dw += dyᵀ·x (not reading w), with dy rounded once at bf16
    if (w.dtype != x.dtype) check_narrow_weight(x, w);  // (f32 rows only)
    if (x.dtype == DType::f32) {
        const Rows<float> X = rows_of<float>(x, "linear: x"), DY = rows_of<float>(dy, "linear: dy");
        const int64_t N = X.rows, IN = X.cols, OUT = DY.cols;
        const auto [D, ldd] = dy_operand(DY, dx.defined() && dw.defined());
        if (dx.defined()) {  // column-major dxᵀ += wᵀ·dyᵀ
            const Rows<float> DX = rows_of<float>(dx, "linear: dx");
            if (w.dtype == DType::f32)
                operand_gemm(false, false, IN, N, OUT, w.ptr<float>(), IN, D, ldd, 1.f, DX.data, DX.ld);
            else
                with_narrow_weight(w, [&](int64_t o0, int64_t n, const void* W, DType wt) {
                    operand_gemm(false, false, IN, N, n, {W, wt}, IN, D.at(o0), ldd, 1.f, DX.data, DX.ld);
                });
        }
        if (dw.defined())  // column-major dwᵀ += xᵀ·dy
            operand_gemm(false, true, IN, OUT, N, X.data, X.ld, D, ldd, 1.f, dw.ptr<float>(), IN);
        if (db.defined())
            check_launch(launch_column_sums<float>(carg<float>(dy, "linear: dy"), db.ptr<float>(),
                                                   column_slabs_scratch<float>(DY.rows, DY.cols, 1), stream()),
                         "linear db");
        return;
    }
    dispatch_float(x.dtype, "linear", [&]<class T>(T) {
        const Rows<T> X = rows_of<T>(x, "linear: x"), DY = rows_of<T>(dy, "linear: dy");
        const int64_t N = X.rows, IN = X.cols, OUT = DY.cols;
        if (dx.defined()) {  // dx += dy·w: column-major dxᵀ += wᵀ·dyᵀ
            const Rows<T> DX = rows_of<T>(dx, "linear: dx");
            gemm<T>(false, false, IN, N, OUT, T(1), w.ptr<T>(), IN, DY.data, DY.ld, T(1), DX.data, DX.ld);
        }
        if (dw.defined()) {  // dw += dyᵀ·x: column-major dwᵀ += xᵀ·dy
            gemm<T>(false, true, IN, OUT, N, T(1), X.data, X.ld, DY.data, DY.ld, T(1), dw.ptr<T>(), IN);
        }
        if (db.defined())
            check_launch(launch_column_sums<T>(carg<T>(dy, "linear: dy"), db.ptr<T>(),
                                               column_slabs_scratch<T>(N, OUT, 1), stream()),
                         "linear db");
    });
}

void rmsnorm_forward(const RmsNormParams& p, TensorView x, TensorView w, TensorView y, TensorView rstd) {
    dispatch_float(x.dtype, "rmsnorm", [&]<class T>(T) {
        check_launch(launch_rmsnorm_forward<T>(carg<T>(x, "rmsnorm: x"), w.ptr<T>(), marg<T>(y, "rmsnorm: y"),
                                               rstd.ptr<T>(), p.eps, stream()),
                     "rmsnorm");
    });
}

void rmsnorm_backward(
    const RmsNormParams&, TensorView dy, TensorView x, TensorView w, TensorView rstd, TensorView dx, TensorView dw) {
    dispatch_float(x.dtype, "rmsnorm", [&]<class T>(T) {
        const RowsArg<T> DX = dx.defined() ? marg<T>(dx, "rmsnorm: dx") : RowsArg<T>{nullptr, 0, 0, 0};
        const RowsArg<const T> X = carg<T>(x, "rmsnorm: x");
        T* slabs = dw.defined() ? column_slabs_scratch<T>(X.rows, X.cols, 1) : nullptr;
        check_launch(launch_rmsnorm_backward<T>(carg<T>(dy, "rmsnorm: dy"), X, w.ptr<T>(), rstd.ptr<T>(), DX,
                                                ptr_or_null<T>(dw), slabs, stream()),
                     "rmsnorm backward");
    });
}

void swiglu_forward(TensorView gate, TensorView up, TensorView y) {
    dispatch_float(gate.dtype, "swiglu", [&]<class T>(T) {
        check_launch(launch_swiglu_forward<T>(carg<T>(gate, "swiglu: gate"), carg<T>(up, "swiglu: up"),
                                              marg<T>(y, "swiglu: y"), stream()),
                     "swiglu");
    });
}

void swiglu_backward(TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup) {
    dispatch_float(gate.dtype, "swiglu", [&]<class T>(T) {
        check_launch(launch_swiglu_backward<T>(carg<T>(dy, "swiglu: dy"), carg<T>(gate, "swiglu: gate"),
                                               carg<T>(up, "swiglu: up"), marg<T>(dgate, "swiglu: dgate"),
                                               marg<T>(dup, "swiglu: dup"), stream()),
                     "swiglu backward");
    });
}

void embedding_forward(TensorView ids, TensorView table, TensorView y) {
    check_embedding_ids(ids, table.size(0));
    const bool ids32 = ids.dtype == DType::i32;
    if (table.dtype == DType::bf16 && y.dtype == DType::f32) {
        check_launch(
            launch_embedding_forward_bf16(ids.data, ids32, ids.numel(), static_cast<const uint16_t*>(table.data),
                                          table.size(1), y.ptr<float>(), stream()),
            "embedding");
        return;
    }
    check_launch(launch_embedding_forward(ids.data, ids32, ids.numel(), table.data,
                                          int64_t(dtype_bytes(table.dtype, table.size(1))), y.data, stream()),
                 "embedding");
}

void embedding_backward(TensorView dy, TensorView ids, TensorView dtable) {
    check_embedding_ids(ids, dtable.size(0));  // (waits for the stream: the ids are read back next)
    const int64_t N = ids.numel();
    if (N == 0) return;
    // the tokens sorted by (id, position) on the host, as keys id·N + n; grow-only buffers (no allocation per step)
    thread_local std::vector<int64_t> keys, table;
    thread_local std::vector<int32_t> narrow;
    keys.resize(size_t(N));
    if (ids.dtype == DType::i32) {
        narrow.resize(size_t(N));
        copy_bytes(narrow.data(), Device::cpu, ids.data, Device::cuda, size_t(N) * sizeof(int32_t));
        std::copy(narrow.begin(), narrow.end(), keys.begin());
    } else {
        copy_bytes(keys.data(), Device::cpu, ids.data, Device::cuda, size_t(N) * sizeof(int64_t));
    }
    for (int64_t n = 0; n < N; ++n) keys[size_t(n)] = keys[size_t(n)] * N + n;
    std::sort(keys.begin(), keys.end());
    int64_t S = 0;  // distinct ids
    for (int64_t k = 0; k < N; ++k) S += k == 0 || keys[size_t(k)] / N != keys[size_t(k - 1)] / N;
    // the launcher's table: the positions [N], then the ids [S] and their runs' starts [S + 1]
    table.resize(size_t(N + 2 * S + 1));
    for (int64_t k = 0, s = 0; k < N; ++k) {
        table[size_t(k)] = keys[size_t(k)] % N;
        if (k > 0 && keys[size_t(k)] / N == keys[size_t(k - 1)] / N) continue;
        table[size_t(N + s)] = keys[size_t(k)] / N;
        table[size_t(N + S + s++)] = k;
    }
    table[size_t(N + 2 * S)] = N;
    const int64_t* dev = to_scratch(std::span<const int64_t>(table));
    dispatch_float(dtable.dtype, "embedding", [&]<class T>(T) {
        check_launch(
            launch_embedding_backward<T>(dy.ptr<T>(), dev, dev + N, S, dtable.size(1), dtable.ptr<T>(), stream()),
            "embedding backward");
    });
}

CrossEntropyResult cross_entropy_forward(const CrossEntropyParams& p,
                                         TensorView logits,
                                         TensorView targets,
                                         TensorView lse) {
    check_targets(p, targets, logits.size(logits.ndim() - 1));
    CrossEntropyResult res;
    dispatch_float(logits.dtype, "cross_entropy", [&]<class T>(T) {
        const RowsArg<const T> X = carg<T>(logits, "cross_entropy: logits");
        auto* buf = static_cast<double*>(scratch(sizeof(double) * size_t(2 + X.rows)));
        check_launch(launch_cross_entropy_forward<T>(X, targets.data, targets.dtype == DType::i32, p.ignore_index,
                                                     lse.ptr<T>(), buf + 2, buf, stream()),
                     "cross_entropy");
        double totals[2] = {0, 0};
        copy_bytes(totals, Device::cpu, buf, Device::cuda, sizeof totals);
        res.sum = totals[0];
        res.count = int64_t(totals[1]);
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
    check_targets(p, targets, logits.size(logits.ndim() - 1));
    dispatch_float(logits.dtype, "cross_entropy", [&]<class T>(T) {
        const RowsArg<const T> X = carg<T>(logits, "cross_entropy: logits");
        auto* buf = static_cast<double*>(scratch(2 * sizeof(double)));
        check_launch(
            launch_count_targets(targets.data, targets.dtype == DType::i32, p.ignore_index, X.rows, buf, stream()),
            "cross_entropy count");
        double totals[2] = {0, 0};
        copy_bytes(totals, Device::cpu, buf, Device::cuda, sizeof totals);
        const int64_t count = int64_t(totals[1]);
        if (count == 0) return;
        check_launch(launch_cross_entropy_backward<T>(X, targets.data, targets.dtype == DType::i32, p.ignore_index,
                                                      lse.ptr<T>(), T(dloss / double(count)),
                                                      marg<T>(dlogits, "cross_entropy: dlogits"), stream()),
                     "cross_entropy backward");
    });
}

void matmul_heads(Trans ta, Trans tb, double alpha, TensorView a, TensorView b, double beta, TensorView c) {
    // row-major C_h = op(A_h)·op(B_h) is column-major C_hᵀ = op(B_h)ᵀ·op(A_h)ᵀ: B first, then A
    const int64_t M = c.size(1), N = c.size(2), K = ta == Trans::N ? a.size(2) : a.size(1);
    dispatch_float(a.dtype, "matmul_heads", [&]<class T>(T) {
        gemm<T>(tb == Trans::T, ta == Trans::T, N, M, K, T(alpha), b.ptr<T>(), b.strides[1], a.ptr<T>(), a.strides[1],
                T(beta), c.ptr<T>(), c.strides[1],
                Batch{.count = c.size(0), .a = b.strides[0], .b = a.strides[0], .c = c.strides[0]});
    });
}

}  // namespace tessera::ops::cuda
