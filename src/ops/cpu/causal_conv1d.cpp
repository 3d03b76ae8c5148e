// Causal depthwise conv1d: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU kernels, per
// sequence (batch row or packed segment).
// Parallel over (sequence, channel block) in forward; backward parallel over channel blocks, each
// walking every sequence and token in order (dw sums in a fixed order).
#include "ops/causal_conv1d.h"

#include <algorithm>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Segments;

namespace {
constexpr int64_t kChannels = 64;  // channels per task: a contiguous run of each token row

void check_shapes(const TensorView& x, const TensorView& w, const TensorView& y, std::string_view yname) {
    TESSERA_CHECK(x.ndim() == 3, "causal_conv1d: x must be [B, T, C], not {}", x.shape.str());
    TESSERA_CHECK(w.ndim() == 2 && w.size(0) == x.size(2) && w.size(1) >= 1,
                  "causal_conv1d: w must be [C, W] with C = {}, not {}", x.size(2), w.shape.str());
    check_shape(y, x.shape, yname);
    check_contiguous(x, "causal_conv1d: x");
    check_contiguous(w, "causal_conv1d: w");
    check_contiguous(y, yname);
}

// z for channels [c0, c1) at token t of a sequence whose first token is t0 (flattened rows)
template <class T>
inline void conv_at(const T* X, const T* W, int64_t C, int64_t K, int64_t t0, int64_t t, int64_t c0, int64_t c1, T* z) {
    for (int64_t c = c0; c < c1; ++c) z[c - c0] = 0;
    for (int64_t k = 0; k < K; ++k) {
        const int64_t s = t - (K - 1) + k;
        if (s < t0) continue;
        const T* xr = X + s * C;
        for (int64_t c = c0; c < c1; ++c) z[c - c0] += W[c * K + k] * xr[c];
    }
}
}  // namespace

void causal_conv1d_forward(
    const CausalConv1dParams& p, TensorView x, TensorView w, TensorView y, std::span<const int64_t> cu_seqlens) {
    note_op_use("causal_conv1d");
    const Device device = op_device("causal_conv1d", {x, w, y});
    check_shapes(x, w, y, "causal_conv1d: y");
    const Segments seg(x.size(0), x.size(1), cu_seqlens, "causal_conv1d");
    if (device == Device::cuda) return TESSERA_ON_CUDA(causal_conv1d_forward(p, x, w, y, cu_seqlens));
    dispatch_float(x.dtype, "causal_conv1d", [&]<class T>(T) {
        const int64_t C = x.size(2), K = w.size(1);
        const T* X = x.ptr<T>();
        const T* W = w.ptr<T>();
        T* Y = y.ptr<T>();
        const int64_t num_cblocks = (C + kChannels - 1) / kChannels;
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t s = 0; s < seg.count(); ++s) {
            for (int64_t cb = 0; cb < num_cblocks; ++cb) {
                const int64_t c0 = cb * kChannels, c1 = std::min(C, c0 + kChannels), t0 = seg.first_token(s);
                T z[kChannels];
                for (int64_t t = t0; t < t0 + seg.length(s); ++t) {
                    conv_at(X, W, C, K, t0, t, c0, c1, z);
                    T* yr = Y + t * C;
                    for (int64_t c = c0; c < c1; ++c) {
                        const T v = z[c - c0];
                        yr[c] = p.activation == Activation::silu ? v * cpu::vsigmoid(v) : v;
                    }
                }
            }
        }
    });
}

void causal_conv1d_backward(const CausalConv1dParams& p,
                            TensorView dy,
                            TensorView x,
                            TensorView w,
                            TensorView dx,
                            TensorView dw,
                            std::span<const int64_t> cu_seqlens) {
    const Device device = op_device("causal_conv1d", {dy, x, w, dx, dw});
    check_shapes(x, w, dy, "causal_conv1d: dy");
    if (dw.defined()) check_shape(dw, w.shape, "causal_conv1d: dw");  // absent: a frozen weight
    if (dx.defined()) check_shapes(x, w, dx, "causal_conv1d: dx");
    const Segments seg(x.size(0), x.size(1), cu_seqlens, "causal_conv1d");
    if (device == Device::cuda) return TESSERA_ON_CUDA(causal_conv1d_backward(p, dy, x, w, dx, dw, cu_seqlens));
    dispatch_float(x.dtype, "causal_conv1d", [&]<class T>(T) {
        const int64_t C = x.size(2), K = w.size(1);
        const T* X = x.ptr<T>();
        const T* W = w.ptr<T>();
        const T* DY = dy.ptr<T>();
        T* DX = dx.defined() ? dx.ptr<T>() : nullptr;
        T* DW = dw.defined() ? dw.ptr<T>() : nullptr;
        const int64_t num_cblocks = (C + kChannels - 1) / kChannels;
        // NOTES: one task per channel block walks every (sequence, t) in order: dw sums in a fixed order.
#pragma omp parallel for schedule(static)
        for (int64_t cb = 0; cb < num_cblocks; ++cb) {
            const int64_t c0 = cb * kChannels, c1 = std::min(C, c0 + kChannels);
            T dz[kChannels], z[kChannels];
            for (int64_t s = 0; s < seg.count(); ++s) {
                const int64_t t0 = seg.first_token(s);
                for (int64_t t = t0; t < t0 + seg.length(s); ++t) {
                    const T* g = DY + t * C;
                    if (p.activation == Activation::none) {
                        for (int64_t c = c0; c < c1; ++c) dz[c - c0] = g[c];
                    } else {
                        conv_at(X, W, C, K, t0, t, c0, c1, z);
                        for (int64_t c = c0; c < c1; ++c) {
                            const T v = z[c - c0], sg = cpu::vsigmoid(v);
                            dz[c - c0] = g[c] * sg * (T(1) + v * (T(1) - sg));
                        }
                    }
                    for (int64_t k = 0; k < K; ++k) {
                        const int64_t src = t - (K - 1) + k;
                        if (src < t0) continue;
                        const T* xr = X + src * C;
                        T* dxr = DX ? DX + src * C : nullptr;
                        for (int64_t c = c0; c < c1; ++c) {
                            if (DW) DW[c * K + k] += dz[c - c0] * xr[c];
                            if (dxr) dxr[c] += W[c * K + k] * dz[c - c0];
                        }
                    }
                }
            }
        }
    });
}

void causal_conv1d_step(const CausalConv1dParams& p, TensorView x, TensorView w, TensorView window, TensorView y) {
    const Device device = op_device("causal_conv1d", {x, w, window, y});
    TESSERA_CHECK(x.ndim() == 2, "causal_conv1d step: x must be [B, C], not {}", x.shape.str());
    const int64_t B = x.size(0), C = x.size(1);
    TESSERA_CHECK(w.ndim() == 2 && w.size(0) == C && w.size(1) >= 1,
                  "causal_conv1d step: w must be [C, W] with C = {}, not {}", C, w.shape.str());
    const int64_t K = w.size(1);
    check_shape(window, Shape{B, K - 1, C}, "causal_conv1d step: window");
    check_shape(y, x.shape, "causal_conv1d step: y");
    for (const auto& [t, name] : {std::pair{x, "x"}, {w, "w"}, {window, "window"}, {y, "y"}}) {
        check_dtype(t, DType::f32, "causal_conv1d step", name);
        check_contiguous(t, "causal_conv1d step", name);
    }
    if (device == Device::cuda) return TESSERA_ON_CUDA(causal_conv1d_step(p, x, w, window, y));
    const float* X = x.ptr<float>();
    const float* W = w.ptr<float>();
    float* Win = window.ptr<float>();
    float* Y = y.ptr<float>();
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        float* win = Win + b * (K - 1) * C;
        const float* xt = X + b * C;
        for (int64_t c = 0; c < C; ++c) {
            float z = 0.f;
            for (int64_t k = 0; k + 1 < K; ++k) z += W[c * K + k] * win[k * C + c];
            z += W[c * K + K - 1] * xt[c];
            Y[b * C + c] = p.activation == Activation::silu ? z * cpu::vsigmoid(z) : z;
        }
        if (K > 1) {
            std::copy(win + C, win + (K - 1) * C, win);
            std::copy(xt, xt + C, win + (K - 2) * C);
        }
    }
}

}  // namespace tessera::ops
