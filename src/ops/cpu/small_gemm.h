// Small dense products for the insides of fused kernels (KDA chunks, attention tiles): C = α·A·B + β·C
// and C = α·Aᵀ·B + β·C, row-major, with register-blocked micro-kernels (f32 accumulators: 8 rows × 32
// columns on AVX-512, 6 × 16 on AVX2) written with GCC vector extensions. For the 16–128-sized
// operands of those kernels this runs like oneDNN's sgemm without its per-call packing and allocation
// (bench/bench_small_gemm.cpp). Large products go through ops/gemm.h. f64 is a plain loop (the
// reference path).
// NOTES: results depend only on the operands, not on threads or the tile shape: each element sums k in
// order.
#pragma once

#include <cstdint>

namespace tessera::ops::cpu {

// C[M, N] = alpha · A[M, K] · B[K, N] + beta · C
template <class T>
void small_gemm_nn(int64_t M,
                   int64_t N,
                   int64_t K,
                   T alpha,
                   const T* A,
                   int64_t lda,
                   const T* B,
                   int64_t ldb,
                   T beta,
                   T* C,
                   int64_t ldc);
// C[M, N] = alpha · A[K, M]ᵀ · B[K, N] + beta · C
template <class T>
void small_gemm_tn(int64_t M,
                   int64_t N,
                   int64_t K,
                   T alpha,
                   const T* A,
                   int64_t lda,
                   const T* B,
                   int64_t ldb,
                   T beta,
                   T* C,
                   int64_t ldc);
// The same products with one operand's rows given by pointers (gathered rows, e.g. the selected keys
// of sparse attention, multiplied in place instead of copied):
// C[M, N] = alpha · [a_rows[0]; …; a_rows[M−1]] · B[K, N] + beta · C   (a_rows[i] has K elements)
template <class T>
void small_gemm_rows_nn(int64_t M,
                        int64_t N,
                        int64_t K,
                        T alpha,
                        const T* const* a_rows,
                        const T* B,
                        int64_t ldb,
                        T beta,
                        T* C,
                        int64_t ldc);
// C[M, N] = alpha · A[K, M]ᵀ · [b_rows[0]; …; b_rows[K−1]] + beta · C   (b_rows[k] has N elements)
template <class T>
void small_gemm_tn_rows(int64_t M,
                        int64_t N,
                        int64_t K,
                        T alpha,
                        const T* A,
                        int64_t lda,
                        const T* const* b_rows,
                        T beta,
                        T* C,
                        int64_t ldc);
// dst[cols, rows] = src[rows, cols]ᵀ (for A·Bᵀ products: transpose B once, then small_gemm_nn)
template <class T>
void transpose(const T* src, int64_t rows, int64_t cols, int64_t lds, T* dst, int64_t ldd);

}  // namespace tessera::ops::cpu
