// Grouped GEMMs over rows laid out expert-contiguously (spec/moe.md §5.1): expert e owns rows
// [offsets[e], offsets[e+1]) of the row operands. Two kinds cover the MoE forward and backward:
//   grouped_gemm        (M-grouped)  C[rows_e] = A[rows_e] · op(B_e) (+ beta·C)   fc1/fc2 forward and dgrad
//   grouped_gemm_wgrad  (K-grouped)  C_e += A[rows_e]ᵀ · B[rows_e]                 weight gradients
// B_e = B + e·b_stride (or b_slices[e]: experts stored apart; MXFP4 ones in pairs, core/tensor.h) and C_e = C +
// e·c_stride. op(B_e) is [K, N]: B_e stored [K, N] (Trans::N) or [N, K] (Trans::T, a weight in [out, in] layout).
// NOTES: one flat list of tiles over all experts, dealt biggest first to the least loaded thread, each tile one
// single-threaded oneDNN sgemm (ops/gemm.h): (expert, ≤256 rows, all columns) for the M-grouped kind,
// (expert, band of output rows, all columns, the expert's whole reduction) for the K-grouped one, with a band per
// 2048 of the expert's rows. Small experts share the threads with large ones instead of each expert's GEMM being
// split over all threads; a tile reads its rows of A from memory once.
// (Also measured and dropped, bench/RESULTS.md: the register kernel for experts of ≤16-64 rows, no packing:
// slower; transposing the weight to call Trans::N: slower; gate and up in one tile: within noise.)
// (A register-kernel version on ops/cpu/small_gemm.h reached 0.44–0.59 of the dense GEMM rate against
// 0.54–0.71 for this one: oneDNN's packing keeps both operands in cache; bench/RESULTS.md.)
// Every output element is computed by one tile in a fixed order, so results do not depend on the
// thread count. f64 runs the same tiles on ops::gemm's reference loop.
#pragma once

#include <cstdint>

#include "ops/gemm.h"

namespace tessera::ops {

struct ExpertRows {
    const int32_t* offsets = nullptr;  // [experts + 1]
    int64_t experts = 0;
};

void grouped_gemm(Trans tb,
                  const ExpertRows& g,
                  int64_t N,
                  int64_t K,
                  const float* A,
                  int64_t lda,
                  const float* B,
                  int64_t b_stride,
                  int64_t ldb,
                  float beta,
                  float* C,
                  int64_t ldc,
                  void* const* b_slices = nullptr);
void grouped_gemm(Trans tb,
                  const ExpertRows& g,
                  int64_t N,
                  int64_t K,
                  const double* A,
                  int64_t lda,
                  const double* B,
                  int64_t b_stride,
                  int64_t ldb,
                  double beta,
                  double* C,
                  int64_t ldc,
                  void* const* b_slices = nullptr);

// The f32 kind with B frozen experts held in bf16 or MXFP4 (ops/gemm.h): bitwise the product with the widened weight.
void grouped_gemm(Trans tb,
                  const ExpertRows& g,
                  int64_t N,
                  int64_t K,
                  const float* A,
                  int64_t lda,
                  const bf16* B,
                  int64_t b_stride,
                  int64_t ldb,
                  float beta,
                  float* C,
                  int64_t ldc,
                  void* const* b_slices = nullptr);
void grouped_gemm(Trans tb,
                  const ExpertRows& g,
                  int64_t N,
                  int64_t K,
                  const float* A,
                  int64_t lda,
                  Mxfp4 B,
                  int64_t b_stride,
                  int64_t ldb,
                  float beta,
                  float* C,
                  int64_t ldc,
                  void* const* b_slices = nullptr);

// C_e[M, N] += A[rows_e, M]ᵀ · B[rows_e, N]
void grouped_gemm_wgrad(const ExpertRows& g,
                        int64_t M,
                        int64_t N,
                        const float* A,
                        int64_t lda,
                        const float* B,
                        int64_t ldb,
                        float* C,
                        int64_t c_stride,
                        int64_t ldc);
void grouped_gemm_wgrad(const ExpertRows& g,
                        int64_t M,
                        int64_t N,
                        const double* A,
                        int64_t lda,
                        const double* B,
                        int64_t ldb,
                        double* C,
                        int64_t c_stride,
                        int64_t ldc);

}  // namespace tessera::ops
