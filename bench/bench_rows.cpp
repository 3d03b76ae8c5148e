// The memory-bound ops around the GEMMs of the demo hybrid's KDA block (configs/demo.json: 16 × 256 tokens,
// d_model 256, 4 heads of 64), at that block's shapes, against the machine's own copy rate: each op's bytes
// (inputs read once, outputs written once) over its time, beside a two-thread copy of as many bytes measured
// in the same run. Prints a markdown table (bench/RESULTS.md).
//   build/bench/bench_rows [--benchmark_repetitions=5]
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench/bench_report.h"
#include "bench/bench_util.h"
#include "ops/causal_conv1d.h"
#include "ops/gated_rmsnorm.h"
#include "ops/isa.h"
#include "ops/kda_gate.h"
#include "ops/l2norm.h"
#include "ops/rmsnorm.h"

namespace {

using tessera::Shape;
using tessera::Tensor;
using tessera::TensorView;
namespace ops = tessera::ops;

constexpr int64_t B = 16, T = 256, N = B * T, D = 256, H = 4, K = 64;

Tensor input(Shape s, uint64_t stream) { return tessera::bench::random_tensor(s, 7, -1, 1, stream); }

struct Case {
    const char* what;
    double bytes;                                 // read once + written once, f32
    std::function<std::function<void()>()> make;  // builds the inputs, returns one call
};

const std::vector<Case>& cases() {
    static const std::vector<Case> all = {
        {"causal_conv1d forward (silu), [16, 256, 768], width 4", 2.0 * N * 3 * D * 4,
         [] {
             auto x = std::make_shared<Tensor>(input(Shape{B, T, 3 * D}, 0));
             auto w = std::make_shared<Tensor>(input(Shape{3 * D, 4}, 1));
             auto y = std::make_shared<Tensor>(input(Shape{B, T, 3 * D}, 2));
             return [=] { ops::causal_conv1d_forward({.activation = ops::Activation::silu}, *x, *w, *y, {}); };
         }},
        {"causal_conv1d backward (silu), dx and dw", 3.0 * N * 3 * D * 4,
         [] {
             auto x = std::make_shared<Tensor>(input(Shape{B, T, 3 * D}, 0));
             auto w = std::make_shared<Tensor>(input(Shape{3 * D, 4}, 1));
             auto dy = std::make_shared<Tensor>(input(Shape{B, T, 3 * D}, 2));
             auto dx = std::make_shared<Tensor>(input(Shape{B, T, 3 * D}, 3));
             auto dw = std::make_shared<Tensor>(input(Shape{3 * D, 4}, 4));
             return
                 [=] { ops::causal_conv1d_backward({.activation = ops::Activation::silu}, *dy, *x, *w, *dx, *dw, {}); };
         }},
        {"kda_gate forward (lower bound -5), [4096, 4, 64]", 2.0 * N * H * K * 4,
         [] {
             auto f = std::make_shared<Tensor>(input(Shape{N, H, K}, 0));
             auto a = std::make_shared<Tensor>(input(Shape{H}, 1));
             auto bias = std::make_shared<Tensor>(input(Shape{H * K}, 2));
             auto g = std::make_shared<Tensor>(input(Shape{N, H, K}, 3));
             return [=] { ops::kda_gate_forward({.lower_bound = -5.0}, *f, *a, *bias, *g); };
         }},
        {"kda_gate backward, df, dA_log and ddt_bias", 3.0 * N * H * K * 4,
         [] {
             auto f = std::make_shared<Tensor>(input(Shape{N, H, K}, 0));
             auto a = std::make_shared<Tensor>(input(Shape{H}, 1));
             auto bias = std::make_shared<Tensor>(input(Shape{H * K}, 2));
             auto dg = std::make_shared<Tensor>(input(Shape{N, H, K}, 3));
             auto df = std::make_shared<Tensor>(input(Shape{N, H, K}, 4));
             auto da = std::make_shared<Tensor>(input(Shape{H}, 5));
             auto db = std::make_shared<Tensor>(input(Shape{H * K}, 6));
             return [=] { ops::kda_gate_backward({.lower_bound = -5.0}, *dg, *f, *a, *bias, *df, *da, *db); };
         }},
        {"l2norm forward, one head's 64 columns of [4096, 768]", 2.0 * N * K * 4,
         [] {
             auto x = std::make_shared<Tensor>(input(Shape{N, 3 * D}, 0));
             auto y = std::make_shared<Tensor>(input(Shape{N, H * K}, 1));
             return [=] { ops::l2norm_forward({}, TensorView(*x).columns(0, K), TensorView(*y).columns(0, K)); };
         }},
        {"l2norm backward, one head", 3.0 * N * K * 4,
         [] {
             auto x = std::make_shared<Tensor>(input(Shape{N, 3 * D}, 0));
             auto dy = std::make_shared<Tensor>(input(Shape{N, H * K}, 1));
             auto dx = std::make_shared<Tensor>(input(Shape{N, 3 * D}, 2));
             return [=] {
                 ops::l2norm_backward({}, TensorView(*dy).columns(0, K), TensorView(*x).columns(0, K),
                                      TensorView(*dx).columns(0, K));
             };
         }},
        {"gated_rmsnorm forward (sigmoid gate), [16384, 64]", 3.0 * N * H * K * 4,
         [] {
             auto x = std::make_shared<Tensor>(input(Shape{N * H, K}, 0));
             auto z = std::make_shared<Tensor>(input(Shape{N * H, K}, 1));
             auto w = std::make_shared<Tensor>(input(Shape{K}, 2));
             auto y = std::make_shared<Tensor>(input(Shape{N * H, K}, 3));
             return [=] { ops::gated_rmsnorm_forward({.eps = 1e-6}, *x, *z, *w, *y); };
         }},
        {"gated_rmsnorm backward, dx, dgate and dweight", 5.0 * N * H * K * 4,
         [] {
             auto x = std::make_shared<Tensor>(input(Shape{N * H, K}, 0));
             auto z = std::make_shared<Tensor>(input(Shape{N * H, K}, 1));
             auto w = std::make_shared<Tensor>(input(Shape{K}, 2));
             auto dy = std::make_shared<Tensor>(input(Shape{N * H, K}, 3));
             auto dx = std::make_shared<Tensor>(input(Shape{N * H, K}, 4));
             auto dz = std::make_shared<Tensor>(input(Shape{N * H, K}, 5));
             auto dw = std::make_shared<Tensor>(input(Shape{K}, 6));
             return [=] { ops::gated_rmsnorm_backward({.eps = 1e-6}, *dy, *x, *z, *w, *dx, *dz, *dw); };
         }},
        {"rmsnorm forward, [4096, 256]", 2.0 * N * D * 4,
         [] {
             auto x = std::make_shared<Tensor>(input(Shape{N, D}, 0));
             auto w = std::make_shared<Tensor>(input(Shape{D}, 1));
             auto y = std::make_shared<Tensor>(input(Shape{N, D}, 2));
             auto r = std::make_shared<Tensor>(input(Shape{N}, 3));
             return [=] { ops::rmsnorm_forward({.eps = 1e-6}, *x, *w, *y, *r); };
         }},
        {"rmsnorm backward, dx and dweight", 3.0 * N * D * 4,
         [] {
             auto x = std::make_shared<Tensor>(input(Shape{N, D}, 0));
             auto w = std::make_shared<Tensor>(input(Shape{D}, 1));
             auto r = std::make_shared<Tensor>(input(Shape{N}, 3));
             auto dy = std::make_shared<Tensor>(input(Shape{N, D}, 2));
             auto dx = std::make_shared<Tensor>(input(Shape{N, D}, 4));
             auto dw = std::make_shared<Tensor>(input(Shape{D}, 5));
             return [=] { ops::rmsnorm_backward({.eps = 1e-6}, *dy, *x, *w, *r, *dx, *dw); };
         }},
    };
    return all;
}

void BM_op(benchmark::State& st) {
    const Case& c = cases()[size_t(st.range(0))];
    const std::function<void()> call = c.make();
    for (auto _ : st) call();
    st.counters["GB/s"] = benchmark::Counter(c.bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// the machine's own rate: as many bytes, half read and half written, by memcpy on both threads
void BM_copy(benchmark::State& st) {
    const Case& c = cases()[size_t(st.range(0))];
    const size_t n = size_t(c.bytes / 2);
    std::vector<char> src(n, 1), dst(n, 0);
    for (auto _ : st) {
#pragma omp parallel
        {
            const size_t t = size_t(omp_get_thread_num()), nt = size_t(omp_get_num_threads());
            const size_t a = n * t / nt, b = n * (t + 1) / nt;
            std::memcpy(dst.data() + a, src.data() + a, b - a);
        }
        benchmark::DoNotOptimize(dst.data());
    }
    st.counters["GB/s"] = benchmark::Counter(c.bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void all_cases(benchmark::internal::Benchmark* b) {
    for (int64_t i = 0; i < int64_t(cases().size()); ++i) b->Arg(i);
    b->UseRealTime()->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_op)->Apply(all_cases);
BENCHMARK(BM_copy)->Apply(all_cases);

}  // namespace

int main(int argc, char** argv) {
    omp_set_num_threads(2);
    benchmark::Initialize(&argc, argv);
    tessera::bench::MedianCollector c;
    benchmark::RunSpecifiedBenchmarks(&c);
    std::printf("\nISA: %s (kernels), %d threads\n\n", tessera::ops::kernel_isa(), omp_get_max_threads());
    std::printf("| op (demo KDA block shapes) | ms | GB/s | copy GB/s, same bytes | share of copy rate |\n");
    std::printf("|---|---|---|---|---|\n");
    for (size_t i = 0; i < cases().size(); ++i) {
        const std::string arg = fmt::format("/{}/real_time", i);
        const double *o = c.find("BM_op" + arg, "GB/s"), *m = c.find("BM_op" + arg, "ms"),
                     *k = c.find("BM_copy" + arg, "GB/s");
        if (!o || !k) continue;
        std::printf("| %s | %.2f | %.1f | %.1f | %.2f |\n", cases()[i].what, *m, *o, *k, *o / *k);
    }
    benchmark::Shutdown();
    return 0;
}
