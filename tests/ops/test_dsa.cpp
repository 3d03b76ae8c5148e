// DSA invariants beyond the PyTorch golden files (spec/dsa.md §5.3): the selection against a brute-force
// sort by the total order, thread-count invariance of the selection and of the backward scatter, lonely
// rows, sparse attention with every candidate selected equal to the dense attention op, a KL target
// equal to the student's own distribution giving zero loss and zero gradients, the π − p form of the KL
// gradient, one-token sequences, and the bf16 scoring of train.precision = bf16.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "ops/attention.h"
#include "ops/dsa.h"
#include "ops/gemm.h"
#include "util/test_util.h"

namespace tessera {
namespace {

struct IndexerInputs {
    Tensor q, k, w;
};

IndexerInputs indexer_inputs(DType t, int64_t T, int64_t HI, int64_t DI, uint64_t seed) {
    return {test::randn(t, Shape{1, T, HI, DI}, seed), test::randn(t, Shape{1, T, DI}, seed + 1),
            test::randn(t, Shape{1, T, HI}, seed + 2)};
}

// The ops with a workspace sized for the current thread count.
void select_topk(int64_t K, const IndexerInputs& in, const Tensor& idx, const Tensor& sc) {
    const Shape& s = in.q.shape();
    std::vector<std::byte> ws(
        ops::dsa_indexer_workspace_bytes(in.q.dtype(), s[0], s[1], s[2], s[3], K, omp_get_max_threads()));
    ops::dsa_indexer_forward({.topk = K}, in.q.view(), in.k.view(), in.w.view(), idx.view(), sc.view(), ws);
}

ops::IndexerKlResult kl_with_grads(
    const IndexerInputs& in, const Tensor& p, const Tensor& idx, const Tensor& dq, const Tensor& dk, const Tensor& dw) {
    const Shape& s = in.q.shape();
    std::vector<std::byte> ws(ops::indexer_kl_workspace_bytes(in.q.dtype(), s[0], s[1], s[2], s[3], idx.shape()[2], 4,
                                                              omp_get_max_threads()));
    return ops::indexer_kl(in.q.view(), in.k.view(), in.w.view(), p.view(), idx.view(), {}, 1.0, dq.view(), dk.view(),
                           dw.view(), ws);
}

std::vector<std::byte> sparse_workspace(const ops::SparseAttentionParams& p, const Tensor& q, const Tensor& idx) {
    const Shape& s = q.shape();
    return std::vector<std::byte>(ops::sparse_attention_workspace_bytes(q.dtype(), p, s[0], s[1], s[2], s[3],
                                                                        idx.shape()[2], omp_get_max_threads()));
}

TEST(DsaIndexer, SelectionIsTheTopOfTheTotalOrder) {
    const int64_t T = 500, HI = 3, DI = 8, K = 64;
    IndexerInputs in = indexer_inputs(DType::f64, T, HI, DI, 1);
    for (int64_t d = 0; d < DI; ++d) in.q.ptr<double>()[(400 * HI + 1) * DI + d] = 0.0;  // partial ties
    for (int64_t j = 0; j < HI; ++j)
        for (int64_t d = 0; d < DI; ++d) in.q.ptr<double>()[(450 * HI + j) * DI + d] = 0.0;  // all ties: I = 0
    Tensor idx(DType::i32, Shape{1, T, K}), sc(DType::f64, Shape{1, T, K});
    select_topk(K, in, idx, sc);
    for (int64_t t = 0; t < T; t += 7) {
        std::vector<std::pair<double, int>> all;
        for (int64_t s = 0; s <= t; ++s) {
            double I = 0;
            for (int64_t j = 0; j < HI; ++j) {
                double a = 0;
                for (int64_t d = 0; d < DI; ++d)
                    a += in.q.ptr<double>()[(t * HI + j) * DI + d] * in.k.ptr<double>()[s * DI + d];
                I += in.w.ptr<double>()[t * HI + j] * std::max(a, 0.0);
            }
            all.push_back({I, int(s)});
        }
        std::sort(all.begin(), all.end(),
                  [](auto& a, auto& b) { return a.first > b.first || (a.first == b.first && a.second > b.second); });
        const size_t n = std::min<size_t>(all.size(), size_t(K));
        std::vector<int> want;
        for (size_t i = 0; i < n; ++i) want.push_back(all[i].second);
        std::sort(want.begin(), want.end());
        const int32_t* row = idx.ptr<int32_t>() + t * K;
        for (size_t i = 0; i < size_t(K); ++i) {
            ASSERT_EQ(row[i], i < n ? want[i] : -1) << "query " << t << " slot " << i;
        }
    }
    // the all-tie row keeps the K most recent tokens
    for (int64_t i = 0; i < K; ++i) EXPECT_EQ(idx.ptr<int32_t>()[450 * K + i], 450 - K + 1 + i);
}

TEST(DsaIndexer, SameSelectionOnOneAndTwoThreads) {
    const int64_t T = 700, K = 96;
    IndexerInputs in = indexer_inputs(DType::f32, T, 4, 16, 11);
    Tensor i1(DType::i32, Shape{1, T, K}), i2(DType::i32, Shape{1, T, K}), s1(DType::f32, Shape{1, T, K}),
        s2(DType::f32, Shape{1, T, K});
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    select_topk(K, in, i1, s1);
    omp_set_num_threads(std::max(2, threads));
    select_topk(K, in, i2, s2);
    omp_set_num_threads(threads);
    EXPECT_TRUE(test::bitwise_equal(i1, i2));
    EXPECT_TRUE(test::bitwise_equal(s1, s2));
}

// At GemmPrecision::bf16 the indexer scores as its GEMM then computes: q and k rounded to bf16 (w not), f32 sums.
// Every selected score is the f64 score of the rounded operands within f32 rounding, and visibly not the unrounded
// one's; at f32 the scores are the unrounded ones'.
TEST(DsaIndexer, Bf16PrecisionScoresTheRoundedOperands) {
    const int64_t T = 300, HI = 4, DI = 24, K = 32;
    const IndexerInputs in = indexer_inputs(DType::f32, T, HI, DI, 21);
    const auto reference = [&](int64_t t, int64_t s, bool rounded) {
        const auto r = [&](float v) { return rounded ? double(bf16_to_float(float_to_bf16(v))) : double(v); };
        double I = 0;
        for (int64_t j = 0; j < HI; ++j) {
            double a = 0;
            for (int64_t d = 0; d < DI; ++d)
                a += r(in.q.ptr<float>()[(t * HI + j) * DI + d]) * r(in.k.ptr<float>()[s * DI + d]);
            I += double(in.w.ptr<float>()[t * HI + j]) * std::max(a, 0.0);
        }
        return I;
    };
    for (const ops::GemmPrecision precision : {ops::GemmPrecision::bf16, ops::GemmPrecision::f32}) {
        Tensor idx(DType::i32, Shape{1, T, K}), sc(DType::f32, Shape{1, T, K});
        {
            const ops::GemmPrecisionScope scope(precision);
            select_topk(K, in, idx, sc);
        }
        const bool bf16 = precision == ops::GemmPrecision::bf16;
        double own = 0,
               other = 0;  // the largest differences from the scores of this precision's and the other's operands
        for (int64_t t = 0; t < T; ++t)
            for (int64_t i = 0; i < K && idx.ptr<int32_t>()[t * K + i] >= 0; ++i) {
                const int64_t s = idx.ptr<int32_t>()[t * K + i];
                const double got = sc.ptr<float>()[t * K + i];
                own = std::max(own, std::abs(got - reference(t, s, bf16)) / (1 + std::abs(got)));
                other = std::max(other, std::abs(got - reference(t, s, !bf16)) / (1 + std::abs(got)));
            }
        EXPECT_LT(own, 1e-5) << (bf16 ? "bf16" : "f32");
        EXPECT_GT(other, 1e-3) << (bf16 ? "bf16" : "f32") << ": the two precisions give the same scores";
    }
}

struct SparseRun {
    Tensor o, lse, dq, dkv;
};

SparseRun run_sparse(
    const ops::SparseAttentionParams& p, const Tensor& q, const Tensor& kv, const Tensor& idx, const Tensor& dout) {
    const int64_t B = q.shape()[0], T = q.shape()[1], H = q.shape()[2];
    const int64_t DV = p.dv > 0 ? p.dv : q.shape()[3];
    SparseRun r{Tensor(q.dtype(), Shape{B, T, H, DV}), Tensor(q.dtype(), Shape{B, T, H}), Tensor(q.dtype(), q.shape()),
                Tensor(q.dtype(), kv.shape())};
    std::vector<std::byte> ws = sparse_workspace(p, q, idx);
    ops::sparse_attention_forward(p, q.view(), kv.view(), idx.view(), r.o.view(), r.lse.view(), ws);
    ops::sparse_attention_backward(p, dout.view(), q.view(), kv.view(), idx.view(), r.o.view(), r.lse.view(),
                                   r.dq.view(), r.dkv.view(), ws);
    return r;
}

TEST(SparseAttention, EveryCandidateSelectedEqualsDenseCausalAttention) {
    const int64_t T = 150, H = 4, D = 24;
    Tensor q = test::randn(DType::f64, Shape{1, T, H, D}, 21), kv = test::randn(DType::f64, Shape{1, T, D}, 22),
           dout = test::randn(DType::f64, Shape{1, T, H, D}, 23);
    Tensor idx(DType::i32, Shape{1, T, T});
    for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s < T; ++s) idx.ptr<int32_t>()[t * T + s] = s <= t ? int32_t(s) : -1;
    SparseRun sp = run_sparse({}, q, kv, idx, dout);
    // the dense op with one kv head whose k and v are both kv
    Tensor k4(DType::f64, Shape{1, T, 1, D});
    std::copy(kv.ptr<double>(), kv.ptr<double>() + T * D, k4.ptr<double>());
    Tensor o(DType::f64, Shape{1, T, H, D}), lse(DType::f64, Shape{1, H, T}), dq(DType::f64, q.shape()),
        dk(DType::f64, k4.shape()), dv(DType::f64, k4.shape());
    std::vector<std::byte> ws(ops::attention_workspace_bytes(DType::f64, T, D, omp_get_max_threads()));
    ops::attention_forward({}, q.view(), k4.view(), k4.view(), o.view(), lse.view(), ws);
    ops::attention_backward({}, dout.view(), q.view(), k4.view(), k4.view(), o.view(), lse.view(), dq.view(), dk.view(),
                            dv.view(), ws);
    EXPECT_TRUE(test::rel_rms_close(sp.o, o, 1e-12));
    EXPECT_TRUE(test::rel_rms_close(sp.dq, dq, 1e-12));
    for (int64_t i = 0; i < T * D; ++i) dk.ptr<double>()[i] += dv.ptr<double>()[i];  // the entry is both key and value
    Tensor dkv_dense(DType::f64, Shape{1, T, D});
    std::copy(dk.ptr<double>(), dk.ptr<double>() + T * D, dkv_dense.ptr<double>());
    EXPECT_TRUE(test::rel_rms_close(sp.dkv, dkv_dense, 1e-12));
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < H; ++h) {
            ASSERT_NEAR(sp.lse.ptr<double>()[t * H + h], lse.ptr<double>()[h * T + t], 1e-12);
        }
    }
}

TEST(SparseAttention, LonelyRowsAndThreadInvariantScatter) {
    const int64_t T = 260, H = 4, DK = 40, DV = 32, K = 70;
    Tensor q = test::randn(DType::f32, Shape{1, T, H, DK}, 31), kv = test::randn(DType::f32, Shape{1, T, DK}, 32),
           dout = test::randn(DType::f32, Shape{1, T, H, DV}, 33);
    Tensor idx(DType::i32, Shape{1, T, K});
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t i = 0; i < K; ++i) {
            const int64_t s = (t * 13 + i * 29) % (t + 1);
            idx.ptr<int32_t>()[t * K + i] = (t % 50 == 7 || i > t) ? -1 : int32_t(s);  // rows 7, 57, ... lonely
        }
    }
    const ops::SparseAttentionParams p{.dv = DV};
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    SparseRun a = run_sparse(p, q, kv, idx, dout);
    omp_set_num_threads(std::max(2, threads));
    SparseRun b = run_sparse(p, q, kv, idx, dout);
    omp_set_num_threads(threads);
    EXPECT_TRUE(test::bitwise_equal(a.o, b.o));
    EXPECT_TRUE(test::bitwise_equal(a.dq, b.dq));
    EXPECT_TRUE(test::bitwise_equal(a.dkv, b.dkv));
    for (int64_t t = 7; t < T; t += 50) {
        for (int64_t h = 0; h < H; ++h) {
            EXPECT_TRUE(std::isinf(a.lse.ptr<float>()[t * H + h]) && a.lse.ptr<float>()[t * H + h] > 0);
            for (int64_t e = 0; e < DV; ++e) ASSERT_EQ(a.o.ptr<float>()[(t * H + h) * DV + e], 0.0f);
            for (int64_t e = 0; e < DK; ++e) ASSERT_EQ(a.dq.ptr<float>()[(t * H + h) * DK + e], 0.0f);
        }
    }
}

TEST(IndexerKl, TargetEqualToTheStudentGivesZeroLossAndGradient) {
    const int64_t T = 40, HI = 2, DI = 6, K = 10;
    IndexerInputs in = indexer_inputs(DType::f64, T, HI, DI, 41);
    Tensor idx(DType::i32, Shape{1, T, K}), sc(DType::f64, Shape{1, T, K}), p(DType::f64, Shape{1, T, K});
    select_topk(K, in, idx, sc);
    for (int64_t t = 0; t < T; ++t) {  // p = softmax of the selected scores
        double m = -INFINITY, z = 0;
        for (int64_t i = 0; i < K; ++i) {
            if (idx.ptr<int32_t>()[t * K + i] >= 0) m = std::max(m, sc.ptr<double>()[t * K + i]);
        }
        for (int64_t i = 0; i < K; ++i) {
            const bool v = idx.ptr<int32_t>()[t * K + i] >= 0;
            z += (p.ptr<double>()[t * K + i] = v ? std::exp(sc.ptr<double>()[t * K + i] - m) : 0.0);
        }
        for (int64_t i = 0; i < K; ++i) p.ptr<double>()[t * K + i] /= z;
    }
    Tensor dq(DType::f64, in.q.shape()), dk(DType::f64, in.k.shape()), dw(DType::f64, in.w.shape());
    const ops::IndexerKlResult r = kl_with_grads(in, p, idx, dq, dk, dw);
    EXPECT_EQ(r.rows, T);
    EXPECT_NEAR(r.loss, 0.0, 1e-14);
    for (const Tensor* g : {&dq, &dk, &dw}) {
        for (int64_t i = 0; i < g->numel(); ++i) ASSERT_NEAR(g->ptr<double>()[i], 0.0, 1e-13);
    }
}

TEST(IndexerKl, WeightGradientIsPiMinusPTimesRelu) {
    // I is linear in w: dL/dw[t,j] = (1/N) Σ_s (π − p)[t,s] · relu(q[t,j]·k[s]) over the support (spec/dsa.md §3.2)
    const int64_t T = 30, HI = 3, DI = 5, K = 8;
    IndexerInputs in = indexer_inputs(DType::f64, T, HI, DI, 77);
    Tensor idx(DType::i32, Shape{1, T, K}), sc(DType::f64, Shape{1, T, K});
    select_topk(K, in, idx, sc);
    Tensor p = test::uniform(DType::f64, Shape{1, T, K}, 78, 0.1, 1.0);
    for (int64_t t = 0; t < T; ++t) {  // a target distribution over each row's valid entries
        double z = 0;
        for (int64_t i = 0; i < K; ++i) {
            if (idx.ptr<int32_t>()[t * K + i] < 0) p.ptr<double>()[t * K + i] = 0;
            z += p.ptr<double>()[t * K + i];
        }
        for (int64_t i = 0; i < K; ++i) p.ptr<double>()[t * K + i] /= z;
    }
    Tensor dq(DType::f64, in.q.shape()), dk(DType::f64, in.k.shape()), dw(DType::f64, in.w.shape());
    kl_with_grads(in, p, idx, dq, dk, dw);
    for (int64_t t = 0; t < T; ++t) {
        double m = -INFINITY, z = 0;  // π = softmax of the selected scores
        for (int64_t i = 0; i < K; ++i) {
            if (idx.ptr<int32_t>()[t * K + i] >= 0) m = std::max(m, sc.ptr<double>()[t * K + i]);
        }
        for (int64_t i = 0; i < K; ++i) {
            if (idx.ptr<int32_t>()[t * K + i] >= 0) z += std::exp(sc.ptr<double>()[t * K + i] - m);
        }
        double dI_sum = 0;
        for (int64_t j = 0; j < HI; ++j) {
            double want = 0;
            for (int64_t i = 0; i < K; ++i) {
                const int32_t s = idx.ptr<int32_t>()[t * K + i];
                if (s < 0) continue;
                const double pi = std::exp(sc.ptr<double>()[t * K + i] - m) / z, dI = (pi - p.ptr<double>()[t * K + i]);
                if (j == 0) dI_sum += dI;
                double a = 0;
                for (int64_t d = 0; d < DI; ++d)
                    a += in.q.ptr<double>()[(t * HI + j) * DI + d] * in.k.ptr<double>()[s * DI + d];
                want += dI * std::max(a, 0.0) / double(T);
            }
            EXPECT_NEAR(dw.ptr<double>()[t * HI + j], want, 1e-12) << "t " << t << " head " << j;
        }
        EXPECT_NEAR(dI_sum, 0.0, 1e-12) << "Σ_s (π − p) = 0 per row";
    }
}

TEST(Dsa, OneTokenSequences) {
    // T = 1 with top-4: the row selects token 0 and pads; attention returns its value, lse = its score
    IndexerInputs in = indexer_inputs(DType::f64, 1, 2, 4, 5);
    Tensor idx(DType::i32, Shape{1, 1, 4}), sc(DType::f64, Shape{1, 1, 4});
    select_topk(4, in, idx, sc);
    EXPECT_EQ(std::vector<int32_t>(idx.ptr<int32_t>(), idx.ptr<int32_t>() + 4), (std::vector<int32_t>{0, -1, -1, -1}));
    Tensor q = test::randn(DType::f64, Shape{1, 1, 3, 6}, 6), kv = test::randn(DType::f64, Shape{1, 1, 6}, 7);
    Tensor o(DType::f64, Shape{1, 1, 3, 4}), lse(DType::f64, Shape{1, 1, 3});
    const ops::SparseAttentionParams sp{.scale = 0.5, .dv = 4};
    std::vector<std::byte> ws = sparse_workspace(sp, q, idx);
    ops::sparse_attention_forward(sp, q.view(), kv.view(), idx.view(), o.view(), lse.view(), ws);
    for (int64_t h = 0; h < 3; ++h) {
        double z = 0;
        for (int64_t d = 0; d < 6; ++d) z += 0.5 * q.ptr<double>()[h * 6 + d] * kv.ptr<double>()[d];
        EXPECT_NEAR(lse.ptr<double>()[h], z, 1e-14);
        for (int64_t e = 0; e < 4; ++e) EXPECT_NEAR(o.ptr<double>()[h * 4 + e], kv.ptr<double>()[e], 1e-14);
    }
}

}  // namespace
}  // namespace tessera
