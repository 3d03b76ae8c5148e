// Helpers shared by both backends' op entry points (ops/cpu and ops/cuda): dtype dispatch (f32 / f64),
// row-strided matrix views and the integer-index check. Views only read a TensorView's metadata, never its
// data, so they work on device memory too.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/tensor.h"

namespace tessera::ops {

// Calls f(float{}) or f(double{}) by the dtype of the op's float tensors.
template <class F>
void dispatch_float(DType t, std::string_view op, F&& f) {
    if (t == DType::f32) {
        f(float{});
    } else if (t == DType::f64) {
        f(double{});
    } else {
        TESSERA_FAIL("{}: tensors are {}; f32 and f64 are supported", op, dtype_name(t));
    }
}

// A matrix seen as rows of a view: leading dims collapsed, last dim contiguous, rows ld apart.
template <class T>
struct Rows {
    T* data = nullptr;
    int64_t rows = 0;
    int64_t cols = 0;
    int64_t ld = 0;
    T* row(int64_t r) const { return data + r * ld; }
};

// Accepts a 1-D view (one row), or a view whose dims before the last collapse with one row stride.
template <class T>
Rows<T> rows_of(const TensorView& v, std::string_view what) {
    TESSERA_CHECK(v.ndim() >= 1, "{} must have at least one dimension", what);
    const int last = v.ndim() - 1;
    TESSERA_CHECK(v.strides[last] == 1 || v.size(last) == 1, "{}: the last dimension must be contiguous", what);
    Rows<T> r;
    r.data = v.ptr<T>();
    r.cols = v.size(last);
    r.rows = 1;
    for (int i = 0; i < last; ++i) r.rows *= v.size(i);
    r.ld = last == 0 ? r.cols : v.strides[last - 1];
    for (int i = last - 1; i > 0; --i) {
        TESSERA_CHECK(v.size(i) == 1 || v.strides[i - 1] == v.strides[i] * v.size(i),
                      "{}: leading dimensions must be collapsible into rows", what);
    }
    return r;
}

inline void check_index_dtype(const TensorView& ids, std::string_view what) {
    TESSERA_CHECK(ids.dtype == DType::i32 || ids.dtype == DType::i64, "{} must be i32 or i64, not {}", what,
                  dtype_name(ids.dtype));
    check_contiguous(ids, what);
}

}  // namespace tessera::ops
