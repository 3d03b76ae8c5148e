// MoE expert compute, forward + backward, for (E, k) = (64, 4), (256, 8), (896, 16) with uniform and
// Zipf-skewed routing (s = 1: expert e is drawn with probability ∝ 1/(e+1), k distinct per token).
// Side by side in one run:
//   grouped     the layer's grouped GEMMs (ops/grouped_gemm.h): one flat tile list over all experts
//   per-expert  one oneDNN GEMM call per expert and product (no merging), same layout and elementwise work
//   dense       one GEMM [N·k, L] × [L, 3F] with exactly the forward FLOPs of the experts
// and the whole layer (router + dispatch + experts + combine, forward + backward) in tokens/s, to
// compare with tools/ref/compare_moe_speed.py (PyTorch) on the same sizes.
// FLOPs counted: forward 6·N·k·L·F (gate, up, down), backward twice that; padding rows are not counted.
//   build/bench/bench_moe [--tokens 4096] [--latent 256] [--ffn 128] [--reps 5] [--experts E (one row pair: 64, 256,
//   896)]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "ops/gemm.h"
#include "ops/moe.h"
#include "ops/moe_balance.h"
#include "ops/swiglu.h"

namespace {

using namespace tessera;
using Clock = std::chrono::steady_clock;

Tensor random(Shape s, uint64_t seed, double scale) { return bench::random_tensor(s, seed, -scale, scale, 7); }

double median_ms(int reps, const std::function<void()>& f) {
    std::vector<double> ms;
    f();  // warm-up
    for (int r = 0; r < reps; ++r) {
        auto t0 = Clock::now();
        f();
        ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

struct Layer {
    ops::MoeParams p;
    ops::MoeDims d;
    Tensor x, dy, dx, router_w, wg, wu, wd, grw, gwg, gwu, gwd;
    ops::MoeWeights w, g;
    ops::MoeBuffers buffers;
    ops::MoeSaved s;
    ops::MoeScratch t;

    Layer(int64_t N, int64_t L, int64_t F, int64_t E, int64_t K) {
        p.router.topk = K;
        x = random(Shape{N, L}, 1, 1.0);
        dy = random(Shape{N, L}, 2, 1.0);
        dx = Tensor(DType::f32, Shape{N, L});
        router_w = random(Shape{E, L}, 3, 0.05);
        wg = random(Shape{E, F, L}, 4, 1.0 / std::sqrt(double(L)));
        wu = random(Shape{E, F, L}, 5, 1.0 / std::sqrt(double(L)));
        wd = random(Shape{E, L, F}, 6, 1.0 / std::sqrt(double(F)));
        grw = Tensor(DType::f32, router_w.shape());
        gwg = Tensor(DType::f32, wg.shape());
        gwu = Tensor(DType::f32, wu.shape());
        gwd = Tensor(DType::f32, wd.shape());
        w.router_w = router_w.view();
        w.w_gate = wg.view();
        w.w_up = wu.view();
        w.w_down = wd.view();
        g.router_w = grw.view();
        g.w_gate = gwg.view();
        g.w_up = gwu.view();
        g.w_down = gwd.view();
        d = ops::moe_dims(p, w, N);
        buffers = ops::moe_buffers(d, DType::f32, Device::cpu);
        s = buffers.saved;
        t = buffers.scratch;
    }
    int64_t rows() const { return s.offsets.ptr<int32_t>()[d.experts]; }
};

// The per-expert baseline: the same products as moe_experts_forward/backward, one GEMM call each.
void per_expert_forward(Layer& l) {
    const int64_t E = l.d.experts, F = l.d.ffn, L = l.d.latent, R = l.rows();
    const int32_t* off = l.s.offsets.ptr<int32_t>();
    const int32_t* cnt = l.s.counts.ptr<int32_t>();
    float* h = l.s.h.ptr<float>();
    for (int64_t e = 0; e < E; ++e) {
        if (!cnt[e]) continue;
        const float* xe = l.s.xe.ptr<float>() + off[e] * L;
        ops::gemm(ops::Trans::N, ops::Trans::T, cnt[e], F, L, 1.f, xe, L, l.wg.ptr<float>() + e * F * L, L, 0.f,
                  h + off[e] * 2 * F, 2 * F);
        ops::gemm(ops::Trans::N, ops::Trans::T, cnt[e], F, L, 1.f, xe, L, l.wu.ptr<float>() + e * F * L, L, 0.f,
                  h + off[e] * 2 * F + F, 2 * F);
    }
    TensorView hg(h, DType::f32, Shape{R, F}), hu(h + F, DType::f32, Shape{R, F});
    hg.strides[0] = hu.strides[0] = 2 * F;
    ops::swiglu_forward(hg, hu, l.s.a.slice0(0, R));
    for (int64_t e = 0; e < E; ++e) {
        if (!cnt[e]) continue;
        ops::gemm(ops::Trans::N, ops::Trans::T, cnt[e], L, F, 1.f, l.s.a.ptr<float>() + off[e] * F, F,
                  l.wd.ptr<float>() + e * L * F, F, 0.f, l.t.ye.ptr<float>() + off[e] * L, L);
    }
}

void per_expert_backward(Layer& l) {
    const int64_t E = l.d.experts, F = l.d.ffn, L = l.d.latent, R = l.rows();
    const int32_t* off = l.s.offsets.ptr<int32_t>();
    const int32_t* cnt = l.s.counts.ptr<int32_t>();
    const float* dye = l.t.ye.ptr<float>();
    float* da = l.t.da.ptr<float>();
    float* dh = l.t.dh.ptr<float>();
    for (int64_t e = 0; e < E; ++e) {
        if (!cnt[e]) continue;
        ops::gemm(ops::Trans::N, ops::Trans::N, cnt[e], F, L, 1.f, dye + off[e] * L, L, l.wd.ptr<float>() + e * L * F,
                  F, 0.f, da + off[e] * F, F);
        ops::gemm(ops::Trans::T, ops::Trans::N, L, F, cnt[e], 1.f, dye + off[e] * L, L, l.s.a.ptr<float>() + off[e] * F,
                  F, 1.f, l.gwd.ptr<float>() + e * L * F, F);
    }
    TensorView hg(l.s.h.ptr<float>(), DType::f32, Shape{R, F}), hu(l.s.h.ptr<float>() + F, DType::f32, Shape{R, F});
    TensorView dhg(dh, DType::f32, Shape{R, F}), dhu(dh + F, DType::f32, Shape{R, F});
    hg.strides[0] = hu.strides[0] = dhg.strides[0] = dhu.strides[0] = 2 * F;
    std::memset(dh, 0, size_t(R * 2 * F) * sizeof(float));
    ops::swiglu_backward(l.t.da.slice0(0, R), hg, hu, dhg, dhu);
    for (int64_t e = 0; e < E; ++e) {
        if (!cnt[e]) continue;
        float* dxe = l.t.dxe.ptr<float>() + off[e] * L;
        const float* xe = l.s.xe.ptr<float>() + off[e] * L;
        ops::gemm(ops::Trans::N, ops::Trans::N, cnt[e], L, F, 1.f, dh + off[e] * 2 * F, 2 * F,
                  l.wg.ptr<float>() + e * F * L, L, 0.f, dxe, L);
        ops::gemm(ops::Trans::N, ops::Trans::N, cnt[e], L, F, 1.f, dh + off[e] * 2 * F + F, 2 * F,
                  l.wu.ptr<float>() + e * F * L, L, 1.f, dxe, L);
        ops::gemm(ops::Trans::T, ops::Trans::N, F, L, cnt[e], 1.f, dh + off[e] * 2 * F, 2 * F, xe, L, 1.f,
                  l.gwg.ptr<float>() + e * F * L, L);
        ops::gemm(ops::Trans::T, ops::Trans::N, F, L, cnt[e], 1.f, dh + off[e] * 2 * F + F, 2 * F, xe, L, 1.f,
                  l.gwu.ptr<float>() + e * F * L, L);
    }
}

int64_t arg(int argc, char** argv, const char* name, int64_t def) {
    for (int i = 1; i + 1 < argc; ++i) {
        if (std::strcmp(argv[i], name) == 0) return std::stoll(argv[i + 1]);
    }
    return def;
}

}  // namespace

int main(int argc, char** argv) {
    const int64_t N = arg(argc, argv, "--tokens", 4096), L = arg(argc, argv, "--latent", 256),
                  F = arg(argc, argv, "--ffn", 128);
    const int reps = int(arg(argc, argv, "--reps", 5));
    const int64_t only = arg(argc, argv, "--experts", 0);
    std::printf("MoE experts forward+backward, N = %lld tokens, L = %lld, F = %lld, median of %d\n", (long long)N,
                (long long)L, (long long)F, reps);
    std::printf("machine GEMM rate (1024^3, best): %.0f GFLOP/s\n\n", ops::measure_gemm_gflops());
    std::printf(
        "| E | k | routing | overload | padding | dense GFLOP/s | grouped GFLOP/s | grouped / dense | "
        "per-expert GFLOP/s | merging gain | layer fwd+bwd tok/s |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    const std::pair<int64_t, int64_t> configs[] = {{64, 4}, {256, 8}, {896, 16}};
    for (auto [E, K] : configs) {
        if (only > 0 && E != only) continue;
        Layer l(N, L, F, E, K);
        const int64_t R0 = N * K;
        Tensor dense_a = random(Shape{R0, L}, 8, 1.0), dense_b = random(Shape{L, 3 * F}, 9, 0.1),
               dense_c(DType::f32, Shape{R0, 3 * F});
        const double fwd_flops = 6.0 * double(R0) * double(L) * double(F);
        const double dense_ms = median_ms(reps, [&] {
            ops::gemm(ops::Trans::N, ops::Trans::N, R0, 3 * F, L, 1.f, dense_a.ptr<float>(), L, dense_b.ptr<float>(),
                      3 * F, 0.f, dense_c.ptr<float>(), 3 * F);
        });
        const double dense_rate = fwd_flops / dense_ms * 1e-6;
        // the whole layer with its own (near-uniform) router
        const double layer_ms = median_ms(reps, [&] {
            ops::moe_forward(l.p, l.w, l.x.view(), l.dx.view(), false, l.s, l.t);
            ops::moe_backward(l.p, l.w, l.x.view(), l.dy.view(), l.dx.view(), l.g, l.s, l.t);
        });
        for (bool zipf : {false, true}) {
            bench::route_experts(zipf, N, E, K, l.s.expert.ptr<int32_t>());
            std::fill(l.s.gates.ptr<float>(), l.s.gates.ptr<float>() + R0, 1.0f / float(K));
            ops::moe_build_layout(l.s, N);
            ops::moe_dispatch(l.s, l.x.view(), l.s.xe);
            std::vector<int64_t> load(l.s.counts.ptr<int32_t>(), l.s.counts.ptr<int32_t>() + E);
            const double overload = ops::moe_load(load, 0).overload;
            const double padding = double(l.rows() - R0) / double(R0);
            Tensor dye = random(Shape{l.rows(), L}, 10, 1.0);
            auto set_dye = [&] { std::memcpy(l.t.ye.data, dye.view().data, dye.view().nbytes()); };
            double grouped_ms = 0, per_ms = 0;
            grouped_ms = median_ms(reps, [&] {
                ops::moe_experts_forward(l.p, l.w, l.s, l.t);
                set_dye();
                ops::moe_experts_backward(l.p, l.w, l.g, l.s, l.t);
            });
            per_ms = median_ms(reps, [&] {
                per_expert_forward(l);
                set_dye();
                per_expert_backward(l);
            });
            const double copy_ms = median_ms(reps, set_dye);  // not expert work: subtracted from both
            const double grouped = 3.0 * fwd_flops / (grouped_ms - copy_ms) * 1e-6;
            const double per = 3.0 * fwd_flops / (per_ms - copy_ms) * 1e-6;
            std::printf("| %lld | %lld | %s | %.2f | %.1f%% | %.0f | %.0f | %.2f | %.0f | %.2fx | %s |\n", (long long)E,
                        (long long)K, zipf ? "Zipf" : "uniform", overload, 100.0 * padding, dense_rate, grouped,
                        grouped / dense_rate, per, grouped / per,
                        zipf ? "" : std::to_string(int64_t(double(N) / layer_ms * 1e3)).c_str());
            std::fflush(stdout);
        }
    }
    return 0;
}
