// The image tower's ops on CUDA (ops/vision.h; the CPU kernels in ops/cpu/vision.cpp are the oracle): GELU and the
// 2-D RoPE elementwise, the position table's taps and the merge's rows from tables the host computed. Each output
// element is written by one thread; the table's gradient is one thread per column walking the patches in order.
#include <cmath>

#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
template <class T>
__device__ T gelu_value(bool tanh_form, T x) {
    if (!tanh_form) return T(0.5) * x * (T(1) + erf(x * T(0.70710678118654752440)));
    const T c = T(0.79788456080286535588);  // √(2/π)
    return T(0.5) * x * (T(1) + tanh(c * (x + T(0.044715) * x * x * x)));
}

template <class T>
__device__ T gelu_slope(bool tanh_form, T x) {
    if (!tanh_form) {
        const T cdf = T(0.5) * (T(1) + erf(x * T(0.70710678118654752440)));
        const T pdf = exp(T(-0.5) * x * x) * T(0.39894228040143267794);  // 1/√(2π)
        return cdf + x * pdf;
    }
    const T c = T(0.79788456080286535588), a = T(0.044715);
    const T t = tanh(c * (x + a * x * x * x));
    return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * c * (T(1) + T(3) * a * x * x);
}

template <class T>
__global__ void gelu_forward_kernel(bool tanh_form, RowsArg<const T> x, RowsArg<T> y) {
    each(x.rows, x.cols,
         [&](int64_t r, int64_t c) { y.data[r * y.ld + c] = gelu_value(tanh_form, x.data[r * x.ld + c]); });
}

template <class T>
__global__ void gelu_backward_kernel(bool tanh_form, RowsArg<const T> dy, RowsArg<const T> x, RowsArg<T> dx) {
    each(x.rows, x.cols, [&](int64_t r, int64_t c) {
        dx.data[r * dx.ld + c] += gelu_slope(tanh_form, x.data[r * x.ld + c]) * dy.data[r * dy.ld + c];
    });
}

// one thread per (patch, head, pair)
template <class T>
__global__ void rope_2d_kernel(HeadsArg<const T> src,
                               HeadsArg<T> dst,
                               int64_t N,
                               int64_t H,
                               int64_t D,
                               const int32_t* colrow,
                               const double* freq,
                               double sign,
                               bool accumulate) {
    const int64_t pairs = D / 2, total = N * H * pairs;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t i = e % pairs, h = (e / pairs) % H, n = e / (pairs * H);
        const double pos = double(colrow[2 * n + (i % 2)]);
        double sn_d, cs_d;
        sincos(pos * freq[i / 2], &sn_d, &cs_d);
        const T cs = T(cs_d), sn = T(sign * sn_d);
        const T* x = src.data + n * src.st + h * src.sh + 2 * i;
        T* y = dst.data + n * dst.st + h * dst.sh + 2 * i;
        const T x1 = x[0], x2 = x[1];
        const T y1 = x1 * cs - x2 * sn, y2 = x2 * cs + x1 * sn;
        if (accumulate) {
            y[0] += y1;
            y[1] += y2;
        } else {
            y[0] = y1;
            y[1] = y2;
        }
    }
}

template <class T>
__global__ void pos_embed_forward_kernel(const PosTaps* taps, const T* table, RowsArg<T> x) {
    each(x.rows, x.cols, [&](int64_t n, int64_t k) {
        const PosTaps& t = taps[n];
        const int64_t C = x.cols;
        x.data[n * x.ld + k] += T(t.w[0]) * table[t.cell[0] * C + k] + T(t.w[1]) * table[t.cell[1] * C + k] +
                                T(t.w[2]) * table[t.cell[2] * C + k] + T(t.w[3]) * table[t.cell[3] * C + k];
    });
}

template <class T>
__global__ void pos_embed_backward_kernel(const PosTaps* taps, RowsArg<const T> dx, T* dtable) {
    const int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, C = dx.cols;
    if (k >= C) return;
    for (int64_t n = 0; n < dx.rows; ++n) {
        const PosTaps& t = taps[n];
        const T d = dx.data[n * dx.ld + k];
        for (int j = 0; j < 4; ++j)
            if (t.w[j] != 0.0) dtable[t.cell[j] * C + k] += T(t.w[j]) * d;
    }
}

template <class T>
__global__ void move_rows_kernel(
    RowMove how, RowsArg<T> narrow, RowsArg<T> wide, int64_t per, const int64_t* idx, int64_t n, int64_t cols) {
    each(n, cols, [&](int64_t i, int64_t c) {
        T* w = wide.data + (i / per) * wide.ld + (i % per) * cols + c;
        T* r = narrow.data + idx[i] * narrow.ld + c;
        switch (how) {
            case RowMove::gather:
                *w = *r;
                break;
            case RowMove::scatter_add:
                *r += *w;
                break;
            case RowMove::scatter:
                *r = *w;
                break;
            case RowMove::zero:
                *r = T(0);
                break;
        }
    });
}
}  // namespace

template <class T>
cudaError_t launch_gelu_forward(bool tanh_form, RowsArg<const T> x, RowsArg<T> y, cudaStream_t stream) {
    if (x.rows == 0 || x.cols == 0) return cudaSuccess;
    launch_kernel(gelu_forward_kernel<T>, rows_grid(x.rows, x.cols), kBlock, 0, stream, tanh_form, x, y);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_gelu_backward(
    bool tanh_form, RowsArg<const T> dy, RowsArg<const T> x, RowsArg<T> dx, cudaStream_t stream) {
    if (x.rows == 0 || x.cols == 0) return cudaSuccess;
    launch_kernel(gelu_backward_kernel<T>, rows_grid(x.rows, x.cols), kBlock, 0, stream, tanh_form, dy, x, dx);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_rope_2d(HeadsArg<const T> src,
                           HeadsArg<T> dst,
                           int64_t N,
                           int64_t H,
                           int64_t D,
                           const int32_t* colrow,
                           const double* freq,
                           double sign,
                           bool accumulate,
                           cudaStream_t stream) {
    const int64_t total = N * H * (D / 2);
    if (total == 0) return cudaSuccess;
    launch_kernel(rope_2d_kernel<T>, grid_for(total), kBlock, 0, stream, src, dst, N, H, D, colrow, freq, sign,
                  accumulate);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_pos_embed_forward(const PosTaps* taps, const T* table, RowsArg<T> x, cudaStream_t stream) {
    if (x.rows == 0 || x.cols == 0) return cudaSuccess;
    launch_kernel(pos_embed_forward_kernel<T>, rows_grid(x.rows, x.cols), kBlock, 0, stream, taps, table, x);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_pos_embed_backward(const PosTaps* taps, RowsArg<const T> dx, T* dtable, cudaStream_t stream) {
    if (dx.rows == 0 || dx.cols == 0) return cudaSuccess;
    launch_kernel(pos_embed_backward_kernel<T>, unsigned((dx.cols + kBlock - 1) / kBlock), kBlock, 0, stream, taps, dx,
                  dtable);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_move_rows(RowMove how,
                             RowsArg<T> narrow,
                             RowsArg<T> wide,
                             int64_t per,
                             const int64_t* idx,
                             int64_t n,
                             int64_t cols,
                             cudaStream_t stream) {
    if (n == 0 || cols == 0) return cudaSuccess;
    launch_kernel(move_rows_kernel<T>, rows_grid(n, cols), kBlock, 0, stream, how, narrow, wide, per, idx, n, cols);
    return cudaGetLastError();
}

#define TESSERA_VISION_LAUNCHERS(T)                                                                                   \
    template cudaError_t launch_gelu_forward<T>(bool, RowsArg<const T>, RowsArg<T>, cudaStream_t);                    \
    template cudaError_t launch_gelu_backward<T>(bool, RowsArg<const T>, RowsArg<const T>, RowsArg<T>, cudaStream_t); \
    template cudaError_t launch_rope_2d<T>(HeadsArg<const T>, HeadsArg<T>, int64_t, int64_t, int64_t, const int32_t*, \
                                           const double*, double, bool, cudaStream_t);                                \
    template cudaError_t launch_pos_embed_forward<T>(const PosTaps*, const T*, RowsArg<T>, cudaStream_t);             \
    template cudaError_t launch_pos_embed_backward<T>(const PosTaps*, RowsArg<const T>, T*, cudaStream_t);            \
    template cudaError_t launch_move_rows<T>(RowMove, RowsArg<T>, RowsArg<T>, int64_t, const int64_t*, int64_t,       \
                                             int64_t, cudaStream_t);
TESSERA_VISION_LAUNCHERS(float)
TESSERA_VISION_LAUNCHERS(double)
#undef TESSERA_VISION_LAUNCHERS

}  // namespace tessera::ops::cuda
