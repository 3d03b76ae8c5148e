// AdamW on CUDA: the same update, in the same operation order, as ops/cpu/adamw.cpp (the oracle).
// Kernels, then launchers. Launchers take raw pointers, counts and a stream only; checks and error
// messages live in cuda_ops.cpp.
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

// ---- kernels ----

namespace {
template <class T>
__global__ void adamw_kernel(T* __restrict__ param,
                             const T* __restrict__ grad,
                             T* __restrict__ m,
                             T* __restrict__ v,
                             int64_t n,
                             AdamWScalars<T> s) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const T g = grad[i];
        T p = param[i] * s.decay;
        const T mi = m[i] + s.one_minus_beta1 * (g - m[i]);
        const T vi = v[i] * s.beta2 + s.one_minus_beta2 * g * g;
        p -= s.step_size * mi / (sqrt(vi) / s.bias_correction2_sqrt + s.eps);
        param[i] = p;
        m[i] = mi;
        v[i] = vi;
    }
}
// A block per chunk: Σ x² in double, the block's fixed tree
__global__ void sum_squares_kernel(const float* x, int64_t n, int64_t chunk, double* out) {
    __shared__ double shared[kBlock / 32];
    const int64_t k = blockIdx.x, e0 = k * chunk, e1 = e0 + chunk < n ? e0 + chunk : n;
    double s = 0;
    for (int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) s += double(x[e]) * double(x[e]);
    s = block_sum(s, shared);
    if (threadIdx.x == 0) out[k] = s;
}

__global__ void scale_vector_kernel(float* x, int64_t n, float factor) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        x[i] *= factor;
}

__global__ void add_vector_kernel(const float* src, float* dst, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] += src[i];
}

template <class T>
__global__ void sum_blocks_kernel(const T* parts, int blocks, int64_t count, T* out, bool accumulate) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
        T s = accumulate ? out[i] + parts[i] : parts[i];
        for (int r = 1; r < blocks; ++r) s += parts[int64_t(r) * count + i];
        out[i] = s;
    }
}
}  // namespace

// ---- launchers ----

template <class T>
cudaError_t launch_adamw(T* param, const T* grad, T* m, T* v, int64_t n, AdamWScalars<T> s, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    const int threads = 256;
    const int64_t want = (n + threads - 1) / threads;
    const int blocks = int(want < 4096 ? want : 4096);
    launch_kernel(adamw_kernel<T>, blocks, threads, 0, stream, param, grad, m, v, n, s);
    return cudaGetLastError();
}

cudaError_t launch_sum_squares(const float* x, int64_t n, int64_t chunk, double* out, cudaStream_t stream) {
    const int64_t chunks = (n + chunk - 1) / chunk;
    if (chunks == 0) return cudaSuccess;
    launch_kernel(sum_squares_kernel, unsigned(chunks), kBlock, 0, stream, x, n, chunk, out);
    return cudaGetLastError();
}

cudaError_t launch_scale_vector(float* x, int64_t n, float factor, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    launch_kernel(scale_vector_kernel, grid_for(n), kBlock, 0, stream, x, n, factor);
    return cudaGetLastError();
}

cudaError_t launch_add_vector(const float* src, float* dst, int64_t n, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    launch_kernel(add_vector_kernel, grid_for(n), kBlock, 0, stream, src, dst, n);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_sum_blocks(const T* parts, int blocks, int64_t count, T* out, bool accumulate, cudaStream_t stream) {
    if (count == 0) return cudaSuccess;
    launch_kernel(sum_blocks_kernel<T>, grid_for(count), kBlock, 0, stream, parts, blocks, count, out, accumulate);
    return cudaGetLastError();
}

template cudaError_t launch_sum_blocks<float>(const float*, int, int64_t, float*, bool, cudaStream_t);
template cudaError_t launch_sum_blocks<double>(const double*, int, int64_t, double*, bool, cudaStream_t);
template cudaError_t launch_sum_blocks<int32_t>(const int32_t*, int, int64_t, int32_t*, bool, cudaStream_t);
template cudaError_t launch_sum_blocks<int64_t>(const int64_t*, int, int64_t, int64_t*, bool, cudaStream_t);
template cudaError_t launch_adamw<float>(
    float*, const float*, float*, float*, int64_t, AdamWScalars<float>, cudaStream_t);
template cudaError_t launch_adamw<double>(
    double*, const double*, double*, double*, int64_t, AdamWScalars<double>, cudaStream_t);

}  // namespace tessera::ops::cuda
