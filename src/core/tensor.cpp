// Tensor views, owning tensors, dtype names and conversions.
#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

#include "core/device.h"
#include "core/mxfp4.h"

namespace tessera {

Shape::Shape(std::initializer_list<int64_t> d) {
    TESSERA_CHECK(d.size() <= size_t(kMaxDims), "tensor rank {} exceeds the maximum {}", d.size(), kMaxDims);
    ndim = int(d.size());
    int i = 0;
    for (int64_t x : d) dims[i++] = x;
}

Shape Shape::from_span(std::span<const int64_t> d) {
    TESSERA_CHECK(d.size() <= size_t(kMaxDims), "tensor rank {} exceeds the maximum {}", d.size(), kMaxDims);
    Shape s;
    s.ndim = int(d.size());
    for (size_t i = 0; i < d.size(); ++i) s.dims[i] = d[i];
    return s;
}

int64_t Shape::numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) {
        // NOTES: sizes come from configs and files; a product that wrapped would size a tiny buffer that a
        // kernel then writes past, so every product is checked here, where all buffer sizes are computed.
        TESSERA_CHECK(dims[i] >= 0, "tensor shape {} has a negative dimension", str());
        TESSERA_CHECK(!__builtin_mul_overflow(n, dims[i], &n), "tensor shape {} has more than 2^63 elements", str());
    }
    return n;
}

bool Shape::operator==(const Shape& o) const {
    if (ndim != o.ndim) return false;
    for (int i = 0; i < ndim; ++i) {
        if (dims[i] != o.dims[i]) return false;
    }
    return true;
}

std::string Shape::str() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) {
        if (i) s += ", ";
        s += std::to_string(dims[i]);
    }
    return s + "]";
}

TensorView::TensorView(void* data_, DType dtype_, Shape shape_, Device device_)
    : data(data_), dtype(dtype_), device(device_), shape(shape_) {
    int64_t stride = 1;
    for (int i = shape.ndim - 1; i >= 0; --i) {
        strides[i] = stride;
        stride *= shape.dims[i];
    }
}

TensorView TensorView::stored_apart(void* const* slices, DType dtype, Shape shape) {
    TESSERA_CHECK(shape.ndim >= 1, "a {} {} tensor cannot have its slices stored apart", dtype_name(dtype),
                  shape.str());
    TensorView v(nullptr, dtype, shape);
    v.slices = slices;
    return v;
}

bool TensorView::is_contiguous() const {
    if (slices) return false;
    int64_t stride = 1;
    for (int i = shape.ndim - 1; i >= 0; --i) {
        if (shape.dims[i] != 1 && strides[i] != stride) return false;
        stride *= shape.dims[i];
    }
    return true;
}

TensorView TensorView::reshape(Shape s) const {
    TESSERA_CHECK(is_contiguous(), "reshape of a non-contiguous tensor {}", shape.str());
    TESSERA_CHECK(s.numel() == numel(), "cannot reshape {} to {}", shape.str(), s.str());
    return TensorView(data, dtype, s, device);
}

TensorView TensorView::slice0(int64_t begin, int64_t end) const {
    TESSERA_CHECK((slices || is_contiguous()) && shape.ndim >= 1, "slice0 needs a contiguous tensor of rank >= 1");
    TESSERA_CHECK(0 <= begin && begin <= end && end <= shape.dims[0], "slice [{}, {}) out of range for {}", begin, end,
                  shape.str());
    Shape s = shape;
    s.dims[0] = end - begin;
    if (dtype == DType::mxfp4 && slices) return stored_apart(slices + 2 * begin, dtype, s);  // (pairs: see tensor.h)
    if (slices)
        return end - begin == 1 ? TensorView(slices[begin], dtype, s, device) : stored_apart(slices + begin, dtype, s);
    TESSERA_CHECK(dtype != DType::mxfp4 || begin * strides[0] % 32 == 0,
                  "slice0 of an mxfp4 tensor {} must start at a block of 32 values", shape.str());
    char* base = static_cast<char*>(data) + dtype_bytes(dtype, begin * strides[0]);
    return TensorView(base, dtype, s, device);
}

TensorView TensorView::prefix(Shape s) const {
    TESSERA_CHECK(is_contiguous(), "prefix of a non-contiguous tensor {}", shape.str());
    TESSERA_CHECK(s.numel() <= numel(), "prefix {} is larger than the tensor {}", s.str(), shape.str());
    return TensorView(data, dtype, s, device);
}

TensorView TensorView::narrow(int dim, int64_t begin, int64_t length) const {
    TESSERA_CHECK(0 <= dim && dim < shape.ndim, "narrow: dimension {} of {}", dim, shape.str());
    TESSERA_CHECK(0 <= begin && 0 <= length && begin + length <= shape.dims[dim],
                  "narrow: [{}, {}) of dimension {} is out of range for {}", begin, begin + length, dim, shape.str());
    TESSERA_CHECK(dtype != DType::mxfp4, "narrow of an mxfp4 tensor {}", shape.str());
    TESSERA_CHECK(!slices, "narrow of a tensor {} whose slices are stored apart", shape.str());
    TensorView v = *this;
    v.data = static_cast<char*>(data) + dtype_bytes(dtype, begin * strides[dim]);
    v.shape.dims[dim] = length;
    return v;
}

void check_shape(const TensorView& t, const Shape& expected, std::string_view what) {
    TESSERA_CHECK(t.shape == expected, "{} is {} but {} was expected", what, t.shape.str(), expected.str());
}

void check_dtype(const TensorView& t, DType expected, std::string_view what) {
    TESSERA_CHECK(t.dtype == expected, "{} is {} but {} was expected", what, dtype_name(t.dtype), dtype_name(expected));
}

void check_contiguous(const TensorView& t, std::string_view what) {
    TESSERA_CHECK(t.is_contiguous(), "{} must be contiguous", what);
}

void check_shape(const TensorView& t, const Shape& expected, std::string_view where, std::string_view what) {
    TESSERA_CHECK(t.shape == expected, "{}: {} is {} but {} was expected", where, what, t.shape.str(), expected.str());
}

void check_dtype(const TensorView& t, DType expected, std::string_view where, std::string_view what) {
    TESSERA_CHECK(t.dtype == expected, "{}: {} is {} but {} was expected", where, what, dtype_name(t.dtype),
                  dtype_name(expected));
}

void check_contiguous(const TensorView& t, std::string_view where, std::string_view what) {
    TESSERA_CHECK(t.is_contiguous(), "{}: {} must be contiguous", where, what);
}

void Tensor::Free::operator()(void* p) const { device_free(device, p); }

Tensor::Tensor(DType dtype, Shape shape, Device device) {
    const size_t bytes = dtype_bytes(dtype, shape.numel());
    TESSERA_CHECK(bytes <= (SIZE_MAX >> 1), "tensor {} {} is too large", dtype_name(dtype), shape.str());
    void* p = device_alloc(device, bytes);
    storage_ = std::unique_ptr<void, Free>(p, Free{device});
    device_zero(device, p, (bytes + 63) / 64 * 64);
    view_ = TensorView(p, dtype, shape, device);
}

Tensor Tensor::copy_of(const TensorView& v) {
    check_contiguous(v, "copied tensor");
    Tensor t(v.dtype, v.shape, v.device);
    copy_bytes(t.view_.data, v.device, v.data, v.device, v.nbytes());
    return t;
}

Tensor Tensor::to(Device device) const {
    Tensor t(view_.dtype, view_.shape, device);
    copy_bytes(t.view_.data, device, view_.data, view_.device, view_.nbytes());
    return t;
}

namespace {
double load_float(const void* p, DType t, int64_t i) {
    switch (t) {
        case DType::f32:
            return static_cast<const float*>(p)[i];
        case DType::f64:
            return static_cast<const double*>(p)[i];
        case DType::bf16:
            return bf16_to_float(static_cast<const bf16*>(p)[i]);
        default:
            TESSERA_FAIL("convert: {} is not a float type", dtype_name(t));
    }
}
void store_float(void* p, DType t, int64_t i, double x) {
    switch (t) {
        case DType::f32:
            static_cast<float*>(p)[i] = float(x);
            return;
        case DType::f64:
            static_cast<double*>(p)[i] = x;
            return;
        case DType::bf16:
            static_cast<bf16*>(p)[i] = float_to_bf16(float(x));
            return;
        default:
            TESSERA_FAIL("convert: {} is not a float type", dtype_name(t));
    }
}
}  // namespace

void convert(const TensorView& src, const TensorView& dst) {
    TESSERA_CHECK(src.numel() == dst.numel(), "convert: {} elements into {}", src.numel(), dst.numel());
    check_contiguous(src, "convert source");
    check_contiguous(dst, "convert destination");
    TESSERA_CHECK(dtype_is_float(src.dtype) && dtype_is_float(dst.dtype), "convert: {} -> {} is not supported",
                  dtype_name(src.dtype), dtype_name(dst.dtype));
    const int64_t n = src.numel();
    if (src.dtype == dst.dtype) {
        std::memmove(dst.data, src.data, src.nbytes());
        return;
    }
    if (src.dtype == DType::mxfp4 || dst.dtype == DType::mxfp4) {  // through f32 (MXFP4 widens to f32 exactly)
        Tensor wide(DType::f32, src.shape);
        if (src.dtype == DType::mxfp4) {
            mxfp4_to_f32(Mxfp4{static_cast<const uint8_t*>(src.data)}, n, wide.ptr<float>());
        } else {
            convert(src, wide.view());
        }
        if (dst.dtype == DType::mxfp4) {
            f32_to_mxfp4(wide.ptr<float>(), n, static_cast<uint8_t*>(dst.data));
        } else {
            convert(wide.view(), dst);
        }
        return;
    }
    if (src.dtype == DType::f32 && dst.dtype == DType::bf16) {  // (saved activations: ops::cast, per thread)
        const float* s = src.ptr<float>();
        bf16* d = dst.ptr<bf16>();
        for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
    } else if (src.dtype == DType::bf16 && dst.dtype == DType::f32) {
        const bf16* s = src.ptr<bf16>();
        float* d = dst.ptr<float>();
        for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_float(s[i]);
    } else {
        for (int64_t i = 0; i < n; ++i) store_float(dst.data, dst.dtype, i, load_float(src.data, src.dtype, i));
    }
}

}  // namespace tessera
