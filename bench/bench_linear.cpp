// linear forward/backward at training shapes against oneDNN's own threaded sgemm on the same
// products, and at train.precision = bf16 (oneDNN's AMX GEMM where it has one), measured side by side in one run
// (repetitions interleaved at random), medians.
// Prints a markdown table of the ratios after Google Benchmark's own output.
//   build/bench/bench_linear --benchmark_repetitions=9 --benchmark_enable_random_interleaving=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

#include <fmt/format.h>

#include "bench/bench_report.h"
#include "core/tensor.h"
#include "ops/gemm.h"
#include "ops/linear.h"

namespace {

using tessera::DType;
using tessera::Shape;
using tessera::Tensor;
using tessera::ops::Trans;

struct LinearShape {
    int64_t n, in, out;
};

// tokens x in -> out: the projections of a d=512 / d=1024 model at 4K-8K tokens per step
const std::vector<LinearShape> kShapes = {{4096, 256, 256},  {4096, 512, 1536}, {4096, 512, 512},
                                          {4096, 512, 2048}, {4096, 2048, 512}, {8192, 1024, 4096}};

Tensor filled(Shape s, float v) {
    Tensor t(DType::f32, s);
    std::fill(t.ptr<float>(), t.ptr<float>() + t.numel(), v);
    return t;
}

void set_rate(benchmark::State& st, double flops) {
    st.counters["GFLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
    st.counters["GFLOP/s"].value /= 1e9;
}

// pass: 0 forward, 1 backward; precision: the GEMMs' (train.precision)
void run_linear(benchmark::State& st, tessera::ops::GemmPrecision precision) {
    const tessera::ops::GemmPrecisionScope scope(precision);
    const LinearShape s = kShapes[size_t(st.range(0))];
    const bool backward = st.range(1) == 1;
    Tensor x = filled(Shape{s.n, s.in}, 0.5f), w = filled(Shape{s.out, s.in}, 0.25f), y = filled(Shape{s.n, s.out}, 0);
    Tensor dx = filled(Shape{s.n, s.in}, 0), dw = filled(Shape{s.out, s.in}, 0);
    for (auto _ : st) {
        if (backward) {
            tessera::ops::linear_backward(y, x, w, dx, dw, {});
        } else {
            tessera::ops::linear_forward({}, x, w, {}, y);
        }
    }
    set_rate(st, (backward ? 4.0 : 2.0) * double(s.n) * double(s.in) * double(s.out));
}

void BM_tessera_linear(benchmark::State& st) { run_linear(st, tessera::ops::GemmPrecision::f32); }
void BM_tessera_linear_bf16(benchmark::State& st) { run_linear(st, tessera::ops::GemmPrecision::bf16); }

// the same GEMMs through oneDNN's threaded sgemm on the whole product
void BM_onednn_sgemm(benchmark::State& st) {
    const LinearShape s = kShapes[size_t(st.range(0))];
    const bool backward = st.range(1) == 1;
    Tensor x = filled(Shape{s.n, s.in}, 0.5f), w = filled(Shape{s.out, s.in}, 0.25f), y = filled(Shape{s.n, s.out}, 0);
    Tensor dx = filled(Shape{s.n, s.in}, 0), dw = filled(Shape{s.out, s.in}, 0);
    using tessera::ops::gemm_onednn_reference;
    for (auto _ : st) {
        if (backward) {
            gemm_onednn_reference(Trans::N, Trans::N, s.n, s.in, s.out, 1.0f, y.ptr<float>(), s.out, w.ptr<float>(),
                                  s.in, 1.0f, dx.ptr<float>(), s.in);
            gemm_onednn_reference(Trans::T, Trans::N, s.out, s.in, s.n, 1.0f, y.ptr<float>(), s.out, x.ptr<float>(),
                                  s.in, 1.0f, dw.ptr<float>(), s.in);
        } else {
            gemm_onednn_reference(Trans::N, Trans::T, s.n, s.out, s.in, 1.0f, x.ptr<float>(), s.in, w.ptr<float>(),
                                  s.in, 0.0f, y.ptr<float>(), s.out);
        }
    }
    set_rate(st, (backward ? 4.0 : 2.0) * double(s.n) * double(s.in) * double(s.out));
}

void shape_args(benchmark::internal::Benchmark* b) {
    for (int64_t i = 0; i < int64_t(kShapes.size()); ++i) {
        b->Args({i, 0});
        b->Args({i, 1});
    }
    b->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(BM_tessera_linear)->Apply(shape_args);
BENCHMARK(BM_tessera_linear_bf16)->Apply(shape_args);
BENCHMARK(BM_onednn_sgemm)->Apply(shape_args);

}  // namespace

int main(int argc, char** argv) {
    benchmark::Initialize(&argc, argv);
    tessera::bench::MedianCollector c;
    benchmark::RunSpecifiedBenchmarks(&c);
    std::printf(
        "\n| linear N x IN -> OUT | pass | tessera GFLOP/s | oneDNN sgemm GFLOP/s | ratio | tessera bf16 GFLOP/s | "
        "bf16 / "
        "f32 |\n|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < kShapes.size(); ++i) {
        for (int pass = 0; pass < 2; ++pass) {
            const std::string args = fmt::format("/{}/{}/real_time", i, pass);
            const double *t = c.find("BM_tessera_linear" + args, "GFLOP/s"),
                         *o = c.find("BM_onednn_sgemm" + args, "GFLOP/s"),
                         *h = c.find("BM_tessera_linear_bf16" + args, "GFLOP/s");
            if (!t || !o || !h) continue;
            std::printf("| %ld x %ld -> %ld | %s | %.0f | %.0f | %.2f | %.0f | %.2f |\n", long(kShapes[i].n),
                        long(kShapes[i].in), long(kShapes[i].out), pass ? "backward" : "forward", *t, *o, *t / *o, *h,
                        *h / *t);
        }
    }
    benchmark::Shutdown();
    return 0;
}
