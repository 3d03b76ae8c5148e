// Embedding lookup and its gradient on CUDA (ops/embedding.h; the oracle is ops/cpu/embedding.cpp), narrow rows
// widened to f32 (a bf16 table's lookup; a frozen bf16 or MXFP4 weight for linear), and f32 GEMM operands rounded to
// bf16 (GemmPrecision::bf16). The
// backward keeps the CPU's order: each column walks the tokens in order, so repeated ids accumulate
// identically on every run (no atomics).
#include <type_traits>

#include "core/mxfp4.h"
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
__global__ void embedding_forward_kernel(
    const void* ids, bool ids32, int64_t n, const unsigned char* table, int64_t row_bytes, unsigned char* y) {
    for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
        const unsigned char* src = table + load_id(ids, ids32, t) * row_bytes;
        unsigned char* dst = y + t * row_bytes;
        for (int64_t b = threadIdx.x; b < row_bytes; b += blockDim.x) dst[b] = src[b];
    }
}

__global__ void embedding_forward_bf16_kernel(
    const void* ids, bool ids32, int64_t n, const uint16_t* table, int64_t d, float* y) {
    for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
        const uint16_t* src = table + load_id(ids, ids32, t) * d;
        for (int64_t c = threadIdx.x; c < d; c += blockDim.x)
            y[t * d + c] = __uint_as_float(static_cast<unsigned>(src[c]) << 16);
    }
}

// held MXFP4 values index..index+n-1 to f32 or bf16, exactly (core/mxfp4.h's mxfp4_value, the CPU's arithmetic: a
// value of 2 significant bits times a power of two within f32's range, which bf16 holds too)
template <class T>
__global__ void widen_mxfp4_kernel(const uint8_t* blocks, int64_t index, int64_t n, T* dst) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const float v = mxfp4_value(Mxfp4{blocks, index + i});
        if constexpr (std::is_same_v<T, float>) {
            dst[i] = v;
        } else {
            dst[i] = uint16_t(__float_as_uint(v) >> 16);
        }
    }
}

__global__ void widen_bf16_kernel(const uint16_t* src, int64_t n, float* dst) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = __uint_as_float(static_cast<unsigned>(src[i]) << 16);
}

__device__ inline uint16_t round_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

__global__ void narrow_bf16_kernel(const float* src, int64_t n, uint16_t* dst) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = round_bf16(src[i]);
}

__global__ void round_to_bf16_kernel(float* x, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        x[i] = __uint_as_float(unsigned(round_bf16(x[i])) << 16);
}

// blockIdx.y walks the pieces, the x blocks a piece's values
__global__ void round_bf16_kernel(const Bf16Piece* pieces, int64_t count) {
    for (int64_t p = blockIdx.y; p < count; p += gridDim.y) {
        const Bf16Piece q = pieces[p];
        const int64_t n = q.cols * q.len;
        for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
            q.dst[i / q.len * q.dst_ld + i % q.len] = round_bf16(q.src[i / q.len * q.ld + i % q.len]);
    }
}

// blockIdx.y walks the segments (one id each), the x threads its row's columns
template <class T>
__global__ void embedding_backward_kernel(
    const T* dy, const int64_t* pos, const int64_t* segs, int64_t segments, int64_t d, T* dtable) {
    for (int64_t s = blockIdx.y; s < segments; s += gridDim.y) {
        const int64_t id = segs[s], begin = segs[segments + s], end = segs[segments + s + 1];
        for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < d; c += int64_t(gridDim.x) * blockDim.x) {
            T acc = dtable[id * d + c];
            for (int64_t k = begin; k < end; ++k) acc += dy[pos[k] * d + c];
            dtable[id * d + c] = acc;
        }
    }
}
}  // namespace

cudaError_t launch_embedding_forward(
    const void* ids, bool ids32, int64_t n, const void* table, int64_t row_bytes, void* y, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    launch_kernel(embedding_forward_kernel, grid_for(n, 1, 65535), kBlock, 0, stream, ids, ids32, n,
                  static_cast<const unsigned char*>(table), row_bytes, static_cast<unsigned char*>(y));
    return cudaGetLastError();
}

cudaError_t launch_embedding_forward_bf16(
    const void* ids, bool ids32, int64_t n, const uint16_t* table, int64_t d, float* y, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    launch_kernel(embedding_forward_bf16_kernel, grid_for(n, 1, 65535), kBlock, 0, stream, ids, ids32, n, table, d, y);
    return cudaGetLastError();
}

cudaError_t launch_widen_bf16(const uint16_t* src, int64_t n, float* dst, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    launch_kernel(widen_bf16_kernel, grid_for(n), kBlock, 0, stream, src, n, dst);
    return cudaGetLastError();
}

cudaError_t launch_narrow_bf16(const float* src, int64_t n, uint16_t* dst, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    launch_kernel(narrow_bf16_kernel, grid_for(n), kBlock, 0, stream, src, n, dst);
    return cudaGetLastError();
}

cudaError_t launch_round_to_bf16(float* x, int64_t n, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    launch_kernel(round_to_bf16_kernel, grid_for(n), kBlock, 0, stream, x, n);
    return cudaGetLastError();
}

cudaError_t launch_widen_mxfp4(
    const uint8_t* blocks, int64_t index, int64_t n, bool to_bf16, void* dst, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    if (to_bf16) {
        launch_kernel(widen_mxfp4_kernel<uint16_t>, grid_for(n), kBlock, 0, stream, blocks, index, n,
                      static_cast<uint16_t*>(dst));
    } else {
        launch_kernel(widen_mxfp4_kernel<float>, grid_for(n), kBlock, 0, stream, blocks, index, n,
                      static_cast<float*>(dst));
    }
    return cudaGetLastError();
}

cudaError_t launch_round_bf16(const Bf16Piece* pieces, int64_t count, int64_t max_elements, cudaStream_t stream) {
    if (count == 0 || max_elements == 0) return cudaSuccess;
    const dim3 grid(unsigned(grid_for(max_elements)), unsigned(std::min<int64_t>(count, 65535)));
    launch_kernel(round_bf16_kernel, grid, kBlock, 0, stream, pieces, count);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_embedding_backward(
    const T* dy, const int64_t* pos, const int64_t* segs, int64_t segments, int64_t d, T* dtable, cudaStream_t stream) {
    if (segments == 0 || d == 0) return cudaSuccess;
    const dim3 grid(unsigned(grid_for(d, kBlock, 64)), unsigned(std::min<int64_t>(segments, 65535)));
    launch_kernel(embedding_backward_kernel<T>, grid, kBlock, 0, stream, dy, pos, segs, segments, d, dtable);
    return cudaGetLastError();
}

template cudaError_t launch_embedding_backward<float>(
    const float*, const int64_t*, const int64_t*, int64_t, int64_t, float*, cudaStream_t);
template cudaError_t launch_embedding_backward<double>(
    const double*, const int64_t*, const int64_t*, int64_t, int64_t, double*, cudaStream_t);

}  // namespace tessera::ops::cuda
