// Cross-entropy on CUDA (ops/cross_entropy.h; the oracle is ops/cpu/cross_entropy.cpp): one block per row
// for the log-sum-exp (max, then the sum of exponentials in double), per-row losses reduced by one block in a
// fixed order, and the backward's softmax − onehot accumulated elementwise. No [N, V] softmax is stored.
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
template <class T>
__global__ void lse_kernel(
    RowsArg<const T> x, const void* targets, bool targets32, int64_t ignore, T* lse, double* row_loss) {
    __shared__ double shared[kBlock / 32];
    __shared__ T shared_max[kBlock / 32];
    const int64_t n = blockIdx.x;
    const T* xr = x.data + n * x.ld;
    T m = -INFINITY;
    for (int64_t v = threadIdx.x; v < x.cols; v += blockDim.x) m = max(m, xr[v]);
    m = block_max(m, shared_max);
    double s = 0.0;
    if (m != T(-INFINITY)) {
        for (int64_t v = threadIdx.x; v < x.cols; v += blockDim.x) s += double(exp(xr[v] - m));
    }
    s = block_sum(s, shared);
    if (threadIdx.x != 0) return;
    const T l = T(double(m) + log(s));
    lse[n] = l;
    const int64_t t = load_id(targets, targets32, n);
    row_loss[n] = t == ignore ? 0.0 : double(l) - double(xr[t]);
}

__global__ void loss_totals_kernel(
    const double* row_loss, const void* targets, bool targets32, int64_t ignore, int64_t rows, double* totals) {
    __shared__ double shared[kBlock / 32];
    double sum = 0.0, count = 0.0;
    for (int64_t n = threadIdx.x; n < rows; n += blockDim.x) {
        if (row_loss) sum += row_loss[n];
        count += load_id(targets, targets32, n) != ignore ? 1.0 : 0.0;
    }
    sum = block_sum(sum, shared);
    count = block_sum(count, shared);
    if (threadIdx.x == 0) {
        totals[0] = sum;
        totals[1] = count;
    }
}

template <class T>
__global__ void cross_entropy_backward_kernel(
    RowsArg<const T> x, const void* targets, bool targets32, int64_t ignore, const T* lse, T scale, RowsArg<T> dx) {
    const int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (v >= x.cols) return;
    for (int64_t n = blockIdx.y; n < x.rows; n += gridDim.y) {
        const int64_t t = load_id(targets, targets32, n);
        if (t == ignore) continue;
        T& d = dx.data[n * dx.ld + v];
        d += scale * exp(x.data[n * x.ld + v] - lse[n]);
        if (v == t) d -= scale;
    }
}
}  // namespace

template <class T>
cudaError_t launch_cross_entropy_forward(RowsArg<const T> x,
                                         const void* targets,
                                         bool targets32,
                                         int64_t ignore_index,
                                         T* lse,
                                         double* row_loss,
                                         double* totals,
                                         cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    launch_kernel(lse_kernel<T>, unsigned(x.rows), kBlock, 0, stream, x, targets, targets32, ignore_index, lse,
                  row_loss);
    launch_kernel(loss_totals_kernel, 1, kBlock, 0, stream, row_loss, targets, targets32, ignore_index, x.rows, totals);
    return cudaGetLastError();
}

cudaError_t launch_count_targets(
    const void* targets, bool targets32, int64_t ignore_index, int64_t rows, double* totals, cudaStream_t stream) {
    if (rows == 0) return cudaSuccess;
    launch_kernel(loss_totals_kernel, 1, kBlock, 0, stream, nullptr, targets, targets32, ignore_index, rows, totals);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_cross_entropy_backward(RowsArg<const T> x,
                                          const void* targets,
                                          bool targets32,
                                          int64_t ignore_index,
                                          const T* lse,
                                          T scale,
                                          RowsArg<T> dx,
                                          cudaStream_t stream) {
    if (x.rows == 0 || x.cols == 0) return cudaSuccess;
    const int64_t gy = x.rows < 65535 ? x.rows : 65535;
    const dim3 grid(unsigned((x.cols + kBlock - 1) / kBlock), unsigned(gy));
    launch_kernel(cross_entropy_backward_kernel<T>, grid, kBlock, 0, stream, x, targets, targets32, ignore_index, lse,
                  scale, dx);
    return cudaGetLastError();
}

#define TESSERA_INSTANTIATE(T)                                                                                       \
    template cudaError_t launch_cross_entropy_forward<T>(RowsArg<const T>, const void*, bool, int64_t, T*, double*,  \
                                                         double*, cudaStream_t);                                     \
    template cudaError_t launch_cross_entropy_backward<T>(RowsArg<const T>, const void*, bool, int64_t, const T*, T, \
                                                          RowsArg<T>, cudaStream_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::ops::cuda
