// Row-wise elementwise kernels on CUDA: SwiGLU (ops/swiglu.h, the math of ops/cpu/glu_math.h), the linear
// layer's bias add and bias gradient, and the integer-id check the embedding and cross-entropy ops share.
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
template <class T>
__global__ void swiglu_forward_kernel(RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> y) {
    const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (c >= g.cols) return;
    for (int64_t r = blockIdx.y; r < g.rows; r += gridDim.y) {
        const T a = g.data[r * g.ld + c];
        y.data[r * y.ld + c] = a * sigmoid(a) * u.data[r * u.ld + c];
    }
}

template <class T>
__global__ void swiglu_backward_kernel(
    RowsArg<const T> dy, RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> dg, RowsArg<T> du) {
    const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (c >= g.cols) return;
    for (int64_t r = blockIdx.y; r < g.rows; r += gridDim.y) {
        const T a = g.data[r * g.ld + c], b = u.data[r * u.ld + c], d = dy.data[r * dy.ld + c];
        const T s = sigmoid(a);
        dg.data[r * dg.ld + c] += d * (b * s * (T(1) + a * (T(1) - s)));
        du.data[r * du.ld + c] += d * (a * s);
    }
}

template <class T>
__global__ void add_bias_kernel(RowsArg<T> y, const T* b) {
    const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (c >= y.cols) return;
    for (int64_t r = blockIdx.y; r < y.rows; r += gridDim.y) y.data[r * y.ld + c] += b[c];
}

template <class T>
__global__ void column_sums_kernel(RowsArg<const T> dy, T* db) {
    for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < dy.cols;
         c += int64_t(gridDim.x) * blockDim.x) {
        T acc = db[c];
        for (int64_t r = 0; r < dy.rows; ++r) acc += dy.data[r * dy.ld + c];
        db[c] = acc;
    }
}

__global__ void check_ids_kernel(const void* ids, bool ids32, int64_t n, int64_t limit, int64_t except, int64_t* bad) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t id = load_id(ids, ids32, i);
        if (id != except && (id < 0 || id >= limit))
            atomicMin(reinterpret_cast<unsigned long long*>(bad), static_cast<unsigned long long>(i));
    }
}
}  // namespace

template <class T>
cudaError_t launch_swiglu_forward(RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> y, cudaStream_t stream) {
    if (g.rows == 0 || g.cols == 0) return cudaSuccess;
    swiglu_forward_kernel<T><<<rows_grid(g.rows, g.cols), kBlock, 0, stream>>>(g, u, y);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_swiglu_backward(
    RowsArg<const T> dy, RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> dg, RowsArg<T> du, cudaStream_t stream) {
    if (g.rows == 0 || g.cols == 0) return cudaSuccess;
    swiglu_backward_kernel<T><<<rows_grid(g.rows, g.cols), kBlock, 0, stream>>>(dy, g, u, dg, du);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_add_bias(RowsArg<T> y, const T* b, cudaStream_t stream) {
    if (y.rows == 0 || y.cols == 0) return cudaSuccess;
    add_bias_kernel<T><<<rows_grid(y.rows, y.cols), kBlock, 0, stream>>>(y, b);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_column_sums(RowsArg<const T> dy, T* db, cudaStream_t stream) {
    if (dy.cols == 0) return cudaSuccess;
    column_sums_kernel<T><<<grid_for(dy.cols), kBlock, 0, stream>>>(dy, db);
    return cudaGetLastError();
}

cudaError_t launch_check_ids(
    const void* ids, bool ids32, int64_t n, int64_t limit, int64_t except, int64_t* bad, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    check_ids_kernel<<<grid_for(n), kBlock, 0, stream>>>(ids, ids32, n, limit, except, bad);
    return cudaGetLastError();
}

#define TESSERA_INSTANTIATE(T)                                                                                       \
    template cudaError_t launch_swiglu_forward<T>(RowsArg<const T>, RowsArg<const T>, RowsArg<T>, cudaStream_t);     \
    template cudaError_t launch_swiglu_backward<T>(RowsArg<const T>, RowsArg<const T>, RowsArg<const T>, RowsArg<T>, \
                                                   RowsArg<T>, cudaStream_t);                                        \
    template cudaError_t launch_add_bias<T>(RowsArg<T>, const T*, cudaStream_t);                                     \
    template cudaError_t launch_column_sums<T>(RowsArg<const T>, T*, cudaStream_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::ops::cuda
