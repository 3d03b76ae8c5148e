// GEMM: every transpose combination, odd shapes, leading dims and beta against the f64 loop; and
// thread-count invariance of the panelled f32 path (the determinism ops/gemm.h promises).
#include <gtest/gtest.h>
#include <omp.h>

#include "ops/gemm.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using ops::Trans;

struct GemmCase {
    int64_t M, N, K;
};

TEST(Gemm, MatchesFloat64ReferenceForAllLayouts) {
    for (GemmCase s : {GemmCase{1, 1, 1}, GemmCase{17, 33, 5}, GemmCase{130, 70, 300}, GemmCase{257, 513, 65}}) {
        for (Trans ta : {Trans::N, Trans::T}) {
            for (Trans tb : {Trans::N, Trans::T}) {
                for (double beta : {0.0, 1.3}) {
                    const int64_t pad = 3;
                    const int64_t arows = ta == Trans::N ? s.M : s.K, acols = ta == Trans::N ? s.K : s.M;
                    const int64_t brows = tb == Trans::N ? s.K : s.N, bcols = tb == Trans::N ? s.N : s.K;
                    Tensor A = test::randn(DType::f64, Shape{arows, acols + pad}, 1);
                    Tensor B = test::randn(DType::f64, Shape{brows, bcols + pad}, 2);
                    Tensor C = test::randn(DType::f64, Shape{s.M, s.N + pad}, 3);
                    Tensor A32(DType::f32, A.shape()), B32(DType::f32, B.shape()), C32(DType::f32, C.shape());
                    convert(A, A32);
                    convert(B, B32);
                    convert(C, C32);
                    ops::gemm(ta, tb, s.M, s.N, s.K, 0.7, A.ptr<double>(), acols + pad, B.ptr<double>(), bcols + pad,
                              beta, C.ptr<double>(), s.N + pad);
                    ops::gemm(ta, tb, s.M, s.N, s.K, 0.7f, A32.ptr<float>(), acols + pad, B32.ptr<float>(), bcols + pad,
                              float(beta), C32.ptr<float>(), s.N + pad);
                    SCOPED_TRACE(
                        fmt::format("M={} N={} K={} ta={} tb={} beta={}", s.M, s.N, s.K, int(ta), int(tb), beta));
                    EXPECT_TRUE(test::all_close(C32, C, 2e-5, 2e-5 * std::sqrt(double(s.K))));
                }
            }
        }
    }
}

TEST(Gemm, SameBitsOnOneAndTwoThreads) {
    for (GemmCase s : {GemmCase{512, 384, 256}, GemmCase{96, 1000, 512}}) {
        Tensor A = test::randn(DType::f32, Shape{s.M, s.K}, 4), B = test::randn(DType::f32, Shape{s.N, s.K}, 5);
        Tensor C1(DType::f32, Shape{s.M, s.N}), C2(DType::f32, Shape{s.M, s.N});
        const int saved = omp_get_max_threads();
        omp_set_num_threads(1);
        ops::gemm(Trans::N, Trans::T, s.M, s.N, s.K, 1.0f, A.ptr<float>(), s.K, B.ptr<float>(), s.K, 0.0f,
                  C1.ptr<float>(), s.N);
        omp_set_num_threads(2);
        ops::gemm(Trans::N, Trans::T, s.M, s.N, s.K, 1.0f, A.ptr<float>(), s.K, B.ptr<float>(), s.K, 0.0f,
                  C2.ptr<float>(), s.N);
        omp_set_num_threads(saved);
        EXPECT_TRUE(test::bitwise_equal(C1, C2)) << "M=" << s.M << " N=" << s.N << " K=" << s.K;
    }
}

}  // namespace
}  // namespace tessera
