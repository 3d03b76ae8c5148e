// LoRA's dropout on CUDA (ops/lora.h): the counter-based mask of core/mix64.h, element (n, i) drawn with counter
// n·IN + i, so the device's mask is the CPU's bit for bit.
#include "core/mix64.h"
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
template <class T>
__global__ void dropout_rows_kernel(RowsArg<const T> x, T* xd, DropoutArg d) {
    const int64_t total = x.rows * x.cols;
    const T s = T(d.scale);
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t n = e / x.cols, i = e % x.cols;
        xd[e] = dropout_keep(d.seed, d.stream, uint64_t(e), d.p) ? x.data[n * x.ld + i] * s : T(0);
    }
}

template <class T>
__global__ void masked_add_kernel(const T* g, RowsArg<T> dx, DropoutArg d) {
    const int64_t total = dx.rows * dx.cols;
    const T s = T(d.scale);
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t n = e / dx.cols, i = e % dx.cols;
        if (dropout_keep(d.seed, d.stream, uint64_t(e), d.p)) dx.data[n * dx.ld + i] += g[e] * s;
    }
}
}  // namespace

template <class T>
cudaError_t launch_dropout_rows(RowsArg<const T> x, T* xd, DropoutArg d, cudaStream_t stream) {
    if (x.rows * x.cols == 0) return cudaSuccess;
    launch_kernel(dropout_rows_kernel<T>, grid_for(x.rows * x.cols), kBlock, 0, stream, x, xd, d);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_masked_add(const T* g, RowsArg<T> dx, DropoutArg d, cudaStream_t stream) {
    if (dx.rows * dx.cols == 0) return cudaSuccess;
    launch_kernel(masked_add_kernel<T>, grid_for(dx.rows * dx.cols), kBlock, 0, stream, g, dx, d);
    return cudaGetLastError();
}

#define TESSERA_INSTANTIATE(T)                                                                   \
    template cudaError_t launch_dropout_rows<T>(RowsArg<const T>, T*, DropoutArg, cudaStream_t); \
    template cudaError_t launch_masked_add<T>(const T*, RowsArg<T>, DropoutArg, cudaStream_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::ops::cuda
