// Kernel launchers of the CUDA backend: raw pointers, counts, row strides and a stream; no tessera types, so
// .cu files compile without the C++ core headers. Each returns the launch status. Matrices are row-major
// [rows, cols] with row stride ld (in elements). T is float or double: the f64 instantiations run the golden
// checks at the CPU oracle's f64 tolerance.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::ops::cuda {

// The scalars of one AdamW step, precomputed on the host (see ops/adamw.h for the math), in the tensors' type.
template <class T>
struct AdamWScalars {
    T decay;  // 1 - lr * weight_decay
    T one_minus_beta1;
    T beta2;
    T one_minus_beta2;
    T step_size;              // lr / (1 - beta1^step)
    T bias_correction2_sqrt;  // sqrt(1 - beta2^step)
    T eps;
};

template <class T>
cudaError_t launch_adamw(T* param, const T* grad, T* m, T* v, int64_t n, AdamWScalars<T> s, cudaStream_t stream);

// A row-major matrix view: element (r, c) at data[r * ld + c].
template <class T>
struct RowsArg {
    T* data;
    int64_t rows, cols, ld;
};

// RMSNorm (ops/rmsnorm.h): one block per row, the row's sum of squares in double, reduced in a fixed order.
template <class T>
cudaError_t launch_rmsnorm_forward(
    RowsArg<const T> x, const T* w, RowsArg<T> y, T* rstd, double eps, cudaStream_t stream);
// dx += ... (dx.data may be null: skipped); dw += Σ_n dy∘x̂ (dw may be null), each column summed in row order.
template <class T>
cudaError_t launch_rmsnorm_backward(
    RowsArg<const T> dy, RowsArg<const T> x, const T* w, const T* rstd, RowsArg<T> dx, T* dw, cudaStream_t stream);

// SwiGLU (ops/swiglu.h): y = silu(g)·u; backward accumulates dgate and dup.
template <class T>
cudaError_t launch_swiglu_forward(RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> y, cudaStream_t stream);
template <class T>
cudaError_t launch_swiglu_backward(
    RowsArg<const T> dy, RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> dg, RowsArg<T> du, cudaStream_t stream);

// y[r, :] += b; db += Σ_r dy[r, :] (each column in row order).
template <class T>
cudaError_t launch_add_bias(RowsArg<T> y, const T* b, cudaStream_t stream);
template <class T>
cudaError_t launch_column_sums(RowsArg<const T> dy, T* db, cudaStream_t stream);

// Integer ids (i32 when ids32, else i64) checked against [0, limit), except those equal to `except`: the first bad
// position is written to *bad (which must hold INT64_MAX before the launch).
cudaError_t launch_check_ids(
    const void* ids, bool ids32, int64_t n, int64_t limit, int64_t except, int64_t* bad, cudaStream_t stream);

// Embedding (ops/embedding.h). Forward copies rows of `row_bytes`; the bf16 variant widens to f32. Backward:
// dtable[ids[n]] += dy[n], each column walking the tokens in order (deterministic).
cudaError_t launch_embedding_forward(
    const void* ids, bool ids32, int64_t n, const void* table, int64_t row_bytes, void* y, cudaStream_t stream);
cudaError_t launch_embedding_forward_bf16(
    const void* ids, bool ids32, int64_t n, const uint16_t* table, int64_t d, float* y, cudaStream_t stream);
template <class T>
cudaError_t launch_embedding_backward(
    const T* dy, const void* ids, bool ids32, int64_t n, int64_t d, T* dtable, cudaStream_t stream);

// Cross-entropy (ops/cross_entropy.h). Forward: lse per row and, in `totals` ([2] doubles: the loss sum over
// counted rows, the count), reduced in a fixed order. Backward accumulates into dx with scale = dloss / count.
template <class T>
cudaError_t launch_cross_entropy_forward(RowsArg<const T> x,
                                         const void* targets,
                                         bool targets32,
                                         int64_t ignore_index,
                                         T* lse,
                                         double* row_loss,
                                         double* totals,
                                         cudaStream_t stream);
// The rows that count (targets not ignore_index) into totals[1] (totals[0] = 0), as forward counts them.
cudaError_t launch_count_targets(
    const void* targets, bool targets32, int64_t ignore_index, int64_t rows, double* totals, cudaStream_t stream);
template <class T>
cudaError_t launch_cross_entropy_backward(RowsArg<const T> x,
                                          const void* targets,
                                          bool targets32,
                                          int64_t ignore_index,
                                          const T* lse,
                                          T scale,
                                          RowsArg<T> dx,
                                          cudaStream_t stream);

// The row glue ops (ops/rows.h), f32: d = scale·s; d += s; y = σ(x); dx += dy·y(1−y); d[n, g·K + k] = s[n, g];
// d[n, g] = Σ_k s[n, g·K + k]; the output gate y = o·σ(z) per group of `per` and its backward.
cudaError_t launch_scale_rows(RowsArg<const float> s, float scale, RowsArg<float> d, cudaStream_t stream);
cudaError_t launch_add_rows(RowsArg<const float> s, RowsArg<float> d, cudaStream_t stream);
cudaError_t launch_sigmoid_forward(RowsArg<const float> x, RowsArg<float> y, cudaStream_t stream);
cudaError_t launch_sigmoid_backward(RowsArg<const float> dy,
                                    RowsArg<const float> y,
                                    RowsArg<float> dx,
                                    cudaStream_t stream);
cudaError_t launch_expand_groups(RowsArg<const float> s, RowsArg<float> d, int64_t K, cudaStream_t stream);
cudaError_t launch_sum_groups(RowsArg<const float> s, RowsArg<float> d, int64_t K, cudaStream_t stream);
cudaError_t launch_output_gate_forward(RowsArg<const float> z,
                                       RowsArg<const float> o,
                                       RowsArg<float> gate,
                                       RowsArg<float> y,
                                       int64_t per,
                                       cudaStream_t stream);
cudaError_t launch_output_gate_backward(RowsArg<const float> dy,
                                        RowsArg<const float> o,
                                        RowsArg<const float> gate,
                                        RowsArg<float> dov,
                                        RowsArg<float> dz,
                                        int64_t per,
                                        cudaStream_t stream);

}  // namespace tessera::ops::cuda
