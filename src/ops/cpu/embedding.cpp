// Embedding forward/backward: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU's copies. An id
// outside [0, V) is an error naming its position.
#include "ops/embedding.h"

#include <algorithm>
#include <cstring>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::load_index;

namespace {
void check_ids(TensorView ids, int64_t vocab) {
    cpu::check_index_dtype(ids, "embedding: ids");
    for (int64_t n = 0; n < ids.numel(); ++n) {
        int64_t id = load_index(ids, n);
        TESSERA_CHECK(0 <= id && id < vocab, "embedding: ids[{}] = {} is outside the vocabulary [0, {})", n, id, vocab);
    }
}
}  // namespace

void embedding_forward(TensorView ids, TensorView table, TensorView y) {
    note_op_use("embedding");
    TESSERA_CHECK(table.ndim() == 2, "embedding: table must be [V, D], not {}", table.shape.str());
    const int64_t N = ids.numel(), D = table.size(1);
    cpu::check_index_dtype(ids, "embedding: ids");
    check_shape(y, Shape{N, D}, "embedding: y");
    check_contiguous(table, "embedding: table");
    check_contiguous(y, "embedding: y");
    TESSERA_CHECK(y.dtype == table.dtype || (table.dtype == DType::bf16 && y.dtype == DType::f32),
                  "embedding: y is {} but the table is {}", dtype_name(y.dtype), dtype_name(table.dtype));
    if (op_device("embedding", {ids, table, y}) == Device::cuda)
        return TESSERA_ON_CUDA(embedding_forward(ids, table, y));
    check_ids(ids, table.size(0));
    if (table.dtype == DType::bf16 && y.dtype == DType::f32) {  // a frozen base kept in bf16: rows widened
        const bf16* src = table.ptr<bf16>();
        float* dst = y.ptr<float>();
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const bf16* row = src + load_index(ids, n) * D;
            for (int64_t d = 0; d < D; ++d) dst[n * D + d] = bf16_to_float(row[d]);
        }
        return;
    }
    const size_t row_bytes = size_t(D) * dtype_size(table.dtype);
    const auto* src = static_cast<const std::byte*>(table.data);
    auto* dst = static_cast<std::byte*>(y.data);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) std::memcpy(dst + n * row_bytes, src + load_index(ids, n) * row_bytes, row_bytes);
}

void embedding_backward(TensorView dy, TensorView ids, TensorView dtable) {
    const Device device = op_device("embedding", {dy, ids, dtable});
    dispatch_float(dtable.dtype, "embedding", [&]<class T>(T) {
        TESSERA_CHECK(dtable.ndim() == 2, "embedding: dtable must be [V, D], not {}", dtable.shape.str());
        const int64_t N = ids.numel(), D = dtable.size(1);
        cpu::check_index_dtype(ids, "embedding: ids");
        check_shape(dy, Shape{N, D}, "embedding: dy");
        check_dtype(dy, dtable.dtype, "embedding: dy");
        check_contiguous(dy, "embedding: dy");
        check_contiguous(dtable, "embedding: dtable");
        if (device == Device::cuda) return TESSERA_ON_CUDA(embedding_backward(dy, ids, dtable));
        check_ids(ids, dtable.size(0));
        const T* DY = dy.ptr<T>();
        T* DT = dtable.ptr<T>();
        // NOTES: each thread owns a column range and walks the tokens in order, so repeated ids
        // accumulate in the same order on any thread count.
        constexpr int64_t kCols = 64;
#pragma omp parallel for schedule(static)
        for (int64_t c0 = 0; c0 < D; c0 += kCols) {
            const int64_t c1 = std::min(D, c0 + kCols);
            for (int64_t n = 0; n < N; ++n) {
                const T* src = DY + n * D;
                T* dst = DT + load_index(ids, n) * D;
                for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
            }
        }
    });
}

}  // namespace tessera::ops
