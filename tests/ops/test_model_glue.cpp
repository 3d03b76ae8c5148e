// The ops the blocks call instead of loops of their own (ops/rows.h, ops/matmul.h, causal_conv1d_step,
// dsa_all_candidates) and the views they take (TensorView::narrow / columns), against element loops written out here,
// finite differences and the full-sequence ops they must agree with.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/causal_conv1d.h"
#include "ops/dsa.h"
#include "ops/matmul.h"
#include "ops/rows.h"
#include "util/test_util.h"

namespace tessera {
namespace {

float at(const TensorView& t, int64_t r, int64_t c) { return t.ptr<float>()[r * t.strides[0] + c]; }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(TensorViews, NarrowAndColumnsKeepStridesAndDevice) {
    Tensor t = test::randn(DType::f32, Shape{4, 3, 10}, 1);
    const TensorView c = t.view().columns(6, 3);
    EXPECT_EQ(c.shape, (Shape{4, 3, 3}));
    EXPECT_EQ(c.strides[0], 30);
    EXPECT_EQ(c.strides[1], 10);
    EXPECT_EQ(c.device, Device::cpu);
    EXPECT_EQ(c.ptr<float>()[1 * 30 + 2 * 10 + 1], t.ptr<float>()[1 * 30 + 2 * 10 + 7]);
    const TensorView n = t.view().narrow(1, 1, 2);
    EXPECT_EQ(n.shape, (Shape{4, 2, 10}));
    EXPECT_EQ(n.ptr<float>(), t.ptr<float>() + 10);
    EXPECT_FALSE(n.is_contiguous());
    test::expect_error([&] { (void)t.view().columns(8, 3); }, "out of range");
    test::expect_error([&] { (void)t.view().narrow(3, 0, 1); }, "dimension 3");
}

TEST(RowOps, CopyAddAndZeroTouchOnlyTheirColumns) {
    Tensor buf = test::randn(DType::f32, Shape{5, 12}, 2), src = test::randn(DType::f32, Shape{5, 4}, 3);
    const Tensor before = Tensor::copy_of(buf);
    const TensorView mid = buf.view().columns(4, 4);
    ops::copy_rows(src, mid, -0.5f);
    for (int64_t r = 0; r < 5; ++r) {
        for (int64_t c = 0; c < 12; ++c) {
            const float want = c >= 4 && c < 8 ? -0.5f * at(src, r, c - 4) : at(before, r, c);
            EXPECT_EQ(at(buf, r, c), want) << r << "," << c;
        }
    }
    ops::add_rows(src, mid);
    EXPECT_FLOAT_EQ(at(buf, 2, 5), 0.5f * at(src, 2, 1));
    ops::zero_rows(mid, 3);  // rows 0..2 of the block only
    for (int64_t r = 0; r < 5; ++r) {
        for (int64_t c = 0; c < 12; ++c) {
            if (c >= 4 && c < 8) {
                const float want = r < 3 ? 0.f : 0.5f * at(src, r, c - 4);
                EXPECT_FLOAT_EQ(at(buf, r, c), want) << r << "," << c;
            } else {
                EXPECT_EQ(at(buf, r, c), at(before, r, c)) << r << "," << c;
            }
        }
    }
    Tensor ints(DType::i32, Shape{4, 3});
    ints.ptr<int32_t>()[11] = 7;
    ops::zero_rows(ints, 3);
    EXPECT_EQ(ints.ptr<int32_t>()[11], 7);  // row 3 kept
    test::expect_error([&] { ops::copy_rows(src, buf.view().columns(0, 5)); }, "copy_rows: dst is [5, 5]");
    test::expect_error([&] { ops::zero_rows(buf, 6); }, "zero_rows: 6 rows");
}

TEST(RowOps, CopyBlocksMovesEachBlockAndNothingElse) {
    std::vector<float> src(40), dst(50, -1.f);
    for (size_t i = 0; i < src.size(); ++i) src[i] = float(i);
    const std::vector<ops::CopyBlock> blocks{{5, 0, 3}, {0, 10, 4}, {30, 20, 10}, {7, 45, 0}, {5, 40, 2}};
    ops::copy_blocks(TensorView(src.data(), DType::f32, Shape{40}), TensorView(dst.data(), DType::f32, Shape{50}),
                     blocks);
    std::vector<float> want(50, -1.f);
    for (const ops::CopyBlock& b : blocks)
        for (int64_t i = 0; i < b.n; ++i) want[size_t(b.to + i)] = float(b.from + i);
    EXPECT_EQ(dst, want);
    const std::vector<ops::CopyBlock> past{{38, 0, 3}};
    test::expect_error(
        [&] {
            ops::copy_blocks(TensorView(src.data(), DType::f32, Shape{40}),
                             TensorView(dst.data(), DType::f32, Shape{50}), past);
        },
        "copy_blocks: block of 3 from 38 to 0 outside 40 / 50 elements");
}

// cast: f32 -> bf16 is the nearest bf16 (ties to the even one), found here by comparing the two neighbours in double
// arithmetic; bf16 -> f32 is exact; one dtype copies.
TEST(RowOps, CastRoundsToTheNearestBf16AndWidensExactly) {
    auto bits = [](float f) { return std::bit_cast<uint32_t>(f); };
    auto from_bits = [](uint32_t u) { return std::bit_cast<float>(u); };
    auto nearest = [&](float x) -> uint16_t {  // the reference, for finite x
        const uint32_t lo = bits(x) & 0xffff0000u, hi = lo + 0x10000u;
        const double dlo = std::abs(double(x) - double(from_bits(lo))),
                     dhi = std::abs(double(x) - double(from_bits(hi)));
        if (dlo != dhi) return uint16_t((dlo < dhi ? lo : hi) >> 16);
        return uint16_t(((lo >> 16) % 2 == 0 ? lo : hi) >> 16);
    };
    std::vector<float> x = {1.f,
                            from_bits(0x3f808000u),  // halfway: down to the even 0x3f80
                            from_bits(0x3f818000u),  // halfway: up to the even 0x3f82
                            from_bits(0x3f808001u),  // past halfway: up
                            -0.f,
                            from_bits(0x7f7fffffu),  // the largest float: to infinity
                            INFINITY,
                            NAN};
    Tensor r = test::randn(DType::f32, Shape{40000}, 9, 3.0);  // more than one chunk of the loop
    x.insert(x.end(), r.ptr<float>(), r.ptr<float>() + r.numel());
    const int64_t n = int64_t(x.size());
    Tensor narrow(DType::bf16, Shape{n}), wide(DType::f32, Shape{n});
    ops::cast(TensorView(x.data(), DType::f32, Shape{n}), narrow);
    ops::cast(narrow, wide);
    const uint16_t* h = static_cast<const uint16_t*>(narrow.view().data);
    EXPECT_EQ(h[0], 0x3f80);
    EXPECT_EQ(h[1], 0x3f80);
    EXPECT_EQ(h[2], 0x3f82);
    EXPECT_EQ(h[3], 0x3f81);
    EXPECT_EQ(h[4], 0x8000);
    EXPECT_EQ(h[5], 0x7f80);
    EXPECT_EQ(h[6], 0x7f80);
    EXPECT_TRUE(std::isnan(wide.ptr<float>()[7]));
    int wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (i != 7 && i != 6 && i != 5) wrong += h[i] != nearest(x[size_t(i)]);
        if (i != 7) wrong += bits(wide.ptr<float>()[i]) != uint32_t(h[i]) << 16;
    }
    EXPECT_EQ(wrong, 0);
    Tensor rounded(DType::f32, Shape{n});  // in place: the same values as through bf16
    std::memcpy(rounded.view().data, x.data(), x.size() * sizeof(float));
    ops::round_to_bf16(rounded);
    EXPECT_EQ(std::memcmp(rounded.view().data, wide.view().data, size_t(n) * sizeof(float)), 0);
    Tensor ints(DType::i32, Shape{3}), copy(DType::i32, Shape{3});
    for (int i = 0; i < 3; ++i) ints.ptr<int32_t>()[i] = 7 * i - 5;
    ops::cast(ints, copy);
    EXPECT_EQ(std::memcmp(ints.ptr<int32_t>(), copy.ptr<int32_t>(), 12), 0);
    Tensor f64(DType::f64, Shape{n});
    test::expect_error([&] { ops::cast(wide, f64); }, "cast: f32 -> f64 is not supported (f32 <-> bf16)");
    test::expect_error([&] { ops::cast(wide.view().slice0(0, 5), narrow); },
                       "cast: src and dst must be contiguous views of one element count (5 and");
}

TEST(RowOps, SigmoidAndItsGradient) {
    Tensor x = test::randn(DType::f32, Shape{3, 7}, 4, 3.0), y(DType::f32, Shape{3, 7});
    ops::sigmoid_forward(x, y);
    Tensor dy = test::randn(DType::f32, Shape{3, 7}, 5), dx = test::randn(DType::f32, Shape{3, 7}, 6);
    const Tensor dx0 = Tensor::copy_of(dx);
    ops::sigmoid_backward(dy, y, dx);
    for (int64_t i = 0; i < 21; ++i) {
        const double xv = x.ptr<float>()[i], s = sigmoid(xv);
        EXPECT_NEAR(y.ptr<float>()[i], s, 2e-7);
        const double fd = (sigmoid(xv + 1e-4) - sigmoid(xv - 1e-4)) / 2e-4;  // accumulates dy·σ'
        EXPECT_NEAR(dx.ptr<float>()[i], dx0.ptr<float>()[i] + dy.ptr<float>()[i] * fd, 1e-5);
    }
}

TEST(RowOps, ExpandGroupsAndSumGroupsAreAdjoint) {
    const int64_t N = 4, G = 3, K = 5;
    Tensor s = test::randn(DType::f32, Shape{N, G}, 7), wide(DType::f32, Shape{N, G * K});
    ops::expand_groups(s, wide);
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t c = 0; c < G * K; ++c) EXPECT_EQ(at(wide, n, c), at(s, n, c / K));
    }
    // <expand(s), w> = <s, sum(w)>
    Tensor w = test::randn(DType::f32, Shape{N, G * K}, 8), sums(DType::f32, Shape{N, G});
    ops::sum_groups(w, sums);
    double lhs = 0, rhs = 0;
    for (int64_t i = 0; i < N * G * K; ++i) lhs += double(wide.ptr<float>()[i]) * w.ptr<float>()[i];
    for (int64_t i = 0; i < N * G; ++i) rhs += double(s.ptr<float>()[i]) * sums.ptr<float>()[i];
    EXPECT_NEAR(lhs, rhs, 1e-4);
    EXPECT_NEAR(at(sums, 2, 1), at(w, 2, 5) + at(w, 2, 6) + at(w, 2, 7) + at(w, 2, 8) + at(w, 2, 9), 1e-6);
    test::expect_error([&] { ops::sum_groups(w, Tensor(DType::f32, Shape{N, 4})); }, "not [4, a multiple of 4]");
}

TEST(RowOps, OutputGateMatchesItsDefinitionAndFiniteDifferences) {
    const int64_t N = 3, G = 4, per = 2;
    Tensor z = test::randn(DType::f32, Shape{N, G}, 9), o = test::randn(DType::f32, Shape{N, G * per}, 10);
    Tensor gate(DType::f32, Shape{N, G}), y(DType::f32, Shape{N, G * per});
    ops::output_gate_forward(z, o, gate, y);
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t e = 0; e < G * per; ++e) EXPECT_NEAR(at(y, n, e), at(o, n, e) * sigmoid(at(z, n, e / per)), 1e-6);
    }
    Tensor dy = test::randn(DType::f32, Shape{N, G * per}, 11), dov(DType::f32, Shape{N, G * per}),
           dz(DType::f32, Shape{N, G});
    ops::output_gate_backward(dy, o, gate, dov, dz);
    // L = Σ dy·o·σ(z): dL/dz and dL/do by central differences in double
    auto loss = [&](int64_t n, double zshift, int64_t eo, double oshift) {
        double L = 0;
        for (int64_t e = 0; e < G * per; ++e) {
            const double ov = at(o, n, e) + (e == eo ? oshift : 0.0);
            const double zv = at(z, n, e / per) + (e / per == eo / per && zshift != 0 ? zshift : 0.0);
            L += at(dy, n, e) * ov * sigmoid(zv);
        }
        return L;
    };
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t g = 0; g < G; ++g) {
            const double fd = (loss(n, 1e-3, g * per, 0) - loss(n, -1e-3, g * per, 0)) / 2e-3;
            EXPECT_NEAR(at(dz, n, g), fd, 1e-4);
        }
        for (int64_t e = 0; e < G * per; ++e) {
            const double fd = (loss(n, 0, e, 1e-3) - loss(n, 0, e, -1e-3)) / 2e-3;
            EXPECT_NEAR(at(dov, n, e), fd, 1e-4);
        }
    }
}

TEST(MatmulHeads, EachHeadIsItsOwnProductInEveryTransposition) {
    const int64_t H = 3, M = 5, N = 4, K = 6;
    for (ops::Trans ta : {ops::Trans::N, ops::Trans::T}) {
        for (ops::Trans tb : {ops::Trans::N, ops::Trans::T}) {
            // heads side by side in the columns of row-major buffers, with a spare column between heads
            const int64_t ar = ta == ops::Trans::N ? M : K, ac = ta == ops::Trans::N ? K : M;
            const int64_t br = tb == ops::Trans::N ? K : N, bc = tb == ops::Trans::N ? N : K;
            Tensor A = test::randn(DType::f64, Shape{ar, H * (ac + 1)}, 12),
                   B = test::randn(DType::f64, Shape{br, H * (bc + 1)}, 13);
            Tensor C = test::randn(DType::f64, Shape{M, H * (N + 1)}, 14);
            const Tensor C0 = Tensor::copy_of(C);
            ops::matmul_heads(ta, tb, 0.5, ops::head_matrices(A, 0, H, ac + 1, ac),
                              ops::head_matrices(B, 0, H, bc + 1, bc), 2.0, ops::head_matrices(C, 0, H, N + 1, N));
            auto el = [](const Tensor& t, int64_t r, int64_t c) { return t.ptr<double>()[r * t.shape().dims[1] + c]; };
            for (int64_t h = 0; h < H; ++h) {
                for (int64_t i = 0; i < M; ++i) {
                    for (int64_t j = 0; j < N; ++j) {
                        double acc = 0;
                        for (int64_t k = 0; k < K; ++k) {
                            const double a =
                                ta == ops::Trans::N ? el(A, i, h * (ac + 1) + k) : el(A, k, h * (ac + 1) + i);
                            const double b =
                                tb == ops::Trans::N ? el(B, k, h * (bc + 1) + j) : el(B, j, h * (bc + 1) + k);
                            acc += a * b;
                        }
                        EXPECT_NEAR(el(C, i, h * (N + 1) + j), 0.5 * acc + 2.0 * el(C0, i, h * (N + 1) + j), 1e-12);
                    }
                    EXPECT_EQ(el(C, i, h * (N + 1) + N), el(C0, i, h * (N + 1) + N));  // the spare column
                }
            }
        }
    }
    Tensor a(DType::f32, Shape{2, 3, 4}), b(DType::f32, Shape{2, 5, 6}), c(DType::f32, Shape{2, 3, 6});
    test::expect_error([&] { ops::matmul_heads(ops::Trans::N, ops::Trans::N, 1, a, b, 0, c); }, "does not give c");
}

TEST(CausalConv1dStep, TokenByTokenEqualsTheFullSequence) {
    const int64_t B = 2, T = 6, C = 5, W = 4;
    Tensor x = test::randn(DType::f32, Shape{B, T, C}, 15), w = test::randn(DType::f32, Shape{C, W}, 16);
    Tensor y(DType::f32, Shape{B, T, C});
    const ops::CausalConv1dParams p{.activation = ops::Activation::silu};
    ops::causal_conv1d_forward(p, x, w, y);
    Tensor window(DType::f32, Shape{B, W - 1, C}), xt(DType::f32, Shape{B, C}), yt(DType::f32, Shape{B, C});
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t b = 0; b < B; ++b) {
            for (int64_t c = 0; c < C; ++c) xt.ptr<float>()[b * C + c] = x.ptr<float>()[(b * T + t) * C + c];
        }
        ops::causal_conv1d_step(p, xt, w, window, yt);
        for (int64_t b = 0; b < B; ++b) {
            for (int64_t c = 0; c < C; ++c)
                EXPECT_NEAR(yt.ptr<float>()[b * C + c], y.ptr<float>()[(b * T + t) * C + c], 1e-6) << t << "," << b;
        }
    }
    test::expect_error(
        [&] {
            ops::causal_conv1d_step(p, xt, w, Tensor(DType::f32, Shape{B, W, C}), yt);
        },
        "causal_conv1d step: window");
}

TEST(DsaAllCandidates, EveryPastTokenOfTheSequenceAscendingThenPadding) {
    Tensor idx(DType::i32, Shape{1, 5, 4});
    const std::vector<int64_t> cu{0, 2, 5};  // two documents: [0, 2) and [2, 5)
    ops::dsa_all_candidates(idx, cu);
    const std::vector<int32_t> want{0, -1, -1, -1, 0, 1, -1, -1, 2, -1, -1, -1, 2, 3, -1, -1, 2, 3, 4, -1};
    EXPECT_EQ(std::vector<int32_t>(idx.ptr<int32_t>(), idx.ptr<int32_t>() + 20), want);
    Tensor rows(DType::i32, Shape{2, 3, 3});
    ops::dsa_all_candidates(rows);
    EXPECT_EQ(rows.ptr<int32_t>()[9 + 6], 0);  // row 1, t = 2: 0, 1, 2 (positions within the row)
    EXPECT_EQ(rows.ptr<int32_t>()[9 + 8], 2);
    test::expect_error([&] { ops::dsa_all_candidates(Tensor(DType::i32, Shape{1, 5, 2}), cu); }, "needs K >= 3");
}

}  // namespace
}  // namespace tessera
