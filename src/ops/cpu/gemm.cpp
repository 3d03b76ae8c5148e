// CPU GEMM: per-thread panels of oneDNN's sgemm (f32) and a plain loop (f64).
#include "ops/gemm.h"

#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "core/check.h"

namespace tessera::ops {

namespace {
char trans_char(Trans t) { return t == Trans::N ? 'N' : 'T'; }

// Row-major sgemm on oneDNN; returns its status (callers inside OpenMP regions must not throw).
dnnl_status_t sgemm(Trans ta,
                    Trans tb,
                    int64_t M,
                    int64_t N,
                    int64_t K,
                    float alpha,
                    const float* A,
                    int64_t lda,
                    const float* B,
                    int64_t ldb,
                    float beta,
                    float* C,
                    int64_t ldc) {
    return dnnl_sgemm(trans_char(ta), trans_char(tb), M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void check_status(bool ok, int64_t M, int64_t N, int64_t K) {
    TESSERA_CHECK(ok, "oneDNN sgemm failed for M={} N={} K={}", M, N, K);
}

// Panel boundary p of n panels over `extent`, rounded to multiples of 16 (one AVX-512 vector of f32).
int64_t panel_edge(int64_t extent, int p, int n) {
    if (p >= n) return extent;
    int64_t e = extent * p / n;
    return std::min(extent, e / 16 * 16);
}
}  // namespace

void gemm(Trans ta,
          Trans tb,
          int64_t M,
          int64_t N,
          int64_t K,
          float alpha,
          const float* A,
          int64_t lda,
          const float* B,
          int64_t ldb,
          float beta,
          float* C,
          int64_t ldc) {
    if (M == 0 || N == 0) return;
    const int64_t work = M * N * std::max<int64_t>(K, 1);
    const int max_threads = omp_in_parallel() ? 1 : omp_get_max_threads();
    const int num_panels = int(std::min<int64_t>(max_threads, std::max<int64_t>(1, work / (64 * 64 * 64))));
    if (num_panels <= 1) {
        // NOTES: too small to split: pin oneDNN to this thread (left to itself it would thread even
        // tiny products, with an extra workspace allocation per call). Restored right after.
        const bool outer = !omp_in_parallel();
        const int saved = omp_get_max_threads();
        if (outer) omp_set_num_threads(1);
        const dnnl_status_t st = sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        if (outer) omp_set_num_threads(saved);
        check_status(st == dnnl_success, M, N, K);
        return;
    }
    const bool split_rows = M >= N;
    int failed = 0;  // exceptions must not leave an OpenMP region
#pragma omp parallel num_threads(num_panels) reduction(+ : failed)
    {
        const int p = omp_get_thread_num();
        const int n = omp_get_num_threads();
        dnnl_status_t st = dnnl_success;
        if (split_rows) {
            int64_t r0 = panel_edge(M, p, n), r1 = panel_edge(M, p + 1, n);
            if (r1 > r0) {
                const float* Ap = ta == Trans::N ? A + r0 * lda : A + r0;
                st = sgemm(ta, tb, r1 - r0, N, K, alpha, Ap, lda, B, ldb, beta, C + r0 * ldc, ldc);
            }
        } else {
            int64_t c0 = panel_edge(N, p, n), c1 = panel_edge(N, p + 1, n);
            if (c1 > c0) {
                const float* Bp = tb == Trans::N ? B + c0 : B + c0 * ldb;
                st = sgemm(ta, tb, M, c1 - c0, K, alpha, A, lda, Bp, ldb, beta, C + c0, ldc);
            }
        }
        failed += st != dnnl_success;
    }
    check_status(failed == 0, M, N, K);
}

void gemm(Trans ta,
          Trans tb,
          int64_t M,
          int64_t N,
          int64_t K,
          double alpha,
          const double* A,
          int64_t lda,
          const double* B,
          int64_t ldb,
          double beta,
          double* C,
          int64_t ldc) {
    auto a = [&](int64_t i, int64_t k) { return ta == Trans::N ? A[i * lda + k] : A[k * lda + i]; };
    auto b = [&](int64_t k, int64_t j) { return tb == Trans::N ? B[k * ldb + j] : B[j * ldb + k]; };
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && M * N * K > 32768)
    for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) {
            double s = 0.0;
            for (int64_t k = 0; k < K; ++k) s += a(i, k) * b(k, j);
            C[i * ldc + j] = alpha * s + (beta == 0.0 ? 0.0 : beta * C[i * ldc + j]);
        }
    }
}

void gemm_onednn_reference(Trans ta,
                           Trans tb,
                           int64_t M,
                           int64_t N,
                           int64_t K,
                           float alpha,
                           const float* A,
                           int64_t lda,
                           const float* B,
                           int64_t ldb,
                           float beta,
                           float* C,
                           int64_t ldc) {
    check_status(sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) == dnnl_success, M, N, K);
}

double measure_gemm_gflops(int64_t n, double seconds) {
    std::vector<float> a(size_t(n * n), 0.5f), b(size_t(n * n), 0.25f), c(size_t(n * n));
    gemm(Trans::N, Trans::T, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);  // warm up
    double best = 0, total = 0;
    for (int r = 0; r < 5 || total < seconds; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        gemm(Trans::N, Trans::T, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        total += s;
        best = std::max(best, 2.0 * double(n) * double(n) * double(n) / s / 1e9);
    }
    return best;
}

}  // namespace tessera::ops
