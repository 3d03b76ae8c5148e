// The gated activations' element math on the device (the CPU's ops/cpu/glu_math.h): value(g, u) and the partials
// ∂y/∂g, ∂y/∂u of SwiGLU and SiTU-GLU, shared by the GLU kernels (elementwise.cu) and the MoE experts' fused
// gate·activation (moe.cu).
#pragma once

#include "ops/cuda/kernel_util.cuh"

namespace tessera::ops::cuda {

template <class T>
struct SwiGlu {
    __device__ T value(T g, T u) const { return g * sigmoid(g) * u; }
    __device__ void partials(T g, T u, T& pg, T& pu) const {
        const T s = sigmoid(g);
        pg = u * s * (T(1) + g * (T(1) - s));
        pu = g * s;
    }
};

template <class T>
struct SituGlu {
    T b, bl, ib, ibl;  // β, β_lin and their inverses
    __device__ T value(T g, T u) const { return b * tanh(g * ib) * sigmoid(g) * (bl * tanh(u * ibl)); }
    __device__ void partials(T g, T u, T& pg, T& pu) const {
        const T t = tanh(g * ib), s = sigmoid(g), tu = tanh(u * ibl);
        pg = bl * tu * ((T(1) - t * t) * s + b * t * s * (T(1) - s));
        pu = b * t * s * (T(1) - tu * tu);
    }
};

template <class T>
SituGlu<T> situ(double beta, double linear_beta) {
    return {T(beta), T(linear_beta), T(1.0 / beta), T(1.0 / linear_beta)};
}

}  // namespace tessera::ops::cuda
