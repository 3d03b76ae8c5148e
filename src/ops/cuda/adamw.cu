// AdamW on CUDA: the same update, in the same operation order, as ops/cpu/adamw.cpp (the oracle).
// Kernels, then launchers. Launchers take raw pointers, counts and a stream only; checks and error
// messages live in cuda_ops.cpp.
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
}  // namespace

// ---- launchers ----

template <class T>
cudaError_t launch_adamw(T* param, const T* grad, T* m, T* v, int64_t n, AdamWScalars<T> s, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    const int threads = 256;
    const int64_t want = (n + threads - 1) / threads;
    const int blocks = int(want < 4096 ? want : 4096);
    adamw_kernel<T><<<blocks, threads, 0, stream>>>(param, grad, m, v, n, s);
    return cudaGetLastError();
}

template cudaError_t launch_adamw<float>(
    float*, const float*, float*, float*, int64_t, AdamWScalars<float>, cudaStream_t);
template cudaError_t launch_adamw<double>(
    double*, const double*, double*, double*, int64_t, AdamWScalars<double>, cudaStream_t);

}  // namespace tessera::ops::cuda
