// RoPE on CUDA (ops/rope.h): one thread per (batch row, token, head, pair); the angle t·f_i and its cos/sin in
// double, rounded to the tensor type as the CPU oracle (ops/cpu/rope.cpp) rounds them. A thread reads both
// elements of its pair before writing, so y may alias x.
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
template <class T>
__global__ void rope_kernel(RopeShape s, const double* inv_freq, HeadsArg<const T> src, HeadsArg<T> dst) {
    const int64_t half = s.D / 2, second = s.interleaved ? 1 : half, step = s.interleaved ? 2 : 1;
    const int64_t total = s.B * s.T * s.H * half;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t i = e % half, row = e / half, h = row % s.H, t = (row / s.H) % s.T, b = row / (s.H * s.T);
        double sn_d, cs_d;
        sincos(double(s.offset + t) * inv_freq[i], &sn_d, &cs_d);
        const T cs = T(s.m * cs_d), sn = T(s.sign * s.m * sn_d);
        const T* x = src.data + b * src.sb + t * src.st + h * src.sh;
        T* y = dst.data + b * dst.sb + t * dst.st + h * dst.sh;
        const int64_t a = step * i, c = a + second;
        const T x1 = x[a], x2 = x[c];
        const T y1 = x1 * cs - x2 * sn, y2 = x2 * cs + x1 * sn;
        if (s.accumulate) {
            y[a] += y1;
            y[c] += y2;
        } else {
            y[a] = y1;
            y[c] = y2;
        }
    }
}
}  // namespace

template <class T>
cudaError_t launch_rope(
    RopeShape s, const double* inv_freq, HeadsArg<const T> src, HeadsArg<T> dst, cudaStream_t stream) {
    const int64_t total = s.B * s.T * s.H * (s.D / 2);
    if (total == 0) return cudaSuccess;
    launch_kernel(rope_kernel<T>, grid_for(total), kBlock, 0, stream, s, inv_freq, src, dst);
    return cudaGetLastError();
}

template cudaError_t launch_rope<float>(RopeShape, const double*, HeadsArg<const float>, HeadsArg<float>, cudaStream_t);
template cudaError_t launch_rope<double>(
    RopeShape, const double*, HeadsArg<const double>, HeadsArg<double>, cudaStream_t);

}  // namespace tessera::ops::cuda
