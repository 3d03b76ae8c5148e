// Tensor views (non-owning: pointer, dtype, shape, strides, device) and a small owning tensor (host
// memory unless asked for a device) used by file i/o, the op runner and tests. Model buffers live in
// the arena and are seen as views.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>

#include "core/check.h"
#include "core/dtype.h"

namespace tessera {

enum class Device : uint8_t { cpu, cuda };

constexpr int kMaxDims = 6;

struct Shape {
    int ndim = 0;
    std::array<int64_t, kMaxDims> dims{};

    Shape() = default;
    Shape(std::initializer_list<int64_t> d);
    static Shape from_span(std::span<const int64_t> d);

    int64_t operator[](int i) const { return dims[i]; }
    int64_t& operator[](int i) { return dims[i]; }
    int64_t numel() const;
    bool operator==(const Shape& o) const;
    std::string str() const;  // "[2, 3]"
};

struct TensorView {
    void* data = nullptr;
    DType dtype = DType::f32;
    Device device = Device::cpu;
    Shape shape;
    std::array<int64_t, kMaxDims> strides{};  // in elements
    // Non-null: dimension 0's slices are stored apart, slice i at slices[i], each contiguous (a stacked expert
    // weight read in place from a file that stores one tensor per expert: train/weight_budget.h). An mxfp4 one is in
    // the checkpoint's layout (core/mxfp4.h): slice i's packed values at slices[2i], its scales at slices[2i + 1].
    // data is then null and the view is not contiguous; slice0 reaches the slices (a single one contiguous, but for
    // mxfp4), the other reshaping calls refuse it.
    void* const* slices = nullptr;

    TensorView() = default;
    // a contiguous (row-major) view
    TensorView(void* data, DType dtype, Shape shape, Device device = Device::cpu);
    // a view whose dimension-0 slices live at slices[0 .. shape[0]), for mxfp4 [0 .. 2·shape[0]) (see above; host
    // memory)
    static TensorView stored_apart(void* const* slices, DType dtype, Shape shape);

    int ndim() const { return shape.ndim; }
    int64_t size(int i) const { return shape.dims[i < 0 ? i + shape.ndim : i]; }
    int64_t numel() const { return shape.numel(); }
    size_t nbytes() const { return dtype_bytes(dtype, numel()); }
    // a default-constructed view is "absent" (optional inputs); a scalar has ndim 0 and data
    bool defined() const { return data != nullptr || shape.ndim > 0; }
    bool is_contiguous() const;

    template <class T>
    T* ptr() const {
        TESSERA_CHECK(dtype == dtype_of<T>(), "tensor is {} but {} was expected", dtype_name(dtype),
                      dtype_name(dtype_of<T>()));
        return static_cast<T*>(data);
    }
    // same memory, new shape (contiguous views only)
    TensorView reshape(Shape s) const;
    // rows [begin, end) of dimension 0 (contiguous views, or slices stored apart: one is then contiguous)
    TensorView slice0(int64_t begin, int64_t end) const;
    // the first shape.numel() elements seen with a new shape (contiguous views only)
    TensorView prefix(Shape s) const;
    // positions [begin, begin + length) of dimension `dim`, same strides (no copy; any view)
    TensorView narrow(int dim, int64_t begin, int64_t length) const;
    // narrow on the last dimension: a column block [.., width] of a row-major buffer
    TensorView columns(int64_t col, int64_t width) const { return narrow(shape.ndim - 1, col, width); }
};

// Shape and dtype checks with messages that name the tensor: "rmsnorm: x is [4, 8] f32 but ..."
void check_shape(const TensorView& t, const Shape& expected, std::string_view what);
void check_dtype(const TensorView& t, DType expected, std::string_view what);
void check_contiguous(const TensorView& t, std::string_view what);
// The same with the name in two parts, "where: what", joined only when the check fails (hot paths
// build no strings).
void check_shape(const TensorView& t, const Shape& expected, std::string_view where, std::string_view what);
void check_dtype(const TensorView& t, DType expected, std::string_view where, std::string_view what);
void check_contiguous(const TensorView& t, std::string_view where, std::string_view what);

// Owning tensor on a device (host by default; core/device.h; 256-byte aligned). Moves, does not copy
// implicitly.
class Tensor {
  public:
    Tensor() = default;
    Tensor(DType dtype, Shape shape, Device device = Device::cpu);  // zero-filled
    static Tensor zeros_like(const TensorView& v) { return Tensor(v.dtype, v.shape, v.device); }
    static Tensor copy_of(const TensorView& v);  // contiguous copy on v's device
    Tensor to(Device device) const;              // a copy on that device

    Device device() const { return view_.device; }
    TensorView view() const { return view_; }
    operator TensorView() const { return view_; }
    DType dtype() const { return view_.dtype; }
    const Shape& shape() const { return view_.shape; }
    int64_t numel() const { return view_.numel(); }
    template <class T>
    T* ptr() const {
        return view_.ptr<T>();
    }

  private:
    struct Free {
        Device device;  // value-initialised (Device::cpu) by unique_ptr's default constructor
        void operator()(void* p) const;
    };
    std::unique_ptr<void, Free> storage_;
    TensorView view_;
};

// Element conversion between float dtypes (f32, f64, bf16) of contiguous views of equal numel.
void convert(const TensorView& src, const TensorView& dst);

}  // namespace tessera
