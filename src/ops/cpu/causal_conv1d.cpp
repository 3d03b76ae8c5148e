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
constexpr int64_t kMaxTaps = kCausalConvMaxWidth;

void check_shapes(const TensorView& x, const TensorView& w, const TensorView& y, std::string_view yname) {
    TESSERA_CHECK(x.ndim() == 3, "causal_conv1d: x must be [B, T, C], not {}", x.shape.str());
    TESSERA_CHECK(w.ndim() == 2 && w.size(0) == x.size(2) && w.size(1) >= 1 && w.size(1) <= kMaxTaps,
                  "causal_conv1d: w must be [C, W] with C = {} and 1 <= W <= {}, not {}", x.size(2), kMaxTaps,
                  w.shape.str());
    check_shape(y, x.shape, yname);
    check_contiguous(x, "causal_conv1d: x");
    check_contiguous(w, "causal_conv1d: w");
    check_contiguous(y, yname);
}

// A task's weights, tap-major: wt[k·kChannels + j] = w[c0 + j, k] (contiguous in the channel, so the channel loops
// vectorize; the sums keep the formula's order, k = 0 first).
template <class T>
void taps(const T* W, int64_t K, int64_t c0, int64_t n, T* wt) {
    for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < n; ++j) wt[k * kChannels + j] = W[(c0 + j) * K + k];
}

// Token rows a task reads kAhead tokens from now: its channels are a short run of each long row, which the hardware
// prefetchers do not follow.
constexpr int64_t kAhead = 8;
template <class T>
inline void prefetch_rows(int64_t n, const T* a, const T* b, const T* c) {
    for (int64_t j = 0; j < n; j += 64 / int64_t(sizeof(T))) {
        __builtin_prefetch(a + j);
        __builtin_prefetch(b + j);
        if (c) __builtin_prefetch(c + j, 1);
    }
}

// z[j] = Σ_k wt[k, j] · x[t − (K−1) + k, c0 + j] over the taps inside the sequence (from t0)
template <class T>
inline void conv_at(const T* X, const T* wt, int64_t C, int64_t K, int64_t t0, int64_t t, int64_t c0, int64_t n, T* z) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) z[j] = 0;
    for (int64_t k = std::max<int64_t>(0, t0 - t + K - 1); k < K; ++k) {
        const T* xr = X + (t - (K - 1) + k) * C + c0;
        const T* wk = wt + k * kChannels;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) z[j] += wk[j] * xr[j];
    }
}

// One channel block of the backward over one sequence: dz from dy (z recomputed for silu), then each tap's dx and
// dw terms in the formula's order. dwt holds the block's dw, tap-major.
template <class T, bool kSilu, bool kDx, bool kDw>
void backward_block(const T* X,
                    const T* DY,
                    const T* wt,
                    T* DX,
                    T* dwt,
                    int64_t C,
                    int64_t K,
                    int64_t t0,
                    int64_t len,
                    int64_t c0,
                    int64_t n) {
    T dz[kChannels], z[kChannels];
    for (int64_t t = t0; t < t0 + len; ++t) {
        const T* g = DY + t * C + c0;
        if (t + kAhead < t0 + len)
            prefetch_rows(n, X + (t + kAhead) * C + c0, g + kAhead * C, DX ? DX + (t + kAhead) * C + c0 : nullptr);
        if constexpr (kSilu) {
            conv_at(X, wt, C, K, t0, t, c0, n, z);
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) {
                const T v = z[j], sg = cpu::vsigmoid(v);
                dz[j] = g[j] * sg * (T(1) + v * (T(1) - sg));
            }
        } else {
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) dz[j] = g[j];
        }
        for (int64_t k = std::max<int64_t>(0, t0 - t + K - 1); k < K; ++k) {
            const int64_t src = t - (K - 1) + k;
            const T* xr = X + src * C + c0;
            if constexpr (kDw) {
                T* dwk = dwt + k * kChannels;
#pragma omp simd
                for (int64_t j = 0; j < n; ++j) dwk[j] += dz[j] * xr[j];
            }
            if constexpr (kDx) {
                T* dxr = DX + src * C + c0;
                const T* wk = wt + k * kChannels;
#pragma omp simd
                for (int64_t j = 0; j < n; ++j) dxr[j] += wk[j] * dz[j];
            }
        }
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
        const bool silu = p.activation == Activation::silu;
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t s = 0; s < seg.count(); ++s) {
            for (int64_t cb = 0; cb < num_cblocks; ++cb) {
                const int64_t c0 = cb * kChannels, n = std::min(C, c0 + kChannels) - c0, t0 = seg.first_token(s);
                T wt[kMaxTaps * kChannels], z[kChannels];
                taps(W, K, c0, n, wt);
                for (int64_t t = t0; t < t0 + seg.length(s); ++t) {
                    if (t + kAhead < t0 + seg.length(s))
                        prefetch_rows(n, X + (t + kAhead) * C + c0, Y + (t + kAhead) * C + c0, (const T*)nullptr);
                    conv_at(X, wt, C, K, t0, t, c0, n, z);
                    T* yr = Y + t * C + c0;
                    if (silu) {
#pragma omp simd
                        for (int64_t j = 0; j < n; ++j) yr[j] = z[j] * cpu::vsigmoid(z[j]);
                    } else {
#pragma omp simd
                        for (int64_t j = 0; j < n; ++j) yr[j] = z[j];
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
        // NOTES: one task per channel block walks every (sequence, t) in order: dw sums in a fixed order (from dw's
        // own values, as if added in place).
        auto kernel = [&]<bool kSilu, bool kDx, bool kDw>() {
#pragma omp parallel for schedule(static)
            for (int64_t cb = 0; cb < num_cblocks; ++cb) {
                const int64_t c0 = cb * kChannels, n = std::min(C, c0 + kChannels) - c0;
                T wt[kMaxTaps * kChannels], dwt[kMaxTaps * kChannels];
                taps(W, K, c0, n, wt);
                if (kDw) taps(DW, K, c0, n, dwt);
                for (int64_t s = 0; s < seg.count(); ++s)
                    backward_block<T, kSilu, kDx, kDw>(X, DY, wt, DX, dwt, C, K, seg.first_token(s), seg.length(s), c0,
                                                       n);
                if (kDw)
                    for (int64_t k = 0; k < K; ++k)
                        for (int64_t j = 0; j < n; ++j) DW[(c0 + j) * K + k] = dwt[k * kChannels + j];
            }
        };
        auto with_dw = [&]<bool kSilu, bool kDx>() {
            if (DW) return kernel.template operator()<kSilu, kDx, true>();
            kernel.template operator()<kSilu, kDx, false>();
        };
        auto with_dx = [&]<bool kSilu>() {
            if (DX) return with_dw.template operator()<kSilu, true>();
            with_dw.template operator()<kSilu, false>();
        };
        if (p.activation == Activation::silu) return with_dx.template operator()<true>();
        with_dx.template operator()<false>();
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
