// matmul_heads (ops/matmul.h): the entry point (checks, then CUDA tensors to ops/cuda) and the CPU's loop of
// ops::gemm over heads.
#include "ops/matmul.h"

#include "ops/backend.h"
#include "ops/views.h"

namespace tessera::ops {

namespace {
// One operand's [rows, cols] per head as stored, and its op()'s shape.
struct Operand {
    int64_t heads, rows, cols;
    int64_t op_rows(Trans t) const { return t == Trans::N ? rows : cols; }
    int64_t op_cols(Trans t) const { return t == Trans::N ? cols : rows; }
};

Operand operand(const TensorView& t, const char* what) {
    TESSERA_CHECK(t.ndim() == 3, "matmul_heads: {} must be [H, rows, cols], not {}", what, t.shape.str());
    TESSERA_CHECK(t.strides[2] == 1 || t.size(2) == 1, "matmul_heads: {} {} needs a contiguous last dimension", what,
                  t.shape.str());
    return {t.size(0), t.size(1), t.size(2)};
}
}  // namespace

TensorView head_matrices(TensorView rows, int64_t col, int64_t heads, int64_t head_stride, int64_t cols) {
    TESSERA_CHECK(rows.ndim() == 2 && rows.strides[1] == 1, "head_matrices: a row-major matrix, not {}",
                  rows.shape.str());
    TESSERA_CHECK(heads >= 1 && col >= 0 && col + (heads - 1) * head_stride + cols <= rows.size(1),
                  "head_matrices: {} heads of {} columns at {} (stride {}) exceed {}", heads, cols, col, head_stride,
                  rows.shape.str());
    TensorView v = rows.columns(col, cols);
    v.shape = Shape{heads, rows.size(0), cols};
    v.strides = {head_stride, rows.strides[0], 1};
    return v;
}

void matmul_heads(Trans ta, Trans tb, double alpha, TensorView a, TensorView b, double beta, TensorView c) {
    const Operand A = operand(a, "a"), B = operand(b, "b"), C = operand(c, "c");
    TESSERA_CHECK(A.heads == B.heads && A.heads == C.heads, "matmul_heads: {}, {} and {} heads differ", A.heads,
                  B.heads, C.heads);
    const int64_t M = A.op_rows(ta), K = A.op_cols(ta), N = B.op_cols(tb);
    TESSERA_CHECK(B.op_rows(tb) == K && C.rows == M && C.cols == N,
                  "matmul_heads: op(a) [{}, {}] · op(b) [{}, {}] does not give c [{}, {}]", M, K, B.op_rows(tb), N,
                  C.rows, C.cols);
    TESSERA_CHECK(a.dtype == b.dtype && a.dtype == c.dtype, "matmul_heads: a, b, c are {}, {}, {}", dtype_name(a.dtype),
                  dtype_name(b.dtype), dtype_name(c.dtype));
    if (op_device("matmul_heads", {a, b, c}) == Device::cuda)
        return TESSERA_ON_CUDA(matmul_heads(ta, tb, alpha, a, b, beta, c));
    dispatch_float(a.dtype, "matmul_heads", [&]<class T>(T) {
        for (int64_t h = 0; h < A.heads; ++h) {
            gemm(ta, tb, M, N, K, T(alpha), a.ptr<T>() + h * a.strides[0], a.strides[1], b.ptr<T>() + h * b.strides[0],
                 b.strides[1], T(beta), c.ptr<T>() + h * c.strides[0], c.strides[1]);
        }
    });
}

}  // namespace tessera::ops
