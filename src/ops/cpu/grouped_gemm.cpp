// Grouped GEMMs over expert-contiguous rows (see grouped_gemm.h).
#include "ops/grouped_gemm.h"

#include <omp.h>

#include <algorithm>
#include <type_traits>

namespace tessera::ops {

namespace {
constexpr int64_t kRowBlock = 256;         // M-grouped tile: up to this many rows of one expert, all columns
constexpr int64_t kGradRowsPerBand = 256;  // K-grouped: one band of output rows per this many expert rows

// Tiles are dealt round-robin over the team; each runs one single-threaded GEMM (ops::gemm inside a
// parallel region). Tile boundaries depend only on the layout, never on the thread count.
// B: the experts' weights in T, or held narrow (bf16, MXFP4: widened by ops::gemm)
// expert e's weight: B + e·stride, or its own address when the experts are stored apart
template <class TB>
TB expert_weight(TB B, int64_t stride, void* const* slices, int64_t e) {
    if (!slices) return B + e * stride;
    if constexpr (std::is_same_v<TB, Mxfp4>) {
        return Mxfp4{static_cast<const uint8_t*>(slices[e])};
    } else {
        return static_cast<TB>(slices[e]);
    }
}

template <class T, class TB>
void m_grouped(Trans tb,
               const ExpertRows& g,
               int64_t N,
               int64_t K,
               const T* A,
               int64_t lda,
               TB B,
               int64_t b_stride,
               int64_t ldb,
               T beta,
               T* C,
               int64_t ldc,
               void* const* b_slices) {
#pragma omp parallel
    {
        const int64_t me = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t tile = 0;
        for (int64_t e = 0; e < g.experts; ++e) {
            const int64_t r1 = g.offsets[e + 1];
            const TB Be = expert_weight(B, b_stride, b_slices, e);
            for (int64_t m0 = g.offsets[e]; m0 < r1; m0 += kRowBlock) {
                if (tile++ % nt != me) continue;
                gemm(Trans::N, tb, std::min(kRowBlock, r1 - m0), N, K, T(1), A + m0 * lda, lda, Be, ldb, beta,
                     C + m0 * ldc, ldc);
            }
        }
    }
}

template <class T>
void k_grouped(const ExpertRows& g,
               int64_t M,
               int64_t N,
               const T* A,
               int64_t lda,
               const T* B,
               int64_t ldb,
               T* C,
               int64_t c_stride,
               int64_t ldc) {
#pragma omp parallel
    {
        const int64_t me = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t tile = 0;
        for (int64_t e = 0; e < g.experts; ++e) {
            const int64_t r0 = g.offsets[e], rows = g.offsets[e + 1] - r0;
            if (rows == 0) continue;
            // a tile is a band of output rows with every column, reducing over all the expert's rows;
            // experts with many rows get more bands (load balance)
            const int64_t bands = std::clamp<int64_t>(rows / kGradRowsPerBand, 1, (M + 7) / 8);
            const int64_t band = (M + bands * 8 - 1) / (bands * 8) * 8;
            for (int64_t m0 = 0; m0 < M; m0 += band) {
                if (tile++ % nt != me) continue;
                gemm(Trans::T, Trans::N, std::min(band, M - m0), N, rows, T(1), A + r0 * lda + m0, lda, B + r0 * ldb,
                     ldb, T(1), C + e * c_stride + m0 * ldc, ldc);
            }
        }
    }
}
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
                  int64_t ldc,
                  void* const* b_slices) {
    m_grouped(tb, g, N, K, A, lda, B, b_stride, ldb, beta, C, ldc, b_slices);
}
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
                  void* const* b_slices) {
    m_grouped(tb, g, N, K, A, lda, B, b_stride, ldb, beta, C, ldc, b_slices);
}
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
                  void* const* b_slices) {
    m_grouped(tb, g, N, K, A, lda, B, b_stride, ldb, beta, C, ldc, b_slices);
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
                  int64_t ldc,
                  void* const* b_slices) {
    m_grouped(tb, g, N, K, A, lda, B, b_stride, ldb, beta, C, ldc, b_slices);
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
    k_grouped(g, M, N, A, lda, B, ldb, C, c_stride, ldc);
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
    k_grouped(g, M, N, A, lda, B, ldb, C, c_stride, ldc);
}

}  // namespace tessera::ops
