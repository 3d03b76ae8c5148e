// Expert parallelism's exchange (parallel/ep.h) on in-process ranks: each rank routes its own tokens and
// holds E/EP experts; its outputs, input gradients and router gradients equal a single process running the
// whole layer on the same tokens, and its experts' weight gradients equal the single process's summed over
// every rank's tokens. Loads are uneven, with experts nobody chooses and a rank whose tokens all go to
// one expert.
#include <gtest/gtest.h>

#include <map>

#include "core/arena.h"
#include "ops/moe.h"
#include "parallel/comm_local.h"
#include "parallel/ep.h"
#include "util/test_util.h"

namespace tessera {
namespace {

constexpr int64_t N = 24, D = 12, E = 8, K = 2, F = 10, L = 6;

struct Layer {
    std::map<std::string, Tensor> t;  // weights and their gradients
    ops::MoeWeights w, g;
};

// The full layer's weights (the same on every rank: one seed), latent projections included.
Layer full_layer() {
    Layer l;
    auto add = [&](const char* name, Shape s, uint64_t seed) {
        l.t.emplace(name, test::randn(DType::f32, s, seed, 0.3));
        l.t.emplace(std::string("d") + name, Tensor(DType::f32, s));
    };
    add("router_w", Shape{E, D}, 1);
    add("w_gate", Shape{E, F, L}, 2);
    add("w_up", Shape{E, F, L}, 3);
    add("w_down", Shape{E, L, F}, 4);
    add("latent_down", Shape{L, D}, 5);
    add("latent_up", Shape{D, L}, 6);
    auto bind = [&](ops::MoeWeights& w, const std::string& pre) {
        w.router_w = l.t.at(pre + "router_w").view();
        w.w_gate = l.t.at(pre + "w_gate").view();
        w.w_up = l.t.at(pre + "w_up").view();
        w.w_down = l.t.at(pre + "w_down").view();
        w.latent_down = l.t.at(pre + "latent_down").view();
        w.latent_up = l.t.at(pre + "latent_up").view();
    };
    bind(l.w, "");
    bind(l.g, "d");
    return l;
}

// rank r's tokens; rank 1's are N copies of one token, so all its rows go to the same two experts
Tensor tokens(int rank) {
    Tensor x = test::randn(DType::f32, Shape{N, D}, 100 + uint64_t(rank));
    if (rank == 1)
        for (int64_t n = 1; n < N; ++n) std::copy_n(x.ptr<float>(), D, x.ptr<float>() + n * D);
    return x;
}

struct Result {
    Tensor y, dx;
};

// The layer's saved and scratch buffers for N tokens under p, and its expert stage's (null: none), in one arena.
struct Buffers {
    Buffers(const ops::MoeParams& p, const ops::MoeWeights& w, parallel::ExpertParallelStage* stage) {
        const ops::MoeDims d = ops::moe_dims(p, w, N);
        std::vector<BufferSpec> specs;
        ops::moe_saved_specs(d, DType::f32, "s.", specs);
        ops::moe_scratch_specs(d, DType::f32, "t.", specs);
        if (stage) {
            stage->saved_specs("es.", N, specs);
            stage->scratch_specs("et.", N, specs);
        }
        grp = BufferGroup("moe", specs);
        grp.allocate(std::make_shared<Arena>(predict_arena_bytes({&grp}, 256), 256));
        s = ops::moe_bind_saved(d, grp, "s.");
        t = ops::moe_bind_scratch(d, grp, "t.");
        if (stage) {
            stage->bind_saved(grp, "es.");
            stage->bind_scratch(grp, "et.");
        }
    }
    BufferGroup grp;
    ops::MoeSaved s;
    ops::MoeScratch t;
};

// One forward and backward; stage null: every expert here.
Result run_layer(const Layer& l,
                 const ops::MoeWeights& w,
                 const ops::MoeWeights& g,
                 const Tensor& x,
                 const Tensor& dy,
                 parallel::ExpertParallelStage* stage) {
    ops::MoeParams p;
    p.router.topk = K;
    p.stage = stage;
    const Buffers b(p, w, stage);
    Result r{Tensor(DType::f32, Shape{N, D}), Tensor(DType::f32, Shape{N, D})};
    ops::moe_forward(p, w, x.view(), r.y.view(), false, b.s, b.t);
    ops::moe_backward(p, w, x.view(), dy.view(), r.dx.view(), g, b.s, b.t);
    return r;
}

TEST(ExpertParallel, EqualsTheWholeLayerOnEveryRanksTokens) {
    for (int W : {2, 4}) {
        // the single process: each rank's tokens through the whole layer; weight gradients summed over ranks
        Layer ref = full_layer();
        std::vector<Result> want;
        for (int r = 0; r < W; ++r) {
            want.push_back(
                run_layer(ref, ref.w, ref.g, tokens(r), test::randn(DType::f32, Shape{N, D}, 200 + r), nullptr));
        }
        parallel::run_local(W, [&](parallel::Comm& c) {
            const int r = c.rank();
            Layer mine = full_layer();  // router and latent weights whole; experts sliced below
            parallel::ExpertParallelStage stage(c, {.experts = E, .topk = K, .latent = L, .ffn = F});
            const int64_t El = stage.local_experts(), e0 = stage.first_expert();
            ASSERT_EQ(El, E / W);
            ops::MoeWeights w = mine.w, g = mine.g;
            for (auto [wv, gv] : {std::pair{&w.w_gate, &g.w_gate}, {&w.w_up, &g.w_up}, {&w.w_down, &g.w_down}}) {
                *wv = wv->slice0(e0, e0 + El);
                *gv = gv->slice0(e0, e0 + El);
            }
            const Result got = run_layer(mine, w, g, tokens(r), test::randn(DType::f32, Shape{N, D}, 200 + r), &stage);
            EXPECT_TRUE(test::all_close(got.y.view(), want[size_t(r)].y.view(), 1e-5, 1e-6)) << "y, rank " << r;
            EXPECT_TRUE(test::all_close(got.dx.view(), want[size_t(r)].dx.view(), 1e-5, 1e-6)) << "dx, rank " << r;
            for (const char* name : {"dw_gate", "dw_up", "dw_down"}) {
                EXPECT_TRUE(test::all_close(mine.t.at(name).view().slice0(e0, e0 + El),
                                            ref.t.at(name).view().slice0(e0, e0 + El), 1e-5, 1e-6))
                    << name << ", rank " << r << " of " << W;
            }
            EXPECT_GT(stage.last_forward_bytes(), 0);
            // overlapped in groups of local experts (uneven groups with 3): the same bits
            for (int64_t chunks : {2, 3}) {
                if (chunks > El) continue;
                Layer again = full_layer();
                parallel::ExpertParallelStage staged(
                    c, {.experts = E, .topk = K, .latent = L, .ffn = F, .chunks = chunks});
                ops::MoeWeights w2 = again.w, g2 = again.g;
                for (auto [wv, gv] :
                     {std::pair{&w2.w_gate, &g2.w_gate}, {&w2.w_up, &g2.w_up}, {&w2.w_down, &g2.w_down}}) {
                    *wv = wv->slice0(e0, e0 + El);
                    *gv = gv->slice0(e0, e0 + El);
                }
                const Result r2 =
                    run_layer(again, w2, g2, tokens(r), test::randn(DType::f32, Shape{N, D}, 200 + r), &staged);
                EXPECT_TRUE(test::bitwise_equal(r2.y.view(), got.y.view())) << chunks << " groups";
                EXPECT_TRUE(test::bitwise_equal(r2.dx.view(), got.dx.view())) << chunks << " groups";
                EXPECT_TRUE(test::bitwise_equal(again.t.at("dw_down").view(), mine.t.at("dw_down").view()));
                EXPECT_TRUE(test::bitwise_equal(again.t.at("drouter_w").view(), mine.t.at("drouter_w").view()));
            }
        });
        // the router's gradient on each rank is its own tokens' (compared above through dx); the latent ones too
    }
}

// Capacity under expert parallelism is global: with a capacity factor c each expert receives at most
// C = ⌈c·(all ranks' tokens)·k/E⌉ rows from all ranks together, shared max-min fairly, so with `drop` exactly
// min(demand, C) rows of each expert survive over the group — rank 1 (all its tokens on two experts) uses the
// room the others leave, which a per-rank cap of ⌈c·N·k/E⌉ would drop. With `reroute` no expert exceeds C.
TEST(ExpertParallel, CapacityIsSharedOverTheExpertGroup) {
    for (int W : {2, 4}) {
        for (ops::MoeOverflow overflow : {ops::MoeOverflow::drop, ops::MoeOverflow::reroute}) {
            parallel::run_local(W, [&](parallel::Comm& c) {
                Layer l = full_layer();
                // receive buffers sized by the capacity (a bound too small would fail the exchange)
                parallel::ExpertParallelStage stage(
                    c, {.experts = E, .topk = K, .latent = L, .ffn = F, .capacity_factor = 1.0});
                EXPECT_LT(stage.max_rows(N), int64_t(W) * N * K);
                const int64_t El = stage.local_experts(), e0 = stage.first_expert();
                ops::MoeWeights w = l.w;
                for (TensorView* v : {&w.w_gate, &w.w_up, &w.w_down}) *v = v->slice0(e0, e0 + El);
                ops::MoeParams p;
                p.router.topk = K;
                p.capacity_factor = 1.0;
                p.overflow = overflow;
                p.stage = &stage;
                const ops::MoeDims d = ops::moe_dims(p, w, N);
                const Buffers b(p, w, &stage);
                const ops::MoeSaved& s = b.s;
                const ops::MoeScratch& t = b.t;
                Tensor y(DType::f32, Shape{N, D});
                const ops::MoeStats st = ops::moe_forward(p, w, tokens(c.rank()).view(), y.view(), false, s, t);
                // over the group: choices per expert, rows kept per expert, rows dropped
                std::vector<int64_t> demand(E), kept(E), mine_demand(E);
                for (int64_t e = 0; e < E; ++e) {
                    mine_demand[size_t(e)] = demand[size_t(e)] = s.demand.ptr<int32_t>()[e];
                    kept[size_t(e)] = s.counts.ptr<int32_t>()[e];
                }
                c.all_reduce(std::span(demand));
                c.all_reduce(std::span(kept));
                const int64_t dropped = c.all_reduce_sum<int64_t>(st.dropped);
                std::vector<int64_t> per_rank_cap_kept(E);  // what a per-rank cap would keep, for contrast
                for (int64_t e = 0; e < E; ++e)
                    per_rank_cap_kept[size_t(e)] = std::min<int64_t>(mine_demand[size_t(e)], d.capacity(1.0));
                c.all_reduce(std::span(per_rank_cap_kept));
                const int64_t room = (N * W * K + E - 1) / E;
                int64_t over = 0;
                bool shared = false;
                for (int64_t e = 0; e < E; ++e) {
                    EXPECT_LE(kept[size_t(e)], room) << "expert " << e << ", " << W << " ranks";
                    if (overflow == ops::MoeOverflow::drop) {
                        EXPECT_EQ(kept[size_t(e)], std::min(demand[size_t(e)], room)) << "expert " << e;
                    }
                    over += std::max<int64_t>(0, demand[size_t(e)] - room);
                    shared = shared || std::min(demand[size_t(e)], room) > per_rank_cap_kept[size_t(e)];
                }
                if (overflow == ops::MoeOverflow::drop) {
                    EXPECT_EQ(dropped, over) << W << " ranks";
                }
                EXPECT_TRUE(shared) << "the tokens must make some rank overflow where another leaves room";
            });
        }
    }
}

// Dropless, the rows that can reach a rank are EP × tokens × min(k, E/EP): a token's k experts are distinct. Every
// token of every rank alike, with top-3 experts 0, 1 and 2 at EP 4 (two experts per rank): rank 0 receives two rows
// per token of every rank, exactly the bound (a bound of k rows per token would be loose by half, and any tighter
// one would fail the exchange).
TEST(ExpertParallel, DroplessRowsReachTheDistinctExpertBound) {
    constexpr int W = 4;
    parallel::run_local(W, [&](parallel::Comm& c) {
        Layer l = full_layer();
        for (int64_t e = 0; e < E; ++e)  // expert e scores 0.1 (E - e) per unit of input
            std::fill_n(l.t.at("router_w").ptr<float>() + e * D, D, 0.1f * float(E - e));
        parallel::ExpertParallelStage stage(c, {.experts = E, .topk = 3, .latent = L, .ffn = F});
        const int64_t El = stage.local_experts(), e0 = stage.first_expert();
        ASSERT_EQ(El, 2);
        ops::MoeWeights w = l.w;
        for (TensorView* v : {&w.w_gate, &w.w_up, &w.w_down}) *v = v->slice0(e0, e0 + El);
        ops::MoeParams p;
        p.router.topk = 3;
        p.stage = &stage;
        const Buffers b(p, w, &stage);
        Tensor x(DType::f32, Shape{N, D}), y(DType::f32, Shape{N, D});
        std::fill_n(x.ptr<float>(), N * D, 1.f);
        ops::moe_forward(p, w, x.view(), y.view(), false, b.s, b.t);
        std::vector<int64_t> demand(E);
        for (int64_t e = 0; e < E; ++e) demand[size_t(e)] = b.s.demand.ptr<int32_t>()[e];
        c.all_reduce(std::span(demand));
        EXPECT_EQ(demand[0] + demand[1], stage.max_rows(N));  // rank 0's rows: every token's experts 0 and 1
        EXPECT_EQ(demand[2], W * N);
        EXPECT_EQ(stage.max_rows(N), W * N * 2);
    });
}

TEST(ExpertParallel, ExpertsMustDivideOverTheRanks) {
    parallel::run_local(3, [](parallel::Comm& c) {
        test::expect_error(
            [&] { parallel::ExpertParallelStage s(c, {.experts = 8, .topk = 2, .latent = 4, .ffn = 4}); },
            "8 experts do not divide over 3 ranks");
    });
}

}  // namespace
}  // namespace tessera
