// kda forward+backward at B = 1, HV = H = 4, K = V = 128 for T = 4K, 16K, 64K: tokens/s and achieved
// GFLOP/s against the machine's GEMM rate measured in the same run (ops::measure_gemm_gflops).
// FLOPs: the paper's forward count per head T·(6d² + 3Cd + C²) (Kimi Linear Eq. 13); forward+backward
// is counted as 3× forward (backward ≈ 2× forward, spec/kda.md §7). The backward uses the states the
// forward saved (as the KDA layer does), so it does not recompute the forward state pass.
//   build/bench/bench_kda --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <vector>

#include "bench/bench_report.h"
#include "bench/bench_util.h"
#include "ops/gemm.h"
#include "ops/kda.h"

namespace {

using namespace tessera;

struct KdaProblem {
    Tensor q, k, v, g, beta, o, dout, dq, dk, dv, dg, dbeta, states;
    std::vector<std::byte> ws;
    ops::KdaInputs in;
    ops::KdaGrads grads;
};

Tensor random(Shape s, uint64_t seed, double lo, double hi) { return bench::random_tensor(s, seed, lo, hi, 1); }

void l2(Tensor& t, int64_t d) {
    float* p = t.ptr<float>();
    for (int64_t r = 0; r < t.numel() / d; ++r) {
        double s = 0;
        for (int64_t c = 0; c < d; ++c) s += double(p[r * d + c]) * p[r * d + c];
        for (int64_t c = 0; c < d; ++c) p[r * d + c] = float(p[r * d + c] / std::sqrt(s + 1e-6));
    }
}

KdaProblem make(int64_t T, bool backward) {
    const int64_t H = 4, D = 128;
    KdaProblem P;
    P.q = random(Shape{1, T, H, D}, 1, 0, 1);
    P.k = random(Shape{1, T, H, D}, 2, 0, 1);
    l2(P.q, D);
    l2(P.k, D);
    P.v = random(Shape{1, T, H, D}, 3, 0, 1);
    P.g = random(Shape{1, T, H, D}, 4, -0.5, 0);
    P.beta = random(Shape{1, T, H}, 5, 0.2, 0.8);
    P.o = Tensor(DType::f32, Shape{1, T, H, D});
    P.dout = random(Shape{1, T, H, D}, 6, -1, 1);
    P.dq = Tensor(DType::f32, P.q.shape());
    P.dk = Tensor(DType::f32, P.k.shape());
    P.dv = Tensor(DType::f32, P.v.shape());
    P.dg = Tensor(DType::f32, P.g.shape());
    P.dbeta = Tensor(DType::f32, P.beta.shape());
    P.in = {P.q, P.k, P.v, P.g, P.beta, {}, {}};
    P.grads = {P.dq, P.dk, P.dv, P.dg, P.dbeta, {}};
    if (backward) P.states = Tensor(DType::f32, ops::kda_saved_states_shape({}, P.in));
    P.ws.resize(ops::kda_workspace_bytes({}, P.in, backward, omp_get_max_threads(), backward));
    return P;
}

void BM_kda(benchmark::State& st) {
    const int64_t T = st.range(0);
    const bool backward = st.range(1) == 1;
    KdaProblem P = make(T, backward);
    for (auto _ : st) {
        ops::kda_forward({}, P.in, P.o, {}, P.ws, P.states);
        if (backward) ops::kda_backward({}, P.in, P.dout, {}, P.grads, P.ws, P.states);
    }
    const double flops = (backward ? 3.0 : 1.0) * ops::kda_forward_flops(T, 4, 128, 64);
    st.counters["GFLOP/s"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
    st.counters["tokens/s"] = benchmark::Counter(double(T), benchmark::Counter::kIsIterationInvariantRate);
    st.counters["workspace_MiB"] = double(P.ws.size()) / (1 << 20);
}
BENCHMARK(BM_kda)
    ->ArgsProduct({{4096, 16384, 65536}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(1.0);

}  // namespace

int main(int argc, char** argv) {
    benchmark::Initialize(&argc, argv);
    const double gemm = tessera::ops::measure_gemm_gflops(1024, 1.0);
    tessera::bench::MedianCollector c;
    benchmark::RunSpecifiedBenchmarks(&c);
    const double gemm_after = tessera::ops::measure_gemm_gflops(1024, 1.0);
    std::printf("\nGEMM rate (best of 1 s of 1024³ sgemm), before / after: %.0f / %.0f GFLOP/s\n\n", gemm, gemm_after);
    std::printf("| T | pass | ms | tokens/s | GFLOP/s | share of GEMM rate |\n|---|---|---|---|---|---|\n");
    for (int64_t T : {4096, 16384, 65536}) {
        for (int b = 0; b < 2; ++b) {
            auto it = c.v.find("BM_kda/" + std::to_string(T) + "/" + std::to_string(b) + "/min_time:1.000/real_time");
            if (it == c.v.end()) continue;
            auto& m = it->second;
            std::printf("| %ld | %s | %.1f | %.0f | %.1f | %.0f%% |\n", long(T), b ? "fwd+bwd" : "fwd", m["ms"],
                        m["tokens/s"], m["GFLOP/s"], 100.0 * m["GFLOP/s"] / std::max(gemm, gemm_after));
        }
    }
    benchmark::Shutdown();
    return 0;
}
