// RoPE forward/backward: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU kernel, a rotation
// per (position, pair) with cos/sin computed once per position and shared by every batch row and head; the
// frequencies (plain or YaRN) once per call.
#include "ops/rope.h"

#include <array>
#include <cmath>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;

namespace {
void check_4d(const TensorView& t, std::string_view what) {
    TESSERA_CHECK(t.ndim() == 4, "{} must be [B, T, H, D], not {}", what, t.shape.str());
    TESSERA_CHECK(t.strides[3] == 1, "{}: the head dimension must be contiguous", what);
    TESSERA_CHECK(t.size(3) % 2 == 0, "{}: head dim {} must be even", what, t.size(3));
}

// dst = m·R(sign·angle) · src, where sign = +1 (forward) or −1 (transpose); accumulate adds into dst.
template <class T>
void rotate(const RopeParams& p, const TensorView& src, const TensorView& dst, double sign, bool accumulate) {
    const int64_t B = src.size(0), Tn = src.size(1), H = src.size(2), D = src.size(3), half = D / 2;
    const int64_t second = p.interleaved ? 1 : half,
                  step = p.interleaved ? 2 : 1;  // pair i = (step·i, step·i + second)
    std::array<double, 512> inv_freq{};          // NOTES: D/2 <= 512 checked by the callers; stack, not heap
    rope_inv_freq(p, D, std::span(inv_freq.data(), size_t(half)));
    const double m = p.scaling.cos_sin_factor();
    const T* S = src.ptr<T>();
    T* Dst = dst.ptr<T>();
#pragma omp parallel
    {
        std::array<T, 512> cs{}, sn{};
#pragma omp for schedule(static)
        for (int64_t t = 0; t < Tn; ++t) {
            const double pos = double(p.offset + t);
            for (int64_t i = 0; i < half; ++i) {
                cs[i] = T(m * std::cos(pos * inv_freq[i]));
                sn[i] = T(sign * m * std::sin(pos * inv_freq[i]));
            }
            for (int64_t b = 0; b < B; ++b) {
                for (int64_t h = 0; h < H; ++h) {
                    const T* x = S + b * src.strides[0] + t * src.strides[1] + h * src.strides[2];
                    T* y = Dst + b * dst.strides[0] + t * dst.strides[1] + h * dst.strides[2];
                    for (int64_t i = 0; i < half; ++i) {
                        const int64_t a = step * i, b = a + second;
                        const T x1 = x[a], x2 = x[b];
                        const T y1 = x1 * cs[i] - x2 * sn[i];
                        const T y2 = x2 * cs[i] + x1 * sn[i];
                        if (accumulate) {
                            y[a] += y1;
                            y[b] += y2;
                        } else {
                            y[a] = y1;
                            y[b] = y2;
                        }
                    }
                }
            }
        }
    }
}
}  // namespace

void rope_forward(const RopeParams& p, TensorView x, TensorView y) {
    note_op_use("rope");
    const Device device = op_device("rope", {x, y});
    check_4d(x, "rope: x");
    check_4d(y, "rope: y");
    TESSERA_CHECK(x.shape == y.shape, "rope: y {} must be shaped like x {}", y.shape.str(), x.shape.str());
    TESSERA_CHECK(x.size(3) <= 1024, "rope: head dim {} exceeds 1024", x.size(3));
    p.scaling.validate("rope");
    TESSERA_CHECK(x.dtype == y.dtype, "rope: y is {} but x is {}", dtype_name(y.dtype), dtype_name(x.dtype));
    if (device == Device::cuda) return TESSERA_ON_CUDA(rope_forward(p, x, y));
    dispatch_float(x.dtype, "rope", [&]<class T>(T) { rotate<T>(p, x, y, +1.0, false); });
}

void rope_backward(const RopeParams& p, TensorView dy, TensorView dx) {
    const Device device = op_device("rope", {dy, dx});
    check_4d(dy, "rope: dy");
    check_4d(dx, "rope: dx");
    TESSERA_CHECK(dx.shape == dy.shape, "rope: dx {} must be shaped like dy {}", dx.shape.str(), dy.shape.str());
    TESSERA_CHECK(dx.data != dy.data, "rope: dx must not alias dy");
    TESSERA_CHECK(dy.size(3) <= 1024, "rope: head dim {} exceeds 1024", dy.size(3));
    p.scaling.validate("rope");
    TESSERA_CHECK(dx.dtype == dy.dtype, "rope: dx is {} but dy is {}", dtype_name(dx.dtype), dtype_name(dy.dtype));
    if (device == Device::cuda) return TESSERA_ON_CUDA(rope_backward(p, dy, dx));
    dispatch_float(dy.dtype, "rope", [&]<class T>(T) { rotate<T>(p, dy, dx, -1.0, true); });
}

}  // namespace tessera::ops
