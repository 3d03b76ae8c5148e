// The image tower's ops (ops/vision.h): entry points (checks, then CUDA tensors to ops/cuda) and the CPU kernels. Every
// output element is written by one thread walking its inputs in a fixed order, so results do not depend on the
// thread count.
#include "ops/vision.h"

#include <array>
#include <cmath>
#include <numbers>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"

namespace tessera::ops {

using cpu::dispatch_float;

int64_t grid_patches(std::span<const PatchGrid> grids) {
    int64_t n = 0;
    for (const PatchGrid& g : grids) {
        TESSERA_CHECK(g.h > 0 && g.w > 0, "image grid {}x{}: sizes must be positive", g.h, g.w);
        n += g.patches();
    }
    return n;
}

namespace {

void check_rows_like(const TensorView& a, const TensorView& b, std::string_view op, std::string_view what) {
    TESSERA_CHECK(a.ndim() == 2 && b.ndim() == 2 && a.shape == b.shape, "{}: {} {} must be shaped like x {}", op, what,
                  b.shape.str(), a.shape.str());
    TESSERA_CHECK(a.dtype == b.dtype, "{}: {} is {} but x is {}", op, what, dtype_name(b.dtype), dtype_name(a.dtype));
}

// ---- gelu ----

template <class T>
T gelu_value(Gelu kind, T x) {
    if (kind == Gelu::erf) return T(0.5) * x * (T(1) + std::erf(x * T(std::numbers::sqrt2 / 2)));
    const T c = T(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);  // √(2/π)
    return T(0.5) * x * (T(1) + std::tanh(c * (x + T(0.044715) * x * x * x)));
}

template <class T>
T gelu_slope(Gelu kind, T x) {
    if (kind == Gelu::erf) {
        const T cdf = T(0.5) * (T(1) + std::erf(x * T(std::numbers::sqrt2 / 2)));
        const T pdf = std::exp(T(-0.5) * x * x) * T(0.5 * std::numbers::sqrt2 * std::numbers::inv_sqrtpi);  // 1/√(2π)
        return cdf + x * pdf;
    }
    const T c = T(std::numbers::sqrt2 * std::numbers::inv_sqrtpi), a = T(0.044715);
    const T t = std::tanh(c * (x + a * x * x * x));
    return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * c * (T(1) + T(3) * a * x * x);
}

// ---- rope_2d ----

template <class T>
void rope_2d(double theta,
             std::span<const PatchGrid> grids,
             const TensorView& src,
             const TensorView& dst,
             double sign,
             bool accumulate) {
    const int64_t H = src.size(1), D = src.size(2), pairs = D / 2;
    std::array<double, 256> freq{};  // D/4 <= 256 checked by the callers
    for (int64_t j = 0; j < D / 4; ++j) freq[size_t(j)] = std::pow(theta, -4.0 * double(j) / double(D));
    const T* S = src.ptr<T>();
    T* Y = dst.ptr<T>();
    int64_t base = 0;
    for (const PatchGrid& g : grids) {
#pragma omp parallel
        {
            std::array<T, 512> cs{}, sn{};
#pragma omp for schedule(static)
            for (int64_t p = 0; p < g.patches(); ++p) {
                const double col = double(p % g.w), row = double(p / g.w);
                for (int64_t i = 0; i < pairs; ++i) {
                    const double angle = (i % 2 == 0 ? col : row) * freq[size_t(i / 2)];
                    cs[size_t(i)] = T(std::cos(angle));
                    sn[size_t(i)] = T(sign * std::sin(angle));
                }
                const int64_t n = base + p;
                for (int64_t h = 0; h < H; ++h) {
                    const T* x = S + n * src.strides[0] + h * src.strides[1];
                    T* y = Y + n * dst.strides[0] + h * dst.strides[1];
                    for (int64_t i = 0; i < pairs; ++i) {
                        const T x1 = x[2 * i], x2 = x[2 * i + 1];
                        const T y1 = x1 * cs[size_t(i)] - x2 * sn[size_t(i)];
                        const T y2 = x2 * cs[size_t(i)] + x1 * sn[size_t(i)];
                        if (accumulate) {
                            y[2 * i] += y1;
                            y[2 * i + 1] += y2;
                        } else {
                            y[2 * i] = y1;
                            y[2 * i + 1] = y2;
                        }
                    }
                }
            }
        }
        base += g.patches();
    }
}

void check_rope_2d(std::span<const PatchGrid> grids, const TensorView& a, const TensorView& b, std::string_view what) {
    TESSERA_CHECK(a.ndim() == 3 && a.strides[2] == 1, "rope_2d: x must be [N, H, D] with D contiguous, not {}",
                  a.shape.str());
    TESSERA_CHECK(b.shape == a.shape && b.strides[2] == 1, "rope_2d: {} {} must be shaped like x {}", what,
                  b.shape.str(), a.shape.str());
    TESSERA_CHECK(a.dtype == b.dtype, "rope_2d: {} is {} but x is {}", what, dtype_name(b.dtype), dtype_name(a.dtype));
    TESSERA_CHECK(a.size(2) % 4 == 0 && a.size(2) <= 1024, "rope_2d: head dim {} must be a multiple of 4, at most 1024",
                  a.size(2));
    TESSERA_CHECK(grid_patches(grids) == a.size(0), "rope_2d: the grids hold {} patches but x has {} rows",
                  grid_patches(grids), a.size(0));
}

// ---- pos_embed ----

void check_table(std::span<const PatchGrid> grids, const TensorView& table, const TensorView& x, std::string_view op) {
    TESSERA_CHECK(table.ndim() == 3 && table.is_contiguous(), "{}: the table must be a contiguous [Ht, Wt, C], not {}",
                  op, table.shape.str());
    TESSERA_CHECK(x.ndim() == 2 && x.size(1) == table.size(2) && x.strides[1] == 1,
                  "{}: x {} must be [patches, {}] rows", op, x.shape.str(), table.size(2));
    TESSERA_CHECK(grid_patches(grids) == x.size(0), "{}: the grids hold {} patches but x has {} rows", op,
                  grid_patches(grids), x.size(0));
    TESSERA_CHECK(x.dtype == table.dtype, "{}: x is {} but the table is {}", op, dtype_name(x.dtype),
                  dtype_name(table.dtype));
}

template <class T>
void pos_embed_fwd(std::span<const PatchGrid> grids, const TensorView& table, const TensorView& x) {
    const int64_t Ht = table.size(0), Wt = table.size(1), C = table.size(2);
    const T* tab = table.ptr<T>();
    const cpu::Rows<T> xr = cpu::rows_of<T>(x, "pos_embed: x");
    int64_t base = 0;
    for (const PatchGrid& g : grids) {
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < g.patches(); ++p) {
            const BilinearTaps r = bilinear_taps(p / g.w, Ht, g.h), c = bilinear_taps(p % g.w, Wt, g.w);
            const T* t00 = tab + (r.i0 * Wt + c.i0) * C;
            const T* t01 = tab + (r.i0 * Wt + c.i1) * C;
            const T* t10 = tab + (r.i1 * Wt + c.i0) * C;
            const T* t11 = tab + (r.i1 * Wt + c.i1) * C;
            const T w00 = T(r.w0 * c.w0), w01 = T(r.w0 * c.w1), w10 = T(r.w1 * c.w0), w11 = T(r.w1 * c.w1);
            T* y = xr.row(base + p);
            for (int64_t k = 0; k < C; ++k) y[k] += w00 * t00[k] + w01 * t01[k] + w10 * t10[k] + w11 * t11[k];
        }
        base += g.patches();
    }
}

// dtable: each thread owns a range of channels and walks every patch in order (a fixed order per element).
template <class T>
void pos_embed_bwd(std::span<const PatchGrid> grids, const TensorView& dx, const TensorView& dtable) {
    const int64_t Ht = dtable.size(0), Wt = dtable.size(1), C = dtable.size(2);
    T* tab = dtable.ptr<T>();
    const cpu::Rows<T> dr = cpu::rows_of<T>(dx, "pos_embed: dx");
    constexpr int64_t kCols = 64;
#pragma omp parallel for schedule(static)
    for (int64_t k0 = 0; k0 < C; k0 += kCols) {
        const int64_t k1 = std::min(k0 + kCols, C);
        int64_t base = 0;
        for (const PatchGrid& g : grids) {
            for (int64_t p = 0; p < g.patches(); ++p) {
                const BilinearTaps r = bilinear_taps(p / g.w, Ht, g.h), c = bilinear_taps(p % g.w, Wt, g.w);
                const T* d = dr.row(base + p);
                const std::array<std::pair<int64_t, T>, 4> to{{{r.i0 * Wt + c.i0, T(r.w0 * c.w0)},
                                                               {r.i0 * Wt + c.i1, T(r.w0 * c.w1)},
                                                               {r.i1 * Wt + c.i0, T(r.w1 * c.w0)},
                                                               {r.i1 * Wt + c.i1, T(r.w1 * c.w1)}}};
                for (const auto& [cell, w] : to) {
                    if (w == T(0)) continue;
                    T* t = tab + cell * C;
                    for (int64_t k = k0; k < k1; ++k) t[k] += w * d[k];
                }
            }
            base += g.patches();
        }
    }
}

// ---- patch_merge ----

void check_merge(std::span<const PatchGrid> grids,
                 int64_t kh,
                 int64_t kw,
                 const TensorView& x,
                 const TensorView& y,
                 std::string_view op) {
    TESSERA_CHECK(kh > 0 && kw > 0, "{}: merge kernel {}x{} must be positive", op, kh, kw);
    int64_t merged = 0;
    for (const PatchGrid& g : grids) {
        TESSERA_CHECK(g.h > 0 && g.w > 0 && g.h % kh == 0 && g.w % kw == 0,
                      "{}: image grid {}x{} is not whole {}x{} cells", op, g.h, g.w, kh, kw);
        merged += g.patches() / (kh * kw);
    }
    TESSERA_CHECK(x.ndim() == 2 && x.size(0) == grid_patches(grids), "{}: x {} must be [{}, C]", op, x.shape.str(),
                  grid_patches(grids));
    TESSERA_CHECK(y.ndim() == 2 && y.size(0) == merged && y.size(1) == kh * kw * x.size(1),
                  "{}: the merged rows {} must be [{}, {}]", op, y.shape.str(), merged, kh * kw * x.size(1));
    TESSERA_CHECK(x.dtype == y.dtype, "{}: x is {} but the merged rows are {}", op, dtype_name(x.dtype),
                  dtype_name(y.dtype));
}

}  // namespace

void gelu_forward(Gelu kind, TensorView x, TensorView y) {
    check_rows_like(x, y, "gelu", "y");
    if (op_device("gelu", {x, y}) == Device::cuda) return TESSERA_ON_CUDA(gelu_forward(kind, x, y));
    dispatch_float(x.dtype, "gelu", [&]<class T>(T) {
        const cpu::Rows<T> xr = cpu::rows_of<T>(x, "gelu: x");
        const cpu::Rows<T> yr = cpu::rows_of<T>(y, "gelu: y");
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < xr.rows; ++r) {
            const T* a = xr.row(r);
            T* b = yr.row(r);
            for (int64_t k = 0; k < xr.cols; ++k) b[k] = gelu_value(kind, a[k]);
        }
    });
}

void gelu_backward(Gelu kind, TensorView dy, TensorView x, TensorView dx) {
    check_rows_like(x, dy, "gelu", "dy");
    check_rows_like(x, dx, "gelu", "dx");
    if (op_device("gelu", {dy, x, dx}) == Device::cuda) return TESSERA_ON_CUDA(gelu_backward(kind, dy, x, dx));
    dispatch_float(x.dtype, "gelu", [&]<class T>(T) {
        const cpu::Rows<T> xr = cpu::rows_of<T>(x, "gelu: x"), dr = cpu::rows_of<T>(dy, "gelu: dy");
        const cpu::Rows<T> gr = cpu::rows_of<T>(dx, "gelu: dx");
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < xr.rows; ++r) {
            const T *a = xr.row(r), *d = dr.row(r);
            T* g = gr.row(r);
            for (int64_t k = 0; k < xr.cols; ++k) g[k] += gelu_slope(kind, a[k]) * d[k];
        }
    });
}

void rope_2d_forward(double theta, std::span<const PatchGrid> grids, TensorView x, TensorView y) {
    check_rope_2d(grids, x, y, "y");
    if (op_device("rope_2d", {x, y}) == Device::cuda) return TESSERA_ON_CUDA(rope_2d_forward(theta, grids, x, y));
    dispatch_float(x.dtype, "rope_2d", [&]<class T>(T) { rope_2d<T>(theta, grids, x, y, +1.0, false); });
}

void rope_2d_backward(double theta, std::span<const PatchGrid> grids, TensorView dy, TensorView dx) {
    check_rope_2d(grids, dy, dx, "dx");
    TESSERA_CHECK(dx.data != dy.data, "rope_2d: dx must not alias dy");
    if (op_device("rope_2d", {dy, dx}) == Device::cuda) return TESSERA_ON_CUDA(rope_2d_backward(theta, grids, dy, dx));
    dispatch_float(dy.dtype, "rope_2d", [&]<class T>(T) { rope_2d<T>(theta, grids, dy, dx, -1.0, true); });
}

void pos_embed_forward(std::span<const PatchGrid> grids, TensorView table, TensorView x) {
    check_table(grids, table, x, "pos_embed");
    if (op_device("pos_embed", {table, x}) == Device::cuda) return TESSERA_ON_CUDA(pos_embed_forward(grids, table, x));
    dispatch_float(x.dtype, "pos_embed", [&]<class T>(T) { pos_embed_fwd<T>(grids, table, x); });
}

void pos_embed_backward(std::span<const PatchGrid> grids, TensorView dx, TensorView dtable) {
    check_table(grids, dtable, dx, "pos_embed");
    if (op_device("pos_embed", {dx, dtable}) == Device::cuda)
        return TESSERA_ON_CUDA(pos_embed_backward(grids, dx, dtable));
    dispatch_float(dx.dtype, "pos_embed", [&]<class T>(T) { pos_embed_bwd<T>(grids, dx, dtable); });
}

void patch_merge_forward(std::span<const PatchGrid> grids, int64_t kh, int64_t kw, TensorView x, TensorView y) {
    check_merge(grids, kh, kw, x, y, "patch_merge");
    if (op_device("patch_merge", {x, y}) == Device::cuda)
        return TESSERA_ON_CUDA(patch_merge_forward(grids, kh, kw, x, y));
    dispatch_float(x.dtype, "patch_merge", [&]<class T>(T) {
        const cpu::Rows<T> xr = cpu::rows_of<T>(x, "patch_merge: x");
        const cpu::Rows<T> yr = cpu::rows_of<T>(y, "patch_merge: y");
        const int64_t C = xr.cols;
        for_each_merge_slot(grids, kh, kw, [&](int64_t m, int64_t s, int64_t n) {
            std::copy(xr.row(n), xr.row(n) + C, yr.row(m) + s * C);
        });
    });
}

void patch_merge_backward(std::span<const PatchGrid> grids, int64_t kh, int64_t kw, TensorView dy, TensorView dx) {
    check_merge(grids, kh, kw, dx, dy, "patch_merge");
    if (op_device("patch_merge", {dy, dx}) == Device::cuda)
        return TESSERA_ON_CUDA(patch_merge_backward(grids, kh, kw, dy, dx));
    dispatch_float(dx.dtype, "patch_merge", [&]<class T>(T) {
        const cpu::Rows<T> yr = cpu::rows_of<T>(dy, "patch_merge: dy");
        const cpu::Rows<T> xr = cpu::rows_of<T>(dx, "patch_merge: dx");
        const int64_t C = xr.cols;
        for_each_merge_slot(grids, kh, kw, [&](int64_t m, int64_t s, int64_t n) {
            const T* d = yr.row(m) + s * C;
            T* g = xr.row(n);
            for (int64_t k = 0; k < C; ++k) g[k] += d[k];
        });
    });
}

}  // namespace tessera::ops
