// Grouped GEMMs over expert-contiguous rows (see grouped_gemm.h).
#include "ops/grouped_gemm.h"

#include <omp.h>

#include <algorithm>
#include <vector>

#include "ops/cpu/small_gemm.h"

namespace tessera::ops {

namespace {
constexpr int64_t kColBlock = 64;   // M-grouped tile: columns
constexpr int64_t kRowBlock = 128;  // M-grouped tile: rows
constexpr int64_t kGradRows = 64;   // K-grouped tile: output rows
constexpr int64_t kGradCols = 128;  // K-grouped tile: output columns

int64_t blocks(int64_t n, int64_t b) { return (n + b - 1) / b; }
}  // namespace

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
                  int64_t ldc) {
#pragma omp parallel
    {
        const int64_t me = omp_get_thread_num(), nt = omp_get_num_threads();
        static thread_local std::vector<float> panel;
        int64_t tile = 0;
        for (int64_t e = 0; e < g.experts; ++e) {
            const int64_t r0 = g.offsets[e], r1 = g.offsets[e + 1];
            const float* Be = B + e * b_stride;
            for (int64_t n0 = 0; n0 < N && r1 > r0; n0 += kColBlock) {
                const int64_t nw = std::min(kColBlock, N - n0);
                for (int64_t m0 = r0; m0 < r1; m0 += kRowBlock) {
                    if (tile++ % nt != me) continue;
                    const int64_t mw = std::min(kRowBlock, r1 - m0);
                    if (tb == Trans::N) {
                        cpu::small_gemm_nn(mw, nw, K, 1.0f, A + m0 * lda, lda, Be + n0, ldb, beta, C + m0 * ldc + n0,
                                           ldc);
                        continue;
                    }
                    if (panel.size() < size_t(K * kColBlock)) panel.resize(size_t(K * kColBlock));
                    cpu::transpose(Be + n0 * ldb, nw, K, ldb, panel.data(), nw);  // [nw, K] -> [K, nw]
                    cpu::small_gemm_nn(mw, nw, K, 1.0f, A + m0 * lda, lda, panel.data(), nw, beta, C + m0 * ldc + n0,
                                       ldc);
                }
            }
        }
    }
}

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
                  int64_t ldc) {
    for (int64_t e = 0; e < g.experts; ++e) {
        const int64_t r0 = g.offsets[e], rows = g.offsets[e + 1] - r0;
        if (rows > 0)
            gemm(Trans::N, tb, rows, N, K, 1.0, A + r0 * lda, lda, B + e * b_stride, ldb, beta, C + r0 * ldc, ldc);
    }
}

void grouped_gemm_wgrad(const ExpertRows& g,
                        int64_t M,
                        int64_t N,
                        const float* A,
                        int64_t lda,
                        const float* B,
                        int64_t ldb,
                        float* C,
                        int64_t c_stride,
                        int64_t ldc) {
    const int64_t per_expert = blocks(M, kGradRows) * blocks(N, kGradCols);
#pragma omp parallel
    {
        const int64_t me = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t tile = 0;
        for (int64_t e = 0; e < g.experts; ++e) {
            const int64_t r0 = g.offsets[e], rows = g.offsets[e + 1] - r0;
            if (rows == 0) continue;
            for (int64_t t = 0; t < per_expert; ++t) {
                if (tile++ % nt != me) continue;
                const int64_t m0 = (t / blocks(N, kGradCols)) * kGradRows, n0 = (t % blocks(N, kGradCols)) * kGradCols;
                cpu::small_gemm_tn(std::min(kGradRows, M - m0), std::min(kGradCols, N - n0), rows, 1.0f,
                                   A + r0 * lda + m0, lda, B + r0 * ldb + n0, ldb, 1.0f,
                                   C + e * c_stride + m0 * ldc + n0, ldc);
            }
        }
    }
}

void grouped_gemm_wgrad(const ExpertRows& g,
                        int64_t M,
                        int64_t N,
                        const double* A,
                        int64_t lda,
                        const double* B,
                        int64_t ldb,
                        double* C,
                        int64_t c_stride,
                        int64_t ldc) {
    for (int64_t e = 0; e < g.experts; ++e) {
        const int64_t r0 = g.offsets[e], rows = g.offsets[e + 1] - r0;
        if (rows > 0)
            gemm(Trans::T, Trans::N, M, N, rows, 1.0, A + r0 * lda, lda, B + r0 * ldb, ldb, 1.0, C + e * c_stride, ldc);
    }
}

}  // namespace tessera::ops
