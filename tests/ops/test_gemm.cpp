// GEMM: every transpose combination, odd shapes, leading dims and beta against the f64 loop; and
// thread-count invariance of the blocked f32 path (the determinism ops/gemm.h promises). The fused kernels' small
// products (ops/cpu/small_gemm.h) against the same loop, narrow ones included.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <utility>
#include <vector>

#include "ops/cpu/small_gemm.h"
#include "ops/gemm.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using ops::Trans;

struct GemmCase {
    int64_t M, N, K;
};

TEST(Gemm, MatchesFloat64ReferenceForAllLayouts) {
    // the last two cross the weight-gradient path's 512-wide panels and 1024-long K chunks
    for (GemmCase s : {GemmCase{1, 1, 1}, GemmCase{17, 33, 5}, GemmCase{130, 70, 300}, GemmCase{257, 513, 65},
                       GemmCase{520, 70, 1100}, GemmCase{40, 530, 1030}}) {
        for (Trans ta : {Trans::N, Trans::T}) {
            for (Trans tb : {Trans::N, Trans::T}) {
                // B's row stride padded, or a multiple of 512 floats (the AVX2 path copies such a B: ops/cpu/gemm.cpp)
                for (auto [beta, b_stride_512] : {std::pair(0.0, false), std::pair(1.3, false), std::pair(1.3, true)}) {
                    const int64_t pad = 3;
                    const int64_t arows = ta == Trans::N ? s.M : s.K, acols = ta == Trans::N ? s.K : s.M;
                    const int64_t brows = tb == Trans::N ? s.K : s.N, bcols = tb == Trans::N ? s.N : s.K;
                    const int64_t ldb = b_stride_512 ? (bcols + 511) / 512 * 512 : bcols + pad;
                    Tensor A = test::randn(DType::f64, Shape{arows, acols + pad}, 1);
                    Tensor B = test::randn(DType::f64, Shape{brows, ldb}, 2);
                    Tensor C = test::randn(DType::f64, Shape{s.M, s.N + pad}, 3);
                    Tensor A32(DType::f32, A.shape()), B32(DType::f32, B.shape()), C32(DType::f32, C.shape());
                    convert(A, A32);
                    convert(B, B32);
                    convert(C, C32);
                    ops::gemm(ta, tb, s.M, s.N, s.K, 0.7, A.ptr<double>(), acols + pad, B.ptr<double>(), ldb, beta,
                              C.ptr<double>(), s.N + pad);
                    ops::gemm(ta, tb, s.M, s.N, s.K, 0.7f, A32.ptr<float>(), acols + pad, B32.ptr<float>(), ldb,
                              float(beta), C32.ptr<float>(), s.N + pad);
                    SCOPED_TRACE(fmt::format("M={} N={} K={} ta={} tb={} beta={} ldb={}", s.M, s.N, s.K, int(ta),
                                             int(tb), beta, ldb));
                    EXPECT_TRUE(test::all_close(C32, C, 2e-5, 2e-5 * std::sqrt(double(s.K))));
                }
            }
        }
    }
}

// Every column count of the register tiles' remainders (1–3: the narrow tail packed 4 wide; 33–35 after the 32-wide
// tiles), row counts below and across the 8-row tile, K past the packed tail's 1,024; plain, transposed and
// gathered-row A, beta 0 and 1.3, each against the f64 loop.
TEST(SmallGemm, MatchesFloat64ReferenceForNarrowAndOddShapes) {
    for (int64_t N : {1, 2, 3, 4, 5, 7, 9, 33, 35})
        for (int64_t M : {1, 5, 8, 13})
            for (int64_t K : {3, 80, 1030})
                for (int form = 0; form < 3; ++form)
                    for (double beta : {0.0, 1.3}) {
                        const int64_t ldc = N + 2, ldb = N + 1, lda = K + 3;
                        // A [M, K] (plain, lda), its transpose [K, M] (form 1), or rows of the plain one (form 2)
                        const Tensor A = test::randn(DType::f32, Shape{form == 1 ? K : M, form == 1 ? M : lda}, 5);
                        const Tensor B = test::randn(DType::f32, Shape{K, ldb}, 6);
                        Tensor C = test::randn(DType::f32, Shape{M, ldc}, 7);
                        auto a = [&](int64_t i, int64_t k) {
                            return double(form == 1 ? A.ptr<float>()[k * M + i] : A.ptr<float>()[i * lda + k]);
                        };
                        std::vector<double> want(size_t(M * ldc));
                        for (int64_t i = 0; i < M; ++i)
                            for (int64_t j = 0; j < ldc; ++j) {
                                double acc = 0;
                                for (int64_t k = 0; k < K && j < N; ++k) acc += a(i, k) * B.ptr<float>()[k * ldb + j];
                                const double c = C.ptr<float>()[i * ldc + j];
                                want[size_t(i * ldc + j)] = j < N ? 0.7 * acc + beta * c : c;
                            }
                        std::vector<const float*> rows;
                        for (int64_t i = 0; i < M; ++i) rows.push_back(A.ptr<float>() + i * lda);
                        if (form == 0)
                            ops::cpu::small_gemm_nn(M, N, K, 0.7f, A.ptr<float>(), lda, B.ptr<float>(), ldb,
                                                    float(beta), C.ptr<float>(), ldc);
                        else if (form == 1)
                            ops::cpu::small_gemm_tn(M, N, K, 0.7f, A.ptr<float>(), M, B.ptr<float>(), ldb, float(beta),
                                                    C.ptr<float>(), ldc);
                        else
                            ops::cpu::small_gemm_rows_nn(M, N, K, 0.7f, rows.data(), B.ptr<float>(), ldb, float(beta),
                                                         C.ptr<float>(), ldc);
                        // as Gemm.MatchesFloat64ReferenceForAllLayouts: within 2e-5 relative + 2e-5·√K absolute
                        double worst = 0;
                        for (size_t e = 0; e < want.size(); ++e)
                            worst = std::max(worst, std::abs(double(C.ptr<float>()[e]) - want[e]) /
                                                        (2e-5 * std::sqrt(double(K)) + 2e-5 * std::abs(want[e])));
                        EXPECT_LT(worst, 1.0)
                            << "M=" << M << " N=" << N << " K=" << K << " form " << form << " beta " << beta;
                    }
}

// The shapes of a training step (token-major projections, weight gradients with long K, attention-
// sized products) and odd ones; under DNNL_MAX_CPU_ISA=AVX2 oneDNN's kernels round a row differently
// for a different block height, so any thread-dependent cut shows up here (CI runs both ISAs).
TEST(Gemm, SameBitsOnOneTwoAndThreeThreads) {
    for (GemmCase s : {GemmCase{512, 384, 256}, GemmCase{96, 1000, 512}, GemmCase{4096, 256, 256},
                       GemmCase{256, 256, 4096}, GemmCase{1000, 777, 129}, GemmCase{300, 40, 70}}) {
        for (Trans ta : {Trans::N, Trans::T}) {
            const Tensor A = ta == Trans::N ? test::randn(DType::f32, Shape{s.M, s.K}, 4)
                                            : test::randn(DType::f32, Shape{s.K, s.M}, 4);
            const Tensor B = test::randn(DType::f32, Shape{s.N, s.K}, 5);
            std::vector<Tensor> C;
            const int saved = omp_get_max_threads();
            for (int threads : {1, 2, 3}) {
                omp_set_num_threads(threads);
                C.emplace_back(DType::f32, Shape{s.M, s.N});
                ops::gemm(ta, Trans::T, s.M, s.N, s.K, 1.0f, A.ptr<float>(), ta == Trans::N ? s.K : s.M, B.ptr<float>(),
                          s.K, 0.0f, C.back().ptr<float>(), s.N);
            }
            omp_set_num_threads(saved);
            for (size_t t = 1; t < C.size(); ++t) {
                EXPECT_TRUE(test::bitwise_equal(C[0], C[t]))
                    << "M=" << s.M << " N=" << s.N << " K=" << s.K << " ta=" << int(ta) << " threads " << t + 1;
            }
        }
    }
}

// A B held narrow (a frozen base's bf16 weight, frozen experts' MXFP4) gives the bits of the f32 product on its
// widened values, for both layouts of B (MXFP4 panels of op(B) then start inside blocks), a padded row stride,
// shapes of one and of many blocks, beta, and 1 or 2 threads.
TEST(Gemm, NarrowWeightGivesTheBitsOfItsWidenedF32Product) {
    for (DType narrow : {DType::bf16, DType::mxfp4}) {
        for (GemmCase s : {GemmCase{1, 1, 1}, GemmCase{17, 33, 5}, GemmCase{512, 384, 256}, GemmCase{1000, 777, 129}}) {
            for (auto [tb, stride_1024] :
                 {std::pair(Trans::N, false), std::pair(Trans::T, false), std::pair(Trans::N, true)}) {
                const int64_t rows = tb == Trans::N ? s.K : s.N, cols = tb == Trans::N ? s.N : s.K;
                // MXFP4: whole blocks; a stride of 1024 floats: the AVX2 path copies the f32 B (ops/cpu/gemm.cpp)
                const int64_t ld = stride_1024 ? 1024 : narrow == DType::bf16 ? cols + 5 : (cols + 1 + 31) / 32 * 32;
                const Tensor A = test::randn(DType::f32, Shape{s.M, s.K}, 6);
                const Tensor B32 = test::randn(DType::f32, Shape{rows, ld}, 7);
                Tensor Bn(narrow, B32.shape()), Bw(DType::f32, B32.shape());
                convert(B32, Bn);
                convert(Bn, Bw);
                const Tensor C0 = test::randn(DType::f32, Shape{s.M, s.N}, 8);
                const int saved = omp_get_max_threads();
                for (int threads : {1, 2}) {
                    omp_set_num_threads(threads);
                    Tensor want(DType::f32, C0.shape()), got(DType::f32, C0.shape());
                    convert(C0, want);
                    convert(C0, got);
                    ops::gemm(Trans::N, tb, s.M, s.N, s.K, 0.7f, A.ptr<float>(), s.K, Bw.ptr<float>(), ld, 1.5f,
                              want.ptr<float>(), s.N);
                    if (narrow == DType::bf16) {
                        ops::gemm(Trans::N, tb, s.M, s.N, s.K, 0.7f, A.ptr<float>(), s.K, Bn.ptr<bf16>(), ld, 1.5f,
                                  got.ptr<float>(), s.N);
                    } else {
                        ops::gemm(Trans::N, tb, s.M, s.N, s.K, 0.7f, A.ptr<float>(), s.K,
                                  Mxfp4{static_cast<const uint8_t*>(Bn.view().data)}, ld, 1.5f, got.ptr<float>(), s.N);
                    }
                    EXPECT_TRUE(test::bitwise_equal(got, want))
                        << dtype_name(narrow) << " M=" << s.M << " N=" << s.N << " K=" << s.K << " tb=" << int(tb)
                        << " ld=" << ld << " threads " << threads;
                }
                omp_set_num_threads(saved);
            }
        }
    }
}

// GemmPrecision::bf16 (train.precision = bf16): the product of the operands rounded to bf16 with f32 sums, as the
// GPU's tensor cores compute it; the CPU rounds each block's operands as it copies them for its sgemm calls, so the
// result is that of the f32 GEMM on the rounded operands up to the K chunks' order, the same bits on any thread
// count, and not the f32 product of the exact operands. A narrow B (a frozen bf16 weight) takes the same path.
TEST(Gemm, Bf16PrecisionIsTheProductOfTheRoundedOperands) {
    auto rounded = [](const Tensor& t) {
        Tensor r(DType::f32, t.shape());
        for (int64_t i = 0; i < t.numel(); ++i) r.ptr<float>()[i] = bf16_to_float(float_to_bf16(t.ptr<float>()[i]));
        return r;
    };
    for (GemmCase s :
         {GemmCase{17, 33, 5}, GemmCase{512, 384, 256}, GemmCase{520, 70, 1100}, GemmCase{40, 530, 1030}}) {
        for (Trans ta : {Trans::N, Trans::T}) {
            for (Trans tb : {Trans::N, Trans::T}) {
                const int64_t lda = (ta == Trans::N ? s.K : s.M) + 3, ldb = (tb == Trans::N ? s.N : s.K) + 5;
                const Tensor A = test::randn(DType::f32, Shape{ta == Trans::N ? s.M : s.K, lda}, 9);
                const Tensor B = test::randn(DType::f32, Shape{tb == Trans::N ? s.K : s.N, ldb}, 10);
                const Tensor Ar = rounded(A), Br = rounded(B);
                auto product = [&](const Tensor& a, const Tensor& b) {
                    Tensor c(DType::f32, Shape{s.M, s.N});
                    ops::gemm(ta, tb, s.M, s.N, s.K, 1.0f, a.ptr<float>(), lda, b.ptr<float>(), ldb, 0.0f,
                              c.ptr<float>(), s.N);
                    return c;
                };
                const Tensor want = product(Ar, Br), exact = product(A, B);
                std::vector<Tensor> got;
                const int saved = omp_get_max_threads();
                {
                    const ops::GemmPrecisionScope precision(ops::GemmPrecision::bf16);
                    for (int threads : {1, 3}) {
                        omp_set_num_threads(threads);
                        got.push_back(product(A, B));
                    }
                }
                omp_set_num_threads(saved);
                SCOPED_TRACE(fmt::format("M={} N={} K={} ta={} tb={}", s.M, s.N, s.K, int(ta), int(tb)));
                EXPECT_TRUE(test::all_close(got[0], want, 1e-5, 1e-5 * std::sqrt(double(s.K))));
                EXPECT_TRUE(test::bitwise_equal(got[0], got[1])) << "1 and 3 threads";
                if (s.K > 5) {
                    EXPECT_FALSE(test::rel_rms_close(got[0], exact, 1e-4)) << "bf16, not f32";
                }
            }
        }
    }
    // a frozen bf16 weight: only the activations round
    const GemmCase s{300, 200, 700};
    const Tensor A = test::randn(DType::f32, Shape{s.M, s.K}, 11), B32 = test::randn(DType::f32, Shape{s.N, s.K}, 12);
    Tensor Bn(DType::bf16, B32.shape()), Bw(DType::f32, B32.shape());
    convert(B32, Bn);
    convert(Bn, Bw);
    const Tensor Ar = rounded(A);
    Tensor want(DType::f32, Shape{s.M, s.N}), got(DType::f32, Shape{s.M, s.N});
    ops::gemm(Trans::N, Trans::T, s.M, s.N, s.K, 1.0f, Ar.ptr<float>(), s.K, Bw.ptr<float>(), s.K, 0.0f,
              want.ptr<float>(), s.N);
    const ops::GemmPrecisionScope precision(ops::GemmPrecision::bf16);
    ops::gemm(Trans::N, Trans::T, s.M, s.N, s.K, 1.0f, A.ptr<float>(), s.K, Bn.ptr<bf16>(), s.K, 0.0f, got.ptr<float>(),
              s.N);
    EXPECT_TRUE(test::all_close(got, want, 1e-5, 1e-5 * std::sqrt(double(s.K))));
}

// An empty reduction (K = 0) sets C = beta·C, at either precision: oneDNN's GEMMs would leave C as it was, so an
// expert's weight gradient over no tokens would keep whatever the buffer held.
TEST(Gemm, AnEmptyReductionScalesCByBeta) {
    for (const ops::GemmPrecision p : {ops::GemmPrecision::f32, ops::GemmPrecision::bf16}) {
        const ops::GemmPrecisionScope precision(p);
        for (const float beta : {0.0f, 0.5f}) {
            Tensor c = test::randn(DType::f32, Shape{3, 6}, 13), want(DType::f32, Shape{3, 6});
            for (int64_t i = 0; i < 3; ++i)
                for (int64_t j = 0; j < 6; ++j)
                    want.ptr<float>()[i * 6 + j] =  // beta 0: C is not read (+0, as BLAS)
                        j >= 4         ? c.ptr<float>()[i * 6 + j]
                        : beta == 0.0f ? 0.0f
                                       : beta * c.ptr<float>()[i * 6 + j];
            const float a = 1.0f;
            ops::gemm(Trans::N, Trans::N, 3, 4, 0, 1.0f, &a, 1, &a, 4, beta, c.ptr<float>(), 6);
            EXPECT_TRUE(test::bitwise_equal(c, want)) << "beta " << beta << " bf16 " << (p == ops::GemmPrecision::bf16);
        }
    }
}

// The grid covers C exactly once with blocks of whole vectors, in a power-of-two count.
TEST(Gemm, GridCoversTheProductInAPowerOfTwoOfBlocks) {
    for (GemmCase s : {GemmCase{1, 1, 1}, GemmCase{4096, 512, 512}, GemmCase{512, 512, 4096}, GemmCase{1000, 777, 129},
                       GemmCase{100000, 16, 16}, GemmCase{3, 70000, 512}}) {
        for (Trans ta : {Trans::N, Trans::T}) {
            const ops::GemmGrid g = ops::gemm_grid(ta, s.M, s.N, s.K);
            SCOPED_TRACE(fmt::format("M={} N={} K={} ta={}", s.M, s.N, s.K, int(ta)));
            EXPECT_GE(g.rows * g.block_m, s.M);
            EXPECT_LT((g.rows - 1) * g.block_m, s.M);
            EXPECT_GE(g.cols * g.block_n, s.N);
            EXPECT_LT((g.cols - 1) * g.block_n, s.N);
            EXPECT_TRUE(g.rows == 1 || g.block_m % 16 == 0);
            EXPECT_TRUE(g.cols == 1 || g.block_n % 16 == 0);
            EXPECT_LE(g.rows * g.cols, 16);
            EXPECT_EQ(g.rows * g.cols & (g.rows * g.cols - 1), 0);
        }
    }
    const ops::GemmGrid big = ops::gemm_grid(Trans::N, 4096, 512, 512), small = ops::gemm_grid(Trans::N, 64, 64, 64);
    EXPECT_EQ(big.rows * big.cols, 16);
    EXPECT_EQ(small.rows * small.cols, 1);
    // weight gradients: blocks of 256 when that makes at least 4 (512 × 512 over 4096 tokens), else of 128 (a
    // d_model-256 linear, 256 × 256: one block of 256 would leave the other threads idle)
    const ops::GemmGrid wide = ops::gemm_grid(Trans::T, 512, 512, 4096),
                        narrow = ops::gemm_grid(Trans::T, 256, 256, 4096);
    EXPECT_EQ(wide.rows * wide.cols, 4);
    EXPECT_EQ(wide.block_m, 256);
    EXPECT_EQ(narrow.rows * narrow.cols, 4);
    EXPECT_EQ(narrow.block_m, 128);
}

}  // namespace
}  // namespace tessera
