// Grouped GEMMs over rows laid out expert-contiguously (spec/moe.md §5.1): expert e owns rows
// [offsets[e], offsets[e+1]) of the row operands. Two kinds cover the MoE forward and backward:
//   grouped_gemm        (M-grouped)  C[rows_e] = A[rows_e] · op(B_e) (+ beta·C)   fc1/fc2 forward and dgrad
//   grouped_gemm_wgrad  (K-grouped)  C_e += A[rows_e]ᵀ · B[rows_e]                 weight gradients
// B_e = B + e·b_stride and C_e = C + e·c_stride. op(B_e) is [K, N]: B_e stored [K, N] (Trans::N) or
// [N, K] (Trans::T, a weight in [out, in] layout).
// NOTES (f32): one flat list of tiles over all experts, (expert, 64 columns, ≤ 128 rows) for the
// M-grouped kind and (expert, 64 × 128 outputs) for the K-grouped one, dealt round-robin to the
// threads: small experts share the threads with large ones instead of each running one tiny GEMM.
// Row counts that are multiples of 8 keep every row in the 8-row register kernel (the MoE layout
// pads each expert to 8 rows). Trans::T operands are packed per tile into a [K, 64] panel. Every
// output element is computed by one tile in a fixed order, so results do not depend on the thread
// count. f64 runs a plain reference loop per expert.
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
                  int64_t ldc);
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
                  int64_t ldc);

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
