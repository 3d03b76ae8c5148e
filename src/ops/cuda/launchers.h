// Kernel launchers of the CUDA backend: raw pointers, counts and a stream; no tessera types, so
// .cu files compile without the C++ core headers. Each returns the launch status.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::ops::cuda {

// The scalars of one AdamW step, precomputed on the host (see ops/adamw.h for the math).
struct AdamWScalars {
    float decay;  // 1 - lr * weight_decay
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float step_size;              // lr / (1 - beta1^step)
    float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
    float eps;
};

cudaError_t launch_adamw(
    float* param, const float* grad, float* m, float* v, int64_t n, AdamWScalars s, cudaStream_t stream);

}  // namespace tessera::ops::cuda
