// AdamW on CUDA: the same update, in the same operation order, as ops/cpu/adamw.cpp (the oracle).
// Kernels, then launchers. Launchers take raw pointers, counts and a stream only; checks and error
// messages live in cuda_ops.cpp.
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

// ---- kernels ----

namespace {
__global__ void adamw_kernel(float* __restrict__ param,
                             const float* __restrict__ grad,
                             float* __restrict__ m,
                             float* __restrict__ v,
                             int64_t n,
                             AdamWScalars s) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const float g = grad[i];
        float p = param[i] * s.decay;
        const float mi = m[i] + s.one_minus_beta1 * (g - m[i]);
        const float vi = v[i] * s.beta2 + s.one_minus_beta2 * g * g;
        p -= s.step_size * mi / (sqrtf(vi) / s.bias_correction2_sqrt + s.eps);
        param[i] = p;
        m[i] = mi;
        v[i] = vi;
    }
}
}  // namespace

// ---- launchers ----

cudaError_t launch_adamw(
    float* param, const float* grad, float* m, float* v, int64_t n, AdamWScalars s, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    const int threads = 256;
    const int64_t want = (n + threads - 1) / threads;
    const int blocks = int(want < 4096 ? want : 4096);
    adamw_kernel<<<blocks, threads, 0, stream>>>(param, grad, m, v, n, s);
    return cudaGetLastError();
}

}  // namespace tessera::ops::cuda
