// Op contracts beyond the numbers: clear errors for bad input, the op runner's validation, strided
// and in-place views, memory bounds of the streaming kernels, thread-count invariance, and the
// accuracy of the vectorized exp used by the softmax kernels.
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>

#include "ops/attention.h"
#include "ops/causal_conv1d.h"
#include "ops/cpu/vec_math.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/gated_rmsnorm.h"
#include "ops/kda_gate.h"
#include "ops/l2norm.h"
#include "ops/linear.h"
#include "ops/registry.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "util/test_util.h"

namespace tessera {
namespace {

Tensor ids(std::vector<int64_t> v) {
    Tensor t(DType::i64, Shape{int64_t(v.size())});
    std::copy(v.begin(), v.end(), t.ptr<int64_t>());
    return t;
}

TEST(OpErrors, OutOfRangeIdsAndTargetsNameThePosition) {
    Tensor table = test::randn(DType::f32, Shape{5, 3}, 1), y(DType::f32, Shape{3, 3});
    test::expect_error(
        [&] {
            ops::embedding_forward(ids({0, 7, 1}), table, y);
        },
        "ids[1] = 7 is outside the vocabulary");
    Tensor logits = test::randn(DType::f32, Shape{2, 4}, 2), lse(DType::f32, Shape{2});
    test::expect_error([&] { ops::cross_entropy_forward({}, logits, ids({1, 4}), lse); }, "targets[1] = 4");
    Tensor x = test::randn(DType::f32, Shape{3, 4}, 3), w = test::randn(DType::f32, Shape{2, 5}, 4);
    Tensor out(DType::f32, Shape{3, 2});
    test::expect_error([&] { ops::linear_forward({}, x, w, {}, out); }, "do not give y");
}

TEST(OpRunner, ValidatesNamesAndParameters) {
    const ops::OpDef* rms = ops::op_registry().find("rmsnorm");
    ASSERT_NE(rms, nullptr);
    auto inputs = [] {
        std::map<std::string, Tensor> m;
        m.emplace("x", test::randn(DType::f32, Shape{2, 3}, 1));
        m.emplace("weight", test::randn(DType::f32, Shape{3}, 2));
        return m;
    };
    test::expect_error([&] { ops::run_op(*rms, inputs(), {{"eps", "abc"}}); }, "eps='abc' is not a number");
    test::expect_error([&] { ops::run_op(*rms, inputs(), {{"epsilon", "1"}}); }, "unknown parameter \"epsilon\"");
    auto extra = inputs();
    extra.emplace("z", test::randn(DType::f32, Shape{1}, 3));
    test::expect_error([&] { ops::run_op(*rms, std::move(extra), {}); }, "unknown input tensor \"z\"");
    auto missing = inputs();
    missing.erase("weight");
    test::expect_error([&] { ops::run_op(*rms, std::move(missing), {}); }, "missing input tensor \"weight\"");
    auto mixed = inputs();
    mixed.erase("weight");
    mixed.emplace("weight", test::randn(DType::f64, Shape{3}, 2));
    test::expect_error([&] { ops::run_op(*rms, std::move(mixed), {}); }, "other float inputs are");
    const ops::OpDef* conv = ops::op_registry().find("causal_conv1d");
    test::expect_error([&] { ops::run_op(*conv, {}, {{"activation", "gelu"}}); }, "must be one of: silu, none");
    const ops::OpDef* rope = ops::op_registry().find("rope");
    test::expect_error([&] { ops::run_op(*rope, {}, {{"offset", "1.5"}}); }, "is not an integer");
}

// Parameters have ranges: a negative scale, dv or eps silently meant "the default" (or a NaN), a huge topk sized
// a huge output.
TEST(OpRunner, ParametersOutsideTheirRangeAreRefused) {
    const std::vector<std::tuple<std::string, std::string, std::string, std::string>> cases = {
        {"sparse_attention", "dv", "-1", "op sparse_attention: parameter dv=-1 must be in [0, 1048576]"},
        {"sparse_attention", "scale", "-0.5", "parameter scale=-0.5 must be >= 0"},
        {"attention", "scale", "-1", "parameter scale=-1 must be >= 0"},
        {"attention", "causal", "2", "parameter causal=2 must be in [0, 1]"},
        {"rmsnorm", "eps", "-1e-6", "parameter eps=-1e-6 must be >= 0"},
        {"l2norm", "eps", "-1", "must be >= 0"},
        {"gated_rmsnorm", "eps", "-1", "must be >= 0"},
        {"dsa_indexer", "topk", "1099511627776", "parameter topk=1099511627776 must be in [1, 16777216]"},
        {"dsa_indexer", "topk", "0", "must be in [1, 16777216]"},
        {"router", "topk", "-2", "must be in [1, 65536]"},
        {"kda", "chunk_size", "16", "must be in [32, 64]"},
        {"kda_gate", "lower_bound", "1", "must be <= 0"},
        {"rope", "theta", "0.5", "must be >= 1"},
        {"adamw", "beta2", "1", "must be in [0, 0.999999]"},
        {"moe", "capacity_factor", "-1", "must be in [0, 1000000]"},
    };
    for (const auto& [name, param, value, needle] : cases) {
        SCOPED_TRACE(name + " " + param + "=" + value);
        test::expect_error([&] { ops::run_op(*ops::op_registry().find(name), {}, {{param, value}}); }, needle);
    }
}

TEST(OpRunner, EmptyInputsAndMisshapenGradientsAreRefused) {
    const ops::OpDef* gate = ops::op_registry().find("kda_gate");
    std::map<std::string, Tensor> in;  // f [2, 0, 3]: the kernel divided by HV·K = 0
    in.emplace("f", Tensor(DType::f32, Shape{2, 0, 3}));
    in.emplace("A_log", Tensor(DType::f32, Shape{0}));
    in.emplace("dt_bias", Tensor(DType::f32, Shape{0, 3}));
    test::expect_error([&] { ops::run_op(*gate, std::move(in), {}); }, "is empty");
    // gated_rmsnorm's backward read dy by x's shape
    const ops::OpDef* norm = ops::op_registry().find("gated_rmsnorm");
    std::map<std::string, Tensor> g;
    g.emplace("x", test::randn(DType::f32, Shape{4, 8}, 1));
    g.emplace("gate", test::randn(DType::f32, Shape{4, 8}, 2));
    g.emplace("weight", test::randn(DType::f32, Shape{8}, 3));
    g.emplace("dy", test::randn(DType::f32, Shape{2, 8}, 4));
    test::expect_error([&] { ops::run_op(*norm, std::move(g), {}); }, "gate and dy must be shaped like x [4, 8]");
}

TEST(OpRunner, ListsEveryOpWithItsNames) {
    for (const char* name :
         {"linear", "embedding", "rmsnorm", "swiglu", "cross_entropy", "rope", "causal_conv1d", "attention", "adamw"}) {
        const ops::OpDef* op = ops::op_registry().find(name);
        ASSERT_NE(op, nullptr) << name;
        std::string d = ops::describe_op(*op);
        for (auto& in : op->inputs) EXPECT_NE(d.find(in.name), std::string::npos) << d;
        for (auto& out : op->outputs) EXPECT_NE(d.find(out), std::string::npos) << d;
    }
}

TEST(Linear, RowStridedViewsOfAFusedBufferMatchContiguous) {
    // x is the right half of a [6, 10] buffer; y is written into columns 2..5 of a [6, 8] buffer
    Tensor big = test::randn(DType::f32, Shape{6, 10}, 1), w = test::randn(DType::f32, Shape{4, 5}, 2);
    TensorView xs = big.view();
    xs.shape = Shape{6, 5};
    xs.data = big.ptr<float>() + 5;
    Tensor xc(DType::f32, Shape{6, 5});
    for (int r = 0; r < 6; ++r)
        for (int c = 0; c < 5; ++c) xc.ptr<float>()[r * 5 + c] = big.ptr<float>()[r * 10 + 5 + c];
    Tensor ybig(DType::f32, Shape{6, 8}), yc(DType::f32, Shape{6, 4});
    TensorView ys = ybig.view();
    ys.shape = Shape{6, 4};
    ys.data = ybig.ptr<float>() + 2;
    ops::linear_forward({}, xs, w, {}, ys);
    ops::linear_forward({}, xc, w, {}, yc);
    for (int r = 0; r < 6; ++r)
        for (int c = 0; c < 4; ++c) EXPECT_EQ(ybig.ptr<float>()[r * 8 + 2 + c], yc.ptr<float>()[r * 4 + c]);
}

TEST(Rope, InPlaceEqualsOutOfPlaceAndBackwardInverts) {
    Tensor x = test::randn(DType::f64, Shape{2, 5, 3, 8}, 1);
    Tensor y(DType::f64, x.shape()), back(DType::f64, x.shape());
    Tensor inplace = Tensor::copy_of(x);
    ops::rope_forward({.offset = 7}, x, y);
    ops::rope_forward({.offset = 7}, inplace, inplace);
    EXPECT_TRUE(test::bitwise_equal(inplace, y));
    ops::rope_backward({.offset = 7}, y, back);  // rotation is orthogonal: its transpose inverts it
    EXPECT_TRUE(test::all_close(back, x, 1e-12, 1e-12));
}

TEST(Rope, InterleavedIsRotateHalfOnPermutedPairs) {
    // interleaved pair i = (2i, 2i+1) is rotate-half pair i = (i, i + D/2) after moving 2i -> i, 2i+1 -> i + D/2
    const int64_t D = 8, half = D / 2;
    Tensor x = test::randn(DType::f64, Shape{1, 5, 2, D}, 2), xp(DType::f64, x.shape());
    for (int64_t r = 0; r < 10; ++r) {
        for (int64_t i = 0; i < half; ++i) {
            xp.ptr<double>()[r * D + i] = x.ptr<double>()[r * D + 2 * i];
            xp.ptr<double>()[r * D + i + half] = x.ptr<double>()[r * D + 2 * i + 1];
        }
    }
    Tensor y(DType::f64, x.shape()), yp(DType::f64, x.shape());
    ops::rope_forward({.theta = 50.0, .offset = 3, .interleaved = true}, x, y);
    ops::rope_forward({.theta = 50.0, .offset = 3}, xp, yp);
    for (int64_t r = 0; r < 10; ++r) {
        for (int64_t i = 0; i < half; ++i) {
            EXPECT_NEAR(y.ptr<double>()[r * D + 2 * i], yp.ptr<double>()[r * D + i], 1e-14);
            EXPECT_NEAR(y.ptr<double>()[r * D + 2 * i + 1], yp.ptr<double>()[r * D + i + half], 1e-14);
        }
    }
}

TEST(CrossEntropy, AllRowsIgnoredGivesZeroLossAndNoGradient) {
    Tensor logits = test::randn(DType::f32, Shape{3, 5}, 1), lse(DType::f32, Shape{3}), d(DType::f32, Shape{3, 5});
    auto r = ops::cross_entropy_forward({}, logits, ids({-100, -100, -100}), lse);
    EXPECT_EQ(r.count, 0);
    EXPECT_EQ(r.loss, 0.0);
    ops::cross_entropy_backward({}, 1.0, logits, ids({-100, -100, -100}), lse, d);
    for (int i = 0; i < 15; ++i) EXPECT_EQ(d.ptr<float>()[i], 0.0f);
}

TEST(Attention, WorkspaceIsLinearInSequenceLength) {
    // a [T, T] score matrix at T = 1M would be 4 TB; the tiles plus one row-statistic vector are not
    const size_t ws = ops::attention_workspace_bytes(DType::f32, 1 << 20, 128, 1);
    EXPECT_LT(ws, size_t(8) << 20);
    EXPECT_LT(ops::attention_workspace_bytes(DType::f32, 2 << 20, 128, 1), 2 * ws);
}

TEST(Attention, SameBitsOnOneAndTwoThreads) {
    const int64_t B = 2, T = 200, H = 4, HKV = 2, D = 32;
    Tensor q = test::randn(DType::f32, Shape{B, T, H, D}, 1), k = test::randn(DType::f32, Shape{B, T, HKV, D}, 2),
           v = test::randn(DType::f32, Shape{B, T, HKV, D}, 3), dout = test::randn(DType::f32, Shape{B, T, H, D}, 4);
    auto run = [&](int threads) {
        const int saved = omp_get_max_threads();
        omp_set_num_threads(threads);
        std::vector<std::byte> ws(ops::attention_workspace_bytes(DType::f32, T, D, threads));
        std::vector<Tensor> r;
        r.emplace_back(DType::f32, q.shape());
        r.emplace_back(DType::f32, Shape{B, H, T});
        r.emplace_back(DType::f32, q.shape());
        r.emplace_back(DType::f32, k.shape());
        r.emplace_back(DType::f32, v.shape());
        ops::attention_forward({}, q, k, v, r[0], r[1], ws);
        ops::attention_backward({}, dout, q, k, v, r[0], r[1], r[2], r[3], r[4], ws);
        omp_set_num_threads(saved);
        return r;
    };
    auto a = run(1), b = run(2);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::bitwise_equal(a[i], b[i])) << "output " << i;
}

// The row ops' sums over tokens (parameter gradients) and over a row's columns (lane_sum) have one order: the same
// bits on one and two threads, on inputs shaped like the demo's (64 columns per head, 3 × 256 channels).
TEST(RowOps, SameBitsOnOneAndTwoThreads) {
    const int64_t N = 300, H = 4, K = 64, C = 768;
    Tensor x = test::randn(DType::f32, Shape{N * H, K}, 1), z = test::randn(DType::f32, Shape{N * H, K}, 2),
           w = test::randn(DType::f32, Shape{K}, 3), dy = test::randn(DType::f32, Shape{N * H, K}, 4);
    Tensor f = test::randn(DType::f32, Shape{N, H, K}, 5), a_log = test::randn(DType::f32, Shape{H}, 6),
           bias = test::randn(DType::f32, Shape{H * K}, 7), dg = test::randn(DType::f32, Shape{N, H, K}, 8);
    Tensor cx = test::randn(DType::f32, Shape{2, N / 2, C}, 9), cw = test::randn(DType::f32, Shape{C, 4}, 10),
           cdy = test::randn(DType::f32, Shape{2, N / 2, C}, 11);
    auto run = [&](int threads) {
        const int saved = omp_get_max_threads();
        omp_set_num_threads(threads);
        std::vector<Tensor> r;
        auto out = [&](Shape s) -> Tensor& { return r.emplace_back(DType::f32, s); };
        r.reserve(16);
        Tensor& y = out(x.shape());
        Tensor& rstd = out(Shape{N * H});
        ops::rmsnorm_forward({.eps = 1e-6}, x, w, y, rstd);
        ops::rmsnorm_backward({.eps = 1e-6}, dy, x, w, rstd, out(x.shape()), out(w.shape()));
        ops::l2norm_forward({}, x, out(x.shape()));
        ops::l2norm_backward({}, dy, x, out(x.shape()));
        ops::gated_rmsnorm_forward({.eps = 1e-6}, x, z, w, out(x.shape()));
        ops::gated_rmsnorm_backward({.eps = 1e-6}, dy, x, z, w, out(x.shape()), out(x.shape()), out(w.shape()));
        for (double lb : {0.0, -5.0}) {
            ops::kda_gate_forward({.lower_bound = lb}, f, a_log, bias, out(f.shape()));
            ops::kda_gate_backward({.lower_bound = lb}, dg, f, a_log, bias, out(f.shape()), out(a_log.shape()),
                                   out(bias.shape()));
        }
        const ops::CausalConv1dParams cp{.activation = ops::Activation::silu};
        ops::causal_conv1d_forward(cp, cx, cw, out(cx.shape()));
        ops::causal_conv1d_backward(cp, cdy, cx, cw, out(cx.shape()), out(cw.shape()));
        omp_set_num_threads(saved);
        return r;
    };
    auto a = run(1), b = run(2);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::bitwise_equal(a[i], b[i])) << "output " << i;
}

// The backward of the short convolution with only dx or only dw wanted gives the bits of the full backward.
TEST(CausalConv1d, EitherGradientAloneMatchesBoth) {
    const int64_t B = 2, T = 50, C = 200, W = 4;
    Tensor x = test::randn(DType::f32, Shape{B, T, C}, 1), w = test::randn(DType::f32, Shape{C, W}, 2),
           dy = test::randn(DType::f32, Shape{B, T, C}, 3);
    for (ops::Activation act : {ops::Activation::none, ops::Activation::silu}) {
        Tensor dx(DType::f32, x.shape()), dw(DType::f32, w.shape()), dx1(DType::f32, x.shape()),
            dw1(DType::f32, w.shape());
        ops::causal_conv1d_backward({.activation = act}, dy, x, w, dx, dw);
        ops::causal_conv1d_backward({.activation = act}, dy, x, w, dx1, {});
        ops::causal_conv1d_backward({.activation = act}, dy, x, w, {}, dw1);
        EXPECT_TRUE(test::bitwise_equal(dx, dx1));
        EXPECT_TRUE(test::bitwise_equal(dw, dw1));
    }
    Tensor wide = test::randn(DType::f32, Shape{C, ops::kCausalConvMaxWidth + 1}, 4), y(DType::f32, x.shape());
    test::expect_error([&] { ops::causal_conv1d_forward({}, x, wide, y); }, "1 <= W <= 16");
}

// kda_gate's backward sums a head's channels in chunks of 64: a head of 150 channels gives what its channels give as
// two narrower heads (df and ddt_bias per channel; dA_log the sum of the two parts' dA_log), in both gate forms.
TEST(KdaGate, WideHeadsMatchTheirChannelsSplit) {
    const int64_t N = 40, K = 150, K1 = 64, K2 = K - K1;
    Tensor f = test::randn(DType::f64, Shape{N, 1, K}, 1), dg = test::randn(DType::f64, Shape{N, 1, K}, 2),
           a_log = test::randn(DType::f64, Shape{1}, 3), bias = test::randn(DType::f64, Shape{K}, 4);
    auto part = [](const Tensor& t, int64_t c0, int64_t width) {  // channels [c0, c0 + width) of each row
        const int64_t rows = t.numel() / K;
        Tensor out(DType::f64, t.shape().ndim == 1 ? Shape{width} : Shape{rows, 1, width});
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < width; ++c) out.ptr<double>()[r * width + c] = t.ptr<double>()[r * K + c0 + c];
        return out;
    };
    for (double lb : {0.0, -5.0}) {
        const ops::KdaGateParams p{.lower_bound = lb};
        Tensor df(DType::f64, f.shape()), da(DType::f64, Shape{1}), db(DType::f64, bias.shape());
        ops::kda_gate_backward(p, dg, f, a_log, bias, df, da, db);
        double da_parts = 0;
        for (auto [c0, w] : {std::pair{int64_t(0), K1}, {K1, K2}}) {
            Tensor fp = part(f, c0, w), gp = part(dg, c0, w), bp = part(bias, c0, w);
            Tensor dfp(DType::f64, fp.shape()), dap(DType::f64, Shape{1}), dbp(DType::f64, bp.shape());
            ops::kda_gate_backward(p, gp, fp, a_log, bp, dfp, dap, dbp);
            EXPECT_TRUE(test::all_close(part(df, c0, w), dfp, 1e-14, 1e-14));
            EXPECT_TRUE(test::all_close(part(db, c0, w), dbp, 1e-14, 1e-14));
            da_parts += dap.ptr<double>()[0];
        }
        EXPECT_NEAR(da.ptr<double>()[0], da_parts, 1e-12 * std::abs(da_parts)) << "lower bound " << lb;
    }
}

// lane_sum adds 16 column lanes (lane j: c = j, j + 16, ...) and then the lanes in order: that order, written out
TEST(VecMath, LaneSumHasOneOrder) {
    Tensor v = test::randn(DType::f32, Shape{1000}, 5);
    const float* p = v.ptr<float>();
    for (int64_t n : {1, 15, 16, 17, 64, 1000}) {
        float lanes[16] = {};
        for (int64_t c = 0; c < n; ++c) lanes[c % 16] += p[c] * p[c];
        float want = 0;
        for (float l : lanes) want += l;
        const float got = ops::cpu::lane_sum<float>(n, [&](int64_t c) { return p[c] * p[c]; });
        EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << "n = " << n;
    }
}

// Packed sequences (cu_seqlens, B = 1) give what each sequence gives on its own (attention: no query
// sees another document; the short convolution restarts at every sequence start).
TEST(Packing, AttentionAndConvolutionRestartAtSequenceStarts) {
    const std::vector<int64_t> cu = {0, 5, 135, 140, 300};
    const int64_t T = cu.back(), H = 2, HKV = 1, D = 8, C = 6, W = 4;
    Tensor q = test::randn(DType::f64, Shape{1, T, H, D}, 1), k = test::randn(DType::f64, Shape{1, T, HKV, D}, 2),
           v = test::randn(DType::f64, Shape{1, T, HKV, D}, 3), dout = test::randn(DType::f64, Shape{1, T, H, D}, 4);
    Tensor x = test::randn(DType::f64, Shape{1, T, C}, 5), w = test::randn(DType::f64, Shape{C, W}, 6),
           dy = test::randn(DType::f64, Shape{1, T, C}, 7);
    auto tokens = [](const Tensor& t, int64_t a, int64_t len) {
        const int64_t per = t.numel() / t.shape()[1];
        Shape s = t.shape();
        s[1] = len;
        return Tensor::copy_of(t.view().reshape(Shape{t.shape()[1], per}).slice0(a, a + len).reshape(s));
    };
    struct Out {
        Tensor o, lse, dq, dk, dv, y, dx, dw;
    };
    auto run = [&](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const Tensor& x,
                   const Tensor& dy, std::span<const int64_t> cu) {
        const int64_t t = q.shape()[1];
        Out r{Tensor(DType::f64, q.shape()), Tensor(DType::f64, Shape{1, H, t}), Tensor(DType::f64, q.shape()),
              Tensor(DType::f64, k.shape()), Tensor(DType::f64, v.shape()),      Tensor(DType::f64, x.shape()),
              Tensor(DType::f64, x.shape()), Tensor(DType::f64, w.shape())};
        std::vector<std::byte> ws(ops::attention_workspace_bytes(DType::f64, t, D, omp_get_max_threads()));
        ops::attention_forward({}, q, k, v, r.o, r.lse, ws, cu);
        ops::attention_backward({}, dout, q, k, v, r.o, r.lse, r.dq, r.dk, r.dv, ws, cu);
        const ops::CausalConv1dParams cp{.activation = ops::Activation::silu};
        ops::causal_conv1d_forward(cp, x, w, r.y, cu);
        ops::causal_conv1d_backward(cp, dy, x, w, r.dx, r.dw, cu);
        return r;
    };
    const Out packed = run(q, k, v, dout, x, dy, cu);
    Tensor dw_sum(DType::f64, w.shape());
    for (size_t s = 0; s + 1 < cu.size(); ++s) {
        const int64_t a = cu[s], len = cu[s + 1] - cu[s];
        const Out one = run(tokens(q, a, len), tokens(k, a, len), tokens(v, a, len), tokens(dout, a, len),
                            tokens(x, a, len), tokens(dy, a, len), {});
        SCOPED_TRACE("sequence " + std::to_string(s));
        EXPECT_TRUE(test::all_close(tokens(packed.o, a, len), one.o, 1e-12, 1e-12));
        EXPECT_TRUE(test::all_close(tokens(packed.dq, a, len), one.dq, 1e-12, 1e-12));
        EXPECT_TRUE(test::all_close(tokens(packed.dk, a, len), one.dk, 1e-12, 1e-12));
        EXPECT_TRUE(test::all_close(tokens(packed.dv, a, len), one.dv, 1e-12, 1e-12));
        EXPECT_TRUE(test::all_close(tokens(packed.y, a, len), one.y, 1e-12, 1e-12));
        EXPECT_TRUE(test::all_close(tokens(packed.dx, a, len), one.dx, 1e-12, 1e-12));
        for (int64_t i = 0; i < w.numel(); ++i) dw_sum.ptr<double>()[i] += one.dw.ptr<double>()[i];
    }
    EXPECT_TRUE(test::all_close(packed.dw, dw_sum, 1e-12, 1e-12));
}

TEST(VecMath, ExpIsAccurateAndHandlesSpecialValues) {
    double worst = 0;
    for (float x = -87.0f; x < 88.0f; x += 0.001f) {
        double rel = std::abs(double(ops::cpu::vexp(x)) - std::exp(double(x))) / std::exp(double(x));
        worst = std::max(worst, rel);
    }
    EXPECT_LT(worst, 3e-7);
    EXPECT_EQ(ops::cpu::vexp(-INFINITY), 0.0f);
    EXPECT_EQ(ops::cpu::vexp(-1000.0f), 0.0f);
    EXPECT_EQ(ops::cpu::vexp(0.0f), 1.0f);
    EXPECT_TRUE(std::isinf(ops::cpu::vexp(100.0f)));
    EXPECT_TRUE(std::isnan(ops::cpu::vexp(NAN)));
}

}  // namespace
}  // namespace tessera
