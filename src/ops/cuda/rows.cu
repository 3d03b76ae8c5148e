// The row glue ops on CUDA (ops/rows.h; the CPU loops in ops/cpu/rows.cpp are the oracle): scaled copies, adds,
// the sigmoid gate and its gradient, group broadcasts and sums, the gated-attention output gate. Elementwise
// kernels on the 2-D rows grid; each group sum is one thread walking its group in order (deterministic).
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
__global__ void scale_rows_kernel(RowsArg<const float> s, float scale, RowsArg<float> d) {
    each(s.rows, s.cols, [&](int64_t r, int64_t c) { d.data[r * d.ld + c] = scale * s.data[r * s.ld + c]; });
}

__global__ void add_rows_kernel(RowsArg<const float> s, RowsArg<float> d) {
    each(s.rows, s.cols, [&](int64_t r, int64_t c) { d.data[r * d.ld + c] += s.data[r * s.ld + c]; });
}

__global__ void copy_blocks_kernel(const float* src, float* dst, const int64_t* table) {
    const int64_t* b = table + 3 * int64_t(blockIdx.x);
    const float* s = src + b[0];
    float* d = dst + b[1];
    for (int64_t i = threadIdx.x; i < b[2]; i += blockDim.x) d[i] = s[i];
}

__global__ void sigmoid_forward_kernel(RowsArg<const float> x, RowsArg<float> y) {
    each(x.rows, x.cols, [&](int64_t r, int64_t c) { y.data[r * y.ld + c] = sigmoid(x.data[r * x.ld + c]); });
}

__global__ void sigmoid_backward_kernel(RowsArg<const float> dy, RowsArg<const float> y, RowsArg<float> dx) {
    each(y.rows, y.cols, [&](int64_t r, int64_t c) {
        const float v = y.data[r * y.ld + c];
        dx.data[r * dx.ld + c] += dy.data[r * dy.ld + c] * v * (1.0f - v);
    });
}

// d [N, G·K] from s [N, G]: thread per element of d.
__global__ void expand_groups_kernel(RowsArg<const float> s, RowsArg<float> d, int64_t K) {
    each(d.rows, d.cols, [&](int64_t r, int64_t c) { d.data[r * d.ld + c] = s.data[r * s.ld + c / K]; });
}

// d [N, G] from s [N, G·K]: thread per element of d, k in order.
__global__ void sum_groups_kernel(RowsArg<const float> s, RowsArg<float> d, int64_t K) {
    each(d.rows, d.cols, [&](int64_t r, int64_t g) {
        const float* p = s.data + r * s.ld + g * K;
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += p[k];
        d.data[r * d.ld + g] = acc;
    });
}

// Thread per (row, group): the gate, then its `per` outputs.
__global__ void output_gate_forward_kernel(
    RowsArg<const float> z, RowsArg<const float> o, RowsArg<float> gate, RowsArg<float> y, int64_t per) {
    each(z.rows, z.cols, [&](int64_t r, int64_t g) {
        const float v = sigmoid(z.data[r * z.ld + g]);
        gate.data[r * gate.ld + g] = v;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) y.data[r * y.ld + e] = o.data[r * o.ld + e] * v;
    });
}

__global__ void output_gate_backward_kernel(RowsArg<const float> dy,
                                            RowsArg<const float> o,
                                            RowsArg<const float> gate,
                                            RowsArg<float> dov,
                                            RowsArg<float> dz,
                                            int64_t per) {
    each(gate.rows, gate.cols, [&](int64_t r, int64_t g) {
        const float v = gate.data[r * gate.ld + g];
        float acc = 0.f;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) {
            const float d = dy.data[r * dy.ld + e];
            acc += d * o.data[r * o.ld + e];
            dov.data[r * dov.ld + e] = d * v;
        }
        dz.data[r * dz.ld + g] = acc * v * (1.f - v);
    });
}

template <class Kernel, class... Args>
cudaError_t launch_on_rows(Kernel k, int64_t rows, int64_t cols, cudaStream_t stream, Args... args) {
    if (rows == 0 || cols == 0) return cudaSuccess;
    launch_kernel(k, rows_grid(rows, cols), kBlock, 0, stream, args...);
    return cudaGetLastError();
}
}  // namespace

cudaError_t launch_scale_rows(RowsArg<const float> s, float scale, RowsArg<float> d, cudaStream_t stream) {
    return launch_on_rows(scale_rows_kernel, s.rows, s.cols, stream, s, scale, d);
}
cudaError_t launch_add_rows(RowsArg<const float> s, RowsArg<float> d, cudaStream_t stream) {
    return launch_on_rows(add_rows_kernel, s.rows, s.cols, stream, s, d);
}
cudaError_t launch_copy_blocks(
    const float* src, float* dst, const int64_t* table, int64_t blocks, cudaStream_t stream) {
    if (blocks == 0) return cudaSuccess;
    if (blocks > 2147483647) return cudaErrorInvalidConfiguration;
    launch_kernel(copy_blocks_kernel, dim3(unsigned(blocks)), kBlock, 0, stream, src, dst, table);
    return cudaGetLastError();
}
cudaError_t launch_sigmoid_forward(RowsArg<const float> x, RowsArg<float> y, cudaStream_t stream) {
    return launch_on_rows(sigmoid_forward_kernel, x.rows, x.cols, stream, x, y);
}
cudaError_t launch_sigmoid_backward(RowsArg<const float> dy,
                                    RowsArg<const float> y,
                                    RowsArg<float> dx,
                                    cudaStream_t stream) {
    return launch_on_rows(sigmoid_backward_kernel, y.rows, y.cols, stream, dy, y, dx);
}
cudaError_t launch_expand_groups(RowsArg<const float> s, RowsArg<float> d, int64_t K, cudaStream_t stream) {
    return launch_on_rows(expand_groups_kernel, d.rows, d.cols, stream, s, d, K);
}
cudaError_t launch_sum_groups(RowsArg<const float> s, RowsArg<float> d, int64_t K, cudaStream_t stream) {
    return launch_on_rows(sum_groups_kernel, d.rows, d.cols, stream, s, d, K);
}
cudaError_t launch_output_gate_forward(RowsArg<const float> z,
                                       RowsArg<const float> o,
                                       RowsArg<float> gate,
                                       RowsArg<float> y,
                                       int64_t per,
                                       cudaStream_t stream) {
    return launch_on_rows(output_gate_forward_kernel, z.rows, z.cols, stream, z, o, gate, y, per);
}
cudaError_t launch_output_gate_backward(RowsArg<const float> dy,
                                        RowsArg<const float> o,
                                        RowsArg<const float> gate,
                                        RowsArg<float> dov,
                                        RowsArg<float> dz,
                                        int64_t per,
                                        cudaStream_t stream) {
    return launch_on_rows(output_gate_backward_kernel, gate.rows, gate.cols, stream, dy, o, gate, dov, dz, per);
}

}  // namespace tessera::ops::cuda
