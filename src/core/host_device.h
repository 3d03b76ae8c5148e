// TESSERA_HOST_DEVICE marks a plain function that both the host compiler and nvcc (for kernels) compile, so the CPU
// and CUDA backends share one definition of its arithmetic.
#pragma once

#if defined(__CUDACC__)
#define TESSERA_HOST_DEVICE __host__ __device__
#else
#define TESSERA_HOST_DEVICE
#endif
