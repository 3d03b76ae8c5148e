// The register-blocked small GEMM (ops/cpu/small_gemm.h) against oneDNN's single-threaded sgemm on
// the tile products of the fused kernels (attention Q·Kᵀ and P·V tiles, KDA chunk products, DSA
// gathered rows), one thread each, measured side by side; medians. Decides per ISA whether the
// hand-written tiles or oneDNN serve these shapes (docs/ops.md); prints a markdown table.
//   build/bench/bench_small_gemm [--benchmark_repetitions=9]
#include <benchmark/benchmark.h>
#include <dnnl.h>
#include <omp.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench/bench_report.h"
#include "bench/bench_util.h"
#include "ops/cpu/small_gemm.h"
#include "ops/isa.h"

namespace {

using tessera::Shape;
using tessera::Tensor;

struct Case {
    const char* what;
    int64_t M, N, K;
    bool a_transposed;
};

const std::vector<Case> kCases = {
    {"attention S = Q·Kᵀ tile (D 64)", 128, 128, 64, false},
    {"attention O += P·V tile (D 64)", 128, 64, 128, false},
    {"attention S tile (D 128)", 128, 128, 128, false},
    {"attention O tile (D 128)", 128, 128, 128, false},
    {"attention dV += Pᵀ·dO (D 64)", 128, 64, 128, true},
    {"KDA chunk (C 64, K 128)", 64, 128, 64, false},
    {"KDA state update Kᵀ·V (C 64)", 128, 128, 64, true},
    {"KDA chunk attention (C 64)", 64, 64, 128, false},
    {"DSA indexer scores (16 heads x 128)", 64, 256, 128, false},
    {"DSA sparse scores, 2 heads (DK 80)", 64, 2, 80, false},
    {"DSA sparse scores, 4 heads (DK 80)", 64, 4, 80, false},
    {"DSA sparse scores, 2 heads (DK 576)", 64, 2, 576, false},
    {"DSA sparse scores, 16 heads (DK 576)", 64, 16, 576, false},
};

void BM_small_gemm(benchmark::State& st) {
    const Case c = kCases[size_t(st.range(0))];
    const int64_t ar = c.a_transposed ? c.K : c.M, ac = c.a_transposed ? c.M : c.K;
    Tensor A = tessera::bench::random_tensor(Shape{ar, ac}, 1, -1, 1, 0);
    Tensor B = tessera::bench::random_tensor(Shape{c.K, c.N}, 1, -1, 1, 1);
    Tensor C = tessera::bench::random_tensor(Shape{c.M, c.N}, 1, -1, 1, 2);
    for (auto _ : st) {
        if (c.a_transposed) {
            tessera::ops::cpu::small_gemm_tn(c.M, c.N, c.K, 1.0f, A.ptr<float>(), ac, B.ptr<float>(), c.N, 1.0f,
                                             C.ptr<float>(), c.N);
        } else {
            tessera::ops::cpu::small_gemm_nn(c.M, c.N, c.K, 1.0f, A.ptr<float>(), ac, B.ptr<float>(), c.N, 1.0f,
                                             C.ptr<float>(), c.N);
        }
        benchmark::DoNotOptimize(C.ptr<float>());
    }
    st.counters["GFLOP/s"] =
        benchmark::Counter(2.0 * double(c.M * c.N * c.K) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_onednn_sgemm(benchmark::State& st) {
    const Case c = kCases[size_t(st.range(0))];
    const int64_t ar = c.a_transposed ? c.K : c.M, ac = c.a_transposed ? c.M : c.K;
    Tensor A = tessera::bench::random_tensor(Shape{ar, ac}, 1, -1, 1, 0);
    Tensor B = tessera::bench::random_tensor(Shape{c.K, c.N}, 1, -1, 1, 1);
    Tensor C = tessera::bench::random_tensor(Shape{c.M, c.N}, 1, -1, 1, 2);
    for (auto _ : st) {
        dnnl_sgemm(c.a_transposed ? 'T' : 'N', 'N', c.M, c.N, c.K, 1.0f, A.ptr<float>(), ac, B.ptr<float>(), c.N, 1.0f,
                   C.ptr<float>(), c.N);
        benchmark::DoNotOptimize(C.ptr<float>());
    }
    st.counters["GFLOP/s"] =
        benchmark::Counter(2.0 * double(c.M * c.N * c.K) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void cases(benchmark::internal::Benchmark* b) {
    for (int64_t i = 0; i < int64_t(kCases.size()); ++i) b->Arg(i);
    b->UseRealTime();
}
BENCHMARK(BM_small_gemm)->Apply(cases);
BENCHMARK(BM_onednn_sgemm)->Apply(cases);

}  // namespace

int main(int argc, char** argv) {
    omp_set_num_threads(1);  // one thread each: these products run inside the kernels' parallel loops
    benchmark::Initialize(&argc, argv);
    tessera::bench::MedianCollector c;
    benchmark::RunSpecifiedBenchmarks(&c);
    std::printf("\nISA: %s (kernels), oneDNN %s\n\n", tessera::ops::kernel_isa(), tessera::ops::onednn_isa().c_str());
    std::printf("| product | M x N x K | small_gemm GFLOP/s | oneDNN sgemm GFLOP/s | ratio |\n|---|---|---|---|---|\n");
    for (size_t i = 0; i < kCases.size(); ++i) {
        const std::string arg = fmt::format("/{}/real_time", i);
        const double *s = c.find("BM_small_gemm" + arg, "GFLOP/s"), *o = c.find("BM_onednn_sgemm" + arg, "GFLOP/s");
        if (!s || !o) continue;
        const Case& k = kCases[i];
        std::printf("| %s | %ld x %ld x %ld%s | %.0f | %.0f | %.2f |\n", k.what, long(k.M), long(k.N), long(k.K),
                    k.a_transposed ? " (Aᵀ)" : "", *s, *o, *s / *o);
    }
    benchmark::Shutdown();
    return 0;
}
