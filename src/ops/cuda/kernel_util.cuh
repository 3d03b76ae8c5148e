// Device helpers shared by the CUDA kernels: grid sizing, fixed-order block reductions, index loads.
// Every reduction here has one order for a given launch shape, so results are bitwise run-to-run.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <tuple>
#include <utility>

#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

// kernel<<<grid, block, smem, stream>>>(args...), spelled so a host compiler compiles it too: under the CUDA emulator
// (src/cuda_emulator) every thread of every block runs the kernel on the CPU. The launch's error is
// cudaGetLastError's, as with the chevrons.
template <class... P, class... A>
void launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... args) {
#if TESSERA_CUDA_EMULATOR
    struct Call {
        void (*kernel)(P...);
        std::tuple<P...> params;  // each thread calls with its own copies, as each GPU thread has its parameters
    };
    Call call{kernel, std::tuple<P...>(std::forward<A>(args)...)};
    cuda_emulator::launch(
        reinterpret_cast<const void*>(kernel), grid, block, smem, stream,
        [](void* c) { std::apply(static_cast<Call*>(c)->kernel, static_cast<Call*>(c)->params); }, &call);
#else
    // (clang-format takes a .cuh for C++ and would split the chevrons)
    // clang-format off
    kernel<<<grid, block, smem, stream>>>(std::forward<A>(args)...);
    // clang-format on
#endif
}

// The block's dynamic shared memory (the launch's smem bytes), 128-byte aligned (WMMA's loads and stores need 32).
__device__ inline unsigned char* dynamic_shared() {
#if TESSERA_CUDA_EMULATOR
    return cuda_emulator::dynamic_shared_memory();
#else
    extern __shared__ __align__(128) unsigned char smem[];
    return smem;
#endif
}

constexpr int kBlock = 256;  // threads per block of the row kernels (8 warps)

inline int grid_for(int64_t n, int threads = kBlock, int64_t cap = 8192) {
    const int64_t want = (n + threads - 1) / threads;
    return int(want < 1 ? 1 : (want < cap ? want : cap));
}

// n rounded up to whole 16s: a dimension padded to WMMA's tiles (16 × 16 × 16).
__host__ __device__ inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// Rows [0, n) of src (row stride ld, `width` values each) as bf16 rows of ldb values in shared memory, zeros past width
// and from row n to `rows`: a tensor-core kernel's operand tile. Every thread of the block takes part.
__device__ inline void stage_rows_bf16(
    const float* src, int64_t ld, int64_t n, int64_t rows, int64_t width, int64_t ldb, __nv_bfloat16* dst) {
    for (int64_t x = threadIdx.x; x < rows * ldb; x += blockDim.x) {
        const int64_t r = x / ldb, d = x % ldb;
        dst[x] = __float2bfloat16(r < n && d < width ? src[r * ld + d] : 0.0f);
    }
}

// The 2-D grid of the elementwise kernels: blockIdx.y walks rows (striding by gridDim.y), x-threads walk columns.
inline dim3 rows_grid(int64_t rows, int64_t cols) {
    const int64_t gy = rows < 65535 ? rows : 65535;
    return dim3(unsigned((cols + kBlock - 1) / kBlock), unsigned(gy < 1 ? 1 : gy));
}

// The body of a kernel on the rows_grid: f(row, column) for each element, x-threads over the columns, blockIdx.y
// striding over the rows.
template <class F>
__device__ void each(int64_t rows, int64_t cols, F f) {
    const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (c >= cols) return;
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) f(r, c);
}

// The sum over a block of each thread's value, in a fixed tree order; every thread gets the result.
// `shared` holds at least blockDim.x / 32 elements. blockDim.x is a multiple of 32.
template <class A>
__device__ A block_sum(A v, A* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();  // shared may still be read by a previous call
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    A total = 0;
    for (int i = 0; i < warps; ++i) total += shared[i];  // the same order in every thread
    return total;
}

template <class A>
__device__ A block_max(A v, A* shared) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    A m = shared[0];
    for (int i = 1; i < warps; ++i) m = max(m, shared[i]);
    return m;
}

// out[i] += Σ_sl acc[sl·n + i], the slabs in order: the reduction of the fixed query slabs that the backward
// scatters of DSA (dkv, the indexer's dk) accumulate into (spec/dsa.md §3.7 scheme B).
template <class T>
__global__ void slab_sum_kernel(int64_t n, int64_t slabs, const T* acc, T* out) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        T x = out[i];
        for (int64_t sl = 0; sl < slabs; ++sl) x += acc[sl * n + i];
        out[i] = x;
    }
}

// Column sums over many rows in two fixed-order stages (the parameter gradients of the norms, linear's bias, the KDA
// gate and the AttnRes mix): column_slabs_kernel sums a block's columns over one slab of kColumnSlabRows rows, rows in
// order, into partial[term][slab][column] (in A); then the slabs are added in order. The slabs depend on the row
// count only, so the result is the same bits on every run; against one thread walking every row of a column, a
// [16K, 7168] gradient runs on 28 × 64 blocks instead of 28. Term(n, c, acc) adds row n's terms of column c to acc.
// A term may fill fewer than Terms accumulators: the first `used` are stored.
template <class A, int Terms, class Term>
__global__ void column_slabs_kernel(int64_t rows, int64_t cols, Term term, A* partial, int used) {
    const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, slab = blockIdx.y, slabs = gridDim.y;
    if (c >= cols) return;
    A acc[Terms] = {};
    const int64_t end = (slab + 1) * kColumnSlabRows < rows ? (slab + 1) * kColumnSlabRows : rows;
    for (int64_t n = slab * kColumnSlabRows; n < end; ++n) term(n, c, acc);
    for (int k = 0; k < used; ++k) partial[(k * slabs + slab) * cols + c] = acc[k];
}

// The first stage on its own: partial holds column_slab_elements(rows, cols, used) elements of device memory.
template <class A, int Terms, class Term>
void launch_column_slabs(int64_t rows, int64_t cols, Term term, A* partial, cudaStream_t stream, int used = Terms) {
    launch_kernel(column_slabs_kernel<A, Terms, Term>,
                  dim3(unsigned((cols + kBlock - 1) / kBlock), unsigned(column_slabs(rows))), kBlock, 0, stream, rows,
                  cols, term, partial, used);
}

// The second stage for one term when the total is not simply added: finish(c, Σ_sl partial[sl·cols + c]), the sum
// from zero in slab order.
template <class A, class Finish>
__global__ void slab_totals_kernel(int64_t cols, int64_t slabs, const A* partial, Finish finish) {
    for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < cols; c += int64_t(gridDim.x) * blockDim.x) {
        A x = 0;
        for (int64_t sl = 0; sl < slabs; ++sl) x += partial[sl * cols + c];
        finish(c, x);
    }
}

// A finish that adds the total to out[c · stride] in out's type.
template <class T>
struct AddTo {
    T* out;
    int64_t stride = 1;
    template <class A>
    __device__ void operator()(int64_t c, A total) const {
        out[c * stride] += T(total);
    }
};

// out[k][c] += Σ_n term k of (n, c), for the Terms outputs (a null output is skipped), the slabs added in order onto
// out; partial holds column_slab_elements(rows, cols, Terms) elements of device memory.
template <class T, int Terms, class Term>
void column_sums_in_slabs(
    int64_t rows, int64_t cols, Term term, T* partial, T* const (&out)[Terms], cudaStream_t stream) {
    if (rows == 0 || cols == 0) return;
    const int64_t slabs = column_slabs(rows);
    launch_column_slabs<T, Terms>(rows, cols, term, partial, stream);
    for (int k = 0; k < Terms; ++k)
        if (out[k])
            launch_kernel(slab_sum_kernel<T>, grid_for(cols), kBlock, 0, stream, cols, slabs,
                          static_cast<const T*>(partial + k * slabs * cols), out[k]);
}

__device__ inline int64_t load_id(const void* ids, bool ids32, int64_t i) {
    return ids32 ? int64_t(static_cast<const int32_t*>(ids)[i]) : static_cast<const int64_t*>(ids)[i];
}

template <class T>
__device__ inline T sigmoid(T x) {
    return T(1) / (T(1) + exp(-x));
}

}  // namespace tessera::ops::cuda
