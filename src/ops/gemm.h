// Dense matrix multiply on the CPU, row-major: C[M,N] = alpha * op(A) · op(B) + beta * C.
// f32 runs on oneDNN's sgemm; f64 is a plain reference loop (tests and finite differences).
//
// NOTES: we split C into per-thread row (or column) panels ourselves and call the single-threaded
// sgemm on each panel. This (1) never allocates (oneDNN's own threaded sgemm mallocs a workspace per
// call), and (2) gives every element the same reduction order whatever the thread count, so results
// are bitwise identical on 1 or N threads. Inside an OpenMP parallel region the call runs on the
// calling thread only.
#pragma once

#include <cstdint>

namespace tessera::ops {

enum class Trans : uint8_t { N, T };

// op(A) is [M, K]: A is [M, K] with row stride lda when ta == N, [K, M] when ta == T (likewise B).
void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
          const double* B, int64_t ldb, double beta, double* C, int64_t ldc);

// The same product computed by oneDNN's own threaded sgemm: the bench's reference point.
void gemm_onednn_reference(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// The machine's practical f32 GEMM rate (GFLOP/s): median of repeated n×n×n products through
// gemm(). The reference point for MFU and benchmark ratios (measured, not a datasheet peak).
double measure_gemm_gflops(int64_t n = 1024, int repeats = 7);

}  // namespace tessera::ops
