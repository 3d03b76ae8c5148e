// CPU GEMM: a fixed grid of blocks of oneDNN's single-threaded sgemm (f32; bf16 precision: its AMX GEMM where it has
// one) and a plain loop (f64).
#include "ops/gemm.h"

#include <dlfcn.h>
#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/mxfp4.h"
#include "ops/cpu/kernel_util.h"
#include "ops/isa.h"

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

// oneDNN's GEMM of bf16 operands with f32 output, row-major as dnnl_sgemm; exported by libdnnl 2.x (its own tests
// and OpenVINO call it) but not declared in its header, so bound by name: null where the library lacks it.
using GemmBf16 = dnnl_status_t (*)(char,
                                   char,
                                   dnnl_dim_t,
                                   dnnl_dim_t,
                                   dnnl_dim_t,
                                   float,
                                   const bf16*,
                                   dnnl_dim_t,
                                   const bf16*,
                                   dnnl_dim_t,
                                   float,
                                   float*,
                                   dnnl_dim_t);

// The bf16 GEMM where it is fast: oneDNN's AMX kernels (avx512_core_amx), 3.9-6.0x its f32 sgemm on one core of a
// Xeon with AMX (bench/RESULTS.md). Its AVX512-BF16 kernels ran at 0.62-0.75x sgemm on the same machine
// (DNNL_MAX_CPU_ISA=AVX512_CORE_BF16), and it has none for AVX2: there, and where the symbol is missing, the bf16
// precision rounds f32 copies for sgemm instead.
GemmBf16 amx_gemm_bf16() {
    static const GemmBf16 f = onednn_isa().find("amx") != std::string::npos
                                  ? reinterpret_cast<GemmBf16>(dlsym(RTLD_DEFAULT, "dnnl_gemm_bf16bf16f32"))
                                  : nullptr;
    return f;
}

void check_status(bool ok, int64_t M, int64_t N, int64_t K) {
    TESSERA_CHECK(ok, "oneDNN GEMM failed for M={} N={} K={}", M, N, K);
}

// Operands a block's sgemm reads through copies with padded row strides.
// NOTES: oneDNN's AVX2 sgemm (not its AVX-512 one, measured on the same machine) is slow on some strides when it
// runs single-threaded on a block, as ours do; its own threaded sgemm hides this:
// - op(A) = Aᵀ, the weight gradients dW = dYᵀ·X (K = tokens): reading operands whose row stride is a power of two
//   (d_model = 512, 2048, ...) runs at half speed (63 vs 120 GFLOP/s per core on ldb = 2048, K = 4096: cache-set
//   conflicts while packing), and C at a stride of 512 costs another ~10% on long reductions (the block's C is read
//   and written once per K block): all three are copied;
// - B not transposed (the input gradients dX = dY·W, W [out, in]) with a row stride that is a multiple of 512 floats
//   (2 KB): 52-76 GFLOP/s per core against 102-114 on other strides, or on the same stride 16 bytes off a cache line:
//   B is copied. (Strides of 256 and 768 run at full speed.)
// Copying costs K·(m + n) moves per block against K·m·n multiply-adds (~15% of a block's time), so the AVX-512 path
// copies nothing: there the weight gradients ran at 0.74-0.89 of oneDNN's threaded sgemm with the copies and at
// 0.89-0.95 without (bench/RESULTS.md, `linear`). The block runs in panels of at most kPanel × kPanel of C, and each K
// chunk of kCopyK of a panel's operands is copied first. Panels and chunks depend on the shape only, so results still
// do not depend on the thread count; the copy buffer has one fixed size (5.4 MB per thread, allocated on a thread's
// first copying product, never grown).
constexpr int64_t kCopyK = 1024, kPanel = 512;
// padded strides, never a power of two: rows of a panel's width, or of a K chunk (B transposed)
constexpr int64_t kStride = kPanel + 16, kStrideK = kCopyK + 16;
// C is copied only for a reduction at least this long: a short one (an expert's few rows) reads and writes C once
// and would only pay for the copy
constexpr int64_t kCopyCK = 1024;

struct Copies {
    bool a = false, b = false, c = false;
    bool round = false;  // GemmPrecision::bf16: op(A) and op(B) rounded to bf16 as they are copied (both copied)
    bool any() const { return a || b || c; }
};

Copies copies_for(Trans ta, Trans tb, int64_t K, int64_t ldb) {
    static const bool avx2 = onednn_isa().rfind("avx512", 0) != 0;
    if (!avx2) return {};
    if (ta == Trans::T) return {true, true, K >= kCopyCK};
    if (tb == Trans::N && ldb % 512 == 0) return {false, true, false};
    return {};
}

constexpr int64_t kCopyA = std::max(kCopyK * kStride, kPanel*kStrideK), kCopyB = kCopyA;
constexpr size_t kCopyElems = size_t(kCopyA + kCopyB + kPanel * kStride);

// n values from src to dst, or (round) each rounded to bf16 and widened back: exactly what a bf16 GEMM multiplies
void copy_values(const float* src, int64_t n, float* dst, bool round) {
    if (!round) {
        std::copy_n(src, n, dst);
        return;
    }
    cpu::round_to_bf16(src, n, dst);
}
// n values from src rounded to bf16 (to nearest even, as above)
void copy_values(const float* src, int64_t n, bf16* dst, bool) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// E: the copies' element type, f32 (sgemm) or bf16 (the AMX GEMM: cp.round, both operands copied, C not)
template <class E>
dnnl_status_t gemm_copied(Copies cp,
                          Trans ta,
                          Trans tb,
                          int64_t m,
                          int64_t n,
                          int64_t K,
                          float alpha,
                          const float* A,
                          int64_t lda,
                          const float* B,
                          int64_t ldb,
                          float beta,
                          float* C,
                          int64_t ldc) {
    thread_local std::vector<E> copy;
    if (copy.empty()) copy.resize(std::is_same_v<E, float> ? kCopyElems : size_t(kCopyA + kCopyB));
    E* a = copy.data();
    E* b = a + kCopyA;
    float* c = nullptr;  // C's copy (cp.c: f32 only)
    if constexpr (std::is_same_v<E, float>) c = b + kCopyB;
    dnnl_status_t st = dnnl_success;
    for (int64_t i0 = 0; i0 < m; i0 += kPanel) {
        const int64_t mi = std::min(kPanel, m - i0);
        for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
            const int64_t nj = std::min(kPanel, n - j0);
            float* Cij = C + i0 * ldc + j0;
            if (cp.c && beta != 0.0f)
                for (int64_t i = 0; i < mi; ++i) std::copy_n(Cij + i * ldc, nj, c + i * kStride);
            for (int64_t k0 = 0; st == dnnl_success && (k0 == 0 || k0 < K); k0 += kCopyK) {
                const int64_t kk = std::min(kCopyK, K - k0);
                // this chunk's op(A) rows [i0, i0 + mi), columns [k0, k0 + kk); op(B) rows [k0, +kk), columns [j0, +nj)
                const float* Ak = ta == Trans::N ? A + i0 * lda + k0 : A + k0 * lda + i0;
                const float* Bk = tb == Trans::N ? B + k0 * ldb + j0 : B + j0 * ldb + k0;
                const E* Ae = nullptr;  // the operands the product reads: the copies, or (f32) A and B in place
                const E* Be = nullptr;
                if constexpr (std::is_same_v<E, float>) {
                    Ae = Ak;
                    Be = Bk;
                }
                int64_t lda_k = lda, ldb_k = ldb;
                if (cp.a) {
                    if (ta == Trans::T) {  // op(A) = Aᵀ: kk rows of mi
                        for (int64_t k = 0; k < kk; ++k) copy_values(Ak + k * lda, mi, a + k * kStride, cp.round);
                        lda_k = kStride;
                    } else {  // mi rows of kk
                        for (int64_t i = 0; i < mi; ++i) copy_values(Ak + i * lda, kk, a + i * kStrideK, cp.round);
                        lda_k = kStrideK;
                    }
                    Ae = a;
                }
                if (cp.b) {
                    if (tb == Trans::N) {
                        for (int64_t k = 0; k < kk; ++k) copy_values(Bk + k * ldb, nj, b + k * kStride, cp.round);
                        ldb_k = kStride;
                    } else {
                        for (int64_t j = 0; j < nj; ++j) copy_values(Bk + j * ldb, kk, b + j * kStrideK, cp.round);
                        ldb_k = kStrideK;
                    }
                    Be = b;
                }
                const float bk = k0 == 0 ? beta : 1.0f;
                if constexpr (std::is_same_v<E, float>)
                    st = sgemm(ta, tb, mi, nj, kk, alpha, Ae, lda_k, Be, ldb_k, bk, cp.c ? c : Cij,
                               cp.c ? kStride : ldc);
                else
                    st = amx_gemm_bf16()(trans_char(ta), trans_char(tb), mi, nj, kk, alpha, Ae, lda_k, Be, ldb_k, bk,
                                         Cij, ldc);
            }
            if (cp.c)
                for (int64_t i = 0; i < mi; ++i) std::copy_n(c + i * kStride, nj, Cij + i * ldc);
        }
    }
    return st;
}

// Runs fn() with OpenMP (and so oneDNN) limited to the calling thread, unless already inside a
// parallel region, where oneDNN's sgemm runs on the calling thread by itself.
template <class Fn>
auto on_this_thread(Fn fn) {
    const bool outer = !omp_in_parallel();
    const int saved = omp_get_max_threads();
    if (outer) omp_set_num_threads(1);
    auto r = fn();
    if (outer) omp_set_num_threads(saved);
    return r;
}
}  // namespace

size_t gemm_copy_buffer_bytes() { return kCopyElems * sizeof(float); }

const char* cpu_bf16_gemm() {
    return amx_gemm_bf16() ? "oneDNN's AMX kernels" : "sgemm on operands rounded to bf16, slower than f32 here";
}

GemmGrid gemm_grid(Trans ta, int64_t M, int64_t N, int64_t K) {
    // NOTES: halve the longer block edge until there are kMaxBlocks blocks, an edge would drop below
    // the minimum, or a block would hold less than kMinWork multiply-adds. Blocks stay large enough
    // that oneDNN's packing of each block's operands is amortised; the block counts are powers of
    // two, so 2, 4, 8 or 16 threads share them evenly. With op(A) = Aᵀ (weight gradients, long K)
    // each block may also copy its operands (gemm_copied): edges of at least 256 keep
    // that copy small, unless that leaves fewer than kFewBlocks blocks; then edges go down to 128.
    // (Edges of 256 alone left a d_model-256 weight gradient, 256 × 256 over 4096 tokens, as one
    // single-threaded block: 0.66 of oneDNN's threaded sgemm on that linear's backward, 0.89 with
    // edges of 128. Edges of 128 everywhere cost the wider AVX2 shapes up to 0.1, e.g. 512 × 512.)
    constexpr int64_t kMaxBlocks = 16, kFewBlocks = 4, kMinWork = int64_t(1) << 21;
    int64_t pm = 1, pn = 1;
    auto halve = [&](int64_t min_edge) {
        while (pm * pn < kMaxBlocks) {
            const int64_t em = (M + pm - 1) / pm, en = (N + pn - 1) / pn;
            const bool rows = em >= en;
            if ((rows ? em : en) < 2 * min_edge || em * en * std::max<int64_t>(K, 1) / 2 < kMinWork) break;
            (rows ? pm : pn) *= 2;
        }
    };
    halve(ta == Trans::T ? 256 : 128);
    if (pm * pn < kFewBlocks) halve(128);
    auto edge = [](int64_t extent, int64_t parts) {  // multiples of 16 floats (one AVX-512 vector)
        return parts == 1 ? extent : ((extent + parts - 1) / parts + 15) / 16 * 16;
    };
    GemmGrid g;
    g.block_m = edge(M, pm);
    g.block_n = edge(N, pn);
    g.rows = (M + g.block_m - 1) / g.block_m;
    g.cols = (N + g.block_n - 1) / g.block_n;
    return g;
}

namespace {
// The grid of single-threaded sgemm calls; panel(c0, n) gives the B operand of the blocks of columns [c0, c0 + n) of
// op(B) as (pointer, row stride); cp is what the blocks copy, chosen on the caller's B (a narrow B's widened panel
// then takes the f32 weight's path: the same bits).
template <class Panel>
void run_grid(Trans ta,
              Trans tb,
              int64_t M,
              int64_t N,
              int64_t K,
              float alpha,
              const float* A,
              int64_t lda,
              Copies cp,
              Panel panel,
              float beta,
              float* C,
              int64_t ldc) {
    if (M == 0 || N == 0) return;
    if (K == 0) {  // C = beta·C: oneDNN's GEMMs leave C as it was for an empty reduction
        for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
        return;
    }
    // bf16: the AMX GEMM on bf16 copies where it runs, else sgemm on rounded f32 copies
    const bool rounds = gemm_precision() == GemmPrecision::bf16, amx = rounds && amx_gemm_bf16();
    if (rounds) cp = Copies{.a = true, .b = true, .c = cp.c && !amx, .round = true};
    const GemmGrid g = gemm_grid(ta, M, N, K);
    const int64_t blocks = g.rows * g.cols;
    // one block of C: single-threaded sgemm on its rows of op(A) and columns of op(B)
    auto block = [&](int64_t b) {
        const int64_t r0 = b / g.cols * g.block_m, c0 = b % g.cols * g.block_n;
        const int64_t m = std::min(g.block_m, M - r0), n = std::min(g.block_n, N - c0);
        const auto [Bb, ldb] = panel(c0, n);
        const float* Ab = ta == Trans::N ? A + r0 * lda : A + r0;
        if (!cp.any()) return sgemm(ta, tb, m, n, K, alpha, Ab, lda, Bb, ldb, beta, C + r0 * ldc + c0, ldc);
        if (amx) return gemm_copied<bf16>(cp, ta, tb, m, n, K, alpha, Ab, lda, Bb, ldb, beta, C + r0 * ldc + c0, ldc);
        return gemm_copied<float>(cp, ta, tb, m, n, K, alpha, Ab, lda, Bb, ldb, beta, C + r0 * ldc + c0, ldc);
    };
    const int threads = omp_in_parallel() ? 1 : int(std::min<int64_t>(omp_get_max_threads(), blocks));
    if (threads <= 1) {
        const bool ok = on_this_thread([&] {
            for (int64_t b = 0; b < blocks; ++b)
                if (block(b) != dnnl_success) return false;
            return true;
        });
        check_status(ok, M, N, K);
        return;
    }
    int failed = 0;  // exceptions must not leave an OpenMP region
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(+ : failed)
    for (int64_t b = 0; b < blocks; ++b) failed += block(b) != dnnl_success;
    check_status(failed == 0, M, N, K);
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
    auto panel = [&](int64_t c0, int64_t) { return std::pair(tb == Trans::N ? B + c0 : B + c0 * ldb, ldb); };
    run_grid(ta, tb, M, N, K, alpha, A, lda, copies_for(ta, tb, K, ldb), panel, beta, C, ldc);
}

namespace {
void widen(const bf16* src, int64_t n, float* dst) {
    for (int64_t c = 0; c < n; ++c) dst[c] = bf16_to_float(src[c]);
}
void widen(Mxfp4 src, int64_t n, float* dst) { mxfp4_to_f32(src, n, dst); }

// the grid with each block's panel of a narrow B (bf16, MXFP4) widened to f32: the block's columns of op(B), n rows
// of K (B transposed: weight rows) or K rows of n
template <class TB>
void gemm_widened(Trans ta,
                  Trans tb,
                  int64_t M,
                  int64_t N,
                  int64_t K,
                  float alpha,
                  const float* A,
                  int64_t lda,
                  TB B,
                  int64_t ldb,
                  float beta,
                  float* C,
                  int64_t ldc) {
    TESSERA_CHECK(ta == Trans::N, "gemm: a {} B needs op(A) = A", std::is_same_v<TB, Mxfp4> ? "mxfp4" : "bf16");
    auto panel = [&](int64_t c0, int64_t n) {
        thread_local std::vector<float> wide;
        const int64_t rows = tb == Trans::T ? n : K, cols = tb == Trans::T ? K : n;
        if (wide.size() < size_t(rows * cols)) wide.resize(size_t(rows * cols));
        for (int64_t r = 0; r < rows; ++r)
            widen(tb == Trans::T ? B + (c0 + r) * ldb : B + r * ldb + c0, cols, wide.data() + r * cols);
        return std::pair<const float*, int64_t>(wide.data(), cols);
    };
    run_grid(ta, tb, M, N, K, alpha, A, lda, copies_for(ta, tb, K, ldb), panel, beta, C, ldc);
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
          const bf16* B,
          int64_t ldb,
          float beta,
          float* C,
          int64_t ldc) {
    gemm_widened(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void gemm(Trans ta,
          Trans tb,
          int64_t M,
          int64_t N,
          int64_t K,
          float alpha,
          const float* A,
          int64_t lda,
          Mxfp4 B,
          int64_t ldb,
          float beta,
          float* C,
          int64_t ldc) {
    gemm_widened(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
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
