// MoE invariants beyond the PyTorch golden files: the grouped GEMMs against per-expert products,
// the reference scale (E = 896, top-16), the edge cases E = 1 and topk = E against hand-written
// dense formulas, token conservation under capacity and re-routing, dispatch/combine as inverses,
// thread-count invariance, and the balancing rules bringing down the overload of a skewed router.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "ops/grouped_gemm.h"
#include "ops/moe.h"
#include "ops/moe_balance.h"
#include "ops/registry.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using Inputs = std::map<std::string, Tensor>;

std::map<std::string, Tensor> run(const std::string& op,
                                  const Inputs& in,
                                  const std::map<std::string, std::string>& params) {
    Inputs copy;
    for (auto& [k, v] : in) copy.emplace(k, Tensor::copy_of(v));
    return ops::run_op(*ops::op_registry().find(op), std::move(copy), params);
}

Inputs moe_inputs(DType t, int64_t N, int64_t D, int64_t E, int64_t F, uint64_t seed, bool bias = false) {
    Inputs m;
    m.emplace("x", test::randn(t, Shape{N, D}, seed));
    m.emplace("router_w", test::randn(t, Shape{E, D}, seed + 1, 0.5));
    m.emplace("w_gate", test::randn(t, Shape{E, F, D}, seed + 2, 1.0 / std::sqrt(double(D))));
    m.emplace("w_up", test::randn(t, Shape{E, F, D}, seed + 3, 1.0 / std::sqrt(double(D))));
    m.emplace("w_down", test::randn(t, Shape{E, D, F}, seed + 4, 1.0 / std::sqrt(double(F))));
    if (bias) m.emplace("router_bias", test::randn(t, Shape{E}, seed + 5, 0.1));
    return m;
}

Inputs as_f64(const Inputs& in) {
    Inputs out;
    for (auto& [k, v] : in) {
        if (v.dtype() != DType::f32) {
            out.emplace(k, Tensor::copy_of(v));
            continue;
        }
        Tensor d(DType::f64, v.shape());
        convert(v, d);
        out.emplace(k, std::move(d));
    }
    return out;
}

double silu(double a) { return a / (1.0 + std::exp(-a)); }

// one SwiGLU expert e on row x (double), [D] -> [D]
std::vector<double> expert_out(const Inputs& in, int64_t e, const double* x) {
    const TensorView wg = in.at("w_gate").view(), wu = in.at("w_up").view(), wd = in.at("w_down").view();
    const int64_t F = wg.size(1), D = wg.size(2);
    std::vector<double> a(static_cast<size_t>(F)), y(static_cast<size_t>(D), 0.0);
    for (int64_t f = 0; f < F; ++f) {
        double g = 0, u = 0;
        for (int64_t d = 0; d < D; ++d) {
            g += wg.ptr<double>()[(e * F + f) * D + d] * x[d];
            u += wu.ptr<double>()[(e * F + f) * D + d] * x[d];
        }
        a[size_t(f)] = silu(g) * u;
    }
    for (int64_t d = 0; d < D; ++d) {
        for (int64_t f = 0; f < F; ++f) y[size_t(d)] += wd.ptr<double>()[(e * D + d) * F + f] * a[size_t(f)];
    }
    return y;
}

TEST(GroupedGemm, MatchesPerExpertProducts) {
    // uneven segments (multiples of 8, one empty), N and K not multiples of the tiles
    const std::vector<int32_t> off = {0, 8, 8, 144, 408};
    const ops::ExpertRows g{off.data(), 4};
    const int64_t R = off.back(), N = 150, K = 70;
    Tensor A = test::randn(DType::f32, Shape{R, K}, 1), Bt = test::randn(DType::f32, Shape{4, N, K}, 2),
           Bn = test::randn(DType::f32, Shape{4, K, N}, 3), dC = test::randn(DType::f32, Shape{R, N}, 4);
    auto ref = [&](bool trans, int64_t r, int64_t n) {
        int64_t e = 0;
        while (off[size_t(e) + 1] <= r) ++e;
        double s = 0;
        for (int64_t k = 0; k < K; ++k) {
            const double b = trans ? Bt.ptr<float>()[(e * N + n) * K + k] : Bn.ptr<float>()[(e * K + k) * N + n];
            s += double(A.ptr<float>()[r * K + k]) * b;
        }
        return s;
    };
    for (bool trans : {true, false}) {
        Tensor C(DType::f32, Shape{R, N});
        ops::grouped_gemm(trans ? ops::Trans::T : ops::Trans::N, g, N, K, A.ptr<float>(), K,
                          trans ? Bt.ptr<float>() : Bn.ptr<float>(), N * K, trans ? K : N, 0.0f, C.ptr<float>(), N);
        for (int64_t r = 0; r < R; r += 7) {
            for (int64_t n = 0; n < N; n += 5) {
                ASSERT_NEAR(C.ptr<float>()[r * N + n], ref(trans, r, n), 1e-4)
                    << "trans " << trans << " at " << r << ", " << n;
            }
        }
        // the experts' weights stored apart (each its own allocation, in reverse order): the same bits
        const Tensor& B = trans ? Bt : Bn;
        std::vector<Tensor> apart;
        std::vector<void*> slices(4);
        for (int64_t e = 3; e >= 0; --e) {
            apart.push_back(Tensor::copy_of(B.view().slice0(e, e + 1)));
            slices[size_t(e)] = apart.back().view().data;
        }
        Tensor C2(DType::f32, Shape{R, N});
        ops::grouped_gemm(trans ? ops::Trans::T : ops::Trans::N, g, N, K, A.ptr<float>(), K,
                          static_cast<const float*>(nullptr), 0, trans ? K : N, 0.0f, C2.ptr<float>(), N,
                          slices.data());
        EXPECT_TRUE(test::bitwise_equal(C.view(), C2.view())) << "trans " << trans;
    }
    // K-grouped: W_e[K, N] += A_eᵀ · dC_e
    Tensor W(DType::f32, Shape{4, K, N});
    ops::grouped_gemm_wgrad(g, K, N, A.ptr<float>(), K, dC.ptr<float>(), N, W.ptr<float>(), K * N, N);
    for (int64_t e = 0; e < 4; ++e) {
        for (int64_t k = 0; k < K; k += 3) {
            for (int64_t n = 0; n < N; n += 7) {
                double s = 0;
                for (int64_t r = off[size_t(e)]; r < off[size_t(e) + 1]; ++r) {
                    s += double(A.ptr<float>()[r * K + k]) * dC.ptr<float>()[r * N + n];
                }
                ASSERT_NEAR(W.ptr<float>()[(e * K + k) * N + n], s, 1e-3) << "expert " << e;
            }
        }
    }
}

TEST(MoeScale, E896Top16) {
    const int64_t N = 48, D = 16, E = 896, K = 16, F = 8;
    Inputs in = moe_inputs(DType::f32, N, D, E, F, 11, /*bias=*/true);
    in.emplace("dy", test::randn(DType::f32, Shape{N, D}, 17));
    const std::map<std::string, std::string> p = {{"topk", "16"}, {"score", "sigmoid"}};
    auto out = run("moe", in, p);
    auto ref = run("moe", as_f64(in), p);
    // every token has 16 distinct experts: the top-16 of σ(x·wᵀ) + bias, in descending order
    const int32_t* idx = out.at("indices").ptr<int32_t>();
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e) total += out.at("counts").ptr<int32_t>()[e];
    EXPECT_EQ(total, N * K);
    const TensorView x = ref.count("x") ? ref.at("x").view() : as_f64(in).at("x").view();
    Inputs in64 = as_f64(in);
    for (int64_t n = 0; n < N; ++n) {
        std::vector<std::pair<double, int>> sel;
        for (int64_t e = 0; e < E; ++e) {
            double u = 0;
            for (int64_t d = 0; d < D; ++d) {
                u += in64.at("x").ptr<double>()[n * D + d] * in64.at("router_w").ptr<double>()[e * D + d];
            }
            sel.push_back({-(1.0 / (1.0 + std::exp(-u)) + in64.at("router_bias").ptr<double>()[e]), int(e)});
        }
        std::sort(sel.begin(), sel.end());
        for (int64_t j = 0; j < K; ++j)
            ASSERT_EQ(idx[n * K + j], sel[size_t(j)].second) << "token " << n << " slot " << j;
    }
    (void)x;
    EXPECT_TRUE(test::rel_rms_close(out.at("y"), ref.at("y"), 1e-5));
    EXPECT_TRUE(test::rel_rms_close(out.at("dx"), ref.at("dx"), 1e-5));
    EXPECT_TRUE(test::rel_rms_close(out.at("dw_gate"), ref.at("dw_gate"), 1e-5));
    EXPECT_TRUE(test::rel_rms_close(out.at("drouter_w"), ref.at("drouter_w"), 1e-4));
}

TEST(MoeEdge, TheAuxLossGradientMustBeOneValue) {
    // daux_loss of shape [0] was read at [0], out of bounds; [3] was read as its first value
    for (const Shape& s : {Shape{3}, Shape{1, 2}}) {
        Inputs in = moe_inputs(DType::f32, 5, 6, 4, 4, 31);
        in.emplace("daux_loss", Tensor(DType::f32, s));
        test::expect_error([&] { run("moe", in, {{"seq_aux_coeff", "0.1"}}); }, "daux_loss must be one f32 value");
    }
    Inputs empty = moe_inputs(DType::f32, 5, 6, 4, 4, 31);
    empty.emplace("daux_loss", Tensor(DType::f32, Shape{0}));
    test::expect_error([&] { run("moe", empty, {}); }, "op moe: input \"daux_loss\" [0] is empty");
    Inputs one = moe_inputs(DType::f32, 5, 6, 4, 4, 31);
    one.emplace("daux_loss", Tensor(DType::f32, Shape{1}));
    EXPECT_NO_THROW(run("moe", one, {{"seq_aux_coeff", "0.1"}}));
}

TEST(MoeEdge, OneExpertIsADenseSwiGlu) {
    Inputs in = as_f64(moe_inputs(DType::f32, 5, 6, 1, 4, 21));
    auto out = run("moe", in, {{"topk", "1"}});
    for (int64_t n = 0; n < 5; ++n) {
        auto want = expert_out(in, 0, in.at("x").ptr<double>() + n * 6);
        for (int64_t d = 0; d < 6; ++d) ASSERT_NEAR(out.at("y").ptr<double>()[n * 6 + d], want[size_t(d)], 1e-12);
    }
}

TEST(MoeEdge, TopkEqualsExpertsWeightsEveryExpertBySoftmax) {
    const int64_t N = 6, D = 5, E = 4;
    Inputs in = as_f64(moe_inputs(DType::f32, N, D, E, 3, 31));
    auto out = run("moe", in, {{"topk", "4"}, {"normalize", "0"}, {"scaling", "0.5"}});
    for (int64_t n = 0; n < N; ++n) {
        const double* x = in.at("x").ptr<double>() + n * D;
        std::vector<double> u(static_cast<size_t>(E));
        double z = 0;
        for (int64_t e = 0; e < E; ++e) {
            for (int64_t d = 0; d < D; ++d) u[size_t(e)] += x[d] * in.at("router_w").ptr<double>()[e * D + d];
            z += std::exp(u[size_t(e)]);
        }
        std::vector<double> want(static_cast<size_t>(D), 0.0);
        for (int64_t e = 0; e < E; ++e) {
            auto y = expert_out(in, e, x);
            for (int64_t d = 0; d < D; ++d) want[size_t(d)] += 0.5 * std::exp(u[size_t(e)]) / z * y[size_t(d)];
        }
        for (int64_t d = 0; d < D; ++d) ASSERT_NEAR(out.at("y").ptr<double>()[n * D + d], want[size_t(d)], 1e-12);
    }
}

TEST(MoeCapacity, ConservesTokensAndRespectsCapacityAndGroups) {
    const int64_t N = 64, D = 8, E = 16, K = 3;
    int rerouted_cases = 0;
    for (std::string overflow : {"reroute", "drop"}) {
        for (double c : {0.5, 1.0, 1.25}) {
            for (int64_t groups : {1, 4}) {
                Inputs in = moe_inputs(DType::f64, N, D, E, 4, 41);
                // a router that strongly prefers experts 0..3
                Tensor bias(DType::f64, Shape{E});
                for (int64_t e = 0; e < E; ++e) bias.ptr<double>()[e] = e < 4 ? 0.5 : 0.0;
                in.emplace("router_bias", std::move(bias));
                std::map<std::string, std::string> p = {{"topk", "3"},
                                                        {"score", "sigmoid"},
                                                        {"capacity_factor", fmt::format("{}", c)},
                                                        {"overflow", overflow},
                                                        {"groups", std::to_string(groups)},
                                                        {"topk_groups", groups > 1 ? "2" : "1"}};
                SCOPED_TRACE(fmt::format("overflow {} capacity {} groups {}", overflow, c, groups));
                auto out = run("moe", in, p);
                const int64_t cap = int64_t(std::ceil(c * double(N * K) / double(E)));
                const int64_t dropped = out.at("dropped").ptr<int64_t>()[0],
                              rerouted = out.at("rerouted").ptr<int64_t>()[0];
                int64_t total = 0;
                for (int64_t e = 0; e < E; ++e) {
                    const int32_t cnt = out.at("counts").ptr<int32_t>()[e];
                    EXPECT_LE(cnt, cap) << "expert " << e;
                    total += cnt;
                }
                EXPECT_EQ(total + dropped, N * K);
                if (overflow == "drop") {
                    EXPECT_EQ(rerouted, 0);
                }
                rerouted_cases += rerouted > 0;
                // scores for the group check
                Inputs rin;
                rin.emplace("x", Tensor::copy_of(in.at("x")));
                rin.emplace("w", Tensor::copy_of(in.at("router_w")));
                auto r = run("router", rin, {{"topk", "3"}, {"score", "sigmoid"}});
                const int32_t* idx = out.at("indices").ptr<int32_t>();
                int64_t minus = 0;
                for (int64_t n = 0; n < N; ++n) {
                    std::set<int32_t> seen;
                    uint8_t allowed[16];
                    ops::RouterParams rp{.topk = K,
                                         .score = ops::RouterScore::sigmoid,
                                         .groups = groups,
                                         .topk_groups = groups > 1 ? 2 : 1};
                    ops::router_allowed_groups(rp, r.at("scores").ptr<double>() + n * E,
                                               in.at("router_bias").ptr<double>(), E, allowed);
                    for (int64_t j = 0; j < K; ++j) {
                        const int32_t e = idx[n * K + j];
                        if (e < 0) {
                            ++minus;
                            continue;
                        }
                        EXPECT_TRUE(seen.insert(e).second) << "token " << n << " has expert " << e << " twice";
                        if (groups > 1) {
                            EXPECT_TRUE(allowed[e / (E / groups)]) << "token " << n << " expert " << e;
                        }
                    }
                }
                EXPECT_EQ(minus, dropped);
            }
        }
    }
    EXPECT_GT(rerouted_cases, 0);
}

TEST(MoeLayout, CombineOfDispatchCountsEachTokenOncePerSlot) {
    const int64_t N = 20, D = 6, E = 5;
    Inputs in = moe_inputs(DType::f64, N, D, E, 3, 51);
    ops::MoeParams p;
    p.router.topk = 2;
    p.capacity_factor = 0.6;
    p.overflow = ops::MoeOverflow::drop;
    ops::MoeWeights w;
    w.router_w = in.at("router_w").view();
    w.w_gate = in.at("w_gate").view();
    w.w_up = in.at("w_up").view();
    w.w_down = in.at("w_down").view();
    const ops::MoeDims d = ops::moe_dims(p, w, N);
    std::vector<BufferSpec> specs;
    ops::moe_saved_specs(d, DType::f64, "", specs);
    BufferGroup g("moe", specs);
    g.allocate(std::make_shared<Arena>(predict_arena_bytes({&g}, 256), 256));
    const ops::MoeSaved s = ops::moe_bind_saved(d, g, "");
    const ops::MoeStats st = ops::moe_route(p, w, in.at("x").view(), s, {}, {});
    EXPECT_GT(st.dropped, 0);
    Tensor back(DType::f64, Shape{N, D});
    ops::moe_dispatch(s, in.at("x").view(), s.xe);
    ops::moe_combine(s, s.xe, back.view(), false);
    for (int64_t n = 0; n < N; ++n) {
        int slots = 0;
        for (int64_t j = 0; j < 2; ++j) slots += s.row.ptr<int32_t>()[n * 2 + j] >= 0;
        for (int64_t c = 0; c < D; ++c) {
            ASSERT_EQ(back.ptr<double>()[n * D + c], slots * in.at("x").ptr<double>()[n * D + c]) << "token " << n;
        }
    }
    // padding rows are zero and every segment is a multiple of 8 rows
    const int32_t* off = s.offsets.ptr<int32_t>();
    for (int64_t e = 0; e < E; ++e) {
        EXPECT_EQ((off[e + 1] - off[e]) % ops::kMoeRowAlign, 0);
        for (int64_t r = off[e] + s.counts.ptr<int32_t>()[e]; r < off[e + 1]; ++r) {
            for (int64_t c = 0; c < D; ++c) ASSERT_EQ(s.xe.ptr<double>()[r * D + c], 0.0);
        }
    }
}

TEST(MoeDeterminism, SameBitsOnOneAndTwoThreads) {
    Inputs in = moe_inputs(DType::f32, 200, 32, 16, 40, 61, true);
    in.emplace("dy", test::randn(DType::f32, Shape{200, 32}, 67));
    const std::map<std::string, std::string> p = {{"topk", "4"}, {"score", "sigmoid"}};
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    auto one = run("moe", in, p);
    omp_set_num_threads(std::max(2, threads));
    auto two = run("moe", in, p);
    omp_set_num_threads(threads);
    for (const char* name : {"y", "dx", "dw_gate", "dw_down", "drouter_w"}) {
        EXPECT_TRUE(test::bitwise_equal(one.at(name), two.at(name))) << name;
    }
}

// A stream of batches whose router strongly prefers experts 0..3: the selection bias, moved by a
// balancing rule after every batch, brings the overload factor (max/mean load) down.
double overload_after(ops::BalanceRule rule, int steps, double* first) {
    const int64_t N = 256, D = 8, E = 16, K = 2;
    Tensor w = test::randn(DType::f32, Shape{E, D}, 71, 0.3);
    for (int64_t e = 0; e < 4; ++e) w.ptr<float>()[e * D] += 2.0f;  // x[:, 0] = 1 below
    Tensor bias(DType::f32, Shape{E}), logits(DType::f32, Shape{N, E}), scores(DType::f32, Shape{N, E});
    Tensor idx(DType::i32, Shape{N, K}), gates(DType::f32, Shape{N, K}), counts(DType::i32, Shape{E});
    const ops::RouterParams rp{.topk = K, .score = ops::RouterScore::sigmoid};
    ops::QuantileBalancer qb(E, K);
    double last = 0;
    for (int step = 0; step < steps; ++step) {
        Tensor x = test::randn(DType::f32, Shape{N, D}, 1000 + uint64_t(step));
        for (int64_t n = 0; n < N; ++n) x.ptr<float>()[n * D] = 1.0f;
        ops::router_scores(rp, x.view(), w.view(), logits.view(), scores.view());
        ops::router_select(rp, scores.view(), bias.view(), idx.view(), gates.view(), counts.view());
        std::vector<int64_t> load(counts.ptr<int32_t>(), counts.ptr<int32_t>() + E);
        last = ops::moe_load(load, 0.0).overload;
        if (step == 0) *first = last;
        std::span<float> b(bias.ptr<float>(), size_t(E));
        if (rule == ops::BalanceRule::sign) ops::balance_sign_update(load, 1e-2, b);
        if (rule == ops::BalanceRule::quantile) {
            qb.add(scores.view(), b);
            qb.update(b);
        }
    }
    return last;
}

TEST(MoeBalance, SignRuleBringsOverloadDown) {
    double first = 0;
    const double frozen = overload_after(ops::BalanceRule::frozen, 60, &first);
    const double sign = overload_after(ops::BalanceRule::sign, 60, &first);
    EXPECT_GT(first, 3.0);  // the skew is real
    EXPECT_GT(frozen, 3.0);
    EXPECT_LT(sign, 1.6) << "from " << first;
}

TEST(MoeBalance, QuantileBalancingEvensLoadInTwoSteps) {
    double first = 0;
    const double qb = overload_after(ops::BalanceRule::quantile, 3, &first);  // two updates
    EXPECT_GT(first, 3.0);
    EXPECT_LT(qb, 1.6) << "from " << first;
}

TEST(MoeBalance, SignRuleMatchesHandMadeCounts) {
    std::vector<int64_t> load = {5, 3, 4, 0};  // mean 3
    std::vector<float> b = {0.f, 0.f, 1.f, -1.f};
    ops::balance_sign_update(load, 0.5, b);
    EXPECT_EQ(b, (std::vector<float>{-0.5f, 0.f, 0.5f, -0.5f}));
    const ops::MoeLoad m = ops::moe_load(load, 0.0);
    EXPECT_DOUBLE_EQ(m.overload, 5.0 / 3.0);
    EXPECT_EQ(m.dead, 1);
}

}  // namespace
}  // namespace tessera
