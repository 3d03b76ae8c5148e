// The row glue ops (ops/rows.h): the entry points (checks, then CUDA tensors to ops/cuda) and the CPU loops.
#include "ops/rows.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"

namespace tessera::ops {

namespace {
using cpu::Rows;
using cpu::vsigmoid;

Rows<float> f32_rows(const TensorView& t, const char* what) {
    check_dtype(t, DType::f32, what);
    return cpu::rows_of<float>(t, what);
}

// Both views as rows, of one shape (as matrices).
void check_alike(const Rows<float>& a, const Rows<float>& b, const char* op, const char* what) {
    TESSERA_CHECK(a.rows == b.rows && a.cols == b.cols, "{}: {} is [{}, {}] but [{}, {}] was expected", op, what,
                  b.rows, b.cols, a.rows, a.cols);
}

// [N, G] and [N, G·per] (per >= 1): the number of values per group.
int64_t group_width(const Rows<float>& g, const Rows<float>& wide, const char* op, const char* what) {
    TESSERA_CHECK(wide.rows == g.rows && g.cols > 0 && wide.cols % g.cols == 0 && wide.cols >= g.cols,
                  "{}: {} is [{}, {}], not [{}, a multiple of {}]", op, what, wide.rows, wide.cols, g.rows, g.cols);
    return wide.cols / g.cols;
}
}  // namespace

void copy_rows(TensorView src, TensorView dst, float scale) {
    const Rows<float> S = f32_rows(src, "copy_rows: src"), D = f32_rows(dst, "copy_rows: dst");
    check_alike(S, D, "copy_rows", "dst");
    if (op_device("copy_rows", {src, dst}) == Device::cuda) return TESSERA_ON_CUDA(copy_rows(src, dst, scale));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < S.rows; ++n) {
        if (scale == 1.f) {
            std::memcpy(D.row(n), S.row(n), size_t(S.cols) * sizeof(float));
        } else {
            for (int64_t c = 0; c < S.cols; ++c) D.row(n)[c] = scale * S.row(n)[c];
        }
    }
}

void add_rows(TensorView src, TensorView dst) {
    const Rows<float> S = f32_rows(src, "add_rows: src"), D = f32_rows(dst, "add_rows: dst");
    check_alike(S, D, "add_rows", "dst");
    if (op_device("add_rows", {src, dst}) == Device::cuda) return TESSERA_ON_CUDA(add_rows(src, dst));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < S.rows; ++n) {
        const float* s = S.row(n);
        float* d = D.row(n);
#pragma omp simd
        for (int64_t c = 0; c < S.cols; ++c) d[c] += s[c];
    }
}

void copy_blocks(TensorView src, TensorView dst, std::span<const CopyBlock> blocks) {
    TESSERA_CHECK(src.dtype == DType::f32 && dst.dtype == DType::f32 && src.is_contiguous() && dst.is_contiguous(),
                  "copy_blocks: src and dst must be contiguous f32 views");
    for (const CopyBlock& b : blocks)
        TESSERA_CHECK(b.n >= 0 && b.from >= 0 && b.to >= 0 && b.from + b.n <= src.numel() && b.to + b.n <= dst.numel(),
                      "copy_blocks: block of {} from {} to {} outside {} / {} elements", b.n, b.from, b.to, src.numel(),
                      dst.numel());
    if (op_device("copy_blocks", {src, dst}) == Device::cuda) return TESSERA_ON_CUDA(copy_blocks(src, dst, blocks));
    const float* s = src.ptr<float>();
    float* d = dst.ptr<float>();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < blocks.size(); ++i)
        std::memcpy(d + blocks[i].to, s + blocks[i].from, size_t(blocks[i].n) * sizeof(float));
}

void cast(TensorView src, TensorView dst) {
    TESSERA_CHECK(src.is_contiguous() && dst.is_contiguous() && src.numel() == dst.numel(),
                  "cast: src and dst must be contiguous views of one element count ({} and {})", src.numel(),
                  dst.numel());
    const bool narrow = src.dtype == DType::f32 && dst.dtype == DType::bf16,
               widen = src.dtype == DType::bf16 && dst.dtype == DType::f32;
    TESSERA_CHECK(src.dtype == dst.dtype || narrow || widen, "cast: {} -> {} is not supported (f32 <-> bf16)",
                  dtype_name(src.dtype), dtype_name(dst.dtype));
    if (op_device("cast", {src, dst}) == Device::cuda) return TESSERA_ON_CUDA(cast(src, dst));
    const int64_t n = src.numel();
    if (!narrow && !widen) {
        std::memcpy(dst.data, src.data, src.nbytes());
        return;
    }
    // core's convert, in chunks over the threads
    const TensorView s = src.reshape(Shape{n}), d = dst.reshape(Shape{n});
    constexpr int64_t kChunk = 1 << 14;
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < n; c0 += kChunk)
        convert(s.slice0(c0, std::min(n, c0 + kChunk)), d.slice0(c0, std::min(n, c0 + kChunk)));
}

void round_to_bf16(TensorView t) {
    TESSERA_CHECK(t.dtype == DType::f32 && t.is_contiguous(), "round_to_bf16: t must be a contiguous f32 view");
    if (op_device("round_to_bf16", {t}) == Device::cuda) return TESSERA_ON_CUDA(round_to_bf16(t));
    float* x = t.ptr<float>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < t.numel(); ++i) x[i] = bf16_to_float(float_to_bf16(x[i]));
}

void scatter_rows(TensorView src, std::span<const int64_t> at, TensorView dst) {
    const Rows<float> S = f32_rows(src, "scatter_rows: src"), D = f32_rows(dst, "scatter_rows: dst");
    TESSERA_CHECK(S.rows == int64_t(at.size()) && S.cols == D.cols, "scatter_rows: src {} for {} positions into {}",
                  src.shape.str(), at.size(), dst.shape.str());
    for (int64_t p : at) TESSERA_CHECK(p >= 0 && p < D.rows, "scatter_rows: position {} of {} rows", p, D.rows);
    if (op_device("scatter_rows", {src, dst}) == Device::cuda) return TESSERA_ON_CUDA(scatter_rows(src, at, dst));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < S.rows; ++i) std::memcpy(D.row(at[size_t(i)]), S.row(i), size_t(S.cols) * sizeof(float));
}

void zero_rows_at(TensorView t, std::span<const int64_t> at) {
    const Rows<float> T = f32_rows(t, "zero_rows_at: t");
    for (int64_t p : at) TESSERA_CHECK(p >= 0 && p < T.rows, "zero_rows_at: position {} of {} rows", p, T.rows);
    if (op_device("zero_rows_at", {t}) == Device::cuda) return TESSERA_ON_CUDA(zero_rows_at(t, at));
    for (int64_t p : at) std::memset(T.row(p), 0, size_t(T.cols) * sizeof(float));
}

void zero_rows(TensorView t, int64_t rows) {
    TESSERA_CHECK(t.ndim() >= 1 && 0 <= rows && rows <= t.size(0), "zero_rows: {} rows of {}", rows, t.shape.str());
    TESSERA_CHECK(t.dtype != DType::mxfp4, "zero_rows: an mxfp4 tensor {}", t.shape.str());
    if (rows == 0) return;
    const int64_t cols = t.numel() / t.size(0);
    const size_t row_bytes = dtype_bytes(t.dtype, cols);
    const bool contiguous = t.is_contiguous();
    TESSERA_CHECK(contiguous || (t.ndim() == 2 && t.strides[1] == 1),
                  "zero_rows: {} must be contiguous or a row-strided matrix", t.shape.str());
    if (op_device("zero_rows", {t}) == Device::cuda) return TESSERA_ON_CUDA(zero_rows(t, rows));
    const size_t pitch = contiguous ? row_bytes : dtype_bytes(t.dtype, t.strides[0]);
    if (contiguous) {  // in pieces of 64 KiB shared by the threads (a layer's gradient is megabytes)
        constexpr size_t kPiece = size_t(1) << 16;
        const size_t bytes = row_bytes * size_t(rows), pieces = (bytes + kPiece - 1) / kPiece;
        // NOTES: a plain branch, not an `if` clause: libgomp allocates a team for every region it runs serially, and
        // the training step allocates nothing after its first (tests/model/test_no_alloc.cpp)
        if (pieces <= 4 || omp_in_parallel()) {
            std::memset(t.data, 0, bytes);
            return;
        }
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < pieces; ++i)
            std::memset(static_cast<std::byte*>(t.data) + i * kPiece, 0, std::min(kPiece, bytes - i * kPiece));
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; ++n) std::memset(static_cast<std::byte*>(t.data) + size_t(n) * pitch, 0, row_bytes);
}

void sigmoid_forward(TensorView x, TensorView y) {
    const Rows<float> X = f32_rows(x, "sigmoid: x"), Y = f32_rows(y, "sigmoid: y");
    check_alike(X, Y, "sigmoid", "y");
    if (op_device("sigmoid", {x, y}) == Device::cuda) return TESSERA_ON_CUDA(sigmoid_forward(x, y));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < X.rows; ++n) {
        const float* xr = X.row(n);
        float* yr = Y.row(n);
#pragma omp simd
        for (int64_t c = 0; c < X.cols; ++c) yr[c] = vsigmoid(xr[c]);
    }
}

void sigmoid_backward(TensorView dy, TensorView y, TensorView dx) {
    const Rows<float> DY = f32_rows(dy, "sigmoid: dy"), Y = f32_rows(y, "sigmoid: y"), DX = f32_rows(dx, "sigmoid: dx");
    check_alike(Y, DY, "sigmoid", "dy");
    check_alike(Y, DX, "sigmoid", "dx");
    if (op_device("sigmoid", {dy, y, dx}) == Device::cuda) return TESSERA_ON_CUDA(sigmoid_backward(dy, y, dx));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < Y.rows; ++n) {
        const float *dyr = DY.row(n), *yr = Y.row(n);
        float* dxr = DX.row(n);
#pragma omp simd
        for (int64_t c = 0; c < Y.cols; ++c) dxr[c] += dyr[c] * yr[c] * (1.0f - yr[c]);
    }
}

void expand_groups(TensorView src, TensorView dst) {
    const Rows<float> S = f32_rows(src, "expand_groups: src"), D = f32_rows(dst, "expand_groups: dst");
    const int64_t K = group_width(S, D, "expand_groups", "dst");
    if (op_device("expand_groups", {src, dst}) == Device::cuda) return TESSERA_ON_CUDA(expand_groups(src, dst));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < S.rows; ++n) {
        for (int64_t g = 0; g < S.cols; ++g) std::fill_n(D.row(n) + g * K, K, S.row(n)[g]);
    }
}

void sum_groups(TensorView src, TensorView dst) {
    const Rows<float> S = f32_rows(src, "sum_groups: src"), D = f32_rows(dst, "sum_groups: dst");
    const int64_t K = group_width(D, S, "sum_groups", "src");
    if (op_device("sum_groups", {src, dst}) == Device::cuda) return TESSERA_ON_CUDA(sum_groups(src, dst));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < D.rows; ++n) {
        for (int64_t g = 0; g < D.cols; ++g) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; ++k) acc += S.row(n)[g * K + k];
            D.row(n)[g] = acc;
        }
    }
}

void output_gate_forward(TensorView z, TensorView o, TensorView gate, TensorView y) {
    const Rows<float> Z = f32_rows(z, "output_gate: z"), O = f32_rows(o, "output_gate: o"),
                      Gt = f32_rows(gate, "output_gate: gate"), Y = f32_rows(y, "output_gate: y");
    check_alike(Z, Gt, "output_gate", "gate");
    check_alike(O, Y, "output_gate", "y");
    const int64_t per = group_width(Z, O, "output_gate", "o");
    if (op_device("output_gate", {z, o, gate, y}) == Device::cuda)
        return TESSERA_ON_CUDA(output_gate_forward(z, o, gate, y));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < Z.rows; ++n) {
        const float *zr = Z.row(n), *orow = O.row(n);
        float *gr = Gt.row(n), *yr = Y.row(n);
        for (int64_t g = 0; g < Z.cols; ++g) {
            gr[g] = vsigmoid(zr[g]);
            for (int64_t e = g * per; e < (g + 1) * per; ++e) yr[e] = orow[e] * gr[g];
        }
    }
}

void output_gate_backward(TensorView dy, TensorView o, TensorView gate, TensorView dov, TensorView dz) {
    const Rows<float> DY = f32_rows(dy, "output_gate: dy"), O = f32_rows(o, "output_gate: o"),
                      Gt = f32_rows(gate, "output_gate: gate"), DO = f32_rows(dov, "output_gate: do"),
                      DZ = f32_rows(dz, "output_gate: dz");
    check_alike(O, DY, "output_gate", "dy");
    check_alike(O, DO, "output_gate", "do");
    check_alike(Gt, DZ, "output_gate", "dz");
    const int64_t per = group_width(Gt, O, "output_gate", "o");
    if (op_device("output_gate", {dy, o, gate, dov, dz}) == Device::cuda)
        return TESSERA_ON_CUDA(output_gate_backward(dy, o, gate, dov, dz));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < Gt.rows; ++n) {
        const float *dyr = DY.row(n), *orow = O.row(n), *gr = Gt.row(n);
        float *dor = DO.row(n), *dzr = DZ.row(n);
        for (int64_t g = 0; g < Gt.cols; ++g) {
            float acc = 0.f;
            for (int64_t e = g * per; e < (g + 1) * per; ++e) {
                acc += dyr[e] * orow[e];
                dor[e] = dyr[e] * gr[g];
            }
            dzr[g] = acc * gr[g] * (1.f - gr[g]);
        }
    }
}

}  // namespace tessera::ops
