// Small dense products for the insides of fused kernels (KDA chunks, attention tiles): C = α·A·B + β·C
// and C = α·Aᵀ·B + β·C, row-major, with register-blocked micro-kernels (8 rows × 32 columns of f32
// accumulators) written with GCC vector extensions. For the 16–128-sized operands of those kernels
// this runs ~5x faster than a library sgemm call, which packs both operands and allocates per call
// (bench: docs/ops.md). Large products go through ops/gemm.h. f64 is a plain loop (the reference path).
// NOTES: results depend only on the operands, not on threads: each element sums k in order.
#pragma once

#include <cstdint>

namespace tessera::ops::cpu {

// C[M, N] = alpha · A[M, K] · B[K, N] + beta · C
void small_gemm_nn(int64_t M,
                   int64_t N,
                   int64_t K,
                   float alpha,
                   const float* A,
                   int64_t lda,
                   const float* B,
                   int64_t ldb,
                   float beta,
                   float* C,
                   int64_t ldc);
void small_gemm_nn(int64_t M,
                   int64_t N,
                   int64_t K,
                   double alpha,
                   const double* A,
                   int64_t lda,
                   const double* B,
                   int64_t ldb,
                   double beta,
                   double* C,
                   int64_t ldc);
// C[M, N] = alpha · A[K, M]ᵀ · B[K, N] + beta · C
void small_gemm_tn(int64_t M,
                   int64_t N,
                   int64_t K,
                   float alpha,
                   const float* A,
                   int64_t lda,
                   const float* B,
                   int64_t ldb,
                   float beta,
                   float* C,
                   int64_t ldc);
void small_gemm_tn(int64_t M,
                   int64_t N,
                   int64_t K,
                   double alpha,
                   const double* A,
                   int64_t lda,
                   const double* B,
                   int64_t ldb,
                   double beta,
                   double* C,
                   int64_t ldc);
// dst[cols, rows] = src[rows, cols]ᵀ (for A·Bᵀ products: transpose B once, then small_gemm_nn)
template <class T>
void transpose(const T* src, int64_t rows, int64_t cols, int64_t lds, T* dst, int64_t ldd);

}  // namespace tessera::ops::cpu
